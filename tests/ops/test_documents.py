"""Per-document sums (``ops.documents.document_sums``) against a loop over each document's own tokens; document ids."""
import pytest
import torch

from pretrain.ops.documents import check_offsets, document_ids, document_sums


def loop_sums(x, cu_seqlens, *, causal, initial):
    """The definition: each document alone, summed token by token in fp64."""
    rows = [x[b] for b in range(x.shape[0])] if cu_seqlens is None else [
        x[0, a:b] for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    sums, totals = [], []
    for i, row in enumerate(rows):
        row = row.double()
        start = 0 if initial is None else initial[i].double()
        total = row.sum(0) + start
        sums.append(row.cumsum(0) + start if causal else total.expand_as(row))
        totals.append(total)
    stacked = torch.stack(sums) if cu_seqlens is None else torch.cat(sums)[None]
    return stacked, torch.stack(totals)


@pytest.mark.parametrize("causal", [True, False], ids=["prefix", "whole"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zero", "initial"])
def test_document_sums_match_each_document_alone(causal, packed, with_initial):
    g = torch.Generator().manual_seed(0)
    if packed:  # one-token documents, and one long document after many tokens (its sum must not inherit theirs)
        cu = torch.tensor([0, 1, 2, 9, 10, 4000, 4003])
        x = torch.randn(1, 4003, 3, 2, generator=g) + 100  # a large running sum before the last documents
    else:
        cu = None
        x = torch.randn(2, 37, 3, 2, generator=g)
    num = x.shape[0] if cu is None else cu.numel() - 1
    initial = torch.randn(num, 3, 2, generator=g) if with_initial else None
    sums, totals = document_sums(x, cu, causal=causal, initial=initial)
    want_sums, want_totals = loop_sums(x, cu, causal=causal, initial=initial)
    assert sums.dtype == totals.dtype == x.dtype
    assert sums.shape == x.shape and totals.shape == (num, 3, 2)
    torch.testing.assert_close(sums.double(), want_sums, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(totals.double(), want_totals, rtol=1e-6, atol=1e-5)


def test_document_ids_count_documents_and_read_nothing_from_the_device():
    """Each token's document, empty documents marking their shared start once (as the chunked ops lay them out);
    on the meta device too, where reading a value (a host sync on a GPU) raises."""
    cu = torch.tensor([0, 2, 2, 3, 7], dtype=torch.int32)  # an empty document between the first two
    assert document_ids(7, cu).tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert document_ids(4, None).tolist() == [0, 0, 0, 0]
    assert document_ids(7, cu.to("meta"), "meta").shape == (7,)


def test_offsets_are_read_once_per_tensor_and_again_after_a_change(monkeypatch):
    """Every layer gets the model's one offsets, as the tensor or (activation checkpointing's recomputation) a
    detached copy of it: reading them per layer was a host sync per layer on a GPU."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert [check_offsets(offsets, 8) for _ in range(4)] == [2] * 4
    assert check_offsets(offsets.detach(), 8) == check_offsets(offsets[:], 8) == 2
    assert len(reads) == 1
    assert check_offsets(offsets.clone(), 8) == 2  # other memory: read
    assert check_offsets(offsets, 8) == 2
    assert len(reads) == 3
    offsets[1] = 0  # changed in place: read and refused
    with pytest.raises(ValueError, match="rise strictly"):
        check_offsets(offsets, 8)
    with pytest.raises(ValueError, match="from 0 to T=9"):  # another length: checked again
        check_offsets(torch.tensor([0, 3, 8]), 9)
    assert len(reads) == 5
