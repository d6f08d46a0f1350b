"""Named regions of a training step, for ``torch.profiler``: ``tools/profile_step.py`` sorts a step's time by them.

``scope(name)`` is a ``record_function`` while a profiler records and nothing otherwise, as torch's own compiled
code does it: a ``record_function`` costs 5-20 µs on the host, and a step enters a few hundred (every block, norm
and mixer, again when activation checkpointing recomputes them).
"""
import contextlib

import torch
from torch.autograd import profiler

BLOCK = "block"          # a transformer block: what it does outside the scopes below is its residual adds
MIXER = "mixer"          # the token mixer (its projections are told apart by their op, aten::linear)
FFN = "ffn"              # the feed-forward
NORM = "norm"            # an RMSNorm (the blocks', the mixers' per-head ones, the final one)
LOSS = "loss"            # the LM head's fused loss (its matmuls are told apart by their ops)
BACKWARD = "backward"    # engine.backward: autograd, and DeepSpeed's gradient reduction around it
OPTIMIZER = "optimizer"  # engine.step: clipping, the optimizer, ZeRO's partitions; the gradient norm
NAMES = (BLOCK, MIXER, FFN, NORM, LOSS, BACKWARD, OPTIMIZER)

_NOTHING = contextlib.nullcontext()


def scope(name: str):
    """A ``with`` block that names what runs in it in a profiler's trace; free when no profiler records.

    Nothing inside compiled code (``train.compile``): the compiler drops a ``record_function`` there anyway, and
    reading whether a profiler records would make it a guard, so starting a profiler compiled every block again.
    """
    if torch.compiler.is_compiling():
        return _NOTHING
    return profiler.record_function(name) if profiler._is_profiler_enabled else _NOTHING
