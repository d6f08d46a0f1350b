"""Small pieces the mixers share: the head split, packed-document positions, projection FLOPs."""
import torch

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
