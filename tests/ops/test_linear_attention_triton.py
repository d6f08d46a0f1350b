"""The Triton kernels held to the naive O(T²) reference, forward and every gradient (docs/MIXERS.md#chunked).

Without a GPU the same kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before anything imports Triton); shapes stay small because the interpreter is slow. The
reference runs in fp64.
"""
import importlib
import warnings

import pytest
import torch

pytest.importorskip("triton")

from pretrain.ops.linear_attention import LinearAttentionState, linear_attention
from pretrain.ops.linear_attention import triton as kernels
from pretrain.ops.linear_attention.state import FIELDS

la = importlib.import_module("pretrain.ops.linear_attention")  # the module, not the function it is named after

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NORMALIZATIONS = ("none", "divisive", "subtractive")


pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")  # tests/ops/conftest.py


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def make_inputs(batch, length, heads, dk, dv, dtype, *, seed):
    """Positive features (as after φ) so divisive denominators stay away from zero; fresh per test."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(batch, length, heads, dk, generator=gen)
    k = torch.rand(batch, length, heads, dk, generator=gen)
    v = torch.randn(batch, length, heads, dv, generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]


def make_state(num, heads, dk, dv, normalize, *, seed):
    """A random initial state with the fields ``normalize`` carries (n a positive count)."""
    gen = torch.Generator().manual_seed(seed)
    parts = {"S": torch.rand(num, heads, dk, dv, generator=gen), "z": torch.rand(num, heads, dk, generator=gen),
             "u": torch.randn(num, heads, dv, generator=gen),
             "n": torch.randint(1, 9, (num, heads), generator=gen).float()}
    return LinearAttentionState(**{f: parts[f].to(DEVICE).requires_grad_(f != "n") for f in FIELDS[normalize]})


def run_both(q, k, v, state, *, seed, **kwargs):
    """Outputs, final states and gradients (of o and of the final state) from triton and from fp64 naive."""
    results = []
    for impl in ("triton", "naive"):
        cast = (lambda t: t.double()) if impl == "naive" else (lambda t: t)
        init = None if state is None else LinearAttentionState(*(None if s is None else cast(s) for s in state))
        o, final = linear_attention(cast(q), cast(k), cast(v), initial_state=init, output_final_state=True,
                                    impl=impl, **kwargs)
        results.append((o, final))
    (o, final), (ref_o, ref_final) = results
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in (o, *final[:3]) if t is not None]
    leaves = [q, k, v] + ([s for s in state[:3] if s is not None] if state is not None else [])
    grads = []
    for out, fin in ((o, final), (ref_o, ref_final)):
        terms = [out, *(f for f in fin[:3] if f is not None)]
        loss = sum((t * w.to(t.dtype)).sum() for t, w in zip(terms, weights))
        grads.append(torch.autograd.grad(loss, leaves))
    return (o, final, grads[0]), (ref_o, ref_final, grads[1])


def assert_close(got, want, tol, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = relative_error(got, want)
    assert err < tol, f"{what}: relative error {err:.2e} ≥ {tol:.0e}"


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
def test_matches_naive_fp32(normalize, causal, packed):
    """Awkward sizes (T not a multiple of the chunk, head dims not powers of two), a random initial state,
    the final state, and the gradients of all of them."""
    seed = 4 * NORMALIZATIONS.index(normalize) + 2 * causal + packed
    if packed:  # 5 < chunk, 16 = chunk
        assert_fp32_matches_naive(normalize, causal, seed=seed, documents=[0, 5, 21, 45], heads=2)
    else:
        assert_fp32_matches_naive(normalize, causal, seed=seed, batch=2, length=37, heads=2)


def assert_fp32_matches_naive(normalize, causal, *, seed, heads, documents=None, batch=1, length=None):
    """Random inputs (d = 12, dv = 20, packed ``documents`` or ``batch`` sequences of ``length``) and initial state,
    chunks of 16: o, every final-state field and every gradient within 1e-5 of fp64 naive."""
    if documents:
        q, k, v = make_inputs(1, documents[-1], heads, 12, 20, torch.float32, seed=seed)
        cu_seqlens = torch.tensor(documents, dtype=torch.int32, device=DEVICE)
        num = len(documents) - 1
    else:
        q, k, v = make_inputs(batch, length, heads, 12, 20, torch.float32, seed=seed)
        cu_seqlens, num = None, batch
    state = make_state(num, heads, 12, 20, normalize, seed=seed)
    (o, final, grads), (ref_o, ref_final, ref_grads) = run_both(
        q, k, v, state, seed=seed, causal=causal, normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=16)
    assert_close(o, ref_o, 1e-5, "o")
    for field in FIELDS[normalize]:
        assert_close(getattr(final, field), getattr(ref_final, field), 1e-5, f"final {field}")
    names = ["dq", "dk", "dv"] + [f"d initial {f}" for f in FIELDS[normalize][:3]]
    for name, got, want in zip(names, grads, ref_grads):
        assert_close(got, want, 1e-5, name)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("normalize,dtype", [
    ("none", torch.bfloat16), ("divisive", torch.bfloat16),
    ("none", torch.float16), ("divisive", torch.float16), ("subtractive", torch.float16),
])
def test_half_precision_with_several_value_blocks(normalize, dtype):
    """bf16/fp16 inputs with fp32 states and accumulators; d = 72 and Dv = 80 span two channel blocks each.

    The tensor-core operands (score tiles, states) are rounded to the input dtype, so errors are a few units of
    its roundoff u, not fp32's: o, dk, dv within 4u (measured ≤ 1.9u; subtractive's o 3.8u in fp16). dq of
    divisive gets 6u: it holds dO·(v_j − o), two nearly cancelling terms, so o's own error (≈ 1.7u) shows
    through: measured 4.0u in bf16, under 2u when o was replaced by the exact output (checked at d = 24).
    Subtractive in bf16 is left out: its terms cancel harder (weights centred on 1/n) and its o reaches 10u.
    """
    q, k, v = make_inputs(1, 70, 1, 72, 80, dtype, seed=7)
    (o, _, grads), (ref_o, _, ref_grads) = run_both(q, k, v, None, seed=7, normalize=normalize, chunk_size=32)
    u = UNIT_ROUNDOFF[dtype]
    assert o.dtype == dtype
    assert_close(o, ref_o, 4 * u, "o")
    for name, got, want in zip(["dq", "dk", "dv"], grads, ref_grads):
        assert got.dtype == dtype
        assert_close(got, want, 6 * u if (name, normalize) == ("dq", "divisive") else 4 * u, name)


def test_chunk_size_does_not_change_results():
    """The chunk size is only the tiling: 16, 32 and 64 agree to fp32 rounding, T shorter than a chunk too."""
    q, k, v = make_inputs(1, 50, 3, 16, 16, torch.float32, seed=3)
    outs = [linear_attention(q, k, v, chunk_size=c, impl="triton") for c in (16, 32, 64)]
    for other in outs[1:]:
        assert_close(other, outs[0], 1e-6, "o across chunk sizes")
    short = [t[:, :5] for t in (q, k, v)]
    assert_close(linear_attention(*short, impl="triton"), linear_attention(*short, impl="naive"), 1e-6, "T=5")


def test_state_carries_across_calls():
    """Two halves with the first half's final state as the second's initial state equal one whole call."""
    q, k, v = make_inputs(2, 40, 2, 8, 8, torch.float32, seed=5)
    whole = linear_attention(q, k, v, normalize="subtractive", impl="triton")
    first, state = linear_attention(q[:, :17], k[:, :17], v[:, :17], normalize="subtractive",
                                    output_final_state=True, impl="triton")
    second = linear_attention(q[:, 17:], k[:, 17:], v[:, 17:], normalize="subtractive", initial_state=state,
                              impl="triton")
    assert_close(torch.cat([first, second], dim=1), whole, 1e-6, "o split in two")


@pytest.mark.skipif(DEVICE == "cuda", reason="meta tensors stand in for the long input only under the interpreter")
def test_refuses_a_sequence_too_long_for_32_bit_offsets():
    """Offsets inside a sequence are 32-bit (64-bit ones spill registers): past that, a clear error, not garbage."""
    q = torch.empty(1, 2**20, 32, 128, device="meta")
    with pytest.raises(ValueError, match="32 bits"):
        linear_attention(q, q, q, impl="triton")


def test_document_lengths_are_read_once_per_offsets(monkeypatch):
    """Every layer launches with the same offsets (in backward's recomputation, a detached copy): their lengths, which
    the 32-bit bound and the segments need, are read on the host (a sync on a GPU) once, not per layer."""
    from pretrain.ops.linear_attention.triton import _Launch

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    short = torch.empty(1, 1024, 2, 16, device="meta")
    offsets = torch.tensor([0, 512, 1024])
    for cu in (offsets, offsets, offsets.detach()):
        _Launch(short, short, cu, 64)
    assert len(reads) == 1
    long = torch.empty(1, 2**20, 32, 128, device="meta")
    _Launch(long, long, torch.arange(0, 2**20 + 1, 2**10), 64)  # documents of 1,024 tokens fit
    with pytest.raises(ValueError, match="32 bits"):
        _Launch(long, long, torch.tensor([0, 2**20]), 64)


# Segments: forced to 2 chunks of 16 here (the rule splits only long sequences on a large grid). They count from
# each document's first token, so every document starts a segment and none holds two. The documents: one token;
# 70 tokens over three segments (32, 32, 6: T not a multiple of the chunk, the third segment partial); one token;
# 24; 32, exactly one segment, from token 96 of the row (a multiple of 32 there too); 5. Short documents leave
# their later segments empty, which must add nothing and write nothing.
SEGMENTED_DOCUMENTS = [0, 1, 71, 72, 96, 128, 133]


@pytest.fixture
def two_chunk_segments(monkeypatch):
    monkeypatch.setattr(kernels, "SEGMENT_CHUNKS", 2)


@pytest.mark.usefixtures("two_chunk_segments")
@pytest.mark.parametrize("normalize,causal,packed", [
    *((n, c, True) for n in NORMALIZATIONS for c in (True, False)), ("subtractive", True, False),
])
def test_segments_match_naive_fp32(normalize, causal, packed):
    """Sequences cut into segments whose states add up (a first pass, a running sum, the main pass, for the
    forward and for the reverse sweeps of dk, dv) give the unsegmented results: every output, state and gradient
    within 1e-5 of fp64 naive, packed documents straddling segments, one-token documents, states in and out."""
    seed = 40 + 2 * NORMALIZATIONS.index(normalize) + causal
    if packed:
        assert_fp32_matches_naive(normalize, causal, seed=seed, documents=SEGMENTED_DOCUMENTS, heads=1)
    else:  # three segments: 32, 32, 6
        assert_fp32_matches_naive(normalize, causal, seed=seed, batch=2, length=70, heads=1)


@pytest.mark.usefixtures("two_chunk_segments")
def test_segments_in_bf16_with_several_value_blocks():
    """As the unsegmented half-precision test (same bounds, same reasons), divisive over three segments of 32
    tokens."""
    q, k, v = make_inputs(1, 70, 1, 72, 80, torch.bfloat16, seed=8)
    (o, _, grads), (ref_o, _, ref_grads) = run_both(q, k, v, None, seed=8, normalize="divisive", chunk_size=16)
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert_close(o, ref_o, 4 * u, "o")
    for name, got, want in zip(["dq", "dk", "dv"], grads, ref_grads):
        assert_close(got, want, 6 * u if name == "dq" else 4 * u, name)


@pytest.mark.usefixtures("two_chunk_segments")
def test_gradients_when_a_loss_reaches_only_o_or_only_the_final_state():
    """Backward gets None for outputs no loss reached (``set_materialize_grads(False)``): dO alone, and the final
    state's gradient alone (dO None: q gets none, k and v theirs), each against naive."""
    q, k, v = make_inputs(1, SEGMENTED_DOCUMENTS[-1], 1, 12, 20, torch.float32, seed=9)
    cu_seqlens = torch.tensor(SEGMENTED_DOCUMENTS, dtype=torch.int32, device=DEVICE)
    for leaves, pick in (((q, k, v), lambda o, final: o.sum()),
                         ((k, v), lambda o, final: (final.S * final.S).sum() + final.z.sum())):
        grads = []
        for impl, cast in (("triton", lambda t: t), ("naive", torch.Tensor.double)):
            o, final = linear_attention(cast(q), cast(k), cast(v), cu_seqlens=cu_seqlens, output_final_state=True,
                                        impl=impl)
            grads.append(torch.autograd.grad(pick(o, final), leaves))
        for name, got, want in zip(["dq", "dk", "dv"][-len(leaves):], *grads):
            assert_close(got, want, 1e-5, name)


# Documents for the rule's own choice at a toy size (chunks of 16): 150 tokens (10 chunks), one token, 70 (5), 17 (2:
# straddling a chunk), 40 (3), one token; the row's offsets are not multiples of a chunk. With 4 SMs (8 resident
# programs) and segments of at least 3 chunks the rule cuts the 150 into 4 segments of 48, 48, 48, 6 and the 70 into
# 48, 22; the others stay whole.
RULED_DOCUMENTS = [0, 150, 151, 221, 238, 278, 279]


@pytest.mark.parametrize("normalize,causal", [("subtractive", True), ("divisive", False)])
def test_segments_the_rule_chooses_match_naive_fp32(normalize, causal, monkeypatch):
    """Packed documents of very different lengths, segmented by the rule itself (its GPU shrunk to 4 SMs so that a
    toy row is worth cutting): the long ones cut, the short ones whole, all in one launch; states in and out, every
    gradient within 1e-5 of fp64 naive."""
    monkeypatch.setattr(kernels, "DEFAULT_MULTIPROCESSORS", 4)
    monkeypatch.setattr(kernels, "MIN_SEGMENT_CHUNKS", 3)
    q = torch.empty(1, RULED_DOCUMENTS[-1], 1, 12, device="meta")
    g = kernels._Launch(q, torch.empty(1, RULED_DOCUMENTS[-1], 1, 20, device="meta"),
                        torch.tensor(RULED_DOCUMENTS), 16)
    g.segment(causal)
    assert g.rows == 10  # 6 segments and 4 whole documents
    assert g.slots == (6 if causal else 10)  # global: whole documents have a slot too (each token reads its total)
    seed = 60 + 2 * NORMALIZATIONS.index(normalize) + causal
    assert_fp32_matches_naive(normalize, causal, seed=seed, documents=RULED_DOCUMENTS, heads=1)


def test_segment_rule():
    """Segments only where the GPU would idle, and then only the long documents (chunks of 64, D = 128: two channel
    blocks, 2 resident programs per SM on an H200's 132). The cases of benchmarks/notes_triton.md, "Segments"."""
    assert kernels.CONFIG["num_warps"] == 4  # the rule's residency assumes it
    def blocks(heads):  # programs per chunk: heads × channel blocks
        return heads * 2
    # B=8, H=32 at 32k: 512 programs fill the GPU: whole
    assert kernels.segment_chunks(512, 8 * 512 * blocks(32), 132) is None
    # B=1, H=16 at 32k: 32 programs; segments of 32 chunks, 16 of them (512 programs)
    assert kernels.segment_chunks(512, 512 * blocks(16), 132) == 32
    table = kernels.segment_table([32768], 64, 32)
    assert table.pairs == [(0, i * 2048, (i + 1) * 2048, i) for i in range(16)] and table.spans == [(0, 0, 16)]
    # short sequences stay whole
    assert kernels.segment_chunks(8, 8 * blocks(16), 132) is None
    # the packed row: B=1, H=16, 20 documents, the longest 8k (here the third) and 19 of ≈ 1.3k: 527 chunks, a share
    # of 63.9, a chain of 128; the 8k cut into 4 segments of 32 chunks, the others whole: 23 rows, not 640 padded
    lengths = [1293, 1293, 8192] + [1293] * 16 + [1302]
    assert sum(lengths) == 32768
    chunks = sum(-(-n // 64) for n in lengths)
    assert kernels.segment_chunks(128, chunks * blocks(16), 132) == 32
    table = kernels.segment_table(lengths, 64, 32)
    assert table.slotted == 4 and table.spans == [(2, 0, 4)]
    assert table.pairs[:4] == [(2, i * 2048, (i + 1) * 2048, i) for i in range(4)]
    assert table.pairs[4] == (19, 0, 1302, -1)  # then the whole ones, longest first
    assert sorted(pair[0] for pair in table.pairs[5:]) == [d for d in range(19) if d != 2]
    # one 30k document among 100 of 20 tokens: 569 chunks, a share of 69, a chain of 469: segments of 35 chunks at
    # most, evened out to 14 of 34 (the last 27); the 100 short ones whole: 114 rows (3,648 programs)
    lengths = [20] * 50 + [30000] + [20] * 50
    assert kernels.segment_chunks(469, (469 + 100) * blocks(16), 132) == 35
    table = kernels.segment_table(lengths, 64, 35)
    assert (len(table.pairs), table.slotted, table.spans) == (114, 14, [(50, 0, 14)])
    assert [(first, stop) for _, first, stop, _ in table.pairs[:14]] == (
        [(i * 2176, (i + 1) * 2176) for i in range(13)] + [(13 * 2176, 30000)])
    assert all(pair == (pair[0], 0, 20, -1) for pair in table.pairs[14:])
    # global attention: every document gets a slot, the whole ones one each
    table = kernels.segment_table([100, 20], 16, 3, slot_every_document=True)
    assert table.pairs == [(0, 0, 48, 0), (0, 48, 96, 1), (1, 0, 20, 3), (0, 96, 100, 2)]
    assert table.spans == [(0, 0, 3), (1, 3, 4)]


@pytest.mark.skipif(DEVICE == "cuda", reason="stands in for CUDA on CPU")
@pytest.mark.usefixtures("fresh_verdicts")
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_kernel_passes_its_first_use_check_whole_and_cut(monkeypatch, packed):
    """``auto``'s check runs the kernel on its small inputs whole and cut into one-chunk segments (a sums pass, a
    running sum, slotted and whole rows): the real kernel passes both and is taken, silently."""
    launches = []
    segment = kernels._Launch.segment

    def recorded(self, causal):
        segment(self, causal)
        launches.append(self.pairs is not None)
    monkeypatch.setattr(kernels._Launch, "segment", recorded)
    monkeypatch.setattr(la, "_triton_may_run", lambda q: True)
    q, k, v = (x.detach() for x in make_inputs(1, 40, 2, 8, 8, torch.float32, seed=70))
    cu = torch.tensor([0, 9, 40]) if packed else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = linear_attention(q, k, v, normalize="divisive", cu_seqlens=cu, impl="auto")
    assert launches == [False, True, False]  # the check whole, then cut; the request (short) whole
    torch.testing.assert_close(got, linear_attention(q, k, v, normalize="divisive", cu_seqlens=cu, impl="chunk"),
                               rtol=1e-5, atol=1e-6)
