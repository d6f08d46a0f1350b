"""The states sequence parallelism hands between ranks, held to each op's own final state (fp64): the state of a
run of tokens, and the combine rule that joins two runs."""
import pytest
import torch

from pretrain.ops.efficient import combine_efficient_states, efficient_attention, efficient_state
from pretrain.ops.linear_attention import linear_attention
from pretrain.ops.linear_attention.state import combine_states, state_of_tokens

B, T, H, D, DV = 2, 23, 2, 4, 3


def inputs(seed=0):
    torch.manual_seed(seed)
    q, k = torch.rand(B, T, H, D, dtype=torch.float64), torch.randn(B, T, H, D, dtype=torch.float64)
    return q, k, torch.randn(B, T, H, DV, dtype=torch.float64)


def tail_mask(starts):
    """Row b keeps tokens from ``starts[b]`` on: the tail a slice hands on."""
    return torch.arange(T)[None] >= torch.tensor(starts)[:, None]


@pytest.mark.parametrize("normalize", ["none", "divisive", "subtractive"])
def test_linear_state_of_tokens_is_the_ops_final_state(normalize):
    q, k, v = inputs()
    k = k.abs()  # a feature map's output
    mask = tail_mask([5, 0])
    state = state_of_tokens(k, v, mask, normalize)
    for b, start in enumerate([5, 0]):
        _, final = linear_attention(q[b:b + 1, start:], k[b:b + 1, start:], v[b:b + 1, start:], normalize=normalize,
                                    output_final_state=True, impl="naive")
        for got, want in zip(state, final):
            if want is not None:
                torch.testing.assert_close(got[b], want[0], rtol=1e-12, atol=1e-12)
    split = 9
    joined = combine_states(state_of_tokens(k[:, :split], v[:, :split], mask[:, :split], normalize),
                            state_of_tokens(k[:, split:], v[:, split:], mask[:, split:], normalize))
    for got, want in zip(joined, state):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_efficient_state_is_the_ops_final_state_and_combines():
    q, k, v = inputs()
    k = 6 * k  # keys spread wide: the log-space normalizers must keep it exact
    mask = tail_mask([7, 0])
    state = efficient_state(k, v, mask)
    for b, start in enumerate([7, 0]):
        _, (sums, log_norm) = efficient_attention(q[b:b + 1, start:], k[b:b + 1, start:], v[b:b + 1, start:],
                                                  causal=True, output_final_state=True, chunk_size=8)
        torch.testing.assert_close(state[0][b], sums[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[1][b], log_norm[0], rtol=1e-12, atol=1e-12)
    for split in (1, 12, 22):
        joined = combine_efficient_states(efficient_state(k[:, :split], v[:, :split], mask[:, :split]),
                                          efficient_state(k[:, split:], v[:, split:], mask[:, split:]))
        for got, want in zip(joined, state):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_efficient_empty_state_is_the_identity_and_its_gradients_are_finite():
    _, k, v = inputs()
    k.requires_grad_(True)
    nothing = torch.zeros(B, T, dtype=torch.bool)
    empty = efficient_state(k, v, nothing)
    assert torch.all(empty[0] == 0) and torch.all(empty[1] == float("-inf"))
    some = efficient_state(k, v, tail_mask([3, 11]))
    for joined in (combine_efficient_states(empty, some), combine_efficient_states(some, empty)):
        for got, want in zip(joined, some):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    sums, log_norm = combine_efficient_states(empty, some)
    (sums.sum() + log_norm.sum()).backward()
    assert torch.isfinite(k.grad).all()
