#!/usr/bin/env python
"""SOFT's symmetric (normalized) form: our ridge Newton–Schulz inverse against the released ridge-free one.

The released symmetric variant of SOFT inverts the landmark kernel A itself: ``α = 2/(max row sum)²`` halved
until ``‖I − A·αA‖₁ ≤ 1.01``, then 20 Newton–Schulz steps on A. Ours runs the same 20 steps on ``A + 0.01·I`` from
``0.9·2/(max row sum)²``, as the released non-symmetric model does. On Gaussian kernel matrices of m landmarks
with condition numbers 1, 300 and 3·10⁴ this reports, for both, in fp64:
- how far each is from the inverse it aims at, and from A⁻¹ (relative Frobenius error, after the symmetric
  scaling ``D^{-1/2} · V · D^{-1/2}`` with D the row sums of A);
- the largest eigenvalue of V (the exact-inverse backward ``−Vᵀ g Vᵀ`` scales with its square);
- how well that backward matches the gradient of the 20 steps themselves (cosine, and the norm ratio), on a
  random probe: the backward is only exact where the iteration has converged.

    python tools/soft_inverse_report.py --out benchmarks/soft_inverse   # writes .json and .md
"""
import argparse
import json
import math
from pathlib import Path

import torch

from pretrain.ops.soft import RIDGE, gaussian_kernel

CONDITIONS = (1.0, 300.0, 3e4)


def kernel_with_condition(target: float, m: int, dim: int, seed: int) -> torch.Tensor:
    """A Gaussian kernel matrix ``G(L, L)`` ``[m, m]`` of random landmarks whose spread is bisected until its
    condition number is ``target`` (within 5 %); ``target`` 1 puts the landmarks far apart (A = I)."""
    points = torch.randn(m, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def kernel(scale):
        landmarks = (points * scale)[None, :, None]
        return gaussian_kernel(landmarks, landmarks)[0, 0]

    if target == 1.0:
        return kernel(100.0)
    low, high = 1e-3, 100.0  # condition falls as the landmarks spread
    for _ in range(200):
        mid = math.sqrt(low * high)
        cond = torch.linalg.cond(kernel(mid)).item()
        if abs(cond / target - 1) < 0.05:
            return kernel(mid)
        low, high = (mid, high) if cond > target else (low, mid)
    raise RuntimeError(f"no spread of {m} landmarks in {dim} dimensions gives condition {target}")


def newton_schulz(p: torch.Tensor, alpha: torch.Tensor, iters: int) -> torch.Tensor:
    inverse = alpha * p
    for _ in range(iters):
        inverse = 2 * inverse - inverse @ p @ inverse
    return inverse


def ours(a, iters):
    """Our inverse: 20 steps on ``A + ridge·I`` from ``0.9·2/(max row sum)²·P``."""
    p = a + RIDGE * torch.eye(a.shape[-1], dtype=a.dtype)
    return newton_schulz(p, 0.9 * 2 / a.sum(-1).amax() ** 2, iters)


def released_symmetric(a, iters):
    """The released symmetric variant's inverse: no ridge, ``α`` halved (at most 10 times) until the first
    iterate's residual column sums are ≤ 1.01."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    alpha = 2 / a.sum(-1).amax() ** 2
    for _ in range(10):
        if (eye - a @ (alpha * a)).abs().sum(-2).amax() <= 1.01:
            break
        alpha = alpha / 2
    return newton_schulz(a, alpha.detach(), iters)


def measure(a: torch.Tensor, inverse_fn, target: torch.Tensor, iters: int, seed: int) -> dict:
    exact = torch.linalg.inv(a)
    scale = a.sum(-1).rsqrt()

    def sym(v):
        return scale[:, None] * v * scale[None, :]

    def rel(x, y):
        return (torch.linalg.matrix_norm(sym(x) - sym(y)) / torch.linalg.matrix_norm(sym(y))).item()

    a = a.clone().requires_grad_()
    v = inverse_fn(a, iters)
    probe = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed), dtype=v.dtype)
    (through_steps,) = torch.autograd.grad((v * probe).sum(), a)
    v = v.detach()
    exact_backward = -v.mT @ probe @ v.mT  # what newton_schulz_pinv's backward returns
    cosine = torch.nn.functional.cosine_similarity(exact_backward.flatten(), through_steps.flatten(), dim=0)
    return {"error_vs_its_target": rel(v, target), "error_vs_exact_inverse": rel(v, exact),
            "largest_eigenvalue": torch.linalg.eigvalsh(v).amax().item(),
            "backward_cosine": cosine.item(),
            "backward_norm_ratio": (exact_backward.norm() / through_steps.norm()).item()}


def report(m: int, dim: int, iters: list[int], seed: int) -> list[dict]:
    rows = []
    for condition in CONDITIONS:
        a = kernel_with_condition(condition, m, dim, seed)
        ridge_target = torch.linalg.inv(a + RIDGE * torch.eye(m, dtype=a.dtype))
        for steps in iters:
            for name, fn, target in (("ours (ridge 0.01)", ours, ridge_target),
                                     ("released symmetric (no ridge)", released_symmetric, torch.linalg.inv(a))):
                row = {"condition": condition, "measured_condition": torch.linalg.cond(a).item(), "steps": steps,
                       "inverse": name}
                rows.append(row | measure(a, fn, target, steps, seed + 1))
    return rows


def markdown(rows: list[dict], m: int, dim: int, seed: int) -> str:
    lines = ["Made by `python tools/soft_inverse_report.py --out benchmarks/soft_inverse` (numerics, not timing; "
             "docs/MIXERS.md#soft reads it).", "",
             f"Gaussian kernel matrices of {m} landmarks in {dim} dimensions (seed {seed}), fp64. Errors are relative "
             "(Frobenius) after the symmetric scaling D^-1/2 · V · D^-1/2.", "",
             "| cond(A) | steps | inverse | error vs its target | error vs A⁻¹ | largest eigenvalue of V | "
             "backward cosine | backward norm ratio |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['measured_condition']:.3g} | {row['steps']} | {row['inverse']} | "
                     f"{row['error_vs_its_target']:.2e} | "
                     f"{row['error_vs_exact_inverse']:.2e} | {row['largest_eigenvalue']:.3g} | "
                     f"{row['backward_cosine']:.4f} | {row['backward_norm_ratio']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--landmarks", type=int, default=49, help="m: 7×7, the presets' landmark grid")
    parser.add_argument("--dim", type=int, default=32, help="landmark dimension (a head's width)")
    parser.add_argument("--iters", type=int, nargs="+", default=[20, 40],
                        help="Newton–Schulz step counts (20: the released default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md; print only if unset")
    args = parser.parse_args(argv)
    rows = report(args.landmarks, args.dim, args.iters, args.seed)
    table = markdown(rows, args.landmarks, args.dim, args.seed)
    print(table, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                                      if k != "out"}, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
