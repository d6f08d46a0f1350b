"""What a run of tokens hands on under decay, and how two runs join: the sequence-parallel state
(docs/MIXERS.md#decay, docs/SEQUENCE_PARALLEL.md).

From zero, the tokens of a run leave ``S = Σ_j exp(G_end − G_j) k_j v_jᵀ`` (and ``z = Σ_j exp(G_end − G_j) k_j``)
and shrink whatever came before them by ``exp(G)``, ``G = Σ g`` over the run. So a run is the pair
``(state, G)``, and the tokens of ``earlier`` then ``later`` leave ``S = exp(G_later) S_earlier + S_later`` with
``G = G_earlier + G_later``. The empty run is ``(0, 0)``.
"""
import torch
import torch.nn.functional as F

from ..linear_attention.state import FIELDS, LinearAttentionState


def decayed_state_of_tokens(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, normalize: str
                            ) -> tuple[LinearAttentionState, torch.Tensor]:
    """The state ``[B, H, ...]`` the tokens of ``k [B, T, H, D]``, ``v [B, T, H, Dv]``, ``g [B, T, H]`` where
    ``mask [B, T]`` (a run that ends the row: what a slice hands on) leave from zero, and their total log-decay
    ``[B, H]`` (fp32, fp64 for fp64 inputs)."""
    wide = torch.promote_types(k.dtype, torch.float32)
    k, v = k.to(wide), v.to(wide)
    g = g.to(wide) * mask[..., None]
    weight = log_decay_after(g, mask).exp() * mask[..., None]
    fields = {"S": lambda: torch.einsum("bth,bthk,bthv->bhkv", weight, k, v),
              "z": lambda: torch.einsum("bth,bthk->bhk", weight, k)}
    return LinearAttentionState(**{field: fields[field]() for field in FIELDS[normalize]}), g.sum(1)


def log_decay_after(g: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, H]``: the log-decay the tokens (where ``mask``) that come after each token apply to it, up to the
    row's end — what is left of a token's ``k vᵀ`` there is ``exp`` of it (sums of g ≤ 0, never differences)."""
    if mask is not None:
        g = g * mask[..., None]
    return F.pad(g.flip(1).cumsum(1).flip(1)[:, 1:], (0, 0, 0, 1))


def combine_decayed_states(earlier: tuple[LinearAttentionState, torch.Tensor],
                           later: tuple[LinearAttentionState, torch.Tensor]
                           ) -> tuple[LinearAttentionState, torch.Tensor]:
    """The run of ``earlier``'s tokens and then ``later``'s: ``S ← exp(G_later)·S_earlier + S_later``, G adds."""
    (state, log_decay), (then, log_decay_then) = earlier, later
    factor = log_decay_then.exp()
    joined = [None if a is None else factor.view(*factor.shape, *[1] * (a.dim() - 2)) * a + b
              for a, b in zip(state, then)]
    return LinearAttentionState(*joined), log_decay + log_decay_then
