"""The fused LM head and loss: the NLL and gradients of cross-entropy on the full logits, without keeping them."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from pretrain.config import ModelConfig
from pretrain.models import build_lm
from pretrain.models import lm_head as lm_head_module
from pretrain.models.lm_head import linear_cross_entropy as fused

IGNORE = -100


def reference_nll(x, weight, labels):
    """The unfused definition: all logits, then cross-entropy in (at least) fp32."""
    logits = F.linear(x, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def inputs(rows, dim, vocab, *, dtype=torch.float64, seed=0, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[list(ignored)] = IGNORE
    return x, weight, labels


def nll_and_grads(fn, x, weight, labels):
    nll = fn(x, weight, labels)
    return [nll, *torch.autograd.grad(nll, (x, weight))]


@pytest.mark.parametrize("rows,ignored", [(10, ()), (10, (0, 3, 9)), (1, ()), (7, range(7))])
@pytest.mark.parametrize("logits_per_chunk", [33, 1 << 25])  # 3 rows of 11 a chunk (10 rows: a ragged last), or one
def test_equals_cross_entropy_on_full_logits_in_fp64(monkeypatch, rows, ignored, logits_per_chunk):
    monkeypatch.setattr(lm_head_module, "LOGITS_PER_CHUNK", logits_per_chunk)
    x, weight, labels = inputs(rows, 6, 11, ignored=ignored)
    for got, want in zip(nll_and_grads(fused, x, weight, labels), nll_and_grads(reference_nll, x, weight, labels)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_per_token_losses_for_evaluation(monkeypatch):
    monkeypatch.setattr(lm_head_module, "LOGITS_PER_CHUNK", 33)
    x, weight, labels = inputs(10, 6, 11, ignored=(0, 4))
    want = F.cross_entropy(F.linear(x, weight), labels, ignore_index=IGNORE, reduction="none")
    with torch.no_grad():
        got = fused(x.view(2, 5, 6), weight, labels.view(2, 5), reduction="none")
    assert got.shape == (2, 5)
    torch.testing.assert_close(got.flatten(), want.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="no_grad"):  # the gradients computed on the way are the sum's
        fused(x, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="'mean'"):
        fused(x, weight, labels, reduction="mean")


def test_gradcheck(monkeypatch):
    monkeypatch.setattr(lm_head_module, "LOGITS_PER_CHUNK", 10)
    x, weight, labels = inputs(5, 3, 5, ignored=(2,))
    assert torch.autograd.gradcheck(lambda x, w: fused(x, w, labels), (x, weight))


def test_bf16_matches_the_unfused_loss(monkeypatch):
    """bf16 matmuls, fp32 softmax, as the unfused path; the weight gradient is summed over chunks in fp32."""
    monkeypatch.setattr(lm_head_module, "LOGITS_PER_CHUNK", 64 * 50)  # 64 rows a chunk: 4 chunks
    x, weight, labels = inputs(256, 32, 50, dtype=torch.bfloat16, ignored=(5, 6))
    got, want = nll_and_grads(fused, x, weight, labels), nll_and_grads(reference_nll, x, weight, labels)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)  # the same logits, reduced in another order
    for g, w in zip(got[1:], want[1:]):  # within 2 bf16 ulps of the gradient's scale
        assert (g.float() - w.float()).abs().max() <= 2 * 2 ** -8 * w.float().abs().max()


def test_keeps_no_logits_for_backward(monkeypatch):
    """Autograd keeps only the gradients: nothing of the [rows, vocab] logits' size (the unfused loss keeps two)."""
    monkeypatch.setattr(lm_head_module, "LOGITS_PER_CHUNK", 4 * 500)
    rows, dim, vocab = 64, 8, 500
    saved = []

    def largest_saved(fn):
        saved.clear()
        x, weight, labels = inputs(rows, dim, vocab, dtype=torch.float32)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            fn(x, weight, labels)
        return max(saved)

    assert largest_saved(reference_nll) >= rows * vocab  # the check can tell
    assert largest_saved(fused) == vocab * dim


def test_without_grad_it_computes_only_the_logits():
    x, weight, labels = inputs(32, 16, 40, dtype=torch.float32)
    head_flops = 2 * 32 * 16 * 40
    for grad_enabled, matmuls in [(False, 1), (True, 3)]:  # with grad: logits, then d/dx and d/dW
        with torch.set_grad_enabled(grad_enabled), FlopCounterMode(display=False) as counter:
            fused(x, weight, labels)
        assert counter.get_total_flops() == matmuls * head_flops


@pytest.mark.parametrize("tie", [True, False])
def test_the_model_with_labels_gives_the_loss_of_its_logits(tie):
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, tie_embeddings=tie)
    torch.manual_seed(0)
    model = build_lm(cfg).double()
    input_ids = torch.randint(0, 50, (2, 12))
    labels = torch.randint(0, 50, (2, 12))
    labels[0, :3] = IGNORE
    params = list(model.parameters())
    results = []
    for loss in (lambda: model(input_ids, labels=labels),
                 lambda: F.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                         reduction="sum")):
        value = loss()
        results.append([value, *torch.autograd.grad(value, params)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_on_cpu_only_the_scored_rows_are_multiplied():
    """A recall task scores about one token in ten: the head's matmuls (forward and both gradients) cover those."""
    x, weight, labels = inputs(10, 6, 11, ignored=range(3, 10))
    with FlopCounterMode(display=False) as counter:
        nll = fused(x, weight, labels)
    assert counter.get_total_flops() == 3 * (2 * 3 * 6 * 11)  # logits, d rows, d weight: 3 scored rows each
    torch.testing.assert_close(nll, reference_nll(x, weight, labels), rtol=1e-12, atol=1e-12)
