"""Compiled blocks (``train.compile``): each block's forward through ``torch.compile``, as torchtitan and flame do.

Per block, not the whole model: blocks of one structure share one compiled graph (their weights are the graph's
inputs, not constants), so a model compiles once per kind of block, and the embedding, the loss and the packed
documents' offsets (``cu_seqlens_from_position_ids``, whose size depends on the data) stay eager around them. Our ops
are ``torch.library`` custom ops (``pretrain/ops/custom_ops.py``): the compiler fuses the projections, norms,
feature maps and feed-forward around them and never traces into their chunk loops, so each block is one graph
(``fullgraph``: a graph break is an error, not a silent slowdown).

Apply it before activation checkpointing: DeepSpeed's checkpoint is a Python autograd function the compiler does not
trace, so it wraps the compiled forward, which then runs twice per step (without autograd in forward, with it in
backward's recomputation) and is compiled once for each.
"""
import torch
from torch import nn


def compile_blocks(model: nn.Module, **options) -> None:
    """Route every ``model.layers[i]`` call through ``torch.compile(block.forward, fullgraph=True, dynamic=False)``.

    Only the bound ``forward`` is replaced, so parameter names (and checkpoints) are the same compiled or not.
    Every block runs one code object (its class's ``forward``), whose compiled graphs dynamo caches together: one
    per kind of block (mixer class), grad mode (checkpointing runs both) and shape (training, validation). The
    cache's default limit of 8 entries per code object is raised to 8 per kind of block, so a hybrid does not fall
    over it (under ``fullgraph`` that is an error). ``dynamic=False``: kinds of block differ in their options
    (``short_conv``, a norm's eps), which dynamo's automatic dynamic shapes would otherwise turn into symbols shared
    by every kind compiled after the first; the one size that does change, the number of packed documents, is
    marked dynamic on every call (``_documents_dynamic``).
    """
    kinds = {type(block.mixer) if hasattr(block, "mixer") else type(block) for block in model.layers}
    config = torch._dynamo.config  # cache_size_limit: recompile_limit's older name, which newer releases still read
    config.cache_size_limit = max(config.cache_size_limit, 8 * len(kinds))
    for block in model.layers:
        block.forward = _documents_dynamic(torch.compile(block.forward, fullgraph=True, dynamic=False, **options))


def _documents_dynamic(compiled):
    """``compiled``, told before each call that ``cu_seqlens``' length (documents + 1) changes from batch to batch.

    The mark is a tensor's attribute, so it is set here, on the tensor the block receives, not once where the
    offsets are made: activation checkpointing's recomputation hands the block detached copies, which carry no
    mark, and each new number of documents would compile its graph again (it did on an H200, every step at 16k).
    """
    def forward(x, cu_seqlens=None, position_ids=None):
        if cu_seqlens is not None:
            torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        return compiled(x, cu_seqlens, position_ids)
    return forward
