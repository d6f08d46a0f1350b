"""Short causal depthwise convolution: each channel mixes its last ``K`` tokens before the token mixer sees them.

docs/MIXERS.md#short-convolution: ``y_t = act(b + Σ_{i<K} w_i ⊙ x_{t−i})``, one ``K``-tap kernel per channel,
taps that would reach a token of an earlier document dropped. On the keys it lets a key carry the token before it,
so a linear state can bind a key to the value that follows it (the MQAR argument). flash-linear-attention's
``ShortConvolution`` in behaviour; the weight here is ``[C, K]`` with ``weight[:, i]`` weighing ``x_{t−i}``. The
module holds the parameters; the op (``ops/short_conv``: the tap loop, and one Triton kernel each way on CUDA)
computes.
"""
import math

import torch
from torch import nn

from ..ops.short_conv import ACTIVATIONS, check_inputs, short_conv


class ShortConvolution(nn.Module):
    """Depthwise causal conv over the last ``kernel_size`` tokens, per channel, then an optional SiLU."""

    def __init__(self, channels: int, kernel_size: int, *, activation: str | None = "silu", bias: bool = False):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"short_conv kernel_size must be ≥ 1; got {kernel_size}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"short_conv activation must be one of {list(ACTIVATIONS)}; got {activation!r}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        bound = 1 / math.sqrt(kernel_size)  # nn.Conv1d's default init for a depthwise kernel (fan-in = K)
        self.weight = nn.Parameter(torch.empty(channels, kernel_size).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(channels).uniform_(-bound, bound)) if bias else None

    @property
    def halo(self) -> int:
        """How many tokens before a slice (or a decoding piece) it reads."""
        return self.kernel_size - 1

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                before: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, C]`` → ``[B, T, C]``. ``position_ids [B, T]``: each token's position in its document (None:
        each row is one document); a tap never reaches a token of an earlier document. ``before [B, K − 1, C]``:
        the ``K − 1`` inputs just before ``x``, oldest first (a decoding tail or a sequence-parallel halo); None:
        zeros."""
        return short_conv(x, self.weight, self.bias, positions=position_ids, before=before,
                          activation=self.activation)

    def tail(self, x: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """The last ``K − 1`` inputs of ``before ++ x`` (``before`` None: zeros), oldest first: the decoding state
        that the next piece passes as ``before``."""
        check_inputs(x, self.weight, before=before)
        if before is None:
            before = x.new_zeros(x.shape[0], self.halo, x.shape[2])
        return torch.cat([before, x], dim=1)[:, x.shape[1]:]

    def flops_per_token(self) -> float:
        """Forward FLOPs per token: a multiply-add per tap and channel (the activation not counted)."""
        return 2.0 * self.kernel_size * self.channels

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, activation={self.activation!r}, "
                f"bias={self.bias is not None}")
