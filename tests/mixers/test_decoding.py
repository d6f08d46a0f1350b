"""Each causal mixer's parallel (chunked) forward equals token-by-token decoding with ``step``, and ``prefill``
(the parallel forward that also returns a state) hands ``step`` the state token-by-token decoding would have."""
import pytest
import torch
from torch.utils._pytree import tree_map

from pretrain.attention import REGISTRY
from pretrain.models.left_padded import join_rows

DIM = 16  # the default width of the make_mixer fixture

CAUSAL_CASES = [
    ("softmax", {}),
    ("linear", {}),
    ("linear", {"feature_map": "relu", "output_norm": True}),
    ("linear", {"feature_map": "identity", "normalize": "none", "output_norm": True}),
    ("cosine", {}),
    ("efficient", {"chunk_size": 4}),
    ("inline", {}),
    ("inline", {"local": False}),
    ("inline", {"conv_size": 1}),
    ("aft_full", {"max_seq_len": 24}),
    ("aft_full", {"max_seq_len": 24, "factor_dim": 3}),
    ("aft_local", {"window": 3, "chunk_size": 4}),
    ("aft_local", {"window": 6, "chunk_size": 4}),
    ("aft_simple", {"chunk_size": 4}),
    ("retnet", {"chunk_size": 4}),
    ("retnet", {"chunk_size": 4, "short_conv": 0, "rope": False, "decay": "lightning", "layer_index": 2,
                "num_layers": 4}),
    ("mamba2", {"chunk_size": 4, "state_size": 8}),
    ("mamba2", {"chunk_size": 4, "state_size": 8, "conv_size": 1, "expand": 1}),
    # short convolutions: their last K − 1 inputs are part of the state (K = 4 reaches past a 1- or 2-token prompt)
    ("linear", {"short_conv": 4}),
    ("cosine", {"short_conv": 3}),
    ("efficient", {"chunk_size": 4, "short_conv": 4}),
    ("inline", {"short_conv": 4}),
    ("aft_local", {"window": 3, "chunk_size": 4, "short_conv": 4}),
    ("aft_simple", {"chunk_size": 4, "short_conv": 2}),
    ("deltanet", {"chunk_size": 4}),
    ("gated_deltanet", {"chunk_size": 4}),
    ("gated_deltanet", {"chunk_size": 4, "short_conv": 0}),
    ("kda", {"chunk_size": 4}),
    ("kda", {"chunk_size": 4, "short_conv": 0, "gate_rank": 3, "gate_bias": -2.0}),
    ("rwkv7", {"chunk_size": 4}),
    ("rwkv7", {"chunk_size": 4, "short_conv": 4, "decay_rank": 3, "rate_rank": 5, "gate_rank": 7}),
]


@pytest.mark.parametrize("name,options", CAUSAL_CASES, ids=lambda c: str(c))
def test_chunked_forward_equals_token_by_token(make_mixer, name, options):
    mixer = make_mixer(name, causal=True, **options)
    x = torch.randn(2, 19, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    parallel = mixer(x)
    state, steps = None, []
    for t in range(x.shape[1]):
        y_t, state = mixer.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, dim=1), parallel, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,options", CAUSAL_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("prompt", [1, 2, 7, 13])
def test_prefill_then_step_equals_the_parallel_forward(make_mixer, name, options, prompt):
    """Prompts shorter and longer than the chunk (4–64), the local window and the convolution's reach."""
    mixer = make_mixer(name, causal=True, **options)
    x = torch.randn(2, 19, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    parallel = mixer(x)
    y, state = mixer.prefill(x[:, :prompt])
    steps = [y]
    for t in range(prompt, x.shape[1]):
        y_t, state = mixer.step(x[:, t], state)
        steps.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(steps, dim=1), parallel, rtol=1e-10, atol=1e-10)


def test_every_causal_mixer_decodes():
    causal = {name for name, cls in REGISTRY.items() if cls.supports_causal}
    assert causal == {name for name, _ in CAUSAL_CASES}
    assert all(callable(getattr(REGISTRY[name], method, None)) for name in causal for method in ("step", "prefill"))


def test_aft_full_refuses_to_decode_past_its_bias(make_mixer):
    mixer = make_mixer("aft_full", causal=True, max_seq_len=3)
    state = None
    x = torch.randn(1, DIM, dtype=torch.float64)
    for _ in range(3):
        _, state = mixer.step(x, state)
    with pytest.raises(ValueError, match="max_seq_len=3"):
        mixer.step(x, state)


@pytest.mark.parametrize("name,options", CAUSAL_CASES, ids=lambda c: str(c))
def test_a_state_holds_each_row_at_its_first_dimension(make_mixer, name, options):
    """The one thing outside code may know of a decoding state (transformers' beam search picks rows with it,
    ``pretrain.hf``): every tensor in it has the batch first, so a row's state is the batch's state at that row."""
    mixer = make_mixer(name, causal=True, **options)
    x = torch.randn(3, 9, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _, batch_state = mixer.prefill(x)
    for row in range(3):
        _, row_state = mixer.prefill(x[row:row + 1])
        picked = tree_map(lambda t, r=row: t[r:r + 1] if isinstance(t, torch.Tensor) else t, batch_state)
        torch.testing.assert_close(picked, row_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,options", CAUSAL_CASES, ids=lambda c: str(c))
def test_rows_prefilled_apart_decode_together(make_mixer, name, options):
    """Prompts of different lengths (1 to 13 tokens, as a left-padded batch holds them): each prefilled alone, the
    states joined into one batch (``pretrain.models.left_padded.join_rows``: a growing cache left-padded, a count
    per row), then stepped together; each row's outputs are those of its prompt decoded alone."""
    mixer = make_mixer(name, causal=True, **options)
    x = torch.randn(4, 19, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lengths, new = [7, 1, 13, 2], 5
    alone, states = [], []
    for row, length in enumerate(lengths):
        _, state = mixer.prefill(x[row:row + 1, :length])
        states.append(state)
        steps = []
        for t in range(length, length + new):
            y_t, state = mixer.step(x[row:row + 1, t], state)
            steps.append(y_t)
        alone.append(torch.cat(steps))
    state = join_rows(states, [torch.tensor([row]) for row in range(len(lengths))], len(lengths))
    together = []
    for i in range(new):
        y_t, state = mixer.step(torch.stack([x[row, length + i] for row, length in enumerate(lengths)]), state)
        together.append(y_t)
    torch.testing.assert_close(torch.stack(together, dim=1), torch.stack(alone), rtol=1e-10, atol=1e-10)
