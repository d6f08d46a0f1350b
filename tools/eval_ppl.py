#!/usr/bin/env python
"""Perplexity of a trained run on text files or token shards, from a checkpoint of any ZeRO stage.

    python tools/eval_ppl.py --run runs/tiny_lm --data wiki.test.txt --txt-docs wikitext --json
    python tools/eval_ppl.py --run runs/tiny_lm --tag step00000500 --data 'shards/val/shard-{000000..000009}.tar'
    torchrun --nproc_per_node 4 tools/eval_ppl.py --run-dir runs/tiny_lm --data shards/val  # documents split over ranks

(``--run-dir`` is ``--run`` under another name: torchrun takes ``--run`` for an abbreviation of its ``--run-path``.)

Text files (``.txt``, ``.jsonl``, ``.gz`` of either) are cut into documents by make_shards' rule
(``pretrain.data.text_files``: a ``.jsonl`` record, or ``--txt-docs`` for ``.txt``, blank-line paragraphs by default),
so a text file and the shards made from it score the same; they are tokenized with the run's tokenizer
(``data.tokenizer``). Shards (a shard directory, or ``.tar`` names and patterns) are read document by document.
Every token, each document's end-of-sequence included, is scored once, with the same windows as the trainer's
validation (``pretrain/tasks/lm_scoring.py``); ``--stride`` below ``--seq-len`` gives long documents overlapping
context. Reported:
  tokens         scored tokens
  nll            mean negative log-likelihood per token (nats); ppl = exp(nll)
  bits_per_byte  total NLL / ln 2 / UTF-8 bytes of the text
  word_ppl       exp(total NLL / (whitespace words + lines)): one end-of-line per line, the WikiText convention
  train_seq_len  the run's train.seq_len: positions past it under a longer --seq-len are extrapolation
  by_position    with --by-position: tokens, nll and ppl per document position of the target, in doubling
                 buckets (0, 1, 2-3, 4-7, ...). Does the model use long context? Positions past --seq-len see at
                 most --seq-len tokens (less with the default stride): evaluate at the length you want to probe.
                 tools/context_position.py compares runs and window lengths this way, in one table and plot.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter
from pretrain.data.text_files import TXT_DOC_RULES


def is_shards(path: str) -> bool:
    """A shard directory (its manifest lists the shards), a .tar name or pattern, or a pipe: URL."""
    return Path(path).is_dir() or path.endswith(".tar") or path.startswith("pipe:")


def word_units(text: str) -> int:
    """Whitespace-separated words plus one end-of-line per line."""
    return len(text.split()) + len(text.splitlines())


def documents(paths: list[str], tokenizer, allow_pipe: bool, txt_docs: str = "paragraphs"):
    """(tokens with eos, UTF-8 bytes, word units) of every document named by ``paths``; text files are cut into
    documents and tokenized as ``make_shards.py text`` does; shards written with another tokenizer are refused
    (a ``ShardError`` naming the shard and both sha256), as training refuses them."""
    import numpy as np

    from pretrain.data import read_documents
    from pretrain.data.text_files import read_text_documents

    for path in paths:
        if is_shards(path):
            for doc in read_documents(path, allow_pipe=allow_pipe, tokenizer_sha256=tokenizer.sha256):
                yield doc.tokens, doc.num_bytes, word_units(tokenizer.decode(doc.tokens[:-1]))
        else:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--data {path}: no such file")
            for text in read_text_documents([path], txt_docs=txt_docs):
                tokens = np.array(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int64)
                yield tokens, len(text.encode("utf-8")), word_units(text)


def launched_ranks() -> bool:
    """Whether a launcher (torchrun, deepspeed) started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def evaluate(args: argparse.Namespace) -> dict:
    """Load the run's checkpoint, score ``args.data`` (on every launched rank), and return the figures."""
    import torch

    from pretrain.distributed.process_group import World
    from pretrain.train.checkpoint import load_trained_model

    model, cfg, checkpoint_path = load_trained_model(Path(args.run), args.tag)
    if not launched_ranks():
        if args.sequence_parallel > 1:
            raise ValueError(f"--sequence-parallel {args.sequence_parallel} needs that many ranks: launch with "
                             "torchrun or deepspeed")
        return score(args, model, cfg, checkpoint_path, World(0, 1, 0, torch.device(args.device)))

    from pretrain.distributed import apply_sequence_parallel, close_process_group, init_process_group, split_sequences

    # every replica scores its share of the documents, each of its sequence ranks a slice of every row;
    # score_documents sums over all ranks
    world = split_sequences(init_process_group(), args.sequence_parallel)
    try:
        apply_sequence_parallel(model, world.sequence, args.seq_len or cfg.train.seq_len)
        return score(args, model, cfg, checkpoint_path, world)
    finally:
        close_process_group()


def score(args, model, cfg, checkpoint_path, world) -> dict:
    """This replica's share of ``args.data`` scored, the totals summed over ranks."""
    import torch
    from tqdm import tqdm

    from pretrain.data import Tokenizer
    from pretrain.tasks.lm_scoring import score_documents

    rank, device = world.data_rank, world.device
    seq_len = args.seq_len or cfg.train.seq_len
    stride = args.stride or seq_len
    model.to(device)
    tokenizer = Tokenizer(cfg.data.tokenizer)

    docs = [doc for i, doc in enumerate(documents(args.data, tokenizer, cfg.data.allow_pipe, args.txt_docs))
            if i % world.data_size == rank]
    local_tokens = sum(len(tokens) for tokens, _, _ in docs)
    with tqdm(total=local_tokens, unit="tok", desc="scoring", file=sys.stderr, disable=rank != 0) as bar:
        scores = score_documents(model, (tokens for tokens, _, _ in docs), seq_len=seq_len, stride=stride,
                                 batch_size=args.batch_size, eos_id=tokenizer.eos_id, device=device,
                                 progress=bar, by_position=args.by_position, sequence=world.sequence)
    nll, tokens = scores.nll, scores.tokens
    num_bytes, words = sum(b for _, b, _ in docs), sum(w for _, _, w in docs)
    if world.sequence is not None and world.sequence.rank > 0:
        num_bytes = words = 0  # the replica's first sequence rank counts its documents' text
    if world.world_size > 1:
        counts = torch.tensor([num_bytes, words], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(counts)
        num_bytes, words = (int(c) for c in counts.tolist())
    result = {"tokens": tokens, "nll": nll / tokens, "ppl": math.exp(nll / tokens),
              "bits_per_byte": nll / math.log(2) / num_bytes, "word_ppl": math.exp(nll / words),
              "bytes": num_bytes, "words": words, "checkpoint": str(checkpoint_path), "seq_len": seq_len,
              "stride": stride, "train_seq_len": cfg.train.seq_len, "ranks": world.world_size,
              "sequence_parallel": 1 if world.sequence is None else world.sequence.size}
    if scores.by_position is not None:
        result["by_position"] = position_rows(scores.by_position)
    return result


def position_rows(by_position) -> list[dict]:
    """The non-empty buckets of ``Scores.by_position`` as rows: positions covered, tokens, mean nll and ppl."""
    rows = []
    for bucket, (nll, count) in enumerate(by_position.tolist()):
        if count:
            first, last = (0, 0) if bucket == 0 else (2 ** (bucket - 1), 2 ** bucket - 1)
            rows.append({"positions": f"{first}-{last}" if last > first else str(first), "tokens": int(count),
                         "nll": nll / count, "ppl": math.exp(nll / count)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", "--run-dir", dest="run", required=True,
                        help="run directory (holds config.yaml and checkpoints/), or a model directory written by "
                             "tools/export.py")
    parser.add_argument("--tag", default="latest", help="checkpoint tag, e.g. step00000500 (default: latest)")
    parser.add_argument("--data", required=True, nargs="+",
                        help="text files (.txt, .jsonl, .gz of either), shard directories and/or shard patterns (.tar)")
    parser.add_argument("--txt-docs", choices=TXT_DOC_RULES, default="paragraphs",
                        help="document boundaries in .txt, as make_shards.py text --txt-docs: blank-line paragraphs, "
                             "WikiText ' = Title = ' articles, or the whole file")
    parser.add_argument("--seq-len", type=int, help="window length (default: the run's train.seq_len)")
    parser.add_argument("--stride", type=int, help="window start every S tokens (default: --seq-len, no overlap)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--by-position", action="store_true",
                        help="also report the loss per document position of the target (doubling buckets)")
    parser.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                        help="split every row over N launched ranks, for documents longer than one rank holds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)

    try:
        result = evaluate(args)
    except (OSError, ValueError) as err:  # a missing run, tag or file; a bad config or shard (all ValueErrors)
        print(f"error: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(result))
        return 0
    rows = result.pop("by_position", [])
    for key, value in result.items():
        print(f"{key:>14}  {value}")
    if rows:
        print(f"\n{'positions':>14}  {'tokens':>9}  {'nll':>7}  {'ppl':>9}")
        for row in rows:
            print(f"{row['positions']:>14}  {row['tokens']:>9}  {row['nll']:7.4f}  {row['ppl']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
