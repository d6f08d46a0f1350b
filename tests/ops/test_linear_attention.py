"""Every fast form of linear attention equals the naive O(T²) definition: outputs, final states and the gradients
of q, k, v and the initial state; pieces with a carried state equal the whole; bad inputs fail by name."""
import pytest
import torch

from pretrain.ops import LinearAttentionState, linear_attention
from pretrain.ops.linear_attention.state import FIELDS, zero_state

NORMALIZATIONS = ("none", "divisive", "subtractive")
CHUNK = 8  # small, so short test sequences still span many chunks

# (name, batch, T, cu_seqlens): T = 1, T not a multiple of the chunk, a multiple, packed documents
SHAPES = {
    "single_token": (2, 1, None),
    "ragged_tail": (2, 37, None),
    "whole_chunks": (1, 4 * CHUNK, None),
    "documents": (1, 45, [0, 1, 2, 5, 13, 16, 29, 45]),
}


def packed_lengths(generator, total_min, longest):
    """Document lengths 1..longest, drawn until they add up to at least total_min."""
    lengths = []
    while sum(lengths) < total_min:
        lengths.append(int(torch.randint(1, longest + 1, (1,), generator=generator)))
    return lengths


def make_inputs(batch, T, heads=2, dk=3, dv=5, *, dtype=torch.float64, seed=0):
    """Feature-mapped (positive) q, k and signed v, awkward head dims; leaves that require grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(batch, T, heads, dk, generator=g, dtype=torch.float64)
    k = torch.rand(batch, T, heads, dk, generator=g, dtype=torch.float64)
    v = torch.randn(batch, T, heads, dv, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def make_state(num, heads, dk, dv, normalize, *, dtype=torch.float64, seed=1):
    """A plausible carried state: sums of positive features, a count of at least one token."""
    g = torch.Generator().manual_seed(seed)
    zero = zero_state(num, heads, dk, dv, normalize, dtype=dtype, device="cpu")
    fields = {}
    for name in FIELDS[normalize]:
        like = getattr(zero, name)
        scale = torch.rand(like.shape, generator=g, dtype=torch.float64) if name != "S" else torch.randn(
            like.shape, generator=g, dtype=torch.float64)
        fields[name] = (scale * 3 + (1 if name == "n" else 0)).to(dtype).requires_grad_()
    return LinearAttentionState(**fields)


def run_with_grads(q, k, v, state, *, impl, seed=2, **kwargs):
    """Output, final state and the gradients of a random linear function of both (w.r.t. q, k, v, state)."""
    o, final = linear_attention(q, k, v, impl=impl, initial_state=state, output_final_state=True, **kwargs)
    g = torch.Generator().manual_seed(seed)
    def weights(x):
        return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device)

    loss = (o.double() * weights(o)).sum()
    for field in final:
        if field is not None:
            loss = loss + (field.double() * weights(field)).sum()
    leaves = [q, k, v] + ([f for f in state if f is not None] if state is not None else [])
    grads = torch.autograd.grad(loss, leaves)
    return o, final, grads


def assert_close_all(got, want, *, rtol, atol, what):
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, f"{what}[{i}]: expected None"
            continue
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}[{i}]: {m}")  # noqa: B023 (called before i moves on)


@pytest.mark.parametrize("impl,causal", [("chunk", True), ("chunk", False), ("recurrent", True)])
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("with_state", [False, True], ids=["from_zero", "from_state"])
def test_matches_naive_fp64(impl, causal, normalize, shape, with_state):
    batch, T, cu = SHAPES[shape]
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v = make_inputs(batch, T)
    num = batch if cu is None else len(cu) - 1
    state = make_state(num, 2, 3, 5, normalize) if with_state else None
    kwargs = dict(causal=causal, normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=CHUNK)
    o, final, grads = run_with_grads(q, k, v, state, impl=impl, **kwargs)
    o_ref, final_ref, grads_ref = run_with_grads(q, k, v, state, impl="naive", **kwargs)
    assert o.dtype == q.dtype and o.shape == v.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    assert_close_all(final, final_ref, rtol=1e-10, atol=1e-10, what="final state")
    assert_close_all(grads, grads_ref, rtol=1e-9, atol=1e-9, what="grad (q, k, v, state...)")


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("block_elements", [1, 400])
def test_chunk_walks_blocks_of_chunks(monkeypatch, normalize, block_elements):
    """Long sequences run in blocks of chunks carrying the state between blocks: shrink the blocks to one chunk
    and to a few, so that state (and its gradient) crosses block edges inside and between documents."""
    from pretrain.ops.linear_attention import chunk

    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", block_elements)
    cu_seqlens = torch.tensor([0, 1, 2, 11, 13, 40, 45, 61], dtype=torch.int32)
    q, k, v = make_inputs(1, 61, seed=11)
    state = make_state(7, 2, 3, 5, normalize, seed=12)
    kwargs = dict(normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=4)
    got = run_with_grads(q, k, v, state, impl="chunk", **kwargs)
    want = run_with_grads(q, k, v, state, impl="naive", **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    assert_close_all(got[1], want[1], rtol=1e-10, atol=1e-10, what="final state")
    assert_close_all(got[2], want[2], rtol=1e-9, atol=1e-9, what="grad")


def test_state_scan_agrees_on_both_device_paths():
    """The chunk core sums chunk states per document by a row loop on CPU and by one fp64 cumsum less each
    segment's start elsewhere (the GPU path, otherwise untested here): both equal each segment summed alone."""
    from pretrain.ops.linear_attention.chunk import _cumsum_in_segments, _scan_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, 3, 4, generator=g) + 50  # a large running sum for later segments to cancel
    restart = torch.rand(40, generator=g) < 0.2
    restart[0] = True
    want = torch.empty_like(x, dtype=torch.float64)
    for i in range(40):
        want[i] = x[i].double() + (0 if restart[i] else want[i - 1])
    for got in (_scan_rows(x, restart), _cumsum_in_segments(x, restart)):
        assert got.dtype == x.dtype
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk_size", [1, 2, 16, 64])
def test_many_short_documents_any_chunk_size(seed, chunk_size):
    """Documents of 1..3·chunk tokens packed together, each with its own initial state, in fp32."""
    g = torch.Generator().manual_seed(seed)
    normalize = NORMALIZATIONS[seed % 3]
    lengths = packed_lengths(g, 4 * chunk_size + 7, 3 * chunk_size)
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(cu_seqlens[-1])
    heads, dk, dv = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), int(
        torch.randint(1, 9, (1,), generator=g))
    q, k, v = make_inputs(1, T, heads, dk, dv, dtype=torch.float32, seed=seed)
    state = make_state(len(lengths), heads, dk, dv, normalize, dtype=torch.float32, seed=seed)
    kwargs = dict(normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    got = run_with_grads(q, k, v, state, impl="chunk", **kwargs)
    want = run_with_grads(q, k, v, state, impl="naive", **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert_close_all(got[1], want[1], rtol=1e-4, atol=1e-4, what="final state")
    assert_close_all(got[2], want[2], rtol=1e-3, atol=1e-3, what="grad")


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_fp32(normalize, dtype):
    """Half inputs: the output is the fp32 result rounded to the input dtype (within 2 units of its last
    place: one rounding of the output, one of the normalized quotient); states and their sums stay fp32."""
    q, k, v = make_inputs(2, 150, 2, 16, 16, dtype=dtype, seed=3)  # 150 tokens: long sums, ragged tail
    kwargs = dict(normalize=normalize, chunk_size=32)
    o, final, grads = run_with_grads(q, k, v, None, impl="chunk", **kwargs)
    o_ref, final_ref, grads_ref = run_with_grads(q, k, v, None, impl="naive", **kwargs)
    assert o.dtype == dtype and final.S.dtype == torch.float32
    ulp = torch.finfo(dtype).eps
    scale = o_ref.detach().double().abs().amax()
    torch.testing.assert_close(o.double(), o_ref.double(), rtol=2 * ulp, atol=2 * ulp * float(scale))
    assert_close_all(final, final_ref, rtol=1e-5, atol=1e-5, what="final state")
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.double(), rtol=2 * ulp, atol=2 * ulp * float(want.abs().amax()))


@pytest.mark.parametrize("impl", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_two_pieces_with_carried_state_equal_the_whole(impl, normalize):
    q, k, v = make_inputs(2, 29, seed=4)
    whole, final = linear_attention(q, k, v, normalize=normalize, impl=impl, chunk_size=CHUNK, output_final_state=True)
    first, carried = linear_attention(q[:, :11], k[:, :11], v[:, :11], normalize=normalize, impl=impl,
                                      chunk_size=CHUNK, output_final_state=True)
    second, final_pieces = linear_attention(q[:, 11:], k[:, 11:], v[:, 11:], normalize=normalize, impl=impl,
                                            chunk_size=CHUNK, initial_state=carried, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-10, atol=1e-10)
    assert_close_all(final_pieces, final, rtol=1e-10, atol=1e-10, what="final state")


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_packed_stream_cut_inside_a_document(normalize):
    """The per-document states of a packed stream: cut the stream in the middle of a document, carry that
    document's state into the second piece (the documents starting there start from zero)."""
    cu = [0, 5, 19, 20, 38]
    q, k, v = make_inputs(1, 38, seed=5)
    kwargs = dict(normalize=normalize, chunk_size=CHUNK, impl="chunk", output_final_state=True)
    whole, final = linear_attention(q, k, v, cu_seqlens=torch.tensor(cu), **kwargs)
    cut = 12  # inside document 1 (5..19)
    first, states = linear_attention(q[:, :cut], k[:, :cut], v[:, :cut], cu_seqlens=torch.tensor([0, 5, cut]), **kwargs)
    second_cu = torch.tensor([0, 19 - cut, 20 - cut, 38 - cut])
    carried = LinearAttentionState(*(None if s is None else torch.cat([s[1:], torch.zeros_like(s[:2])])
                                     for s in states))
    second, finals = linear_attention(q[:, cut:], k[:, cut:], v[:, cut:], cu_seqlens=second_cu,
                                      initial_state=carried, **kwargs)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-10, atol=1e-10)
    whole_finals_from_doc_1 = tuple(None if s is None else s[1:] for s in final)
    assert_close_all(finals, whole_finals_from_doc_1, rtol=1e-10, atol=1e-10, what="final state")


def test_decoding_continues_from_a_chunked_prefill():
    """Prefill a prompt with the chunked form, then decode one token at a time with the recurrent form."""
    q, k, v = make_inputs(3, 20, seed=6)
    whole = linear_attention(q, k, v, impl="naive", normalize="subtractive")
    o, state = linear_attention(q[:, :13], k[:, :13], v[:, :13], impl="chunk", chunk_size=CHUNK,
                                normalize="subtractive", output_final_state=True)
    outputs = [o]
    for t in range(13, 20):
        o, state = linear_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], impl="recurrent",
                                    normalize="subtractive", initial_state=state, output_final_state=True)
        outputs.append(o)
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl,causal", [("chunk", True), ("chunk", False), ("recurrent", True)])
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_gradcheck_fp64(impl, causal, normalize):
    cu_seqlens = torch.tensor([0, 2, 7, 11], dtype=torch.int32)
    q, k, v = make_inputs(1, 11, 1, 2, 3, seed=7)
    state = make_state(3, 1, 2, 3, normalize, seed=8)
    fields = [f for f in state if f is not None]

    def fn(q, k, v, *fields):
        o, final = linear_attention(q, k, v, causal=causal, normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=4,
                                    impl=impl, initial_state=LinearAttentionState(*fields),
                                    output_final_state=True)
        return (o, *(f for f in final if f is not None))

    assert torch.autograd.gradcheck(fn, (q, k, v, *fields))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_chunk_on_cuda_matches_naive(dtype, normalize):
    cu_seqlens = torch.tensor([0, 3, 70, 75, 200], dtype=torch.int32)
    q, k, v = make_inputs(1, 200, 4, 32, 32, dtype=dtype, seed=13)
    state = make_state(4, 4, 32, 32, normalize, dtype=torch.float32, seed=14)
    kwargs = dict(normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=64)
    want = run_with_grads(q, k, v, state, impl="naive", **kwargs)
    on_gpu = [x.detach().cuda().requires_grad_() for x in (q, k, v)]
    gpu_state = LinearAttentionState(*(None if s is None else s.detach().cuda().requires_grad_() for s in state))
    got = run_with_grads(*on_gpu, gpu_state, impl="chunk", **{**kwargs, "cu_seqlens": cu_seqlens.cuda()})
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # scaled by each tensor's largest entry
    for got_x, want_x in zip([got[0], *got[2]], [want[0], *want[2]]):
        want_x = want_x.detach().double()
        torch.testing.assert_close(got_x.cpu().double(), want_x, rtol=tol, atol=tol * float(want_x.abs().amax()))
    assert_close_all([None if f is None else f.cpu() for f in got[1]], want[1], rtol=1e-5, atol=1e-4, what="final")


def test_auto_picks_chunk_on_cpu():
    q, k, v = make_inputs(1, 19, seed=9)
    torch.testing.assert_close(linear_attention(q, k, v), linear_attention(q, k, v, impl="chunk"), rtol=0, atol=0)


def test_chunk_keeps_no_per_chunk_states_for_backward():
    """Activation memory O(T·d): what autograd keeps does not depend on the chunk size; storing the T/C chunk
    states (d × dv each) would have made it grow as the chunks shrink."""
    q, k, v = make_inputs(1, 256, 2, 32, 32, dtype=torch.float32, seed=10)

    def saved_bytes(chunk_size):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            linear_attention(q, k, v, impl="chunk", chunk_size=chunk_size)
        return total

    small_chunks, large_chunks = saved_bytes(4), saved_bytes(64)
    chunk_states_at_4 = (256 // 4) * 2 * 32 * 33 * 4
    assert small_chunks == large_chunks
    assert small_chunks < chunk_states_at_4


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(normalize="softmax"), "normalize must be one of"),
        (dict(impl="fast"), "impl must be one of"),
        (dict(chunk_size=48), "chunk_size must be a power of two"),
        (dict(cu_seqlens=torch.tensor([0, 4, 9])), "cu_seqlens must rise strictly from 0 to T=10"),
        (dict(cu_seqlens=torch.tensor([0, 4, 4, 10])), "no empty documents"),
        (dict(impl="recurrent", causal=False), "impl='recurrent' is causal only"),
        (dict(initial_state=LinearAttentionState(torch.zeros(1, 2, 3, 5))), r"initial_state\.z is missing"),
        (dict(initial_state=LinearAttentionState(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3))),
         r"initial_state\.S has shape \(1, 2, 3, 4\); expected \(1, 2, 3, 5\)"),
    ],
)
def test_bad_inputs_fail_by_name(change, message):
    q, k, v = make_inputs(1, 10)
    with pytest.raises(ValueError, match=message):
        linear_attention(q, k, v, **change)


def test_packed_documents_need_batch_one():
    q, k, v = make_inputs(2, 10)
    with pytest.raises(ValueError, match="cu_seqlens needs batch size 1"):
        linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 10]))


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_bf16_inputs_with_an_fp32_state_keep_each_dtype(impl, normalize):
    """What DeepSpeed bf16 training and bf16 decoding hand the op: bf16 q, k, v (packed documents) and an fp32
    carried state. The output and the gradients of q, k, v come back bf16; the final state and the state's
    gradients stay fp32 and carry fp32 accuracy (held to the naive form on the same inputs at 1e-5, which a
    trip through bf16, eps 8e-3, would fail)."""
    cu_seqlens = torch.tensor([0, 7, 30, 41], dtype=torch.int32)
    q, k, v = make_inputs(1, 41, 2, 8, 6, dtype=torch.bfloat16, seed=20)
    state = make_state(3, 2, 8, 6, normalize, dtype=torch.float32, seed=21)
    kwargs = dict(normalize=normalize, cu_seqlens=cu_seqlens, chunk_size=CHUNK)
    o, final, grads = run_with_grads(q, k, v, state, impl=impl, **kwargs)
    _, final_ref, grads_ref = run_with_grads(q, k, v, state, impl="naive", **kwargs)
    assert o.dtype == torch.bfloat16
    assert [f.dtype for f in final if f is not None] == [torch.float32] * len(FIELDS[normalize])
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32] * len(FIELDS[normalize])
    assert_close_all(final, final_ref, rtol=1e-5, atol=1e-5, what="final state")
    assert_close_all(grads[3:], grads_ref[3:], rtol=1e-5, atol=1e-5, what="state grad")
