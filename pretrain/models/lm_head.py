"""The LM head with its loss fused in, so a training step never holds the ``[B·T, V]`` logits.

At long context the logits are a language model's largest activation: 4 × 4096 tokens × a 32k vocabulary is
2.1 GB in fp32, and autograd keeps them (and the bf16 copy) for backward. Here the loss walks the tokens in
chunks; for each chunk it takes the logits, their log-sum-exp, the summed NLL and, in the same pass, the gradients
of the hidden states and of the weight. Backward only scales those. Peak memory: one chunk's logits.

The weight is used only inside this module's forward, where ZeRO-3 has gathered it; backward needs no weight.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.precision import upcast
from ..scopes import LOSS, scope

LOGITS_PER_CHUNK = 1 << 25  # 128 MiB of fp32 logits: small next to the model, whole matmuls for the GPU


def working_set_bytes(tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """What the fused loss allocates beyond what it keeps: one chunk's logits in fp32 and ``logsumexp``'s
    temporary of the same size; in a lower precision also the matmul's output and the gradient's copy in it."""
    rows = min(tokens, max(1, LOGITS_PER_CHUNK // vocab))
    wide = max(dtype.itemsize, 4)
    low = 0 if dtype.itemsize >= 4 else 2 * dtype.itemsize
    return rows * vocab * (2 * wide + low)


class LMHead(nn.Linear):
    """``x [..., dim]`` → logits ``[..., vocab]``; given ``labels [...]``, the summed NLL (≥ fp32) of the scored."""

    def __init__(self, dim: int, vocab: int):
        super().__init__(dim, vocab, bias=False)

    def forward(self, x, labels=None, *, ignore_index: int = -100, reduction: str = "sum"):
        if labels is None:
            return F.linear(x, self.weight)
        with scope(LOSS):
            return linear_cross_entropy(x, self.weight, labels, ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy(x, weight, labels, *, ignore_index: int = -100, reduction: str = "sum"):
    """``cross_entropy(x @ weightᵀ, labels, reduction=...)`` over ``x [..., dim]``, ``labels [...]``, fused.

    ``reduction="none"`` (each token's NLL, 0 where not scored) is for evaluation only: the gradients computed on
    the way are those of the sum, so it refuses to run where autograd would need it.
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none'; got {reduction!r}")
    per_token = reduction == "none"
    if per_token and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise ValueError("reduction='none' is for evaluation: run it under torch.no_grad()")
    # inside a Function grad mode is off and needs_input_grad ignores it: say whether gradients are wanted
    nll = _LinearCrossEntropy.apply(x.flatten(0, -2), weight, labels.flatten(), ignore_index,
                                    torch.is_grad_enabled() and not per_token, per_token)
    return nll.view(labels.shape) if per_token else nll


class _LinearCrossEntropy(torch.autograd.Function):
    """``Σ_scored −log softmax(x Wᵀ)[label]`` chunk by chunk, its gradients computed on the way (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, labels, ignore_index, grad_enabled, per_token):
        wants_x, wants_w = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        accumulate = torch.promote_types(x.dtype, torch.float32)
        nll = torch.zeros(x.shape[0] if per_token else (), dtype=accumulate, device=x.device)
        grad_x = torch.zeros_like(x) if wants_x else None
        grad_w = torch.zeros_like(weight, dtype=accumulate) if wants_w else None
        rows, targets, scored = x, labels, None
        if x.device.type == "cpu":  # only the scored rows (a recall task scores one in ten): on CUDA, picking
            scored = (labels != ignore_index).nonzero().squeeze(1)  # them would cost a host sync per micro-batch
            rows, targets = x[scored], labels[scored]
        grad_rows = None if grad_x is None else (grad_x if scored is None else torch.empty_like(rows))
        step = max(1, LOGITS_PER_CHUNK // weight.shape[0])
        for start in range(0, rows.shape[0], step):
            token_nll = _chunk(rows[start:start + step], weight, targets[start:start + step], ignore_index,
                               None if grad_rows is None else grad_rows[start:start + step], grad_w)
            if per_token:
                at = slice(start, start + step) if scored is None else scored[start:start + step]
                nll[at] = token_nll
            else:
                nll = nll + token_nll.sum()
        if scored is not None and grad_x is not None:
            grad_x[scored] = grad_rows
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(weight.dtype))
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        grad_x, grad_w = ctx.saved_tensors
        scale = lambda grad: None if grad is None else grad * grad_nll.to(grad.dtype)
        return scale(grad_x), scale(grad_w), None, None, None, None


def _chunk(rows, weight, targets, ignore_index, grad_rows, grad_w):
    """One chunk's NLL per token; its gradients written into ``grad_rows`` and added to ``grad_w`` (None: not
    wanted). A function of its own so that its logits are freed before the next chunk's are made: the working
    set is one chunk's logits, not two."""
    logits, = upcast(F.linear(rows, weight))  # the matmul in the model's precision, the softmax in fp32
    scored = targets != ignore_index
    targets = torch.where(scored, targets, 0)[:, None]
    log_norm = logits.logsumexp(dim=-1, keepdim=True)
    token_nll = (log_norm - logits.gather(1, targets)).squeeze(1) * scored
    if grad_rows is not None or grad_w is not None:  # d nll / d logits = softmax − one-hot, on scored rows
        grad_logits = logits.sub_(log_norm).exp_().scatter_add_(1, targets, -torch.ones_like(log_norm))
        grad_logits = grad_logits.mul_(scored[:, None]).to(rows.dtype)
        del logits  # in fp32 the same buffer; in lower precision the fp32 one goes before the matmuls
        if grad_rows is not None:
            torch.mm(grad_logits, weight, out=grad_rows)
        if grad_w is not None:
            grad_w += grad_logits.T @ rows
    return token_nll
