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


def test_aft_state_combines_and_stands_in_for_its_tokens():
    """The state of a run of tokens, as one token in front of the rest, gives the rest the outputs the run gave."""
    from pretrain.ops import aft_simple
    from pretrain.ops.aft import aft_state, combine_aft_states, state_as_token

    torch.manual_seed(1)
    q, k, v = (torch.randn(B, T, 5, dtype=torch.float64) for _ in range(3))
    k = 5 * k
    everything = torch.ones(B, T, dtype=torch.bool)
    for split in (1, 9, 22):
        joined = combine_aft_states(aft_state(k[:, :split], v[:, :split], everything[:, :split]),
                                    aft_state(k[:, split:], v[:, split:], everything[:, split:]))
        for got, want in zip(joined, aft_state(k, v, everything)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        state_k, state_v = state_as_token(aft_state(k[:, :split], v[:, :split], everything[:, :split]))
        rest = aft_simple(torch.cat([q[:, :1], q[:, split:]], 1), torch.cat([state_k[:, None], k[:, split:]], 1),
                          torch.cat([state_v[:, None], v[:, split:]], 1), chunk_size=8)
        torch.testing.assert_close(rest[:, 1:], aft_simple(q, k, v, chunk_size=8)[:, split:], rtol=1e-10, atol=1e-10)


def test_aft_empty_state_is_the_identity_and_its_gradients_are_finite():
    from pretrain.ops.aft import aft_state, combine_aft_states, state_as_token

    torch.manual_seed(2)
    k, v = torch.randn(B, T, 5, dtype=torch.float64, requires_grad=True), torch.randn(B, T, 5, dtype=torch.float64)
    empty = aft_state(k, v, torch.zeros(B, T, dtype=torch.bool))
    assert torch.all(empty[1] == 0) and torch.all(empty[2] == float("-inf"))
    some = aft_state(k, v, tail_mask([4, 15]))
    for joined in (combine_aft_states(empty, some), combine_aft_states(some, empty)):
        for got, want in zip(joined, some):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    token_k, token_v = state_as_token(combine_aft_states(empty, empty))
    (token_k.sum() + token_v.sum() + sum(x.sum() for x in combine_aft_states(empty, some)[:2])).backward()
    assert torch.isfinite(token_k).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("normalize", ["none", "divisive"])
def test_decayed_state_is_the_ops_final_state_and_folds(normalize):
    """The state of a whole run (and its total log-decay) equals the op's final state from zero, and the fold of
    its pieces' states in order equals it, whether the pieces' decay is deep or shallow."""
    from pretrain.ops.decayed_linear_attention import decayed_linear_attention
    from pretrain.ops.decayed_linear_attention.state import combine_decayed_states, decayed_state_of_tokens
    q, k, v = inputs()
    k = k.abs()
    g = -3 * torch.rand(B, T, H, dtype=torch.float64)
    starts = [6, 0]
    mask = tail_mask(starts)
    state, log_decay = decayed_state_of_tokens(k, v, g, mask, normalize)
    for b, start in enumerate(starts):
        _, final = decayed_linear_attention(q[b:b + 1, start:], k[b:b + 1, start:], v[b:b + 1, start:],
                                            g[b:b + 1, start:], normalize=normalize, output_final_state=True,
                                            impl="naive")
        for got, want in zip(state, final):
            if want is not None:
                torch.testing.assert_close(got[b], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(log_decay[b], g[b, start:].sum(0), rtol=1e-12, atol=1e-12)
    cuts = [0, 1, 9, 17, T]
    pieces = [decayed_state_of_tokens(k[:, a:b], v[:, a:b], g[:, a:b], mask[:, a:b], normalize)
              for a, b in zip(cuts, cuts[1:])]
    folded = pieces[0]
    for piece in pieces[1:]:
        folded = combine_decayed_states(folded, piece)
    for got, want in zip([*folded[0], folded[1]], [*state, log_decay]):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_delta_rule_transition_maps_the_entering_state_and_combines():
    """A run's (S_run, M) gives the op's final state from any entering state, M S_0 + S_run; split runs combine to
    the whole; masked-out tokens (before the tail) change nothing."""
    import torch.nn.functional as F

    from pretrain.ops.delta_rule import delta_rule
    from pretrain.ops.delta_rule.state import combine_transitions, transition_of_tokens

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, D, dtype=torch.float64, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, dtype=torch.float64, generator=gen), dim=-1)
    v = torch.randn(B, T, H, DV, dtype=torch.float64, generator=gen)
    beta = torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    mask = tail_mask([6, 0])
    entering = torch.randn(B, H, D, DV, dtype=torch.float64, generator=gen)
    for g in (-2 * torch.rand(B, T, H, dtype=torch.float64, generator=gen), None):  # gated, then DeltaNet
        S_run, M = transition_of_tokens(k, v, beta, g, mask, chunk_size=8)
        for b, start in enumerate([6, 0]):
            _, final = delta_rule(q[b:b + 1, start:], k[b:b + 1, start:], v[b:b + 1, start:], beta[b:b + 1, start:],
                                  None if g is None else g[b:b + 1, start:], initial_state=entering[b:b + 1],
                                  output_final_state=True, impl="naive")
            torch.testing.assert_close(M[b] @ entering[b] + S_run[b], final[0], rtol=1e-12, atol=1e-12)
        for split in (1, 12, 22):
            pieces = [[None if x is None else x[:, part] for x in (k, v, beta, g, mask)]
                      for part in (slice(None, split), slice(split, None))]
            joined = combine_transitions(transition_of_tokens(*pieces[0]), transition_of_tokens(*pieces[1]))
            for got, want in zip(joined, (S_run, M)):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    nothing = transition_of_tokens(k, v, beta, None, torch.zeros(B, T, dtype=torch.bool))
    torch.testing.assert_close(nothing[0], torch.zeros_like(S_run), rtol=0, atol=0)
    torch.testing.assert_close(nothing[1], torch.eye(D, dtype=torch.float64).expand_as(M), rtol=0, atol=0)
