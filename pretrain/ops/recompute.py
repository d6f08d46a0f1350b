"""Chunked ops whose backward is autograd's, at the activation memory of their inputs: blocks recomputed.

A chunked op walks its chunks in blocks, ``block(lo, hi, *tokens, state, *extra) -> (rows, state_after, *more)``
for chunks ``lo … hi-1`` (``tokens``: the block's rows of the per-token inputs; ``state``: the state entering chunk
lo). ``in_blocks`` runs each block without autograd and, when a gradient is wanted, through ``Recomputed``, which
keeps only the block's inputs and runs the block again with autograd in backward: its C×C factors and chunk states
exist only during its own backward. Backward then keeps, per token and head, the inputs (which the caller holds
anyway) and one state per block. Used by ``delta_rule/chunk.py`` and ``decayed_linear_attention/chunk.py``;
``delta_rule/triton.py`` walks its blocks with ``in_blocks`` too, each an autograd Function that recomputes by
hand.
"""
from functools import partial

import torch


def bounded_blocks(count: int, heads: int, size: int, width: int, elements: int) -> list[tuple[int, int]]:
    """Consecutive ranges of ``count`` chunks of ``size`` tokens whose C×C and C×width temporaries hold about
    ``elements`` numbers, on every device: each block is a unit of recomputation, so its size bounds backward's
    peak."""
    step = max(1, elements // (heads * size * max(size, width)))
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)]


def in_blocks(block, blocks: list[tuple[int, int]], size: int, tokens, state, *extra, recompute: bool = True):
    """``block`` over ``blocks`` of chunks of ``size`` rows of ``tokens`` (``[T, ...]`` each), carrying ``state``
    from block to block → every block's rows (concatenated, cut to T), the state after the last block, and the
    blocks' further outputs (``more``, in order). ``recompute=False``: the block differentiates itself at the memory
    of its inputs (an autograd Function that recomputes what its backward needs), and runs as it is."""
    total = tokens[0].shape[0]
    saving = recompute and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*tokens, state, *extra))
    sizes = [min(hi * size, total) - lo * size for lo, hi in blocks]
    rows, more = [], []
    for (lo, hi), piece in zip(blocks, zip(*(x.split(sizes) for x in tokens))):  # one gradient buffer each
        run = partial(block, lo, hi)
        out, state, *rest = Recomputed.apply(run, *piece, state, *extra) if saving else run(*piece, state, *extra)
        rows.append(out)
        more += rest
    return torch.cat(rows)[:total], state, more


class Recomputed(torch.autograd.Function):
    """``run(*tensors)`` without autograd; backward runs it again with autograd and differentiates that, so its
    temporaries exist only during its own backward. (``torch.utils.checkpoint``'s non-reentrant form kept 4× the
    memory through the delta rule's forward at T = 16k; the reentrant one refuses ``torch.autograd.grad``.)
    ``tensors`` may hold None."""

    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        return run(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        tensors = [None if t is None else t.detach().requires_grad_(need)
                   for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        with torch.enable_grad():
            outputs = ctx.run(*tensors)
        used = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
        wanted = [t for t in tensors if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad([out for out, _ in used], wanted, [grad for _, grad in used],
                                         allow_unused=True) if used and wanted else [None] * len(wanted))
        return None, *(next(found) if t is not None and t.requires_grad else None for t in tensors)
