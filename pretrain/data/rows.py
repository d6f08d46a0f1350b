"""The order of a text stream's rows, from the shards' token counts alone: which shard, and which row of it, every
row of the stream is, so a replica opens only the shards of its own rows and a resume seeks without reading.

A shard packs on its own. Its documents (eos included), shuffled by rng(seed, epoch, source, shard) when
``shuffle``, are concatenated and cut into rows of ``seq_len + 1`` tokens that overlap by one: row i holds the
shard's tokens ``[i*L, i*L + L]``. A shard of T tokens gives ``(T - 1) // L`` rows, a count its manifest gives
(``tokens``), and leaves its last ``< L`` tokens unread.

One source's rows (``SourceRows``). Epoch e takes the shards in the order rng(seed, e) permutes them (pattern order
without ``shuffle``), each shard's rows in order: E rows an epoch. They are cut into K parts (K = min(lanes, E)) of
consecutive rows, m = E // K each and one more for the first E mod K, and interleaved: row q < Km of the epoch is
row q // K of part q mod K, and the rows after are the last rows of parts 0, 1, ...; odd parts are walked from
their end, so two neighbours meet the shard they share at once (a worker holding both reads it once). The
source's row n is row
n mod E of epoch n // E, in lane n mod K: a lane walks one part of each epoch, ~1/K of the shards, while
consecutive rows come from K places of the epoch. No row is left out.

A mixture (``MixedRows``) gives each source some of the K lanes (``lane_sources``): row g is the source of lane
g mod K, and that source's row ``(g // K) * K_i + j`` (lane g mod K is its j-th of K_i). A single source is the
mixture of one. Replica r of R takes the rows g ≡ r (mod R) of each round of R × batch_size rows (``share``), so it
meets the lanes ≡ r (mod gcd(R, K)) only: 1/R of the shards when R divides K.
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class RowPlace(NamedTuple):
    """Where a stream row lies: source, epoch, the shard's index in the source's shard list, its row in that shard,
    and the source's lane (a worker keeps one shard a lane in memory)."""
    source: int
    epoch: int
    shard: int
    row: int
    lane: int


def rows_of(tokens: int, seq_len: int) -> int:
    """Rows of ``seq_len + 1`` tokens, overlapping by one, that a shard of ``tokens`` packs into."""
    return max(0, (tokens - 1) // seq_len)


@dataclass(frozen=True)
class SourceRows:
    """One source's rows, a pure function of (shard token counts, seq_len, lanes, seed, shuffle)."""
    tokens: tuple[int, ...]  # per shard, eos included, from the manifests
    seq_len: int
    lanes: int
    seed: int
    shuffle: bool
    shard_rows: np.ndarray = field(init=False, compare=False, repr=False)
    width: int = field(init=False, compare=False)       # K, the lanes the epoch is cut into
    epoch_rows: int = field(init=False, compare=False)  # E, every shard's rows
    _orders: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        rows = np.array([rows_of(t, self.seq_len) for t in self.tokens], dtype=np.int64)
        total = int(rows.sum())
        if total == 0:
            raise ValueError(f"no shard holds seq_len + 1 = {self.seq_len + 1} tokens (the largest holds "
                             f"{max(self.tokens)}): nothing to pack into rows")
        for name, value in (("shard_rows", rows), ("width", min(self.lanes, total)), ("epoch_rows", total)):
            object.__setattr__(self, name, value)

    def shard_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard indices in epoch order, the epoch row each starts at); a few epochs are kept."""
        if epoch not in self._orders:
            n = len(self.tokens)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            starts = np.concatenate([[0], np.cumsum(self.shard_rows[order])[:-1]])
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = (order, starts)
        return self._orders[epoch]

    def place(self, n: int) -> tuple[int, int, int, int]:
        """(epoch, shard, row in shard, lane) of the source's row n. Lane n mod K walks part (n − epoch·E) mod K of
        each epoch (the parts rotate from epoch to epoch when K does not divide E), so a reader of rows ≡ c
        (mod K) meets one lane, whatever the epoch."""
        epoch, q = divmod(n, self.epoch_rows)
        m, extra = divmod(self.epoch_rows, self.width)
        part, step = (q % self.width, q // self.width) if q < self.width * m else (q - self.width * m, m)
        if part % 2:  # odd parts walk backwards: a shard two parts share is read by both at the same time
            step = m - (part >= extra) - step
        epoch_row = part * m + min(part, extra) + step
        order, starts = self.shard_order(epoch)
        at = int(np.searchsorted(starts, epoch_row, side="right")) - 1  # past shards of no rows (same start)
        return epoch, int(order[at]), int(epoch_row - starts[at]), n % self.width

    def next_shard(self, epoch: int, shard: int) -> int:
        """The shard after ``shard`` in epoch order, wrapping (a corrupt shard's rows come from it)."""
        order, _ = self.shard_order(epoch)
        return int(order[(int(np.flatnonzero(order == shard)[0]) + 1) % len(order)])


def lane_sources(shares: Sequence[float], lanes: int) -> tuple[int, ...]:
    """The source of each of ``lanes`` lanes: lane k goes to the source furthest behind its share of the lanes so
    far (``shares[i] * (k + 1) - lanes_i`` largest, the first on a tie), so the sources' lanes are spread evenly
    and each gets round(share × lanes) of them, within one. Every source must get one."""
    counts = [0] * len(shares)
    out = []
    for k in range(lanes):
        i = max(range(len(shares)), key=lambda s: shares[s] * (k + 1) - counts[s])
        counts[i] += 1
        out.append(i)
    for i, count in enumerate(counts):
        if count == 0:
            raise ValueError(f"lanes={lanes}: source {i}'s share {shares[i]:.4g} gets none of the lanes; "
                             f"raise lanes to at least {math.ceil(1 / shares[i])}")
    return tuple(out)


@dataclass(frozen=True)
class MixedRows:
    """Row g of the stream, over the sources' ``SourceRows`` that share its lanes (``lane_sources``)."""
    sources: tuple[SourceRows, ...]
    lane_source: tuple[int, ...]  # per lane
    _slots: tuple = field(init=False, compare=False, repr=False)  # per lane: its index among its source's lanes

    def __post_init__(self):
        seen = [0] * len(self.sources)
        slots = []
        for i in self.lane_source:
            slots.append(seen[i])
            seen[i] += 1
        object.__setattr__(self, "_slots", tuple(slots))

    @property
    def lanes(self) -> int:
        return len(self.lane_source)

    def place(self, g: int) -> RowPlace:
        lane = g % self.lanes
        source = self.lane_source[lane]
        n = g // self.lanes * self.sources[source].lanes + self._slots[lane]
        return RowPlace(source, *self.sources[source].place(n))

    def source_rows(self, g: int) -> list[int]:
        """Rows each source gave to the stream's first g rows."""
        whole, part = divmod(g, self.lanes)
        return [whole * source.lanes + self.lane_source[:part].count(i) for i, source in enumerate(self.sources)]

    def epoch(self, g: int) -> int:
        """The fewest epochs any source has finished by row g."""
        return min(source.place(n)[0] for source, n in zip(self.sources, self.source_rows(g)))

    def stream_rows(self, epochs: int) -> int:
        """Rows of the first ``epochs`` epochs of a single source (the stream ends there)."""
        return epochs * self.sources[0].epoch_rows


def share(start: int, rows: int, replica: int, replicas: int, batch: int) -> list[int]:
    """The rows of a replica's ``batch``-th batch from ``start``: round ``batch`` is the ``replicas × rows`` rows
    from ``start + batch × replicas × rows``, and replica r takes those ≡ r (mod replicas)."""
    first = start + batch * replicas * rows + replica
    return list(range(first, first + rows * replicas, replicas))
