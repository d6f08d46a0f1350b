"""``Mixer``: what every token mixer shares, so a new one writes only its op.

A mixer maps ``x [B, T, C] → [B, T, C]``. The base class owns the q/k/v/o projections (with the ``qkv_bias`` /
``o_bias`` options the released models use), the head split, and the two decoding entry points, which run one path:
``forward_with_state(x, state)`` — a prompt (``prefill``, state None) or a single token (``step``) continuing from
the state the tokens before it left. ``sequence`` is set by ``pretrain.distributed.apply_sequence_parallel`` when
the rows are split across ranks; a mixer that can run on a slice says so with ``supports_sequence_parallel``.
"""
from typing import ClassVar

import torch
from torch import nn

from ..parallel import SequenceShard
from .common import check_heads, projection_flops


class Mixer(nn.Module):
    supports_causal: ClassVar[bool] = True               # False: vision only (a causal LM refuses it)
    supports_sequence_parallel: ClassVar[bool] = False   # True: forward runs on a slice when ``sequence`` is set
    sequence: SequenceShard | None = None                # this rank's slice of the rows (sequence parallelism)

    def __init__(self, dim: int, num_heads: int, *, causal: bool, qkv_bias: bool = False, o_bias: bool = False,
                 heads: bool = True):
        """``heads=False``: the mixer mixes per channel (AFT); ``num_heads`` is then not checked."""
        super().__init__()
        if causal and not self.supports_causal:
            raise ValueError(f"{type(self).__name__} has no causal form; build it with causal=False")
        self.head_dim = check_heads(dim, num_heads) if heads else dim
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=qkv_bias) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=o_bias)

    def qkv(self, x: torch.Tensor, *, packed: bool = False, heads: bool = True) -> tuple[torch.Tensor, ...]:
        """The projections of ``x [B, T, C]``: ``[B, T, H, D]`` each (``[1, B·T, H, D]`` when ``packed``, the ops'
        cu_seqlens layout), or ``[B, T, C]`` (``[1, B·T, C]``) with ``heads=False``."""
        batch, seq_len, _ = x.shape
        shape = (1, batch * seq_len) if packed else (batch, seq_len)
        shape += (self.num_heads, self.head_dim) if heads else (self.dim,)
        return tuple(proj(x).reshape(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))

    def step(self, x_t: torch.Tensor, state=None):
        """One token ``[B, C]`` with the state of the tokens before it (None at the start) → ``(y_t, state)``."""
        y, state = self.forward_with_state(x_t[:, None], state)
        return y[:, 0], state

    def prefill(self, x: torch.Tensor):
        """A whole prompt ``[B, T, C]`` in one parallel pass → ``(y, state)``, the state ``step`` goes on from."""
        return self.forward_with_state(x, None)

    def forward_with_state(self, x: torch.Tensor, state):
        """``x [B, T, C]`` continuing from ``state`` (None: from the start) → ``(y, state after x)``."""
        raise NotImplementedError(f"{type(self).__name__} has no decoding state")

    def check_sequence_parallel(self, size: int, slice_len: int) -> None:
        """Refuse, saying why, rows split into ``size`` slices of ``slice_len`` tokens that this mixer cannot run on."""
        if not self.supports_sequence_parallel:
            raise ValueError(f"{type(self).__name__} has no sequence-parallel form")

    def projection_flops(self) -> float:
        """Forward FLOPs per token of the four projections."""
        return projection_flops(self.dim, 4)
