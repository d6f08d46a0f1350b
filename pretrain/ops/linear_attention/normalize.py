"""The three normalizations as one unnormalized linear attention on augmented inputs.

A "core" computes ``o_t = qᵀ S_t`` with ``S_t = S_0 + Σ_j k_j v_jᵀ`` (causal or global, per document) and the
final ``S``. Appending a column of ones to v makes the same core also return ``q·z_t`` (the divisive
denominator), and a core call with q = k = 1 returns InLine's ``u_t`` (its count ``n_t`` is a cumsum). So each
fast form writes (and differentiates) only the core, and the state ``(S, z)`` is the augmented ``[D, Dv + 1]``
matrix.
"""
import torch

from ..documents import document_sums
from ..precision import upcast
from .state import LinearAttentionState


def normalized(core, q, k, v, *, causal, normalize, eps, cu_seqlens, initial_state, output_final_state):
    """Linear attention with ``normalize`` from ``core(q, k, v, initial, cu_seqlens, output_final) -> (o, S)``,
    a causal core if ``causal``."""
    dtype = q.dtype
    q, k, v = upcast(q, k, v)
    init = None if initial_state is None else LinearAttentionState(
        *(None if s is None else s.to(q.dtype) for s in initial_state))
    if normalize == "none":
        o, S = core(q, k, v, None if init is None else init.S, cu_seqlens, output_final_state)
        return _result(o.to(dtype), LinearAttentionState(S), output_final_state)

    ones = q.new_ones(*q.shape[:3], 1)
    v1 = torch.cat([v, ones], dim=-1)
    Sz0 = None if init is None else torch.cat([init.S, init.z[..., None]], dim=-1)
    num_den, Sz = core(q, k, v1, Sz0, cu_seqlens, output_final_state)
    num, den = num_den[..., :-1], num_den[..., -1:]
    final = None if Sz is None else LinearAttentionState(Sz[..., :-1], Sz[..., -1])
    if normalize == "divisive":
        return _result(_Quotient.apply(num, den + eps).to(dtype), final, output_final_state)

    # u_t, the values' own sum, is the core with q = k = 1 (its chunked form beats a segmented cumsum on CPU);
    # the count n_t depends on no token, so it is a cheap cumsum that carries no gradient in training
    u0 = None if init is None else init.u[:, :, None]
    u, u_final = core(ones, ones, v, u0, cu_seqlens, output_final_state)
    n, n_final = document_sums(ones, cu_seqlens, causal=causal, initial=None if init is None else init.n[..., None])
    inv_n = 1 / n
    o = (num + (1 - den * inv_n) * u) * inv_n  # q·S/n + (1 − q·z/n)·u/n with one reciprocal, on [T, H, 1]
    if final is not None:
        final = final._replace(u=u_final[:, :, 0], n=n_final[..., 0])
    return _result(o.to(dtype), final, output_final_state)


class _Quotient(torch.autograd.Function):
    """``num / den`` keeping the quotient rather than the numerator (``d num = g / den``, ``d den = −Σ (g / den)·o``):
    the layer after the op keeps the output as its input, so the divisive form's backward holds no tensor of its
    own over the tokens (``/`` would keep ``num``, ``[T, H, Dv]``, besides)."""

    @staticmethod
    def forward(ctx, num, den):
        o = num / den
        ctx.save_for_backward(o, den)
        return o

    @staticmethod
    def backward(ctx, grad):
        o, den = ctx.saved_tensors
        d_num = grad / den
        return d_num, -(d_num * o).sum(-1, keepdim=True)


def _result(o, final, output_final_state):
    return (o, final) if output_final_state else o
