"""Mini-sequence: a token-wise sub-layer run over slices of the row, keeping only its input for backward.

A block's feed-forward (its norm, the SwiGLU and the residual add) works on each token alone, yet autograd keeps
its hidden activations for every token of the row: with SwiGLU's 8/3·dim width those are 12× the block's input
(gate, its silu, up, their product), over half of what a block of a linear-attention LM keeps. Run over slices of
``tokens`` tokens, each slice checkpointed, backward keeps the input alone and recomputes one slice's hidden
activations at a time (Mini-Sequence Transformer, Luo et al. 2024, arXiv 2407.15892); the price is one more
forward of the slice's first matmuls. Under ``no_grad`` (activation checkpointing's first pass, evaluation) the
slices only bound the temporaries. Outputs and gradients are the unsliced ones: every token is computed alone.
"""
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def sliced(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens: int) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` on ``x [..., C]``, over slices of ``tokens`` tokens (0: the whole of x).

    Slices run along the flattened leading dimensions, so a batch of short rows is cut like one long row.
    """
    flat = x.reshape(-1, x.shape[-1])
    if tokens <= 0 or flat.shape[0] <= tokens:
        return fn(x)
    if torch.is_grad_enabled():  # each slice keeps its input; its activations come back one slice at a time
        run = lambda piece: checkpoint(fn, piece, use_reentrant=False, preserve_rng_state=False)
    else:
        run = fn
    return torch.cat([run(piece) for piece in flat.split(tokens)]).view(*x.shape[:-1], -1)
