"""SOFT: Newton–Schulz pseudo-inverse with its exact-inverse backward, and the landmark attention."""
import pytest
import torch

from pretrain.ops import newton_schulz_pinv, soft_attention, soft_attention_naive
from pretrain.ops.soft import RIDGE, gaussian_kernel


def randn(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def moderately_conditioned(batch, m, dim, seed=0):
    """A Gaussian kernel matrix of close-by points: cond(A + ridge·I) in the tens to hundreds."""
    points = randn(batch, m, 2, dim, scale=0.6, seed=seed).detach()
    a = gaussian_kernel(points, points).requires_grad_()
    cond = torch.linalg.cond(a + RIDGE * torch.eye(m, dtype=a.dtype))
    assert 10 < cond.max() < 300, cond  # the premise of the comparison below
    return a


def test_pinv_converges_to_the_ridge_inverse_with_its_gradient():
    a = moderately_conditioned(3, 7, 4)
    exact = torch.linalg.inv(a + RIDGE * torch.eye(7, dtype=a.dtype))
    approx = newton_schulz_pinv(a)
    torch.testing.assert_close(approx, exact, rtol=1e-7, atol=1e-7)
    probe = torch.randn(exact.shape, generator=torch.Generator().manual_seed(1), dtype=exact.dtype)
    (grad_exact,) = torch.autograd.grad((exact * probe).sum(), a)
    (grad_approx,) = torch.autograd.grad((approx * probe).sum(), a)
    torch.testing.assert_close(grad_approx, grad_exact, rtol=1e-6, atol=1e-6)


def test_pinv_is_the_twenty_step_recurrence_even_when_unconverged():
    """On an ill-conditioned matrix the op must still be exactly the published iteration."""
    points = randn(1, 6, 1, 3, scale=0.05, seed=2).detach()
    a = gaussian_kernel(points, points)[0, 0]
    p = a + RIDGE * torch.eye(6, dtype=a.dtype)
    v = 0.9 * 2 / a.sum(-1).max() ** 2 * p
    for _ in range(20):
        v = 2 * v - v @ p @ v
    assert (v - torch.linalg.inv(p)).abs().max() > 1e-3  # genuinely unconverged
    torch.testing.assert_close(newton_schulz_pinv(a), v, rtol=1e-12, atol=1e-12)


def test_pinv_backward_uses_no_graph_of_the_iterations():
    a = moderately_conditioned(1, 5, 3)
    out = newton_schulz_pinv(a, iters=50)
    assert out.grad_fn is not None and out.grad_fn.next_functions[0][0] is not None
    assert len(out.grad_fn.next_functions) == 1  # one node back to `a`, not 50 matmuls


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("n,m,heads,dk,dv", [(30, 6, 3, 8, 5), (1, 1, 1, 1, 1), (49, 4, 2, 16, 3)])
def test_soft_attention_equals_exact_inverse_definition(symmetric, n, m, heads, dk, dv):
    q = randn(2, n, heads, dk, scale=dk ** -0.25, seed=3)
    landmarks = randn(2, m, heads, dk, scale=0.6, seed=4)
    v = randn(2, n, heads, dv, seed=5)
    cond = torch.linalg.cond(gaussian_kernel(landmarks, landmarks) + RIDGE * torch.eye(m, dtype=q.dtype))
    assert cond.max() < 300
    probe = torch.randn(2, n, heads, dv, generator=torch.Generator().manual_seed(6), dtype=q.dtype)
    results = []
    for fn in (soft_attention, soft_attention_naive):
        out = fn(q, landmarks, v, symmetric=symmetric)
        results.append([out, *torch.autograd.grad((out * probe).sum(), (q, landmarks, v))])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


def test_bf16_inputs_are_computed_in_fp32():
    q = randn(1, 20, 2, 8, scale=8 ** -0.25, seed=3).detach()
    landmarks = randn(1, 5, 2, 8, scale=0.6, seed=4).detach()
    v = randn(1, 20, 2, 4, seed=5).detach()
    out = soft_attention(q.bfloat16(), landmarks.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    expected = soft_attention_naive(*(t.bfloat16().double() for t in (q, landmarks, v)))
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)  # bf16 rounding of the output


def test_bad_shapes_are_named():
    q, v = randn(1, 9, 2, 4), randn(1, 9, 2, 3)
    with pytest.raises(ValueError, match=r"landmarks \(1, 3, 2, 5\)"):
        soft_attention(q, randn(1, 3, 2, 5), v)
    with pytest.raises(ValueError, match="square"):
        newton_schulz_pinv(torch.zeros(3, 4))
