"""Item 4 of the issue: decoding a CausalLM token by token (``CausalLM.step``) matches its parallel forward, and
``tools/generate.py`` picks tokens as asked (its run end to end: tests/train/test_generate_cli.py)."""
import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.models import build_lm

VOCAB = 64


@pytest.fixture(scope="module")
def generate_tool(load_tool):
    return load_tool("generate")


def random_lm(layer_pattern, seed=0, ffn="swiglu"):
    """A tiny fp32 CausalLM with weights well away from zero, so logits spread and argmax has no near-ties."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, layer_pattern=list(layer_pattern), ffn=ffn,
                      mixer_options={"aft_local": {"window": 3, "chunk_size": 4}, "rwkv7": {"chunk_size": 4}})
    model = build_lm(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 1.0 / param.shape[-1] ** 0.5)
    return model


PATTERNS = [["softmax"], ["linear"], ["linear", "softmax"], ["aft_local", "inline"]]
# RWKV's channel mixing as the feed-forward: its token shift's last token rides in each block's decoding state
CHANNEL_MIX = [(["rwkv7"], "rwkv_channel_mix"), (["linear", "softmax"], "rwkv_channel_mix")]


@pytest.mark.parametrize("pattern,ffn", [(p, "swiglu") for p in PATTERNS] + CHANNEL_MIX,
                         ids=lambda p: "+".join(p) if isinstance(p, list) else p)
@pytest.mark.parametrize("prompt", [0, 9], ids=["step-only", "prefill-9"])
def test_decoding_logits_equal_the_parallel_forward(pattern, ffn, prompt):
    """Every token through ``step``, or the first ``prompt`` through ``prefill`` and the rest through ``step``."""
    model = random_lm(pattern, ffn=ffn)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        parallel = model(ids)
        states, steps = None, []
        if prompt:
            logits, states = model.prefill(ids[:, :prompt])
            steps.append(logits)
        for t in range(prompt, ids.shape[1]):
            logits, states = model.step(ids[:, t], states)
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, dim=1), parallel[:, max(prompt - 1, 0):], rtol=0, atol=1e-5)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: "+".join(p))
def test_left_padded_prompts_decode_as_alone(pattern):
    """Prompts of 11, 3, 1 and 11 tokens left-padded to one batch (``prefill(ids, starts)``), then stepped together:
    each row's logits are its prompt's alone; a pad token of any value changes nothing."""
    model = random_lm(pattern)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    starts = torch.tensor([0, 8, 10, 0])
    ids[1, :8], ids[2, :10] = 7, 63  # left pads
    with torch.no_grad():
        logits, states = model.prefill(ids[:, :11], starts)
        together = [logits]
        for t in range(11, 16):
            logits, states = model.step(ids[:, t], states)
            together.append(logits)
        for row, start in enumerate(starts.tolist()):
            alone = model(ids[row:row + 1, start:])[0, 10 - start:]
            torch.testing.assert_close(torch.stack(together, dim=1)[row], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: "+".join(p))
def test_greedy_generation_is_the_argmax_of_the_parallel_forward(pattern, generate_tool):
    model = random_lm(pattern)
    prompt = [5, 17, 42]
    new = generate_tool.generate(model, prompt, 14, temperature=0.0)
    assert len(new) == 14
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new]))[0]
    # the token after position p is the argmax of the logits at p, for every generated token
    assert new == logits[len(prompt) - 1:-1].argmax(dim=-1).tolist()


def test_sampling_keeps_to_top_k_and_top_p(generate_tool):
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(generate_tool.filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    probs = logits.softmax(-1)[0]  # ≈ 0.64, 0.24, 0.09, ...: the nucleus of 0.8 needs the first two tokens
    assert probs[0] < 0.8 < probs[:2].sum()
    kept = torch.isfinite(generate_tool.filter_logits(logits, top_p=0.8))
    assert kept.tolist() == [[True, True, False, False, False]]
    draws = {generate_tool.next_token(logits, temperature=1.0, top_k=0, top_p=0.8,
                                      generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert draws == {0, 1}
