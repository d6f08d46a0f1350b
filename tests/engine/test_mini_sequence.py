"""Mini-sequence blocks (``model.mini_sequence``): the feed-forward over slices of the row gives the unsliced
model's outputs and gradients, fp64 to 1e-10, for every causal mixer, packed documents and checkpointing included."""
import dataclasses

import pytest
import torch

from pretrain.attention import REGISTRY
from pretrain.config import ConfigError, ModelConfig, load_config
from pretrain.models import build_lm
from pretrain.models.mini_sequence import sliced

CAUSAL = sorted(name for name, cls in REGISTRY.items() if cls.supports_causal)
DOCUMENTS = [[9, 1, 20], [30]]  # two rows of 30 tokens: a one-token document, one straddling a slice boundary
SEQ_LEN = 30


def lm(mini_sequence: int):
    """An fp64 LM with one layer of every causal mixer, its weights away from init."""
    cfg = ModelConfig(vocab_size=53, dim=16, n_heads=2, n_layers=len(CAUSAL), layer_pattern=CAUSAL,
                      mixer_options={"linear": {"chunk_size": 8}, "inline": {"chunk_size": 8},
                                     "aft_full": {"max_seq_len": SEQ_LEN}})
    torch.manual_seed(0)
    model = build_lm(dataclasses.replace(cfg, mini_sequence=mini_sequence)).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 53, (len(DOCUMENTS), SEQ_LEN + 1), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])
    return ids[:, :-1], ids[:, 1:], positions


def loss_and_gradients(model):
    ids, labels, positions = batch()
    loss = model(ids, position_ids=positions, labels=labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("tokens", [4, 16])
def test_sliced_feed_forward_equals_the_whole_row_for_every_mixer(tokens):
    whole_loss, whole = loss_and_gradients(lm(0))
    loss, grads = loss_and_gradients(lm(tokens))
    torch.testing.assert_close(loss, whole_loss, rtol=1e-10, atol=1e-10)
    for name, grad in whole.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-10, msg=name)


def test_composes_with_activation_checkpointing():
    from pretrain.distributed import apply_activation_checkpointing

    whole_loss, whole = loss_and_gradients(lm(0))
    model = lm(7)
    apply_activation_checkpointing(model)
    loss, grads = loss_and_gradients(model)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-10, atol=1e-10)
    for name, grad in whole.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-10, msg=name)


def test_logits_and_decoding_are_unchanged():
    ids, _, positions = batch()
    whole, split = lm(0), lm(7)
    with torch.no_grad():
        torch.testing.assert_close(split(ids, position_ids=positions), whole(ids, position_ids=positions),
                                   rtol=1e-10, atol=1e-10)
        (last, _), (last_whole, _) = split.prefill(ids), whole.prefill(ids)
        torch.testing.assert_close(last, last_whole, rtol=1e-10, atol=1e-10)


def test_sliced_keeps_only_the_input_for_backward():
    """What autograd holds after a sliced forward: the input and the output, none of the hidden activations."""
    ffn = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.SiLU(), torch.nn.Linear(64, 8))
    x = torch.randn(1, 100, 8, requires_grad=True)
    held = []

    def pack(tensor):
        held.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = sliced(ffn, x, 30)
    assert y.shape == x.shape
    assert sum(held) <= x.numel()  # the slices of x; autograd through ffn would keep 100 × (8 + 64 + 64)
    y.sum().backward()
    reference = torch.autograd.grad(ffn(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, reference)


def test_refused_where_it_cannot_apply():
    base = ["data.tokenizer=none", "data.train_shards=none"]
    with pytest.raises(ConfigError, match="model.mini_sequence: must be >= 0"):
        load_config(None, [*base, "model.mini_sequence=-1"])
    with pytest.raises(ConfigError, match="model.mini_sequence: slices the rows of a causal LM's blocks; task vision"):
        load_config(None, ["task=vision", "data.tokenizer=null", "data.train_shards=none", "model.mini_sequence=64"])
