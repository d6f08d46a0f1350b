#!/usr/bin/env python
"""Write webdataset shards: pre-tokenized text documents, or labelled images.

  text    one document per sample: its token ids with eos appended (tokens.u16/.u32) and its UTF-8 byte length
          (json); a .jsonl record or a .parquet row (its text column) is a document, .txt files are cut by
          --txt-docs; .txt and .jsonl may be .gz or .zst (the Pile's .jsonl.zst). .zst and .parquet need the
          extra `formats` (pip install -e .[formats]).
  images  one image per sample (jpg/png bytes unchanged, and cls) from an ImageFolder directory or a tar of one.
  verify  every shard's sha256 against its manifest, before a run meets a corrupt shard at step 1500.

Every shard set gets DIR/manifest.json (counts, the tokenizer's sha256 or the class names). Same inputs give
byte-identical shards. Formats: pretrain/data/text_shards.py and pretrain/data/images.py.

Examples:
  python tools/make_shards.py text --input ../shared/data/text/wikitext-2/train.txt --txt-docs wikitext \\
      --tokenizer data/tokenizers/wikitext2.model --out data/shards/wikitext2/train
  python tools/make_shards.py images --input ../shared/data/images/cifar10_jpg.tar.gz --split train \\
      --out data/shards/cifar10/train
  python tools/make_shards.py verify --data data/shards/wikitext2/train
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pretrain.cli_help import HelpFormatter
from pretrain.data.images import make_image_shards
from pretrain.data.shards import expand_shards, verify_shards
from pretrain.data.text_files import TXT_DOC_RULES
from pretrain.data.text_shards import make_text_shards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    kinds = parser.add_subparsers(dest="kind", required=True)
    text = kinds.add_parser("text", help="pre-tokenized text documents", formatter_class=HelpFormatter)
    text.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                      help=".txt/.jsonl[.gz|.zst] or .parquet files")
    text.add_argument("--tokenizer", required=True, metavar="PREFIX.model", help="a sentencepiece model")
    text.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    text.add_argument("--docs-per-shard", type=int, default=10_000,
                      help="shards are split among training ranks whole: make at least as many as ranks")
    text.add_argument("--txt-docs", choices=TXT_DOC_RULES, default="paragraphs",
                      help="document boundaries in .txt: blank-line paragraphs (default), WikiText ' = Title = ' "
                           "articles, or the whole file")
    text.add_argument("--workers", type=int, default=1, help="tokenizing processes (output does not depend on it)")
    images = kinds.add_parser("images", help="images with class labels", formatter_class=HelpFormatter)
    images.add_argument("--input", required=True, metavar="DIR_OR_TAR", help="ImageFolder directory or tar(.gz)")
    images.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    images.add_argument("--split", default=None, help="the split folder to take (e.g. train, test)")
    images.add_argument("--images-per-shard", type=int, default=5000)
    images.add_argument("--seed", type=int, default=0, help="seed of the order images are written in")
    check = kinds.add_parser("verify", help="check every shard's sha256 against its manifest",
                            formatter_class=HelpFormatter)
    check.add_argument("--data", required=True, metavar="DIR_OR_PATTERN", help="shard directory or pattern (.tar)")
    args = parser.parse_args()

    start = time.time()
    try:
        if args.kind == "verify":
            print(verify_shards(expand_shards(args.data), report=print))
            return 0
        if args.kind == "text":
            manifest = make_text_shards(args.input, args.tokenizer, args.out, docs_per_shard=args.docs_per_shard,
                                        txt_docs=args.txt_docs, workers=args.workers, progress=True)
            summary = f"{manifest['documents']} documents, {manifest['tokens']} tokens, {manifest['bytes']} bytes"
        else:
            manifest = make_image_shards(args.input, args.out, split=args.split,
                                         images_per_shard=args.images_per_shard, seed=args.seed, progress=True)
            summary = f"{manifest['images']} images in {len(manifest['classes'])} classes"
    except (ValueError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {manifest['shards']} shards to {args.out}: {summary} in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
