#!/usr/bin/env python
"""Top-1 / top-5 accuracy of a trained vision run on image shards, at any resolution, from any ZeRO stage.

    python tools/eval_cls.py --run runs/vision/cifar10_soft --data data/shards/cifar10/test --json
    python tools/eval_cls.py --run runs/vision/cifar10_soft --data data/shards/cifar10/test --resolution 64

Images are prepared as the trainer's validation prepares them (``pretrain.data.image_loader``, ``train=False``):
the short side resized to ``resolution / augment.eval_crop_ratio``, then a centre crop of ``resolution`` pixels.
The resolution defaults to the run's ``vision.image_size``; any multiple of the backbone's output stride
(``vision.patch_size·8``) works, since the backbone has no fixed-size position table. Scores come from
``pretrain.tasks.vision.score_images``, the trainer's own validation. Reported:
  top1, top5   percent of images whose label is the top prediction / among the top five
  loss         mean cross-entropy (nats, no label smoothing)
  images       images scored; resolution: the square side they were scored at
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from pretrain.cli_help import HelpFormatter


def evaluate(args: argparse.Namespace) -> dict:
    """Load the run's checkpoint, score ``args.data`` at the chosen resolution, and return the figures."""
    import torch
    from tqdm import tqdm

    from pretrain.data.image_loader import ImageLoader
    from pretrain.tasks.vision import score_images
    from pretrain.train.checkpoint import load_trained_model, trained_config

    cfg = trained_config(Path(args.run))  # checked before the weights are read
    if cfg.task != "vision":
        raise ValueError(f"--run {args.run} is a task {cfg.task!r} run; eval_cls scores vision runs "
                         "(tools/eval_ppl.py scores language models)")
    resolution = args.resolution or cfg.vision.image_size
    stride = cfg.vision.patch_size * 8
    if resolution % stride:
        raise ValueError(f"--resolution {resolution} must be a multiple of the backbone's output stride {stride} "
                         f"(vision.patch_size {cfg.vision.patch_size} × 8)")
    model, cfg, checkpoint_path = load_trained_model(Path(args.run), args.tag)
    device = torch.device(args.device)
    model.to(device)
    loader = ImageLoader(args.data, image_size=resolution, batch_size=args.batch_size, train=False,
                         eval_crop_ratio=cfg.augment.eval_crop_ratio, allow_pipe=cfg.data.allow_pipe)
    with tqdm(unit="img", desc=f"scoring at {resolution} px", file=sys.stderr) as bar:
        scores = score_images(model, loader, image_shape=(cfg.vision.in_channels, resolution, resolution),
                              device=device, progress=bar)
    if scores["val/images"] == 0:
        raise ValueError(f"--data {args.data} holds no images")
    return {"top1": scores["val/top1"], "top5": scores["val/top5"], "loss": scores["val/loss"],
            "images": scores["val/images"], "resolution": resolution, "checkpoint": str(checkpoint_path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--run", "--run-dir", dest="run", required=True,
                        help="run directory (holds config.yaml and checkpoints/), or a model directory written by "
                             "tools/export.py")
    parser.add_argument("--tag", default="latest", help="checkpoint tag, e.g. step00000500 (default: latest)")
    parser.add_argument("--data", required=True, help="image shards: a shard directory or a .tar pattern")
    parser.add_argument("--resolution", type=int, help="square side in pixels (default: the run's vision.image_size)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)

    try:
        result = evaluate(args)
    except (OSError, ValueError) as err:  # a missing run, tag or shard; a bad config or resolution
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>10}  {value:.2f}" if isinstance(value, float) else f"{key:>10}  {value}")
        print("(top1 and top5 in percent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
