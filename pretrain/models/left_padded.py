"""Prompts of different lengths in one batch, padded on the left: prefilled so that no pad enters a state.

Each group of rows of one length is prefilled on its own tokens alone (no pads at all), so every row's state is the
state of its prompt generated alone: the pads enter no recurrent state, no convolution's window, no attention. The
groups' states are then joined into one batch for ``step``, which all rows take together.

Joining relies on two promises of a decoding state (docs/CONTRACTS.md, "A state's rows"): its tensors have the batch
first; and a tensor whose length depends on the prompt's (a KV cache) grows along dim 1, next to an int that counts
the tokens its row has seen. Such a tensor is left-padded with zeros here, and the count becomes a tensor of each
row's own count where the rows' counts differ; the mixer's ``step`` masks the first ``length − count`` entries of a
row and reads its positions from the count. Every other leaf must agree between the groups.
"""
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def prefill_left_padded(model, input_ids: torch.Tensor, starts: torch.Tensor, *, last: int = 0):
    """``model.forward_with_state`` from the start over rows left-padded to one length: row b's prompt is
    ``input_ids[b, starts[b]:]`` → ``(logits, states)``, the logits of the last ``last`` columns (all when 0), zero
    at the pads, and the batch's states."""
    batch, length = input_ids.shape
    if starts.shape != (batch,) or not ((starts >= 0) & (starts < length)).all():
        raise ValueError(f"starts must give each of the {batch} rows a first token in [0, {length}); "
                         f"got {starts.tolist()}")
    keep = min(last, length) if last else length
    logits, states, groups = None, [], []
    for start in starts.unique().tolist():
        rows = (starts == start).nonzero().squeeze(1)
        part, state = model.forward_with_state(input_ids[rows, start:], last=last)
        if logits is None:
            logits = part.new_zeros(batch, keep, part.shape[-1])
        logits[rows, keep - part.shape[1]:] = part
        states.append(state)
        groups.append(rows)
    return logits, join_rows(states, groups, batch)


def join_rows(states: list, groups: list[torch.Tensor], batch: int):
    """The states of groups of rows decoded apart → the state of all ``batch`` rows, row ``groups[g][i]`` from the
    i-th row of ``states[g]``."""
    flat, specs = zip(*(tree_flatten(state) for state in states))
    if any(spec != specs[0] for spec in specs):
        raise ValueError("the groups' decoding states differ in structure; a mixer's state must have one structure "
                         "whatever the prompt's length")
    return tree_unflatten([_joined(leaves, groups, batch) for leaves in zip(*flat)], specs[0])


def _joined(leaves: tuple, groups: list[torch.Tensor], batch: int):
    first = leaves[0]
    if isinstance(first, torch.Tensor):
        shape = [batch, *first.shape[1:]]
        if first.dim() > 1:
            shape[1] = max(leaf.shape[1] for leaf in leaves)
        if any(leaf.shape[2:] != first.shape[2:] for leaf in leaves):
            raise ValueError(f"a decoding state's tensor differs between prompts of different lengths beyond dim 1: "
                             f"{[tuple(leaf.shape) for leaf in leaves]}")
        joined = first.new_zeros(shape)
        for leaf, rows in zip(leaves, groups):
            if first.dim() > 1:
                joined[rows, shape[1] - leaf.shape[1]:] = leaf
            else:
                joined[rows] = leaf
        return joined
    if all(leaf == first for leaf in leaves):
        return first
    if not all(isinstance(leaf, int) for leaf in leaves):
        raise ValueError(f"a decoding state's leaf differs between prompts of different lengths and is not a count "
                         f"of tokens: {leaves}")
    counts = torch.zeros(batch, dtype=torch.long, device=groups[0].device)
    for leaf, rows in zip(leaves, groups):
        counts[rows] = leaf
    return counts
