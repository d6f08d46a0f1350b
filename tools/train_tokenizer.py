#!/usr/bin/env python
"""Train a sentencepiece tokenizer that round-trips any UTF-8 text (byte fallback on).

Writes PREFIX.model and PREFIX.vocab. Special ids: pad=0, unk=1, bos=2, eos=3 (shards append eos to every
document). Inputs: .txt, .jsonl (field "text") and .gz of either; globs are expanded.

Example:
  python tools/train_tokenizer.py --input ../shared/data/text/wikitext-2/train.txt --vocab-size 8192 \\
      --out data/tokenizers/wikitext2 --txt-docs wikitext
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pretrain.cli_help import HelpFormatter
from pretrain.data.text_files import TXT_DOC_RULES, expand_inputs
from pretrain.data.tokenizer import train_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB", help="training text")
    parser.add_argument("--vocab-size", type=int, required=True, help="pieces in the vocabulary (> 260)")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--sample-bytes", type=int, default=None,
                        help="train on an even random sample of about this many bytes of lines (default: all)")
    parser.add_argument("--txt-docs", choices=TXT_DOC_RULES, default="paragraphs",
                        help="document boundaries in .txt files (see pretrain/data/text_files.py)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the line sample")
    parser.add_argument("--verbose", action="store_true", help="show reading progress and sentencepiece's own log")
    args = parser.parse_args()

    start = time.time()
    try:
        inputs = expand_inputs(args.input)
        print(f"training a {args.vocab_size}-piece {args.model_type} tokenizer on {len(inputs)} file"
              f"{'s' if len(inputs) > 1 else ''} with sentencepiece", file=sys.stderr, flush=True)
        tok = train_tokenizer(inputs, args.vocab_size, args.out, model_type=args.model_type,
                              sample_bytes=args.sample_bytes, txt_docs=args.txt_docs, seed=args.seed,
                              progress=args.verbose)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}.model and {args.out}.vocab: vocab_size={tok.vocab_size} pad={tok.pad_id} "
          f"bos={tok.bos_id} eos={tok.eos_id} sha256={tok.sha256} in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
