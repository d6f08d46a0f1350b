"""Efficient attention (Shen et al. 2021): softmax over Q's features and over K's positions, separately.

REFERENCE §3. Non-causal, as published: ``O = softmax_d(Q) · (softmax_T(K)ᵀ V)``.
Causal (derived): ``o_t = Σ_c softmax(q_t)_c · A_t[c]`` with ``A_t[c] = Σ_{j≤t} softmax_{j≤t}(k_{·c})_j v_j``,
a per-channel prefix softmax over the keys.

Stability of the causal form: every exponent is taken relative to the running log-normaliser
``LZ_t = logcumsumexp_{j≤t}(k_j)`` (per channel) — the online-softmax trick with the normaliser folded in — so
every ``exp`` has a non-positive argument and no prefix collapses to 0/0, however the keys are spread.
The state carried between chunks is ``(Ŝ, L)``: ``Ŝ = Σ_j e^{k_j − L} v_jᵀ`` (d × dv) and ``L = LZ`` at the last token.
"""
import torch
from torch.utils.checkpoint import checkpoint

from .documents import document_mask, per_document
from .precision import upcast


def efficient_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 16,
    impl: str = "auto",
):
    """q, k ``[B, T, H, D]``, v ``[B, T, H, Dv]`` → o ``[B, T, H, Dv]`` (or ``(o, state)``).

    ``impl``: "naive" (the O(T²) definition), "chunk" (causal: chunks of ``chunk_size``; non-causal: the
    published two-matmul form) or "auto" (= "chunk"). The causal chunk weighs every key channel separately,
    C×C×D exponentials per chunk, so chunks are smaller than linear attention's (16 measured fastest on CPU). ``initial_state``/``output_final_state`` carry the causal
    state ``(Ŝ [B,H,D,Dv], L [B,H,D])`` across calls, e.g. for token-by-token decoding.
    """
    if not (q.shape[:3] == k.shape[:3] == v.shape[:3] and q.shape[-1] == k.shape[-1]):
        raise ValueError(f"efficient_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if impl not in ("auto", "naive", "chunk"):
        raise ValueError(f"efficient_attention: unknown impl {impl!r}; choose auto, naive or chunk")
    if (initial_state is not None or output_final_state) and not causal:
        raise ValueError("efficient_attention: a state exists only for causal=True")
    if (initial_state is not None or output_final_state) and cu_seqlens is not None:
        raise ValueError("efficient_attention: states and cu_seqlens together are not supported")
    if impl == "naive":
        if initial_state is not None or output_final_state:
            raise ValueError("efficient_attention: impl='naive' carries no state")
        return efficient_attention_naive(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    if not causal:
        run = _noncausal
    else:
        def run(q, k, v):
            return _causal_chunked(q, k, v, chunk_size, initial_state, output_final_state)
    if cu_seqlens is not None:
        return per_document(run, cu_seqlens, q, k, v)
    return run(q, k, v)


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


def _noncausal(q, k, v):
    """As published: two softmaxes, then a d × dv context per head."""
    q, k, v_acc = upcast(q, k, v)
    p = torch.softmax(q, dim=-1)
    a = torch.softmax(k, dim=1)
    context = torch.einsum("bjhc,bjhv->bhcv", a, v_acc)
    return torch.einsum("bthc,bhcv->bthv", p, context).to(v.dtype)


def _causal_chunked(q, k, v, chunk_size, initial_state, output_final_state):
    """Intra-chunk: explicit per-channel weights ``e^{k_j − LZ_t}``; inter-chunk: the state ``(Ŝ, L)``."""
    batch, _, heads, dim = k.shape
    q32, k32, v32 = upcast(q, k, v)
    p = torch.softmax(q32, dim=-1)
    if initial_state is None:
        state = k32.new_zeros(batch, heads, dim, v.shape[-1])
        log_norm = k32.new_full((batch, heads, dim), float("-inf"))
    else:
        state, log_norm = (s.to(k32.dtype) for s in initial_state)
    lz = torch.logaddexp(log_norm[:, None], torch.logcumsumexp(k32, dim=1))  # [B, T, H, D]
    outputs = []
    # split, not a slice per chunk: a slice's backward writes a whole [B, T, H, D] gradient, T/C times over
    for pc, kc, vc, lzc in zip(*(x.split(chunk_size, dim=1) for x in (p, k32, v32, lz))):
        intra = checkpoint(_within_chunk, pc, kc, vc, lzc, use_reentrant=False)
        inter = torch.einsum("bthc,bhcv->bthv", pc * (log_norm[:, None] - lzc).exp(), state)
        outputs.append(intra + inter)
        new_log_norm = lzc[:, -1]
        state = (log_norm - new_log_norm).exp()[..., None] * state + torch.einsum(
            "bjhc,bjhv->bhcv", (kc - new_log_norm[:, None]).exp(), vc
        )
        log_norm = new_log_norm
    o = torch.cat(outputs, dim=1).to(v.dtype)
    return (o, (state, log_norm)) if output_final_state else o


def _within_chunk(p, k, v, lz):
    """``Σ_c p_tc Σ_{j≤t} e^{k_jc − LZ_tc} v_j`` inside one chunk. Its ``[B, C, C, H, D]`` weights are recomputed
    in backward (checkpointed) rather than kept for every chunk, so autograd memory stays O(T·D)."""
    size = k.shape[1]
    below = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()[None, :, :, None, None]
    exponent = (k[:, None] - lz[:, :, None]).masked_fill(~below, float("-inf"))  # [B, t, j, H, D], all ≤ 0
    mix = torch.einsum("bthc,btjhc->bhtj", p, exponent.exp())
    return torch.einsum("bhtj,bjhv->bthv", mix, v)
