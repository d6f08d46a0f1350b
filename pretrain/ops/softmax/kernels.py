"""The library kernels behind softmax attention: flash-attn's where it is installed, PyTorch's SDPA everywhere."""
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # CPU machines and GPUs without the package: SDPA
    flash_attn_func = flash_attn_varlen_func = None

flash_available = flash_attn_func is not None


def sdpa(q, k, v, *, causal):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def flash(q, k, v, causal, cu_seqlens):
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, causal=causal)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_len, max_len, causal=causal)
    return out.unsqueeze(0)
