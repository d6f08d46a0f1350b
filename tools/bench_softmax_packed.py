"""Softmax attention over packed documents: forward+backward time of each ``impl`` on the same packed rows.

    python tools/bench_softmax_packed.py --device cpu --impls sdpa,masked
    python tools/bench_softmax_packed.py --device cuda --dtype bf16 --batch 8 --seq-len 4096 --heads 16 \\
        --head-dim 64 --impls sdpa,varlen,masked

Rows of ``--seq-len`` tokens are cut into documents of uniformly random length in [``--min-doc``, ``--max-doc``]
(seeded; the last one in a row cut short), packed into one row of B·T as the LM does, with the row length as
``max_seqlen`` (``--max-seqlen exact``: the longest document). Each impl runs ``--warmup`` then ``--repeats``
forward+backward steps; the median is reported with the largest difference from ``sdpa`` (SDPA once per document,
the reference).
"""
import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain.cli_help import HelpFormatter
from pretrain.ops.precision import DTYPES
from pretrain.ops.softmax import softmax_attention


def packed_offsets(batch: int, seq_len: int, min_doc: int, max_doc: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(batch):
        left = seq_len
        while left:
            length = min(left, int(torch.randint(min_doc, max_doc + 1, (), generator=gen)))
            lengths.append(length)
            left -= length
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def median_seconds(step, device, warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=4, help="rows, packed into one of batch × seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per row (each row starts a document)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-doc", type=int, default=32)
    parser.add_argument("--max-doc", type=int, default=400)
    parser.add_argument("--impls", default="sdpa,masked", help="comma-separated softmax_attention impls")
    parser.add_argument("--max-seqlen", choices=["row", "exact"], default="row",
                        help="the bound the varlen kernels get: the row length (as the mixer passes it, nothing read "
                             "from the device) or the longest document (read once here)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cu = packed_offsets(args.batch, args.seq_len, args.min_doc, args.max_doc, args.seed).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (1, args.batch * args.seq_len, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))

    max_seqlen = args.seq_len if args.max_seqlen == "row" else int(cu.diff().max())

    def run(impl):
        return softmax_attention(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, impl=impl)

    def forward_backward(impl):
        run(impl).sum().backward()

    reference = run("sdpa").detach().float()
    print(f"{args.batch} rows × {args.seq_len} tokens, {cu.numel() - 1} documents, {args.heads} heads × "
          f"{args.head_dim}, {args.dtype} on {device}, max_seqlen {max_seqlen}")
    print("| impl | forward+backward (ms) | max abs difference from sdpa |\n|---|---:|---:|")
    for impl in args.impls.split(","):
        seconds = median_seconds(functools.partial(forward_backward, impl), device, args.warmup, args.repeats)
        difference = (run(impl).detach().float() - reference).abs().max().item()
        print(f"| {impl} | {seconds * 1e3:.1f} | {difference:.1e} |")


if __name__ == "__main__":
    main()
