#!/usr/bin/env python
"""Throughput of the text data path in one reader process: packed tokens/s of TokenLoader.

Reads either your shards (--shards) or synthetic ones written to a temporary directory (random token ids,
document lengths drawn log-normally around --mean-doc-tokens). Reports, side by side in one run:
  read      read_documents: tar parsing and decoding only
  packed    TokenLoader with num_workers=0: documents shuffled and packed into rows, position ids, tensors
and the ratio packed/read; with --workers N also the same loader through N DataLoader worker processes (each
builds every N-th batch). The target for pre-tokenized shards is >= 1M packed tokens/s per reader process.

With --replicas R1 R2 ... it reports instead what each replica's share costs (no ranks needed: it walks each
replica's share of the rows with TokenLoader.planned_shards, the loader's own walk): for one epoch's rows, the shards
opened and bytes read per replica and per worker (the most of any), as fractions of what one replica reads for the
same rows; and, reading for real, the time to replica 0's first batch from the start and from resumes at
--resume-epochs (a resume seeks; it does not replay the stream).

Example:
  python tools/bench_data.py --mean-doc-tokens 300 --tokens 20000000
  python tools/bench_data.py --shards data/shards/wikitext2/train --seq-len 2048 --batch-size 8
  python tools/bench_data.py --replicas 1 8 64 512 --lanes 512 --docs-per-shard 40 --json out.json
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from tqdm import tqdm

from pretrain.cli_help import HelpFormatter
from pretrain.data.shards import ShardWriter, write_manifest

import benchlib


def write_synthetic_shards(directory: str, tokens: int, mean_doc_tokens: int, docs_per_shard: int) -> None:
    rng = np.random.default_rng(0)
    writer = ShardWriter(directory, samples_per_shard=docs_per_shard)
    written, i = 0, 0
    with tqdm(total=tokens, unit="tok", unit_scale=True, desc="writing synthetic shards") as bar:
        while written < tokens:
            n = max(1, int(rng.lognormal(np.log(mean_doc_tokens), 1.0)))
            ids = rng.integers(4, 32000, size=n, dtype=np.uint16)
            writer.add(f"{i:010d}", {"tokens.u16": ids.tobytes(), "json": b'{"num_bytes":%d}' % (4 * n)},
                       tokens=n, bytes=4 * n)
            written, i = written + n, i + 1
            bar.update(n)
    files = writer.close()
    write_manifest(directory, {"files": files, "shards": len(files), "tokens": written, "documents": i,
                               "tokenizer_sha256": None})


def tokens_per_second(batches, limit: int, desc: str, count) -> float:
    return benchlib.units_per_second(batches, limit, desc, count, unit="tok")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--data", "--shards", dest="data", default=None,
                        help="a shard pattern or directory (default: synthetic shards)")
    parser.add_argument("--tokens", type=int, default=20_000_000, help="tokens to read per measurement")
    parser.add_argument("--mean-doc-tokens", type=int, default=500, help="synthetic document length (median)")
    parser.add_argument("--docs-per-shard", type=int, default=10_000, help="synthetic shard size")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lanes", type=int, default=64, help="the loader's lanes (data.lanes)")
    parser.add_argument("--workers", type=int, default=0, help="also measure with this many DataLoader workers "
                        "(with --replicas: the workers per replica the shares are split for)")
    parser.add_argument("--replicas", type=int, nargs="+", default=None, metavar="R",
                        help="report each replica's share of the reads for these numbers of replicas")
    parser.add_argument("--resume-epochs", type=float, nargs="+", default=[0.5, 3.5], metavar="E",
                        help="with --replicas: how far in (epochs) the resumes start")
    parser.add_argument("--json", default=None, metavar="PATH", help="with --replicas: also write the report here")
    args = parser.parse_args()

    from pretrain.data import TokenLoader, read_documents

    with tempfile.TemporaryDirectory() as scratch:
        pattern = args.data
        if pattern is None:
            pattern = scratch
            write_synthetic_shards(scratch, args.tokens, args.mean_doc_tokens, args.docs_per_shard)
        if args.replicas:
            return report_shares(pattern, args, TokenLoader)

        def forever_documents():
            while True:
                yield from read_documents(pattern)

        read = tokens_per_second(forever_documents(), args.tokens, "read", lambda d: len(d.tokens))
        def packed_tokens_per_second(workers: int) -> float:
            loader = TokenLoader(pattern, seq_len=args.seq_len, batch_size=args.batch_size, lanes=args.lanes,
                                 num_workers=workers)
            return tokens_per_second(loader, args.tokens, f"packed, {workers} workers",
                                     lambda b: b["input_ids"].numel())

        packed = packed_tokens_per_second(0)
        with_workers = packed_tokens_per_second(args.workers) if args.workers else None
    print(f"\nshards: {args.data or f'synthetic, median {args.mean_doc_tokens} tokens a document'}; "
          f"seq_len={args.seq_len} batch_size={args.batch_size} lanes={args.lanes}")
    print(f"  read    {read / 1e6:8.2f} M tokens/s")
    print(f"  packed  {packed / 1e6:8.2f} M tokens/s   (packed/read = {packed / read:.2f})")
    if with_workers is not None:
        print(f"  packed with {args.workers} workers {with_workers / 1e6:8.2f} M tokens/s   "
              f"(/ packed in process = {with_workers / packed:.2f})")
    print(f"  target  {'met' if packed >= 1e6 else 'MISSED'}: >= 1 M packed tokens/s per reader process")
    return 0


def report_shares(pattern: str, args, TokenLoader) -> int:
    """Shards and bytes each replica (and worker) reads for one epoch's rows, and the time to a first batch."""
    settings = dict(seq_len=args.seq_len, batch_size=args.batch_size, lanes=args.lanes)
    whole = TokenLoader(pattern, **settings)
    sizes = {url: os.path.getsize(url) for url in whole.shard_urls}
    epoch_batches = whole.rows_per_epoch // args.batch_size  # of one replica alone
    alone = whole.planned_shards(epoch_batches)
    alone_bytes = sum(sizes[url] for url in alone)
    workers = max(1, args.workers)
    print(f"{len(sizes)} shards, {sum(sizes.values()) / 1e6:.1f} MB; seq_len={args.seq_len} "
          f"batch_size={args.batch_size} lanes={whole.lanes} workers={workers}; one epoch = {whole.rows_per_epoch} "
          f"rows; one replica alone opens {len(alone)} shards, {alone_bytes / 1e6:.1f} MB")
    resumed_at = "".join(f" {f'@{epochs:g} ep s':>10}" for epochs in args.resume_epochs)
    print(f"{'R':>5} {'shards/replica':>15} {'MB/replica':>11} {'of alone':>9} {'1/R':>7} {'shards/worker':>14} "
          f"{'of alone':>9} {'first batch s':>14}{resumed_at}")
    records = []
    for replicas in args.replicas:
        batches = epoch_batches // replicas
        shards, worker_shards = [], []
        for rank in range(replicas):
            loader = TokenLoader(pattern, rank=rank, world_size=replicas, **settings)
            shards.append(loader.planned_shards(batches))
            worker_shards += [loader.planned_shards(batches, worker=w, num_workers=workers) for w in range(workers)]
        most = max(shards, key=lambda share: sum(sizes[url] for url in share))
        most_bytes = sum(sizes[url] for url in most)
        first = first_batch_seconds(pattern, replicas, settings, TokenLoader, None)
        resumed = [first_batch_seconds(pattern, replicas, settings, TokenLoader, e) for e in args.resume_epochs]
        record = {"replicas": replicas, "batches_per_replica": batches,
                  "shards_per_replica_max": max(map(len, shards)), "bytes_per_replica_max": most_bytes,
                  "bytes_fraction_of_alone": most_bytes / alone_bytes,
                  "shards_per_worker_max": max(map(len, worker_shards)),
                  "shards_per_worker_fraction_of_alone": max(map(len, worker_shards)) / len(alone),
                  "first_batch_s": first, "resumed_first_batch_s": dict(zip(args.resume_epochs, resumed)),
                  "load_1min": os.getloadavg()[0]}
        records.append(record)
        print(f"{replicas:>5} {record['shards_per_replica_max']:>15} {most_bytes / 1e6:>11.2f} "
              f"{record['bytes_fraction_of_alone']:>9.4f} {1 / replicas:>7.4f} {record['shards_per_worker_max']:>14} "
              f"{record['shards_per_worker_fraction_of_alone']:>9.4f} {first:>14.3f}"
              + "".join(f" {seconds:>10.3f}" for seconds in resumed))
    if args.json:
        setup = {"shards": len(sizes), "bytes": sum(sizes.values()), "rows_per_epoch": whole.rows_per_epoch,
                 "seq_len": args.seq_len, "batch_size": args.batch_size, "lanes": whole.lanes, "workers": workers,
                 "alone_shards": len(alone), "alone_bytes": alone_bytes, "data": args.data or "synthetic"}
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "replicas": records}, f, indent=1)
            f.write("\n")
    return 0


def first_batch_seconds(pattern: str, replicas: int, settings: dict, TokenLoader, resume_epochs: float | None
                        ) -> float:
    """Seconds from building replica 0's loader to its first batch: from the start (``resume_epochs`` None), or
    resumed from a state that many epochs in (a fresh loader's state with its row moved there: the row is what a
    resume reads)."""
    state = None
    if resume_epochs is not None:
        far = TokenLoader(pattern, **settings)
        state = {**far.state_dict(), "row": round(resume_epochs * far.rows_per_epoch), "epoch": int(resume_epochs)}
    start = time.perf_counter()
    loader = TokenLoader(pattern, rank=0, world_size=replicas, **settings)
    if state is not None:
        loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
