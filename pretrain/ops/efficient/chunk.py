"""Causal efficient attention in chunks.

Stability: every exponent is taken relative to the running log-normaliser
``LZ_t = logcumsumexp_{j≤t}(k_j)`` (per channel) — the online-softmax trick with the normaliser folded in — so
every true weight ``e^{k_j − LZ_t}`` is at most 1 and no prefix collapses to 0/0, however the keys are spread.
The state carried between chunks is ``(Ŝ, L)``: ``Ŝ = Σ_j e^{k_j − L} v_jᵀ`` (d × dv) and ``L = LZ`` at the last token.
Inside a chunk the weights factor into a C×C matmul (see ``SPREAD``), so all chunks run at once.
"""
import torch
import torch.nn.functional as F

from ..precision import upcast

# Inside a chunk the weights factor, e^{k_j − LZ_t} = e^{k_j − r}·e^{r − LZ_t}, with one reference r per chunk and
# channel midway between the chunk's largest key and its smallest normaliser: the chunk is then a C×C matmul, as
# in linear attention. Each factor stays below e^{SPREAD/2}, so nothing overflows; what underflows weighs less than
# e^{−40} in a row whose weights sum to 1. A chunk whose keys and normalisers spread wider in some channel (keys
# ~80 apart within C tokens) takes the exact per-channel weights instead, C×C×D of them.
SPREAD = 80.0


def causal_chunked(q, k, v, chunk_size, initial_state, output_final_state):
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
