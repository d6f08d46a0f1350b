"""AFT mixers (Zhai et al. 2021, docs/MIXERS.md#aft): ``aft_full``, ``aft_local``, ``aft_simple`` and ``aft_conv``.

Each projects x to Q, K, V of ``dim`` channels, applies its op from ``pretrain.ops.aft`` and projects back.
AFT mixes per channel and has no heads: ``num_heads`` is taken for the common signature and used only by
``aft_conv``, whose heads are groups of channels sharing one 2-D kernel. Position biases start at 0, so every
variant starts out as AFT-simple.

Decoding (``step``, after ``prefill`` reads the prompt in parallel): ``aft_local`` and ``aft_simple`` carry a
constant-size state — the prefix sums ``(Σ e^{K−m} V, Σ e^{K−m}, m)`` plus, for the window, the last ``window − 1``
keys and values. ``aft_full``'s bias pairs every two positions, so its state is the keys and values so far and
their number, bounded by ``max_seq_len``.
"""
import torch
from torch import nn

from ..ops import aft_conv2d, aft_full, aft_local, aft_simple
from ..ops.aft import aft_state, combine_aft_states, state_as_token
from ..parallel import exchange_with_earlier_ranks, slice_layout
from .base import Mixer
from .registry import register
from .sequence_parallel import SliceConvolutions, from_previous_rank


class _AFTBase(Mixer):
    """Projections around an AFT op; subclasses define ``mix(q, k, v, cu_seqlens, hw)`` on ``[B, T, C]``."""

    def __init__(self, dim: int, num_heads: int, causal: bool, qkv_bias: bool, o_bias: bool, short_conv: int = 0):
        super().__init__(dim, num_heads, causal=causal, qkv_bias=qkv_bias, o_bias=o_bias, heads=False,
                         short_conv=short_conv)

    halo = 0  # tokens before a slice its band reads (aft_local: window − 1)

    def forward(self, x, *, cu_seqlens=None, position_ids=None, hw=None):
        if self.sequence is not None:
            return self.o_proj(self._on_slice(x, position_ids).reshape(x.shape))
        return self._mixed(x, cu_seqlens, position_ids, hw)[0]

    def _on_slice(self, x, position_ids):
        """The op on this rank's rows with the earlier ranks' tokens of each row's first document put in front of
        it: their prefix sums as one token (``state_as_token``) placed beyond the band, then the previous rank's last
        ``halo`` tokens themselves, which the band weighs. Tokens put in front of a row that do not belong to its
        first document form a document of their own, so every rank runs the same shapes and uses the exchange."""
        shard, (batch, seq_len), reach = self.sequence, position_ids.shape, self.halo
        convolutions = SliceConvolutions(self, x, position_ids, shard)
        q, k, v = convolutions.early  # final from token short_conv − 1 on, where the band's halo lies
        layout = slice_layout(position_ids)
        before_halo = layout.tail & (torch.arange(seq_len, device=k.device) < seq_len - reach)
        entering, (halo_k, halo_v, *packet) = exchange_with_earlier_ranks(
            _aft_state(k, v, convolutions.own(layout.tail)), layout, shard, lambda a, b: list(combine_aft_states(a, b)),
            handed_to_next=_aft_state(k, v, convolutions.own(before_halo)),
            shared=[k[:, seq_len - reach:], v[:, seq_len - reach:], *convolutions.packet(layout.tail)],
            first_states=convolutions.first_states_from(2, _aft_state))
        if self.short_conv:  # the first K − 1 tokens again, now with the previous rank's halo
            q, k, v = convolutions.final(packet)
        state_k, state_v = state_as_token(entering)
        halo_k, halo_v = (from_previous_rank(gathered, shard) for gathered in (halo_k, halo_v))
        keys = torch.cat([state_k[:, None].to(k.dtype), halo_k, k], dim=1)
        values = torch.cat([state_v[:, None].to(v.dtype), halo_v, v], dim=1)
        queries = torch.cat([q.new_zeros(batch, reach + 1, self.dim), q], dim=1)

        # which of the reach + 1 tokens in front join the first document: the state when the document has tokens
        # before the halo, a halo token when it lies within the document (its distance ≤ the first position)
        first = position_ids[:, 0]
        distance = torch.arange(reach, 0, -1, device=k.device)
        joining = (first > reach).long() + (distance[None] <= first[:, None]).sum(1)
        starts = torch.cat([torch.zeros(batch, reach + 1, dtype=torch.bool, device=k.device), position_ids == 0], 1)
        starts[:, 0] = True
        starts[torch.arange(batch, device=k.device), reach + 1 - joining] = True
        flat = starts.reshape(-1)
        cu_seqlens = torch.cat([flat.nonzero().squeeze(1), flat.new_tensor([flat.numel()], dtype=torch.long)])
        mixed = self.mix(*(t.reshape(1, -1, self.dim) for t in (queries, keys, values)), cu_seqlens, None)
        return mixed.reshape(batch, reach + 1 + seq_len, self.dim)[:, reach + 1:]

    def _mixed(self, x, cu_seqlens, position_ids, hw):
        """The output, and the keys and values it came from (a decoding state is made of them)."""
        q, k, v = self.qkv(x, cu_seqlens=cu_seqlens, position_ids=position_ids)
        return self.o_proj(self.mix(q, k, v, cu_seqlens, hw).reshape(x.shape)), k, v

    def _qkv_step(self, x_t):
        return self.q_proj(x_t), self.k_proj(x_t), self.v_proj(x_t)


@register("aft_full")
class AFTFull(_AFTBase):
    """A learned bias for every pair of positions up to ``max_seq_len``; ``factor_dim > 0`` factorizes it as
    ``w = U U'ᵀ`` (U, U' of ``[max_seq_len, factor_dim]``). Longer sequences are refused: there is no bias for them.
    """

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, max_seq_len: int = 1024, factor_dim: int = 0,
                 qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal, qkv_bias, o_bias)
        self.max_seq_len = max_seq_len
        if factor_dim > 0:
            self.bias_left = nn.Parameter(torch.randn(max_seq_len, factor_dim) * 0.02)
            self.bias_right = nn.Parameter(torch.randn(max_seq_len, factor_dim) * 0.02)
        else:
            self.pos_bias = nn.Parameter(torch.zeros(max_seq_len, max_seq_len))

    def bias(self) -> torch.Tensor:
        """The ``[max_seq_len, max_seq_len]`` bias w."""
        return self.pos_bias if hasattr(self, "pos_bias") else self.bias_left @ self.bias_right.T

    def mix(self, q, k, v, cu_seqlens, hw):
        return aft_full(q, k, v, self.bias(), causal=self.causal, cu_seqlens=cu_seqlens)

    def step(self, x_t, state=None):
        """One token ``[B, C]``; the state is ``(K, V)`` of the tokens so far and their number (None at the start):
        an int, or each row's own ``[B]`` for prompts of different lengths, whose first keys are then left padding
        (``pretrain.models.left_padded``), weighted 0 by a bias of −∞."""
        q, k, v = self._qkv_step(x_t)
        past_k, past_v, seen = state if state is not None else (None, None, 0)
        keys, values = (k[:, None], v[:, None]) if past_k is None else (torch.cat([past_k, k[:, None]], 1),
                                                                        torch.cat([past_v, v[:, None]], 1))
        position = torch.as_tensor(seen, device=x_t.device).expand(k.shape[0])  # each row's own
        if position.max() >= self.max_seq_len:
            raise ValueError(f"aft_full: position {int(position.max())} is beyond max_seq_len={self.max_seq_len}")
        # each key's position in its row's sequence; a left pad's is negative
        key_positions = torch.arange(keys.shape[1], device=k.device) - (keys.shape[1] - 1 - position)[:, None]
        bias = self.bias()[position[:, None], key_positions.clamp(min=0)]
        bias = bias.masked_fill(key_positions < 0, float("-inf"))
        weights = torch.softmax(keys + bias[:, :, None], dim=1)
        return self.o_proj(torch.sigmoid(q) * (weights * values).sum(1)), (keys, values, seen + 1)

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` → ``(y, state)``; the state is its keys and values and their number."""
        y, k, v = self._mixed(x, None, None, None)
        return y, (k, v, x.shape[1])

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and the two bias matmuls (numerator, denominator) over ``seq_len`` (½ when causal)."""
        keys = seq_len / 2 if self.causal else seq_len
        return self.projection_flops() + 2 * 2 * keys * self.dim


@register("aft_local")
class AFTLocal(_AFTBase):
    """A relative bias inside ``window`` tokens, 0 outside (distant tokens still count through e^K)."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, window: int = 64, chunk_size: int = 64,
                 short_conv: int = 0, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal, qkv_bias, o_bias, short_conv)
        if window < 1:
            raise ValueError(f"aft_local: window must be ≥ 1; got {window}")
        self.window, self.chunk_size = window, chunk_size
        self.halo = window - 1
        self.rel_bias = nn.Parameter(torch.zeros(window if causal else 2 * window - 1))

    def mix(self, q, k, v, cu_seqlens, hw):
        return aft_local(q, k, v, self.rel_bias, window=self.window, causal=self.causal, cu_seqlens=cu_seqlens,
                         chunk_size=self.chunk_size)

    def step(self, x_t, state=None):
        """One token ``[B, C]`` → ``(y_t, state)``; constant-size state (see the module docstring)."""
        return _decode_step(self, x_t, state, self.rel_bias)

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` in chunks → ``(y, state)``, the state ``step`` goes on from."""
        return _prefill(self, x, recent=self.window - 1)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections, the prefix sums and the band of ``window`` (``2·window − 1`` non-causal) offsets."""
        return self.projection_flops() + 2 * 2 * (self.rel_bias.numel() + 1) * self.dim


@register("aft_simple")
class AFTSimple(_AFTBase):
    """No position bias: a (prefix) softmax over positions per channel."""

    supports_sequence_parallel = True

    def __init__(self, dim: int, num_heads: int, *, causal: bool = True, chunk_size: int = 64, short_conv: int = 0,
                 qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(dim, num_heads, causal, qkv_bias, o_bias, short_conv)
        self.chunk_size = chunk_size

    def mix(self, q, k, v, cu_seqlens, hw):
        return aft_simple(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)

    def step(self, x_t, state=None):
        """One token ``[B, C]`` → ``(y_t, state)``; the state is the prefix sums."""
        return _decode_step(self, x_t, state, None)

    def prefill(self, x):
        """A whole prompt ``[B, T, C]`` in chunks → ``(y, state)``, the state ``step`` goes on from."""
        return _prefill(self, x, recent=0)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections and the prefix sums."""
        return self.projection_flops() + 2 * 2 * self.dim


@register("aft_conv")
class AFTConv(_AFTBase):
    """Vision: per-head ``kernel_size``² relative biases on the image grid ``hw=(H, W)`` (a forward keyword)."""

    supports_causal = False

    def __init__(self, dim: int, num_heads: int, *, causal: bool = False, kernel_size: int = 7,
                 qkv_bias: bool = False, o_bias: bool = False):
        if causal:
            raise ValueError("aft_conv has no causal form (its kernel sees both sides); use it non-causally")
        if dim % num_heads or kernel_size % 2 == 0:
            raise ValueError(f"aft_conv: dim {dim} must split into num_heads {num_heads}; kernel_size "
                             f"{kernel_size} must be odd")
        super().__init__(dim, num_heads, causal, qkv_bias, o_bias)
        self.kernel_size = kernel_size
        self.pos_bias = nn.Parameter(torch.zeros(num_heads, kernel_size, kernel_size))

    def mix(self, q, k, v, cu_seqlens, hw):
        if hw is None or cu_seqlens is not None:
            raise ValueError("aft_conv works on an image grid: pass hw=(H, W) and no cu_seqlens")
        return aft_conv2d(q, k, v, self.pos_bias, hw=hw, heads=self.num_heads)

    def flops_per_token(self, seq_len: int) -> float:
        """Four projections, two depthwise convolutions and the global sums."""
        return self.projection_flops() + 2 * 2 * (self.kernel_size ** 2 + 1) * self.dim


def _prefix_state(k, v, *, recent):
    """``_decode_step``'s state after the tokens of ``k, v [B, T, C]``: the prefix sums relative to the max of K, and
    the last ``recent`` keys and values, newest first (``_before_start`` where there are fewer tokens)."""
    running_max = k.max(dim=1).values
    exp_k = (k - running_max[:, None]).exp()
    last = slice(max(0, k.shape[1] - recent), None)
    missing_k, missing_v = _before_start(k, max(0, recent - k.shape[1]))
    return ((exp_k * v).sum(1), exp_k.sum(1), running_max, torch.cat([k[:, last].flip(1), missing_k], 1),
            torch.cat([v[:, last].flip(1), missing_v], 1))


def _before_start(k, count):
    """``count`` recent keys and values ``[B, count, C]`` before the first token: keys of −∞, which the band weighs
    exactly 0, and zero values. The state's shape then does not depend on the prompt's length (``step`` takes prompts
    of different lengths together, ``pretrain.models.left_padded``)."""
    shape = (k.shape[0], count, k.shape[-1])
    return k.new_full(shape, float("-inf")), k.new_zeros(shape)


def _aft_state(k, v, mask) -> list[torch.Tensor]:
    return list(aft_state(k, v, mask))


def _prefill(mixer, x, *, recent):
    """A prompt through ``mixer`` (AFT-local or -simple) → ``(y, state)``: ``_decode_step``'s state after it and the
    short convolutions' tails."""
    (q, k, v), tails = mixer.qkv_continuing(x, None)
    return mixer.o_proj(mixer.mix(q, k, v, None, None)), (_prefix_state(k, v, recent=recent), tails)


def _decode_step(mixer, x_t, state, rel_bias):
    """One causal AFT-local step (AFT-simple when ``rel_bias`` is None) from the prefix sums and recent tokens."""
    state, tails = state if state is not None else (None, None)
    (q, k, v), tails = mixer.qkv_continuing(x_t[:, None], tails)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    if state is None:
        recent = mixer.window - 1 if rel_bias is not None else 0
        state = (torch.zeros_like(k), torch.zeros_like(k), torch.full_like(k, float("-inf")), *_before_start(k, recent))
    num, den, running_max, recent_k, recent_v = state
    new_max = torch.maximum(running_max, k)
    rescale, exp_k = (running_max - new_max).exp(), (k - new_max).exp()
    num, den = num * rescale + exp_k * v, den * rescale + exp_k
    out_num, out_den = num, den
    if rel_bias is not None:  # offsets 0, 1, … from the newest token back
        keys = torch.cat([k[:, None], recent_k], 1)
        values = torch.cat([v[:, None], recent_v], 1)
        band = (rel_bias[: keys.shape[1]].exp() - 1)[None, :, None] * (keys - new_max[:, None]).exp()
        out_num, out_den = out_num + (band * values).sum(1), out_den + band.sum(1)
        recent_k, recent_v = keys[:, : mixer.window - 1], values[:, : mixer.window - 1]
    y = torch.sigmoid(q) * out_num / out_den
    return mixer.o_proj(y), ((num, den, new_max, recent_k, recent_v), tails)
