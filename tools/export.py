#!/usr/bin/env python
"""Export a checkpoint of a run as a model directory that loads without DeepSpeed and without the run.

    python tools/export.py --run runs/tiny_lm --out exports/tiny_lm
    python tools/export.py --run runs/aft1b --tag step00010000 --out exports/aft1b --dtype bf16

Writes OUT/model.safetensors (the checkpoint's fp32 weights, reassembled from any ZeRO stage by DeepSpeed's
zero_to_fp32, stored as --dtype), OUT/config.json (the run's resolved config: its model section builds the model)
and OUT/tokenizer.model (a copy of the run's tokenizer, for tasks with one). Then:

    from pretrain.models import load_pretrained
    model = load_pretrained("exports/tiny_lm")          # fp32, CPU, eval mode

and tools/eval_ppl.py, generate.py and eval_cls.py take the directory as --run; `train.init_from` starts a new
run from it.
"""
import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", "--run-dir", dest="run", required=True,
                        help="run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--tag", default="latest", help="checkpoint tag, e.g. step00000500 (default: latest)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the model directory to write")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the stored weights")
    args = parser.parse_args(argv)

    from pretrain.train.export import export_run

    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's reports; stdout is the one result line
            source = export_run(Path(args.run), Path(args.out), tag=args.tag, dtype=args.dtype)
    except (OSError, ValueError) as err:  # a missing run, tag or tokenizer; a bad config; --out a run directory
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported {source} to {args.out} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
