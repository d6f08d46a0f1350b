"""The carried state of linear attention, one type for every implementation.

``S = Σ φ(k) vᵀ`` ``[N, H, D, Dv]``, ``z = Σ φ(k)`` ``[N, H, D]``, ``u = Σ v`` ``[N, H, Dv]``,
``n`` = tokens seen ``[N, H]`` (docs/MIXERS.md#linear, #inline), all fp32 (fp64 for fp64 inputs). ``N`` is the
batch, or the number of documents when ``cu_seqlens`` packs them. Which fields are present depends on the normalization:
``none`` keeps ``S``, ``divisive`` ``S, z``, ``subtractive`` all four; the others are ``None``.
"""
from typing import NamedTuple

import torch

FIELDS = {"none": ("S",), "divisive": ("S", "z"), "subtractive": ("S", "z", "u", "n")}


class LinearAttentionState(NamedTuple):
    S: torch.Tensor
    z: torch.Tensor | None = None
    u: torch.Tensor | None = None
    n: torch.Tensor | None = None


def zero_state(num: int, heads: int, dk: int, dv: int, normalize: str, *, dtype, device) -> LinearAttentionState:
    """The state before any token: zeros in the fields ``normalize`` uses."""
    shapes = {"S": (num, heads, dk, dv), "z": (num, heads, dk), "u": (num, heads, dv), "n": (num, heads)}
    return LinearAttentionState(**{f: torch.zeros(shapes[f], dtype=dtype, device=device)
                                   for f in FIELDS[normalize]})


def check_state(state, num: int, heads: int, dk: int, dv: int, normalize: str, what="initial_state"):
    """Refuse a state whose fields or shapes do not match the inputs, naming the field and both shapes."""
    if not isinstance(state, tuple):
        raise TypeError(f"{what} must be a LinearAttentionState; got {type(state).__name__}")
    state = LinearAttentionState(*state)
    expected = zero_state(num, heads, dk, dv, normalize, dtype=torch.float32, device="meta")
    for field, want in zip(LinearAttentionState._fields, expected):
        got = getattr(state, field)
        if want is None:
            continue
        if got is None:
            raise ValueError(f"{what}.{field} is missing; normalize={normalize!r} carries {FIELDS[normalize]}")
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{what}.{field} has shape {tuple(got.shape)}; expected {tuple(want.shape)} "
                             f"([N, H, ...] with N = batch or number of documents)")
        if not got.is_floating_point():
            raise ValueError(f"{what}.{field} must be floating point; got {got.dtype}")
    return state


def state_of_tokens(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, normalize: str) -> LinearAttentionState:
    """The state ``[B, H, ...]`` that the tokens of ``k [B, T, H, D]``, ``v [B, T, H, Dv]`` where ``mask [B, T]``
    leave behind, starting from zero: what a slice hands on to the next one (fp32, fp64 for fp64 inputs)."""
    wide = torch.promote_types(k.dtype, torch.float32)
    k, v = k.to(wide), v.to(wide)
    weight = mask.to(wide)[:, :, None, None]
    kept = k * weight
    fields = {"S": lambda: torch.einsum("bthk,bthv->bhkv", kept, v), "z": lambda: kept.sum(1),
              "u": lambda: (v * weight).sum(1), "n": lambda: weight[..., 0].sum(1).expand(k.shape[0], k.shape[2])}
    return LinearAttentionState(**{field: fields[field]() for field in FIELDS[normalize]})


def combine_states(earlier: LinearAttentionState, later: LinearAttentionState) -> LinearAttentionState:
    """The state after ``earlier``'s tokens and then ``later``'s: every field is a sum over tokens."""
    return LinearAttentionState(*(None if a is None else a + b for a, b in zip(earlier, later)))
