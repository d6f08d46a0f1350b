"""``Mixer``: what every token mixer shares, so a new one writes only its op.

A mixer maps ``x [B, T, C] → [B, T, C]``. The base class owns the q/k/v/o projections (with the ``qkv_bias`` /
``o_bias`` options the released models use), the optional short convolutions after the q/k/v projections
(``short_conv``), the head split, and the two decoding entry points, which run one path:
``forward_with_state(x, state)`` — a prompt (``prefill``, state None) or a single token (``step``) continuing from
the state the tokens before it left. ``sequence`` is set by ``pretrain.distributed.apply_sequence_parallel`` when
the rows are split across ranks; a mixer that can run on a slice says so with ``supports_sequence_parallel``.
"""
from typing import ClassVar

import torch
from torch import nn

from ..parallel import SequenceShard
from .common import check_heads, projection_flops, token_positions
from .short_conv import ShortConvolution


class Mixer(nn.Module):
    supports_causal: ClassVar[bool] = True               # False: vision only (a causal LM refuses it)
    supports_sequence_parallel: ClassVar[bool] = False   # True: forward runs on a slice when ``sequence`` is set
    sequence: SequenceShard | None = None                # this rank's slice of the rows (sequence parallelism)
    halo: int = 0  # tokens before a slice that the mixer's own local window reads (InLine's conv, AFT's band)

    def __init__(self, dim: int, num_heads: int, *, causal: bool, qkv_bias: bool = False, o_bias: bool = False,
                 heads: bool = True, short_conv: int = 0):
        """``heads=False``: the mixer mixes per channel (AFT); ``num_heads`` is then not checked. ``short_conv=K``:
        a causal depthwise convolution of K taps and SiLU on each of q, k, v after its projection (0: none)."""
        super().__init__()
        if causal and not self.supports_causal:
            raise ValueError(f"{type(self).__name__} has no causal form; build it with causal=False")
        if short_conv < 0 or (short_conv and not causal):
            raise ValueError(f"short_conv must be ≥ 0 (0: off) and needs causal=True; got {short_conv}, "
                             f"causal={causal}")
        self.head_dim = check_heads(dim, num_heads) if heads else dim
        self.dim, self.num_heads, self.causal, self.short_conv = dim, num_heads, causal, short_conv
        self.split_heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=qkv_bias) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=o_bias)
        if short_conv:
            self.q_conv, self.k_conv, self.v_conv = (ShortConvolution(dim, short_conv) for _ in range(3))

    def qkv(self, x: torch.Tensor, *, cu_seqlens=None, position_ids=None) -> tuple[torch.Tensor, ...]:
        """The op's q, k, v of ``x [B, T, C]``: projected, convolved, laid out by ``split`` (packed with
        ``cu_seqlens``), through ``features``. ``position_ids [B, T]`` tell the short convolutions where documents
        start (derived from ``cu_seqlens`` when None)."""
        if self.short_conv and position_ids is None and cu_seqlens is not None:
            position_ids = token_positions(x.shape[0], x.shape[1], cu_seqlens, x.device)
        convolved = self.convolved(self.projections(x), position_ids)
        return self.features(*self.split(convolved, packed=cu_seqlens is not None))

    def qkv_continuing(self, x: torch.Tensor, tails):
        """For decoding: the op's ``(q, k, v)`` of ``x [B, T, C]`` continuing from ``tails`` (the short convolutions'
        last inputs before ``x``, None at the start), and the tails after ``x`` (None without ``short_conv``)."""
        projected = self.projections(x)
        convolved = self.convolved(projected, None, tails)
        if self.short_conv:
            tails = [conv.tail(p, b) for conv, p, b in zip(self.convolutions(), projected, tails or [None] * 3)]
        return self.features(*self.split(convolved)), tails

    def projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The q, k, v projections of ``x``, ``[B, T, C]`` each: the short convolutions' inputs."""
        return [proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)]

    def convolutions(self) -> tuple[ShortConvolution, ...]:
        return (self.q_conv, self.k_conv, self.v_conv) if self.short_conv else ()

    def convolved(self, qkv: list[torch.Tensor], position_ids: torch.Tensor | None = None,
                  before: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """q, k, v ``[B, T, C]`` through their short convolutions (as they are without ``short_conv``); ``before``:
        the ``K − 1`` inputs of each just before these (a decoding tail, a sequence-parallel halo), None: zeros."""
        if not self.short_conv:
            return list(qkv)
        return [conv(t, position_ids=position_ids, before=b)
                for conv, t, b in zip(self.convolutions(), qkv, before or [None] * 3)]

    @property
    def conv_reach(self) -> int:
        """How many inputs before a token the short convolutions read, ``K − 1`` (0 without): a sequence slice's
        halo."""
        return max(self.short_conv - 1, 0)

    def keys_values(self, convolved: list[torch.Tensor], position_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k and v a sequence slice's state reads, from the convolved inputs of tokens at ``position_ids``
        (``SliceConvolutions`` remakes them for an earlier slice's first tokens): the op's k and v here."""
        _, k, v = self.features(*self.split(convolved))
        return k, v

    def split(self, qkv: list[torch.Tensor], *, packed: bool = False) -> list[torch.Tensor]:
        """``[B, T, C]`` each → ``[B, T, H, D]`` (``[1, B·T, H, D]`` when ``packed``, the ops' cu_seqlens layout), or
        ``[B, T, C]`` (``[1, B·T, C]``) for a mixer built with ``heads=False``."""
        batch, seq_len, _ = qkv[0].shape
        shape = (1, batch * seq_len) if packed else (batch, seq_len)
        shape += (self.num_heads, self.head_dim) if self.split_heads else (self.dim,)
        return [t.reshape(shape) for t in qkv]

    def features(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the op reads of the (convolved) q, k, v: they themselves here; a feature map or a scale in mixers
        that apply one."""
        return q, k, v

    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """The log of the factor the state is multiplied by at each token of ``x [B, T, C]``, ≤ 0: ``[B, T, H]`` for a
        data-dependent gate (``[B, T, H, D]`` for one per key channel), ``[H]`` for a fixed decay; None for a state
        that does not decay. What the op is given, so a reading of it (``tools/eval_recall.py``) says how far back the
        trained gates remember."""
        return None

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
        reach = self.halo + self.conv_reach
        if slice_len < reach:
            raise ValueError(f"a slice of {slice_len} tokens is shorter than the {reach} tokens before it that "
                             f"{type(self).__name__} reads ({self.halo} for its local window, "
                             f"{self.conv_reach} for short_conv): use fewer sequence ranks, or a smaller "
                             "window, conv_size or short_conv")

    def projection_flops(self) -> float:
        """Forward FLOPs per token of the four projections, and of the short convolutions when there are."""
        return projection_flops(self.dim, 4) + sum(conv.flops_per_token() for conv in self.convolutions())
