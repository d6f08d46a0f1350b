"""Runs of consecutive tokens (documents, or pieces of them) gathered into padded rows and scattered back.

The forms that are naturally per sequence (recurrent, non-causal) run packed documents as a padded batch, and
the chunked form gathers the few tokens of a document that share a chunk with its neighbours.
"""
import torch


def gather_runs(x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor):
    """Rows ``[M, max(lengths), ...]`` of ``x [T, ...]`` from each start, zero past each run's length.

    Also returns ``index`` (the token of each slot) and ``valid`` (slots inside their run), both ``[M, Lmax]``.
    """
    width = int(lengths.max()) if lengths.numel() else 0
    offsets = torch.arange(width, device=x.device)
    valid = offsets[None, :] < lengths[:, None]
    index = (starts[:, None] + offsets[None, :]).clamp(max=x.shape[0] - 1)
    rows = x[index] * valid.view(*valid.shape, *(1,) * (x.dim() - 1)).to(x.dtype)
    return rows, index, valid


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """``[1, T, ...]`` packed documents → ``[N, Lmax, ...]`` zero-padded rows, and ``valid``; batches pass through."""
    if cu_seqlens is None:
        return x, None
    cu = cu_seqlens.long()
    rows, _, valid = gather_runs(x[0], cu[:-1], cu[1:] - cu[:-1])
    return rows, valid


def repack(rows: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The inverse of ``unpack``: the valid slots, in order, as ``[1, T, ...]``."""
    return rows if valid is None else rows[valid].unsqueeze(0)
