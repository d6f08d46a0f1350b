"""The short convolution as its definition reads, a loop over the taps: the CPU form and the oracle.

docs/MIXERS.md#short-convolution: ``y_t = act(b + Σ_{i<K, i ≤ p_t} w_i ⊙ x_{t−i})``. Each tap is a slice of the
inputs, a multiply by its weight column and, with positions, a mask dropping the tokens whose document began after
the one the tap reaches; autograd differentiates the loop. Inductor fuses it under ``torch.compile``.
"""
import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, None: lambda x: x}


def short_conv_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     positions: torch.Tensor | None = None, before: torch.Tensor | None = None,
                     activation: str | None = "silu") -> torch.Tensor:
    """``short_conv(..., impl="naive")``: the same arguments, already checked."""
    seq_len, reach = x.shape[1], weight.shape[1] - 1
    inputs = torch.cat([x.new_zeros(x.shape[0], reach, x.shape[2]) if before is None else before, x], dim=1)
    out = x * weight[:, 0]
    for i in range(1, reach + 1):
        earlier = inputs[:, reach - i: reach - i + seq_len] * weight[:, i]
        out = out + (earlier if positions is None else earlier * (positions >= i)[..., None])
    if bias is not None:
        out = out + bias
    return ACTIVATIONS[activation](out)
