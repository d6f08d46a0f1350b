"""Activation checkpointing applied from outside the model: each block recomputes its activations in backward."""
import functools

from torch import nn


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Route every ``model.layers[i]`` call through ``deepspeed.checkpointing.checkpoint``.

    Only the bound ``forward`` is replaced, so parameter names (and checkpoints) are the same with or without it.
    Blocks are called positionally: ``block(x, cu_seqlens, position_ids)`` in the LM, ``block(x, hw)`` in the vision
    backbone.
    """
    import deepspeed

    for block in model.layers:
        block.forward = functools.partial(deepspeed.checkpointing.checkpoint, block.forward)
