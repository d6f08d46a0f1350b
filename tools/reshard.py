#!/usr/bin/env python
"""Convert a run's checkpoint for a resume on another number of ranks, ahead of the launch.

    python tools/reshard.py --run runs/gdn_1b                     # the latest checkpoint
    python tools/reshard.py --run runs/gdn_1b --workers 16 --json reshard.json

A resume on another number of ranks needs the partitioned optimizer states whole (DeepSpeed's universal checkpoint,
``TAG/universal/``). The trainer makes it itself, on rank 0, while the other ranks wait outside any collective; this
makes it beforehand, on any machine that sees ``run.dir``, with as many worker processes as it has cores, so the
relaunch converts nothing (it says "converted ahead of the launch"). The copy is removed once a resume has loaded it.
Prints one line: the tag, the parameters, the seconds and seconds per billion parameters.
"""
import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter


def count_parameters(tag_dir: Path) -> int:
    """Parameters of the model a checkpoint holds, from DeepSpeed's record of their shapes (no weights loaded)."""
    import torch

    states = torch.load(next(tag_dir.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    shapes = states["param_shapes"]
    groups = shapes if isinstance(shapes, list) else [shapes]
    return sum(int(torch.Size(shape).numel()) for group in groups for shape in group.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", "--run-dir", dest="run", required=True, help="run directory (holds checkpoints/)")
    parser.add_argument("--tag", default="latest", help="checkpoint tag, e.g. step00000500 (default: latest)")
    parser.add_argument("--workers", type=int, default=4,
                        help="processes that extract and merge the partitions (memory grows with them)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1 (got {args.workers})")

    from pretrain.train import checkpoint, universal

    ckpt_dir = Path(args.run) / "checkpoints"
    tag = checkpoint.latest_tag(ckpt_dir) if args.tag == "latest" else args.tag
    if tag is None or not checkpoint.is_complete(ckpt_dir, tag):
        print(f"error: {ckpt_dir / (tag or 'latest')}: no complete checkpoint there", file=sys.stderr)
        return 1
    tag_dir = ckpt_dir / tag
    if not any(tag_dir.glob("*optim_states.pt")):
        print(f"{tag_dir} holds whole optimizer states (ZeRO 0): it loads on any number of ranks as it is")
        return 0
    if universal.universal_dir(tag_dir).is_dir():
        print(f"{universal.universal_dir(tag_dir)} is there already: a resume will load it")
        return 0
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's reports; stdout is the one result line
            seconds = universal.convert(tag_dir, workers=args.workers)
    except universal.ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    parameters = count_parameters(tag_dir)
    per_billion = seconds / parameters * 1e9
    print(f"converted {tag_dir} ({parameters / 1e6:.1f}M parameters, {checkpoint.ranks_that_wrote(ckpt_dir, tag)} "
          f"ranks' partitions) in {seconds:.1f} s with {args.workers} worker{'s' if args.workers > 1 else ''}: "
          f"{per_billion:.0f} s per billion "
          "parameters")
    if args.json:
        Path(args.json).write_text(json.dumps({"tag_dir": str(tag_dir), "parameters": parameters, "seconds": seconds,
                                               "workers": args.workers, "seconds_per_billion": per_billion}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
