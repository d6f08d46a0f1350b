"""The (gated) delta rule by flash-linear-attention's ``chunk_gated_delta_rule``, or ``chunk_delta_rule`` when
there is no gate (CUDA).

The conventions agree (``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, state
``[N, H, Dk, Dv]``, g the log of α); what differs is mapped here: fla scales q by ``Dk^-1/2`` unless told otherwise
(scale=1.0: ours is scaled by the caller) and can L2-normalize q and k itself (off: our mixers normalize k);
offsets become int64; the final state comes back in our state dtype. ``chunk_delta_rule`` refuses fp32, so an
ungated fp32 request goes to the gated kernel with g = 0. fla tiles by its own chunk size (``chunk_size`` unused).
"""
import torch

from ..flash_linear import check_fla_device, fla_function, fla_offsets, state_dtype


def delta_rule_fla(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size):
    """Same arguments and results as ``delta_rule``; ``g`` may be None (DeltaNet)."""
    del chunk_size
    check_fla_device(q, "delta_rule")
    common = dict(scale=1.0, use_qk_l2norm_in_kernel=False, output_final_state=output_final_state,
                  initial_state=None if initial_state is None else initial_state.to(state_dtype(q)),
                  **fla_offsets(cu_seqlens, q))
    if g is None and q.dtype != torch.float32:
        o, final = fla_function("fla.ops.delta_rule", "chunk_delta_rule")(q, k, v, beta, **common)
    else:
        gate = beta.new_zeros(beta.shape) if g is None else g
        o, final = fla_function("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")(q, k, v, gate, beta, **common)
    return (o, final.to(state_dtype(q))) if output_final_state else o
