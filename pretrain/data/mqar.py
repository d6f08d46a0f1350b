"""Multi-query associative recall (MQAR; Arora et al., "Zoology", arXiv 2312.04927), generated on the fly.

A row of ``seq_len`` tokens opens with ``num_pairs`` key–value pairs ``k1 v1 k2 v2 …`` (keys drawn without
replacement from ``[1, vocab_size/2)``, values from ``[vocab_size/2, vocab_size)``); after them every key comes back
once as a query, and the label at a query is its value. Only those labels are scored (−100 elsewhere), so loss and
accuracy measure recall alone. Everything else after the pairs is noise drawn from the whole vocabulary. As in
Zoology, the queries sit at even offsets ``2g`` after the pairs, the gaps ``g`` drawn without replacement with
probability ∝ (g+1)^(query_power − 1): a small power puts most queries soon after the pairs, 1 spreads them evenly.

A *mixture* of settings (Zoology's and Based's multi-length training) packs each row with examples of one
setting drawn per row, uniformly: a 256-token row holds four (64, 4) examples, two (128, 8) or one (256, 16), each
its own document (``position_ids`` restart at 0), so the causal mixers see each example alone, as when it is a row of
its own, and every row has the same length.

Batch ``j`` of the stream comes from its own generator, seeded by (split, seed, 1, 0, j) (1, 0: the world size and
rank one-rank runs were keyed by). As TokenLoader's rounds, the data-parallel replicas share the stream: replica ``r``
of ``R`` takes batches ``r, r + R, ...``, so the rows of a global step do not depend on how many replicas share
them, and resuming, on any number of replicas, needs only the number of batches the replicas have taken.
"""
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pretrain.data.stream import check_at_least, check_split

IGNORE = -100
SPLITS = {"train": 0, "val": 1, "test": 2}  # disjoint generator streams for the same seed


class MQARSettingError(ValueError):
    """An impossible MQAR setting; ``arg`` is the argument at fault (callers map it to their config key)."""

    def __init__(self, arg: str, message: str):
        super().__init__(f"{arg}: {message}")
        self.arg = arg


def check_mqar(*, vocab_size: int, seq_len: int, num_pairs: int, query_power: float) -> None:
    """Refuse settings with too few keys, values or query slots, naming the argument to change."""
    check_at_least(num_pairs=(num_pairs, 1))
    keys, values = vocab_size // 2 - 1, vocab_size - vocab_size // 2
    if min(keys, values) < num_pairs:
        raise MQARSettingError("vocab_size", f"{vocab_size} gives {keys} keys and {values} values, fewer than "
                                             f"num_pairs={num_pairs} distinct ones; use at least {2 * num_pairs + 2}")
    if seq_len < 4 * num_pairs:
        raise MQARSettingError("seq_len", f"{seq_len} holds the {num_pairs} pairs but not a query slot for each of "
                                          f"them; use at least 4·num_pairs = {4 * num_pairs}")
    if not query_power > 0:
        raise MQARSettingError("query_power", f"must be > 0 (1 spreads queries evenly), got {query_power}")


def mqar_rows(rng: np.random.Generator, rows: int, *, vocab_size: int, seq_len: int, num_pairs: int,
              query_power: float) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)``, int64 ``[rows, seq_len]``: labels are −100 except each query's value."""
    half, n = vocab_size // 2, num_pairs
    slots = (seq_len - 2 * n) // 2
    keys = 1 + _without_replacement(rng, np.zeros(half - 1), rows, n)
    values = half + _without_replacement(rng, np.zeros(vocab_size - half), rows, n)
    weights = np.log(query_power) + (query_power - 1) * np.log(np.arange(1, slots + 1))
    query_at = 2 * n + 2 * _without_replacement(rng, weights, rows, n)

    inputs = rng.integers(0, vocab_size, (rows, seq_len))
    inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2] = keys, values
    labels = np.full((rows, seq_len), IGNORE, dtype=np.int64)
    np.put_along_axis(inputs, query_at, keys, axis=1)
    np.put_along_axis(labels, query_at, values, axis=1)
    return inputs, labels


def mqar_mixture_rows(rng: np.random.Generator, rows: int, *, vocab_size: int, seq_len: int,
                      mixture: Sequence[tuple[int, int]], query_power: float) -> tuple[np.ndarray, ...]:
    """``(inputs, labels, position_ids)`` ``[rows, seq_len]``: each row packs ``seq_len / T`` examples of one
    ``(T, num_pairs)`` setting of ``mixture``, drawn per row; positions count from each example's start."""
    choice = rng.integers(0, len(mixture), rows)
    inputs, labels = np.empty((rows, seq_len), np.int64), np.empty((rows, seq_len), np.int64)
    positions = np.empty((rows, seq_len), np.int64)
    for index, (length, num_pairs) in enumerate(mixture):
        chosen = np.nonzero(choice == index)[0]
        per_row = seq_len // length
        x, y = mqar_rows(rng, len(chosen) * per_row, vocab_size=vocab_size, seq_len=length, num_pairs=num_pairs,
                         query_power=query_power)
        inputs[chosen], labels[chosen] = x.reshape(-1, seq_len), y.reshape(-1, seq_len)
        positions[chosen] = np.tile(np.arange(length), per_row)
    return inputs, labels, positions


def check_mixture(*, vocab_size: int, seq_len: int, mixture: Sequence[tuple[int, int]], query_power: float) -> None:
    """Every setting possible and packing whole into rows of ``seq_len``; the error names the entry
    (``mixture[i].seq_len``) as ``MQARSettingError.arg``."""
    if not mixture:
        raise MQARSettingError("mixture", "is empty; give at least one {seq_len, num_pairs} setting")
    for i, (length, num_pairs) in enumerate(mixture):
        if not isinstance(length, int) or length < 1 or seq_len % length:
            raise MQARSettingError(f"mixture[{i}].seq_len", f"{length} does not divide the rows of {seq_len} "
                                                            "tokens into whole examples")
        try:
            check_mqar(vocab_size=vocab_size, seq_len=length, num_pairs=num_pairs, query_power=query_power)
        except MQARSettingError as err:
            arg = err.arg if err.arg in ("vocab_size", "query_power") else f"mixture[{i}].{err.arg}"
            raise MQARSettingError(arg, str(err).split(": ", 1)[1]) from None
        except ValueError as err:
            raise MQARSettingError(f"mixture[{i}].num_pairs", str(err)) from None


def _without_replacement(rng: np.random.Generator, log_weights: np.ndarray, rows: int, k: int) -> np.ndarray:
    """``[rows, k]`` indices drawn without replacement ∝ exp(log_weights), each row apart (the Gumbel top-k trick,
    the same law as drawing one at a time)."""
    keys = log_weights + rng.gumbel(size=(rows, len(log_weights)))
    return np.argsort(-keys, axis=1, kind="stable")[:, :k]


class MQARLoader:
    """Iterates dicts of ``input_ids``, ``labels``, ``position_ids`` (``torch.long``, ``[batch_size, seq_len]``),
    forever; the ``state_dict()``/``load_state_dict()`` of ``TokenLoader``."""

    epoch = 0  # generated, so there are no passes to count

    def __init__(self, *, vocab_size: int, seq_len: int, num_pairs: int | None = None, batch_size: int,
                 query_power: float = 0.01, rank: int = 0, world_size: int = 1, seed: int = 0, split: str = "train",
                 mixture: Sequence[tuple[int, int]] | None = None):
        """One setting (``num_pairs`` in rows of ``seq_len``), or a ``mixture`` of ``(T, num_pairs)`` settings
        packed into rows of ``seq_len`` tokens (module docstring)."""
        check_at_least(batch_size=(batch_size, 1), world_size=(world_size, 1), seed=(seed, 0))
        check_split(rank, world_size, None)
        if (num_pairs is None) == (mixture is None):
            raise ValueError("give num_pairs (one setting) or mixture (several), not both or neither")
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
        self.identity = {"generator": "mqar", "split": split, "seed": seed, "vocab_size": vocab_size,
                         "query_power": query_power}
        if mixture is None:
            check_mqar(vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, query_power=query_power)
            self.identity["num_pairs"] = num_pairs
        else:
            mixture = [tuple(setting) for setting in mixture]
            check_mixture(vocab_size=vocab_size, seq_len=seq_len, mixture=mixture, query_power=query_power)
            self.identity["mixture"] = [list(setting) for setting in mixture]  # as a checkpoint's JSON holds it
        self.seq_len, self.mixture = seq_len, mixture
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.batches = batch_size, 0  # batches: taken by all replicas together

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """This replica's ``index``-th batch (the same on every call)."""
        return self._generate(index * self.world_size + self.rank)

    def _generate(self, index: int) -> dict[str, torch.Tensor]:
        """The stream's ``index``-th batch."""
        ident = self.identity
        rng = np.random.default_rng([SPLITS[ident["split"]], ident["seed"], 1, 0, index])
        common = {"vocab_size": ident["vocab_size"], "seq_len": self.seq_len, "query_power": ident["query_power"]}
        if self.mixture is None:
            inputs, labels = mqar_rows(rng, self.batch_size, num_pairs=ident["num_pairs"], **common)
            positions = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape).copy()
        else:
            inputs, labels, positions = mqar_mixture_rows(rng, self.batch_size, mixture=self.mixture, **common)
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            batch = self._generate(self.batches + self.rank)
            self.batches += self.world_size  # the round: every replica took one
            yield batch

    def state_dict(self) -> dict:
        return {**self.identity, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the round the state was taken at, on any number of replicas; another stream (seed,
        setting) is refused, naming the key. ``seq_len`` and ``batch_size`` may change, as TokenLoader's."""
        if state.get("world_size", 1) != 1:  # kept only by states from before the replicas shared one stream
            raise ValueError(f"this data loader state is rank {state.get('rank')}'s of {state['world_size']}, "
                             "written before the ranks shared one stream: it cannot resume with this version (a "
                             "one-rank run's can); start a new run.dir, or resume with the version that wrote it")
        for key, mine in self.identity.items():
            if key not in state:
                raise ValueError(f"data loader state lacks key {key!r}")
            if state[key] != mine:
                raise ValueError(f"data loader state key {key!r} is {state[key]!r}, but this loader has {mine!r}: "
                                 "resuming would read a different stream")
        if "batches" not in state:
            raise ValueError("data loader state lacks key 'batches'")
        self.batches = int(state["batches"])
