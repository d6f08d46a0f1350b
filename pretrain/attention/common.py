"""Small pieces the mixers share: the head split, packed-document positions, projection FLOPs, Mamba-2's decay init."""
import math

import torch
from torch import nn

from ..ops.documents import document_positions


def split_heads(x: torch.Tensor, num_heads: int, *, packed: bool) -> torch.Tensor:
    """``[B, T, C]`` → ``[B, T, H, C/H]``, or ``[1, B·T, H, C/H]`` when ``packed`` (the ops' cu_seqlens layout)."""
    batch, seq_len, dim = x.shape
    if packed:
        return x.reshape(1, batch * seq_len, num_heads, dim // num_heads)
    return x.reshape(batch, seq_len, num_heads, dim // num_heads)


def token_positions(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """``[B, T]`` position of each token within its document (rows are separate sequences without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(seq_len, device=device).expand(batch, seq_len)
    return document_positions(batch * seq_len, cu_seqlens, device=device).view(batch, seq_len)


def check_heads(dim: int, num_heads: int) -> int:
    """The head dimension, or a clear error when ``dim`` does not split into ``num_heads``."""
    if dim % num_heads:
        raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
    return dim // num_heads


def projection_flops(dim: int, count: int) -> float:
    """Forward FLOPs per token of ``count`` dim×dim projections (a multiply-add = 2)."""
    return 2.0 * dim * dim * count


# Mamba-2's default decay init (its paper's and its reference code's): dt log-uniform in [0.001, 0.1], A in [1, 16].
MAMBA2_DT_MIN, MAMBA2_DT_MAX, MAMBA2_A_INIT_RANGE, MAMBA2_DT_INIT_FLOOR = 0.001, 0.1, (1.0, 16.0), 1e-4


def mamba2_decay_init(name: str, num_heads: int, *, dt_min: float, dt_max: float, a_init_range, dt_init_floor: float
                      ) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba-2's per-head decay parameters ``(A_log, dt_bias)`` (``mamba2``'s and ``gated_deltanet``'s): dt
    log-uniform in ``[dt_min, dt_max]``, stored through softplus's inverse, and A uniform in ``a_init_range``, so the
    log-decay ``−A·softplus(· + dt_bias)`` starts near ``−A·dt`` per token. ``name`` is the mixer the errors name."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"{name}: need 0 < dt_min ≤ dt_max; got dt_min={dt_min}, dt_max={dt_max}")
    low, high = a_init_range
    if not 0 < low <= high:
        raise ValueError(f"{name}: a_init_range must be 0 < low ≤ high; got {tuple(a_init_range)}")
    dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_init_floor)
    dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
    return nn.Parameter(torch.empty(num_heads).uniform_(low, high).log()), dt_bias
