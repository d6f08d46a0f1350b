"""``linear_attention`` as a torch.library op: its registration checks out, and a compiled model calling plain
``linear_attention`` (which turns into the op when compiled) runs as one graph with the results of eager mode
(on CPU, where the op runs the chunked form)."""
import pytest
import torch
import torch.nn.functional as F

from pretrain.ops.linear_attention import LinearAttentionState, linear_attention
from pretrain.ops.linear_attention.library import _forward


def inputs(batch, length, heads, dim, *, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(batch, length, heads, dim, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(batch, length, heads, dim, generator=gen, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("normalize", ["none", "divisive", "subtractive"])
def test_registration_passes_opcheck(normalize):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch, checked by PyTorch itself."""
    q, k, v = inputs(1, 23, 2, 8, seed=1)
    cu_seqlens = torch.tensor([0, 9, 23], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    state = {"S": torch.rand(2, 2, 8, 8, generator=gen), "z": torch.rand(2, 2, 8, generator=gen),
             "u": torch.randn(2, 2, 8, generator=gen), "n": torch.full((2, 2), 3.0)}
    fields = {"none": "S", "divisive": "Sz", "subtractive": "Szun"}[normalize]
    initial = [state[f].requires_grad_(f != "n") if f in fields else None for f in "Szun"]
    torch.library.opcheck(_forward, (q, k, v, *initial, cu_seqlens, True, normalize, 1e-6, 16, "chunk"))


class TinyLinearAttention(torch.nn.Module):
    """Projections around the op, as a mixer would use it: elu+1 feature map, packed documents."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        o, state = linear_attention(F.elu(q) + 1, F.elu(k) + 1, v, cu_seqlens=cu_seqlens, chunk_size=16,
                                    output_final_state=True)
        return self.out(o.flatten(2)), state


def test_compiled_model_is_one_graph_with_eager_results():
    torch.manual_seed(0)
    model = TinyLinearAttention()
    x = torch.randn(1, 50, 32)
    cu_seqlens = torch.tensor([0, 13, 40, 50], dtype=torch.int32)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break fails

    results = []
    for run in (model, compiled):
        model.zero_grad()
        y, state = run(x, cu_seqlens)
        assert isinstance(state, LinearAttentionState) and state.u is None
        (y.square().mean() + state.S.mean()).backward()
        results.append((y.detach(), state.z.detach(), [p.grad.clone() for p in model.parameters()]))
    (y, z, grads), (y_c, z_c, grads_c) = results
    torch.testing.assert_close(y_c, y, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(z_c, z, rtol=1e-6, atol=1e-7)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, rtol=1e-6, atol=1e-7)


# A whole LM whose mixers call plain ``linear_attention``: under torch.compile it must reach the library op.
LINEAR_MIXERS = ("linear", "cosine", "inline")


def tiny_lm():
    from pretrain.config import ModelConfig
    from pretrain.models import build_lm

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, dim=16, n_layers=3, n_heads=2, layer_pattern=list(LINEAR_MIXERS),
                      mixer_options={name: {"chunk_size": 8} for name in LINEAR_MIXERS})
    return build_lm(cfg)


def lm_batch():
    """Two rows of packed documents (10 + 14 tokens each): the model derives cu_seqlens from position_ids."""
    input_ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    return input_ids, position_ids


def test_lm_graph_breaks_only_where_cu_seqlens_is_derived():
    """No mixer breaks the graph; the one break left is ``cu_seqlens_from_position_ids``: its ``nonzero`` has a
    data-dependent size (the number of documents), which dynamo will not trace by default."""
    model = tiny_lm()
    explained = torch._dynamo.explain(model)(*lm_batch())
    assert explained.graph_break_count >= 1
    for reason in explained.break_reasons:
        assert reason.user_stack[-1].filename.endswith("pretrain/ops/varlen.py"), reason
        assert "nonzero" in reason.reason, reason.reason
    ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes
           if node.op == "call_function"}
    assert "pretrain.linear_attention.default" in ops, sorted(ops)


def test_compiled_lm_is_one_graph_with_eager_logits_and_gradients():
    """With dynamo allowed to trace data-dependent sizes, the whole packed-batch LM is one graph (fullgraph=True
    fails on any break). ``aot_eager`` runs the traced ATen graph: the same fp32 kernels as eager, up to
    decompositions that may reorder a sum, so results agree to a few fp32 ulps (rtol 1e-5), not bit for bit."""
    model = tiny_lm()
    batch = lm_batch()
    results = []
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for run in (model, compiled):
            model.zero_grad()
            logits = run(*batch)
            logits.logsumexp(-1).mean().backward()
            results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits, grads), (logits_c, grads_c) = results
    torch.testing.assert_close(logits_c, logits, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_registration_passes_opcheck_in_bf16_with_an_fp32_state():
    """The dtypes bf16 training sees: the fake implementation must promise what the real one returns
    (bf16 output and q, k, v gradients; fp32 final state and state gradients)."""
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in inputs(1, 23, 2, 8, seed=4))
    cu_seqlens = torch.tensor([0, 9, 23], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    initial = [torch.rand(2, 2, 8, 8, generator=gen).requires_grad_(), torch.rand(2, 2, 8, generator=gen)
               .requires_grad_(), torch.randn(2, 2, 8, generator=gen).requires_grad_(), torch.full((2, 2), 3.0)]
    torch.library.opcheck(_forward, (q, k, v, *initial, cu_seqlens, True, "subtractive", 1e-6, 16, "chunk"))
    o, *final = _forward(q, k, v, *initial, cu_seqlens, True, "subtractive", 1e-6, 16, "chunk")
    assert o.dtype == torch.bfloat16 and {f.dtype for f in final} == {torch.float32}
