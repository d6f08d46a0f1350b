"""Softmax attention by its definition: the oracle for the fast forms."""
import torch

from ..documents import document_mask
from ..precision import upcast


def softmax_attention_naive(q, k, v, *, causal: bool = True, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, in (at least) fp32 with the whole ``[T, T]`` score matrix: the oracle for the fast forms."""
    q32, k32, v32 = upcast(q, k, v)
    scores = torch.einsum("bthd,bshd->bhts", q32, k32) * q.shape[-1] ** -0.5
    allowed = document_mask(q.shape[1], cu_seqlens, causal=causal, device=q.device)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhts,bshd->bthd", weights, v32).to(q.dtype)
