"""Packed documents (``cu_seqlens`` offsets along one row): which tokens share one, and ops done per document.

The references mask with ``document_mask``; the chunked ops lay the ids out by chunk; ``document_sums`` is a
segmented sum. An op whose fast form is a per-sequence scan can simply run once per document
(``per_document``): one Python call each, cheap next to the work inside for documents of useful length.
"""
import torch
import torch.nn.functional as F


def check_packing(batch: int, cu_seqlens: torch.Tensor | None) -> None:
    """What the shapes of packed-document offsets show (traceable: no values read): batch 1, 1-D integers."""
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (flatten [B, T] to [1, B*T]); got batch {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be 1-D integer offsets [N + 1]; got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")


class OffsetsMemo:
    """The last value built from offsets' values, for the next call with the same offsets.

    Reading offsets on the host waits for the stream on a GPU, and a model hands every layer the same offsets, but
    not always the same tensor: activation checkpointing's recomputation hands each block a detached copy. So "the
    same" is the same memory, layout and version (an in-place change bumps it); the memo holds the tensor it was
    built from, so that memory cannot be reused by other offsets meanwhile (a few bytes)."""

    def __init__(self):
        self._key, self._held, self._value = None, None, None

    def get(self, cu_seqlens: torch.Tensor | None, build, *extra):
        """``build()``'s value, or the last one's where ``cu_seqlens`` (None too) and ``extra`` are the same."""
        key = extra if cu_seqlens is None else (cu_seqlens.device, cu_seqlens.dtype, tuple(cu_seqlens.shape),
                                                cu_seqlens.stride(), cu_seqlens.data_ptr(), cu_seqlens._version,
                                                *extra)
        if self._key != key:
            self._value = build()
            self._key, self._held = key, cu_seqlens
        return self._value


_checked = OffsetsMemo()


def check_offsets(cu_seqlens: torch.Tensor, length: int) -> int:
    """What only the values show: offsets rising strictly from 0 to ``length``; returns the number of documents.

    The values are read once per offsets (``OffsetsMemo``), not once per layer: each read is a host sync."""
    return _checked.get(cu_seqlens, lambda: _validated(cu_seqlens.tolist(), length), length)


def _validated(offsets: list[int], length: int) -> int:
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != length or any(
            b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={length} (no empty documents); "
                         f"got {offsets if len(offsets) <= 16 else offsets[:8] + ['...'] + offsets[-8:]}")
    return len(offsets) - 1


def stream_offsets(batch: int, length: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Long offsets of the documents of ``[B, T]`` tokens read as one stream of B·T: ``cu_seqlens`` when they are
    packed, else each row a document of its own (the chunked ops' layout)."""
    if cu_seqlens is None:
        return torch.arange(batch + 1, device=device) * length
    return cu_seqlens.to(device=device, dtype=torch.long)


def document_slices(cu_seqlens: torch.Tensor) -> list[slice]:
    """``cu_seqlens`` (int offsets, 0 … T) as one slice per document along the token axis."""
    offsets = cu_seqlens.tolist()
    return [slice(start, end) for start, end in zip(offsets[:-1], offsets[1:]) if end > start]


def per_document(op, cu_seqlens: torch.Tensor, *tensors: torch.Tensor, **kwargs) -> torch.Tensor:
    """``op`` applied to each document of the packed ``tensors`` (batch 1, tokens on dim 1), outputs joined."""
    total = tensors[0].shape[1]
    if tensors[0].shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (flatten [B, T] to [1, B*T]); got batch {tensors[0].shape[0]}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seqlens must run from 0 to T={total}; got {cu_seqlens.tolist()}")
    pieces = split_documents(cu_seqlens, *tensors)
    return torch.cat([op(*piece, **kwargs) for piece in pieces if piece[0].shape[1] > 0], dim=1)


def split_documents(cu_seqlens: torch.Tensor, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each document's pieces of the packed ``tensors`` (tokens on dim 1), the i-th for document i (empty ones
    included). One split per tensor, not a slice per document: each slice's backward writes all T tokens."""
    return list(zip(*(t.split(cu_seqlens.diff().tolist(), dim=1) for t in tensors)))


def document_ids(total: int, cu_seqlens: torch.Tensor | None, device=None) -> torch.Tensor:
    """``[T]`` long: the index of the document each token belongs to (all 0 without ``cu_seqlens``).

    Reads no values on the host (a one-call attention builds its mask from it on the GPU): starts at or past T mark
    a spare slot past the end, and empty documents mark their shared start once."""
    if cu_seqlens is None:
        return torch.zeros(total, dtype=torch.long, device=device)
    marks = torch.zeros(total + 1, dtype=torch.long, device=device)
    marks[cu_seqlens[1:-1].long().to(device).clamp(max=total)] = 1
    return marks[:total].cumsum(0)


def document_positions(total: int, cu_seqlens: torch.Tensor | None, device=None) -> torch.Tensor:
    """``[T]`` long: each token's position within its own document."""
    positions = torch.arange(total, device=device)
    if cu_seqlens is None:
        return positions
    starts = cu_seqlens.long().to(device).unique_consecutive()  # empty documents share an offset
    return positions - starts[document_ids(total, cu_seqlens, device)]


def document_sums(x: torch.Tensor, cu_seqlens: torch.Tensor | None, *, causal: bool,
                  initial: torch.Tensor | None = None):
    """Per token of ``x [B, T, ...]``, the sum over its document (a row, or a ``cu_seqlens`` piece of the one row)
    of the tokens up to it (causal) or of all of them; and each document's total ``[N, ...]``. ``initial [N, ...]``
    is added to every sum and total of its document.

    Packed documents take differences of one running sum, in fp64 so that what precedes a document cancels
    closely enough for fp32 results (a plain cumsum has no segmented form).
    """
    if cu_seqlens is None:
        totals = x.sum(1)
        sums = x.cumsum(1) if causal else totals[:, None].expand_as(x)
        per_token = None if initial is None else initial[:, None]
    else:
        cu = cu_seqlens.long().to(x.device)
        doc = document_ids(x.shape[1], cu, x.device)
        running = torch.cat([x.new_zeros(1, *x.shape[2:], dtype=torch.float64), x[0].double().cumsum(0)])
        before, after = running[cu[:-1]], running[cu[1:]]  # the running sum at each document's start and end
        sums = running[1:] - before[doc] if causal else (after - before)[doc]
        sums, totals = sums.to(x.dtype)[None], (after - before).to(x.dtype)
        per_token = None if initial is None else initial[doc][None]
    if initial is None:
        return sums, totals
    return sums + per_token, totals + initial


def chunked_document_ids(total: int, cu_seqlens: torch.Tensor | None, size: int, device=None) -> torch.Tensor:
    """``[n, size]``: each token's document in chunks of ``size`` tokens (the chunked ops' layout). The padding past
    T is a document of its own, id ``total``, which no real document has."""
    count = -(-total // size)
    doc = F.pad(document_ids(total, cu_seqlens, device), (0, count * size - total), value=total)
    return doc.view(count, size)


def causal_same_document(by_chunk: torch.Tensor) -> torch.Tensor:
    """``[n, L, L]`` bool from ``chunked_document_ids``: may a chunk's token t see its token j (j ≤ t, same doc)?"""
    size = by_chunk.shape[1]
    causal = torch.ones(size, size, dtype=torch.bool, device=by_chunk.device).tril()
    return causal & (by_chunk[:, :, None] == by_chunk[:, None, :])


def document_mask(total: int, cu_seqlens: torch.Tensor | None, *, causal: bool, device=None) -> torch.Tensor:
    """``[T, T]`` bool: may token t (row) see token j (column)? Same document, and j ≤ t when causal.

    The naive references use it, and softmax's one-call SDPA form (``impl="masked"``); no other fast form builds a
    T×T matrix.
    """
    doc = document_ids(total, cu_seqlens, device)
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return allowed
