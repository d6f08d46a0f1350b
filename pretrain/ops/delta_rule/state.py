"""The delta rule's carried state, and what a run of tokens does to it (sequence parallelism's combine rule).

The state is ``S [N, H, Dk, Dv]`` (k × v, as linear attention's), fp32 (fp64 for fp64 inputs); ``N`` is the batch,
or the number of documents when ``cu_seqlens`` packs them. It is not a sum over tokens: a run of tokens maps the
state entering it to ``M S + S_run``, where ``S_run`` is the run's state from zero and ``M`` the product of its
transitions ``α_t (I − β_t k_t k_tᵀ)``, ``[Dk, Dk]`` per head. Such pairs compose:
``later ∘ earlier = (M_l M_e, M_l S_e + S_l)``.
"""
import torch

from .chunk import delta_rule_chunk


def check_state(state, num: int, heads: int, dk: int, dv: int, what="initial_state") -> torch.Tensor:
    """Refuse a state that is not a floating ``[N, H, Dk, Dv]`` tensor matching the inputs, naming both shapes."""
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{what} must be a tensor [N, H, Dk, Dv]; got {type(state).__name__}")
    if tuple(state.shape) != (num, heads, dk, dv):
        raise ValueError(f"{what} has shape {tuple(state.shape)}; expected {(num, heads, dk, dv)} "
                         "([N, H, Dk, Dv] with N = batch or number of documents)")
    if not state.is_floating_point():
        raise ValueError(f"{what} must be floating point; got {state.dtype}")
    return state


def transition_of_tokens(k, v, beta, g, mask, *, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S_run, M)`` ``[B, H, Dk, Dv]``, ``[B, H, Dk, Dk]`` of the tokens of ``k [B, T, H, Dk]``, ``v``, ``β``,
    ``g`` where ``mask [B, T]``: what a sequence slice hands on (fp32, fp64 for fp64 inputs).

    One chunked pass gives both: masked-out tokens get β = 0, g = 0 (the identity transition, adding nothing), and
    the values ``[V, 0]`` start from ``[0, I]``, so the final state is ``[M·0 + S_run, M·I + 0]``.
    """
    batch, _, heads, dk = k.shape
    dv = v.shape[-1]
    keep = mask[:, :, None].to(beta.dtype)
    values = torch.cat([v, v.new_zeros(*v.shape[:3], dk)], dim=-1)
    wide = torch.promote_types(k.dtype, torch.float32)
    start = torch.cat([torch.zeros(batch, heads, dk, dv, dtype=wide, device=k.device),
                       torch.eye(dk, dtype=wide, device=k.device).expand(batch, heads, dk, dk)], dim=-1)
    gate = beta.new_zeros(beta.shape) if g is None else g * keep
    _, final = delta_rule_chunk(k, k, values, beta * keep, gate, cu_seqlens=None, initial_state=start,
                                output_final_state=True, chunk_size=chunk_size)
    return final[..., :dv], final[..., dv:]


def combine_transitions(earlier, later):
    """``(S, M)`` pairs: the map of ``earlier``'s tokens followed by ``later``'s."""
    (S_e, M_e), (S_l, M_l) = earlier, later
    return [M_l @ S_e + S_l, M_l @ M_e]
