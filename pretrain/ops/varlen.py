"""Packed documents: from per-token positions to flash-attn style ``cu_seqlens``."""
import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Offsets of the documents in the flattened ``[B*T]`` token stream (int32, starts 0, ends B*T).

    A document starts wherever ``position_ids == 0`` and at every row start, so rows never merge.
    """
    starts = position_ids == 0
    starts[:, 0] = True
    flat = starts.reshape(-1)
    offsets = torch.nonzero(flat, as_tuple=False).squeeze(1)
    total = torch.tensor([flat.numel()], device=flat.device, dtype=offsets.dtype)
    return torch.cat([offsets, total]).to(torch.int32)
