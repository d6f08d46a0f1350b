"""``model.ffn: rwkv_channel_mix``: RWKV's token-shifted ReLU² feed-forward in the block, held to a per-token form
written from its formula (documents, mini-sequence slices), left-padded decoding, its width, FLOPs and refusals.
Decoding token by token against the parallel forward: tests/mixers/test_generate.py."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ConfigError, ModelConfig, load_config
from pretrain.models import build_lm
from pretrain.parallel import SequenceShard

DOCUMENTS = [[5, 1, 9], [15]]  # rows of 15 tokens: a one-token document, documents straddling mini-sequence slices


def lm(pattern=("rwkv7",), **overrides):
    """An fp64 LM of ``pattern`` with RWKV's channel mixing, its weights away from init."""
    options = {"vocab_size": 41, "dim": 16, "n_heads": 2, "n_layers": 2, "ffn": "rwkv_channel_mix",
               "mixer_options": {"rwkv7": {"chunk_size": 4}, "linear": {"chunk_size": 4}}, **overrides}
    cfg = ModelConfig(layer_pattern=list(pattern), **options)
    torch.manual_seed(0)
    model = build_lm(cfg).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def positions():
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def channel_mix_per_token(block, h, position_ids):
    """``h_t + W_v relu(W_k (n_t + μ ⊙ (n_{t−1} − n_t)))²`` with ``n = ffn_norm(h)``, token by token, ``n_{t−1} = 0``
    at a document's first token."""
    ffn, rows = block.ffn, []
    for b in range(h.shape[0]):
        out = []
        for t in range(h.shape[1]):
            n_t = block.ffn_norm(h[b, t])
            before = block.ffn_norm(h[b, t - 1]) if position_ids[b, t] > 0 else torch.zeros_like(n_t)
            shifted = n_t + ffn.shift_mix * (before - n_t)
            out.append(h[b, t] + F.relu(shifted @ ffn.up_proj.weight.T).square() @ ffn.down_proj.weight.T)
        rows.append(torch.stack(out))
    return torch.stack(rows)


@pytest.mark.parametrize("mini_sequence", [0, 4])
def test_the_blocks_feed_forward_equals_its_per_token_form_forward_and_gradients(mini_sequence):
    block = lm(mini_sequence=mini_sequence).layers[0]
    h = torch.randn(len(DOCUMENTS), 15, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn_like(h)
    position_ids = positions()
    fast = block._then_ffn(h, position_ids)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), [h, *block.parameters()], allow_unused=True)
    naive = channel_mix_per_token(block, h, position_ids)
    naive_grads = torch.autograd.grad((naive * upstream).sum(), [h, *block.parameters()], allow_unused=True)
    torch.testing.assert_close(fast, naive, rtol=1e-10, atol=1e-10)
    for got, expected in zip(fast_grads, naive_grads):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_packed_documents_give_what_each_document_gives_alone():
    model = lm()
    ids = torch.randint(0, 41, (len(DOCUMENTS), 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = model(ids, positions())
        for row, start, end in [(0, 0, 5), (0, 5, 6), (0, 6, 15), (1, 0, 15)]:
            torch.testing.assert_close(packed[row, start:end], model(ids[row:row + 1, start:end])[0],
                                       rtol=1e-10, atol=1e-10)


def test_left_padded_prompts_decode_as_alone():
    model = lm()
    ids = torch.randint(0, 41, (2, 8), generator=torch.Generator().manual_seed(3))
    starts = torch.tensor([0, 3])
    with torch.no_grad():
        logits, states = model.prefill(ids, starts)
        logits, _ = model.step(ids[:, 0], states)
        alone, alone_states = model.prefill(ids[1:, 3:])
        alone, _ = model.step(ids[1:, 0], alone_states)
    torch.testing.assert_close(logits[1:], alone, rtol=1e-10, atol=1e-10)


def test_width_parameters_and_flops():
    model = lm(n_layers=3, multiple_of=8)
    ffn = model.layers[0].ffn
    assert ffn.up_proj.out_features == 64  # 4·dim, two matrices: as many parameters as SwiGLU's three at 8/3·dim
    swiglu = build_lm(ModelConfig(vocab_size=41, dim=48, n_heads=2, multiple_of=8)).layers[0].ffn
    mix = build_lm(ModelConfig(vocab_size=41, dim=48, n_heads=2, multiple_of=8, ffn="rwkv_channel_mix")).layers[0].ffn
    count = lambda module: sum(p.numel() for p in module.parameters())
    assert count(mix) - 48 == count(swiglu)  # μ is the only difference
    assert model.flops_by_part(15)["RWKVChannelMix"] == 3 * 2 * 2 * 16 * 64
    assert "SwiGLU" not in model.flops_by_part(15)


BASE = ["data.tokenizer=none.model", "data.train_shards=none", "model.vocab_size=64", "model.dim=32",
        "model.n_heads=4", "train.seq_len=32"]


@pytest.mark.parametrize("overrides,reason", [
    (["model.ffn=mlp"], "'mlp' is not one of swiglu, rwkv_channel_mix"),
    (["model.ffn=rwkv_channel_mix", "parallel.sequence_parallel=2"],
     "rwkv_channel_mix does not combine with parallel.sequence_parallel 2"),
])
def test_bad_values_are_refused_naming_the_key(overrides, reason):
    with pytest.raises(ConfigError, match="model.ffn") as caught:
        load_config(None, [*BASE, *overrides])
    assert reason in str(caught.value)


def test_a_sequence_slice_is_refused_by_the_model_too():
    from pretrain.distributed import apply_sequence_parallel

    with pytest.raises(ValueError, match="rwkv_channel_mix has no sequence-parallel form"):
        apply_sequence_parallel(lm(), SequenceShard(group=None, rank=0, size=2), 16)


def test_vision_is_refused():
    with pytest.raises(ConfigError, match="model.ffn"):
        load_config("configs/vision/linear_tiny.yaml", ["model.ffn=rwkv_channel_mix"])


def test_the_default_stays_swiglu():
    assert ModelConfig().ffn == "swiglu"
    assert type(build_lm(dataclasses.replace(ModelConfig(), vocab_size=41, dim=16, n_heads=2)).layers[0].ffn
                ).__name__ == "SwiGLU"
