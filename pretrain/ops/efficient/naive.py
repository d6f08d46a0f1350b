"""Efficient attention by its definition, O(T²·D) memory: the oracle for the fast forms."""
import torch

from ..documents import document_mask
from ..precision import upcast


def efficient_attention_naive(q, k, v, *, causal=True, cu_seqlens=None):
    """The definition, O(T² · D) memory: for each query, a masked softmax of every key channel over positions."""
    total = q.shape[1]
    allowed = document_mask(total, cu_seqlens, causal=causal, device=q.device)  # [t, j]
    q, k, v_acc = upcast(q, k, v)
    p = torch.softmax(q, dim=-1)  # [B, t, H, D]
    logits = k[:, None].expand(-1, total, -1, -1, -1)  # [B, t, j, H, D]
    logits = logits.masked_fill(~allowed[None, :, :, None, None], float("-inf"))
    weights = torch.softmax(logits, dim=2)  # over j, per query t and channel
    mix = torch.einsum("bthc,btjhc->bhtj", p, weights)
    return torch.einsum("bhtj,bjhv->bthv", mix, v_acc).to(v.dtype)
