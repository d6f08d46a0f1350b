"""Issue 27, items 1 and 2: an exported LM is a transformers model whose logits are ``load_pretrained``'s, and whose
``generate`` decodes from the mixers' states to the tokens ``tools/generate.py`` picks."""
import subprocess
import sys

import pytest
import torch

from pretrain.data.tokenizer import EOS_ID
from pretrain.models import load_pretrained
from pretrain.train.export import write_export

from tiny_lms import PATTERNS, random_lm, run_config

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
from transformers import AutoModelForCausalLM  # noqa: E402

HYBRID = PATTERNS[-1]
name = lambda pattern: "+".join(pattern)


def ids(batch: int, tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, 300, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pattern", PATTERNS, ids=name)
def test_logits_equal_load_pretrained(export, pattern):
    directory = export(pattern)
    model, ours = AutoModelForCausalLM.from_pretrained(directory), load_pretrained(directory)
    assert type(model).__name__ == "PretrainForCausalLM" and set(model.state_dict()) == set(ours.state_dict())
    tokens = ids(2, 70)  # past every mixer's chunk (16–64), the local window and the convolution
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, ours(tokens), rtol=0, atol=1e-6)
        cached = model(tokens, use_cache=True)  # the decoding path: each mixer's prefill
        torch.testing.assert_close(cached.logits, ours(tokens), rtol=0, atol=1e-6)
        assert cached.cache.get_seq_length() == 70


@pytest.mark.parametrize("pattern", PATTERNS, ids=name)
def test_greedy_generate_equals_tools_generate(export, pattern, load_tool):
    directory = export(pattern)
    model, ours = AutoModelForCausalLM.from_pretrained(directory), load_pretrained(directory)
    prompt, new = ids(1, 70)[0].tolist(), 24
    expected = load_tool("generate").generate(ours, prompt, new, temperature=0.0, eos_id=EOS_ID)
    assert model.generation_config.eos_token_id == EOS_ID  # generate stops where tools/generate.py stops
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()
    assert out == expected + ([EOS_ID] if len(expected) < new else [])  # transformers keeps the eos it stops at


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch padded on the left with the pad id (0), and its attention mask."""
    width = max(len(prompt) for prompt in prompts)
    batch, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    return batch, mask


@pytest.mark.parametrize("pattern", PATTERNS, ids=name)
def test_prompts_of_different_lengths_decode_together_as_alone(export, pattern):
    """A left-padded batch (what generate and lm-evaluation-harness send): the logits of each row's real tokens,
    prompt and continuation, are those of its prompt alone, and greedy generate picks each row's tokens as alone.
    In fp64, so the comparison sees the pads, not the rounding of another batch size."""
    model = AutoModelForCausalLM.from_pretrained(export(pattern)).double()
    prompts = [ids(1, length, seed=10 + length)[0] for length in (19, 6, 1, 11)]
    batch, mask = left_padded(prompts)
    more = ids(len(prompts), 3, seed=9)
    with torch.no_grad():
        prefilled = model(batch, attention_mask=mask, use_cache=True)
        continued = model(more, attention_mask=torch.cat([mask, torch.ones_like(more)], 1), cache=prefilled.cache)
        for row, prompt in enumerate(prompts):
            expected = model(torch.cat([prompt, more[row]])[None]).logits[0]
            torch.testing.assert_close(prefilled.logits[row, batch.shape[1] - len(prompt):], expected[:len(prompt)],
                                       rtol=0, atol=1e-10)
            torch.testing.assert_close(continued.logits[row], expected[len(prompt):], rtol=0, atol=1e-10)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    together = model.generate(batch, attention_mask=mask, **kwargs)[:, batch.shape[1]:]
    for row, prompt in enumerate(prompts):
        assert torch.equal(together[row], model.generate(prompt[None], **kwargs)[0, len(prompt):])


def test_left_padded_generation_without_a_cache_and_with_beams(export):
    """Without a cache, the left pads are a document of their own: recomputing each prefix finds the tokens the
    states find, for greedy search and for beams (whose rows the cache's pads follow)."""
    model = AutoModelForCausalLM.from_pretrained(export(HYBRID))
    batch, mask = left_padded([ids(1, 9, seed=20)[0], ids(1, 4, seed=21)[0]])
    for beams in (1, 3):
        kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=beams, do_sample=False)
        assert torch.equal(model.generate(batch, use_cache=True, **kwargs),
                           model.generate(batch, use_cache=False, **kwargs))


def test_right_padding_and_holes_are_refused_while_decoding(export):
    model = AutoModelForCausalLM.from_pretrained(export(HYBRID))
    prompts = ids(2, 10, seed=2)
    right = torch.ones_like(prompts)
    right[0, 7:] = 0
    with pytest.raises(ValueError, match="decodes left-padded rows only: the attention mask has a pad after a real"):
        model.generate(prompts, attention_mask=right, max_new_tokens=2, do_sample=False)
    hole = torch.ones_like(prompts)
    hole[1, 3:5] = 0
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="pad between two real tokens: each row must be one run of real tokens"):
            model(prompts, attention_mask=hole, use_cache=use_cache)
    cache = model(prompts, attention_mask=right.flip(1), use_cache=True).cache
    with pytest.raises(ValueError, match=r"left pads per row \(none\) are not those the cache's prompt had"):
        model(prompts[:, :1], attention_mask=torch.ones(2, 11, dtype=torch.long), cache=cache)


def test_padding_leaves_the_real_tokens_logits(export):
    """What lm-evaluation-harness sends to score: rows of different lengths, padded on the right, whose pads follow
    every real token; and padded on the left, whose pads a forward without a cache reads as a document of their own.
    In fp64: the chunked forms sum in another order for another length, which fp32 rounds differently."""
    model = AutoModelForCausalLM.from_pretrained(export(HYBRID)).double()
    tokens = ids(2, 30, seed=3)
    mask = torch.ones_like(tokens)
    mask[1, 17:] = 0
    with torch.no_grad():
        right = model(tokens, attention_mask=mask).logits
        torch.testing.assert_close(right[1, :17], model(tokens[1:, :17]).logits[0], rtol=0, atol=1e-10)
        left = model(tokens, attention_mask=mask.flip(1)).logits
        torch.testing.assert_close(left[1, 13:], model(tokens[1:, 13:]).logits[0], rtol=0, atol=1e-10)


def test_beam_search_picks_rows_of_the_states(export):
    """Beam search reorders the cache's rows each step (MixerStateCache.reorder_cache): it must find the beams that
    recomputing every prefix from scratch finds."""
    model = AutoModelForCausalLM.from_pretrained(export(HYBRID))
    prompt = ids(1, 12, seed=4)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, num_return_sequences=3, do_sample=False)
    with_states = model.generate(prompt, use_cache=True, **kwargs)
    recomputed = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(with_states, recomputed)


def test_generation_continues_a_returned_cache(export):
    """``generate`` again with the cache of a first call, on the whole sequence so far: only the new tokens are
    fed (one at a time, through ``step``), and the result is the one-call result."""
    model = AutoModelForCausalLM.from_pretrained(export(HYBRID))
    prompt = ids(1, 15, seed=5)
    first = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([first.sequences, ids(1, 3, seed=6)], dim=1)
    continued = model.generate(more, cache=first.cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(continued, model.generate(more, max_new_tokens=6, min_new_tokens=6, do_sample=False))


def test_loss_is_the_mean_nll_of_the_shifted_labels(export):
    directory = export(HYBRID)
    model, ours = AutoModelForCausalLM.from_pretrained(directory), load_pretrained(directory)
    tokens = ids(2, 25, seed=7)
    labels = tokens.clone()
    labels[0, 10:] = -100
    with torch.no_grad():
        loss = model(tokens, labels=labels).loss
        shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
        nll = ours(tokens, labels=shifted)
    torch.testing.assert_close(loss, nll / (shifted != -100).sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_save_pretrained_round_trips(export, tmp_path, tie):
    """Saved by transformers (after a fine-tune, say), the directory loads through transformers, load_pretrained
    and the tools' loader alike."""
    from pretrain.train.checkpoint import load_trained_model

    directory = export(HYBRID, tie_embeddings=tie)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert (model.lm_head.weight is model.embed.weight) == tie
    model.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(directory).save_pretrained(tmp_path)
    tokens = ids(2, 20, seed=8)
    with torch.no_grad():
        expected = model(tokens).logits
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(tokens).logits, expected,
                                   rtol=0, atol=0)
        for loaded in (load_pretrained(tmp_path), load_trained_model(tmp_path)[0]):
            torch.testing.assert_close(loaded(tokens), expected, rtol=0, atol=0)


def test_a_bf16_export_loads_in_bf16_with_load_pretrained_s_weights(tokenizer_model, tmp_path):
    """transformers' dtype "auto" keeps the stored bf16 (load_pretrained gives fp32); ``dtype=torch.float32`` asks."""
    lm, cfg = random_lm(HYBRID, 300)
    write_export(lm, run_config(cfg, tokenizer_model), tmp_path, dtype="bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = ids(2, 20, seed=9)
    with torch.no_grad():
        expected = load_pretrained(tmp_path)(tokens)
        for fp32 in (model.float(), AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)):
            torch.testing.assert_close(fp32(tokens).logits, expected, rtol=0, atol=0)


def test_a_random_model_is_built_from_the_config_alone(export):
    """``from_config`` (fine-tuning from scratch, tests of other libraries): our initialisation, not transformers'."""
    config = transformers.AutoConfig.from_pretrained(export(HYBRID))
    model = AutoModelForCausalLM.from_config(config)
    reference, _ = random_lm(HYBRID, 300)
    shapes = lambda module: {key: value.shape for key, value in module.state_dict().items()}
    assert shapes(model) == shapes(reference)
    assert model.layers[0].mixer.o_proj.weight.std() < model.embed.weight.std() / 2  # the residual-scaled init


@pytest.mark.dist
def test_import_pretrain_registers_without_importing_transformers():
    """``import pretrain`` stays light; the Auto classes know our model type once transformers is imported too, in
    either order."""
    check = ("from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer; "
             "from transformers.models.auto.configuration_auto import CONFIG_MAPPING; "
             "assert CONFIG_MAPPING['pretrain'].__name__ == 'PretrainConfig'")
    light = "import sys, pretrain; assert 'transformers' not in sys.modules, 'import pretrain loaded it'; "
    for code in (light + check, "import transformers, pretrain; " + check):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.dist
def test_a_missing_extra_is_named_with_its_pip_command():
    code = "import sys; sys.modules['transformers'] = None; import pretrain; import pretrain.hf"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "ImportError: pretrain.hf needs the 'hf' extra: pip install -e '.[hf]' -c constraints.txt" in result.stderr
