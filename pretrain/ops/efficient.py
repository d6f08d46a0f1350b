"""Efficient attention (Shen et al. 2021): softmax over Q's features and over K's positions, separately.

REFERENCE §3. Non-causal, as published: ``O = softmax_d(Q) · (softmax_T(K)ᵀ V)``.
Causal (derived): ``o_t = Σ_c softmax(q_t)_c · A_t[c]`` with ``A_t[c] = Σ_{j≤t} softmax_{j≤t}(k_{·c})_j v_j``,
a per-channel prefix softmax over the keys.

Stability of the causal form: every exponent is taken relative to the running log-normaliser
``LZ_t = logcumsumexp_{j≤t}(k_j)`` (per channel) — the online-softmax trick with the normaliser folded in — so
every true weight ``e^{k_j − LZ_t}`` is at most 1 and no prefix collapses to 0/0, however the keys are spread.
The state carried between chunks is ``(Ŝ, L)``: ``Ŝ = Σ_j e^{k_j − L} v_jᵀ`` (d × dv) and ``L = LZ`` at the last token.
Inside a chunk the weights factor into a C×C matmul (see ``SPREAD``), so all chunks run at once.
"""
import torch
import torch.nn.functional as F

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
    chunk_size: int = 64,
    impl: str = "auto",
):
    """q, k ``[B, T, H, D]``, v ``[B, T, H, Dv]`` → o ``[B, T, H, Dv]`` (or ``(o, state)``).

    ``impl``: "naive" (the O(T²) definition), "chunk" (causal: chunks of ``chunk_size``; non-causal: the
    published two-matmul form) or "auto" (= "chunk"). ``initial_state``/``output_final_state`` carry the causal
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


# Inside a chunk the weights factor, e^{k_j − LZ_t} = e^{k_j − r}·e^{r − LZ_t}, with one reference r per chunk and
# channel midway between the chunk's largest key and its smallest normaliser: the chunk is then a C×C matmul, as
# in linear attention. Each factor stays below e^{SPREAD/2}, so nothing overflows; what underflows weighs less than
# e^{−40} in a row whose weights sum to 1. A chunk whose keys and normalisers spread wider in some channel (keys
# ~80 apart within C tokens) takes the exact per-channel weights instead, C×C×D of them.
SPREAD = 80.0


def _causal_chunked(q, k, v, chunk_size, initial_state, output_final_state):
    """All chunks at once: the factored C×C weights inside each, the state ``(Ŝ, L)`` carried between them."""
    batch, length, heads, dim = k.shape
    q32, k32, v32 = upcast(q, k, v)
    p = torch.softmax(q32, dim=-1)
    if initial_state is None:
        state = k32.new_zeros(batch, heads, dim, v.shape[-1])
        log_norm = k32.new_full((batch, heads, dim), float("-inf"))
    else:
        state, log_norm = (s.to(k32.dtype) for s in initial_state)
    lz = torch.logaddexp(log_norm[:, None], torch.logcumsumexp(k32, dim=1))  # [B, T, H, D]

    count = -(-length // chunk_size)
    last = torch.arange(count * chunk_size, device=k.device).clamp(max=length - 1)  # padding repeats the last token

    def chunked(x, pad_with_last):
        x = x[:, last] if pad_with_last else F.pad(x, (0, 0, 0, 0, 0, count * chunk_size - length))
        return x.view(batch, count, chunk_size, heads, x.shape[-1])

    P, V = chunked(p, False), chunked(v32, False)  # padding weighs nothing and adds nothing
    K, LZ = chunked(k32, True), chunked(lz, True)
    end = LZ[:, :, -1]  # [B, N, H, D]: the log-normaliser at each chunk's last token
    before = torch.cat([log_norm[:, None], end[:, :-1]], dim=1)  # ... and just before its first

    with torch.no_grad():  # the reference cancels from every weight: no gradient through it
        top, bottom = K.amax(dim=2), LZ[:, :, 0]
        reference = ((top + bottom) / 2)[:, :, None]
        wide = (top - bottom > SPREAD).any(dim=-1)  # [B, N, H]
    narrow = ~wide[:, :, None, :, None]
    q_factor = P * torch.exp(torch.where(narrow, reference - LZ, 0.0))  # wide chunks: finite stand-ins, replaced below
    k_factor = torch.exp(torch.where(narrow, K - reference, 0.0))
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    mix = torch.einsum("bnthc,bnjhc->bnhtj", q_factor, k_factor) * causal
    intra = torch.einsum("bnhtj,bnjhv->bnhtv", mix, V)
    if wide.any():
        b, n, h = wide.nonzero(as_tuple=True)
        intra = intra.index_put((b, n, h), _exact_within_chunk(P[b, n, :, h], K[b, n, :, h], V[b, n, :, h],
                                                              LZ[b, n, :, h]))

    # the state before each chunk, Ŝ = Σ_{earlier j} e^{k_j − L} v_j with L its log-normaliser: a short recurrence
    added = torch.einsum("bnjhc,bnjhv->bnhcv", torch.exp(K - end[:, :, None]), V)
    decay = torch.exp(before - end)[..., None]
    entering = []
    for decay_n, added_n in zip(decay.unbind(1), added.unbind(1)):  # (indexing each would give every step's
        entering.append(state)                                       # backward a whole-size gradient to fill)
        state = decay_n * state + added_n
    inter = torch.einsum("bnthc,bnhcv->bnhtv", P * torch.exp(before[:, :, None] - LZ), torch.stack(entering, 1))

    o = (intra + inter).transpose(2, 3).reshape(batch, count * chunk_size, heads, -1)[:, :length].to(v.dtype)
    return (o, (state, end[:, -1])) if output_final_state else o


def _exact_within_chunk(p, k, v, lz):
    """``Σ_c p_tc Σ_{j≤t} e^{k_jc − LZ_tc} v_j`` for chunks ``[M, C, ·]`` with one exponential per channel: every
    exponent ≤ 0, however the keys spread."""
    size = k.shape[1]
    below = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()[None, :, :, None]
    exponent = (k[:, None] - lz[:, :, None]).masked_fill(~below, float("-inf"))  # [M, t, j, D]
    mix = torch.einsum("mtc,mtjc->mtj", p, exponent.exp())
    return mix @ v


def efficient_state(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal state ``(Ŝ [B, H, D, Dv], L [B, H, D])`` that the tokens of ``k [B, T, H, D]``, ``v [B, T, H, Dv]``
    where ``mask [B, T]`` leave, from nothing: ``L = log Σ e^k`` per channel, ``Ŝ = Σ e^{k − L} vᵀ``. A row with no
    token leaves the empty state ``(0, −∞)``."""
    k, v = upcast(k, v)
    logits = k.masked_fill(~mask[:, :, None, None], float("-inf"))
    log_norm = torch.logsumexp(logits, dim=1)
    weights = torch.exp(logits - _finite(log_norm)[:, None])
    return torch.einsum("bthc,bthv->bhcv", weights, v), log_norm


def combine_efficient_states(earlier, later) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after ``earlier``'s tokens and then ``later``'s: normalizers add in log space, and each sum is
    rescaled to the joint one."""
    (s_a, l_a), (s_b, l_b) = earlier, later
    log_norm = torch.logaddexp(l_a, l_b)
    joint = _finite(log_norm)
    return torch.exp(l_a - joint)[..., None] * s_a + torch.exp(l_b - joint)[..., None] * s_b, log_norm


def _finite(log_norm: torch.Tensor) -> torch.Tensor:
    """``log_norm`` with the empty state's −∞ as 0, so ``exp(x − log_norm)`` of empty sums is 0, never NaN."""
    return torch.where(torch.isfinite(log_norm), log_norm, 0.0)
