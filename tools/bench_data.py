#!/usr/bin/env python
"""Throughput of the text data path in one reader process: packed tokens/s of TokenLoader.

Reads either your shards (--shards) or synthetic ones written to a temporary directory (random token ids,
document lengths drawn log-normally around --mean-doc-tokens). Reports, side by side in one run:
  read      read_documents: tar parsing and decoding only
  packed    TokenLoader with num_workers=0: shuffle windows, packing, position ids, torch tensors
and the ratio packed/read; with --workers N also the same loader through N DataLoader worker processes (each
walks the whole stream and assembles every N-th batch). The target for pre-tokenized shards is >= 1M packed
tokens/s per reader process.

Example:
  python tools/bench_data.py --mean-doc-tokens 300 --tokens 20000000
  python tools/bench_data.py --shards data/shards/wikitext2/train --seq-len 2048 --batch-size 8
"""
import argparse
import os
import sys
import tempfile

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
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=0, help="also measure with this many DataLoader workers")
    args = parser.parse_args()

    from pretrain.data import TokenLoader, read_documents

    with tempfile.TemporaryDirectory() as scratch:
        pattern = args.data
        if pattern is None:
            pattern = scratch
            write_synthetic_shards(scratch, args.tokens, args.mean_doc_tokens, args.docs_per_shard)

        def forever_documents():
            while True:
                yield from read_documents(pattern)

        read = tokens_per_second(forever_documents(), args.tokens, "read", lambda d: len(d.tokens))
        def packed_tokens_per_second(workers: int) -> float:
            loader = TokenLoader(pattern, seq_len=args.seq_len, batch_size=args.batch_size,
                                 shuffle_buffer=args.shuffle_buffer, num_workers=workers)
            return tokens_per_second(loader, args.tokens, f"packed, {workers} workers",
                                     lambda b: b["input_ids"].numel())

        packed = packed_tokens_per_second(0)
        with_workers = packed_tokens_per_second(args.workers) if args.workers else None
    print(f"\nshards: {args.data or f'synthetic, median {args.mean_doc_tokens} tokens a document'}; "
          f"seq_len={args.seq_len} batch_size={args.batch_size} shuffle_buffer={args.shuffle_buffer}")
    print(f"  read    {read / 1e6:8.2f} M tokens/s")
    print(f"  packed  {packed / 1e6:8.2f} M tokens/s   (packed/read = {packed / read:.2f})")
    if with_workers is not None:
        print(f"  packed with {args.workers} workers {with_workers / 1e6:8.2f} M tokens/s   "
              f"(/ packed in process = {with_workers / packed:.2f})")
    print(f"  target  {'met' if packed >= 1e6 else 'MISSED'}: >= 1 M packed tokens/s per reader process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
