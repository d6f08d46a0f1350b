"""``linear_attention`` as a torch.library op: its registration checks out, and a compiled model using it runs
as one graph with the results of eager mode (on CPU, where the op runs the chunked form)."""
import pytest
import torch
import torch.nn.functional as F

from pretrain.ops.linear_attention import LinearAttentionState
from pretrain.ops.linear_attention.library import _forward, linear_attention_op


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
        o, state = linear_attention_op(F.elu(q) + 1, F.elu(k) + 1, v, cu_seqlens=cu_seqlens, chunk_size=16,
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
