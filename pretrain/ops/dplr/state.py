"""The diagonal-plus-low-rank rule's carried state, and what a run of tokens does to it (sequence parallelism).

As the delta rule's (``delta_rule/state.py``, whose shape check and combine rule this reuses): ``S [N, H, Dk, Dv]``,
and a run of tokens maps the state entering it to ``M S + S_run``, ``M`` the product of its transitions
``Diag(e^{g_t}) + a_t b_tᵀ`` (``[Dk, Dk]`` per head). Pairs compose: ``later ∘ earlier = (M_l M_e, M_l S_e + S_l)``.
"""
import torch

from ..delta_rule.state import check_state, combine_transitions
from .chunk import dplr_chunk


def dplr_transition_of_tokens(k, v, a, b, g, mask, *, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S_run, M)`` ``[B, H, Dk, Dv]``, ``[B, H, Dk, Dk]`` of the tokens of ``k, a, b, g [B, T, H, Dk]``, ``v``
    where ``mask [B, T]``: what a sequence slice hands on (fp32, fp64 for fp64 inputs).

    One chunked pass gives both: masked-out tokens get k = a = 0 and g = 0 (the identity transition, adding
    nothing), and the values ``[V, 0]`` start from ``[0, I]``, so the final state is ``[M·0 + S_run, M·I + 0]``.
    """
    batch, _, heads, dk = k.shape
    dv = v.shape[-1]
    keep = mask[:, :, None, None].to(k.dtype)
    values = torch.cat([v, v.new_zeros(*v.shape[:3], dk)], dim=-1)
    wide = torch.promote_types(k.dtype, torch.float32)
    start = torch.cat([torch.zeros(batch, heads, dk, dv, dtype=wide, device=k.device),
                       torch.eye(dk, dtype=wide, device=k.device).expand(batch, heads, dk, dk)], dim=-1)
    _, final = dplr_chunk(k, k * keep, values, a * keep, b, g * keep, cu_seqlens=None, initial_state=start,
                          output_final_state=True, chunk_size=chunk_size)
    return final[..., :dv], final[..., dv:]


__all__ = ["check_state", "combine_transitions", "dplr_transition_of_tokens"]
