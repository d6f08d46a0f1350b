#!/usr/bin/env python
"""Throughput of the image data path: images/s of ImageLoader, beside the decoding alone and, optionally, a model.

Reports, side by side in one run, on your image shards (tools/make_shards.py images):
  decode           PIL decoding to RGB of every sample, in this process: the floor of the loader's work
  train, 0 workers ImageLoader(train=True) in process: + random resized crop, flip, batching, normalization
  train, N workers the same through N DataLoader worker processes (each decodes every N-th batch)
  eval, 0 workers  ImageLoader(train=False): resize + center crop
and with --model-config, forward + backward images/s of that config's vision backbone on this machine's CPU at
the same batch size, so the loader/model ratio says whether the loader keeps the model fed (> 1: it does).

Example:
  python tools/bench_images.py --shards /tmp/cifar/train --image-size 32 --workers 2 \\
      --model-config configs/vision/cifar10_linear.yaml
"""
import argparse
import os
import sys
from collections.abc import Callable, Iterable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pretrain.cli_help import HelpFormatter

import benchlib  # tools/, beside this script


def images_per_second(items: Iterable, limit: int, desc: str, count: Callable = len) -> float:
    return benchlib.units_per_second(items, limit, desc, count, unit="img")


def decoded(pattern: str):
    from pretrain.data.augment import decode_rgb
    from pretrain.data.shards import expand_shards, iter_samples

    while True:
        for url in expand_shards(pattern):
            for sample in iter_samples(url):
                yield decode_rgb(sample.get("jpg") or sample.get("png") or sample["jpeg"])


def model_images_per_second(config: str, image_size: int, batch_size: int, steps: int) -> float:
    import torch

    from pretrain.tasks import build_model
    from pretrain.tasks.config_checks import load_run_config

    cfg = load_run_config(config, [f"vision.image_size={image_size}"])
    model = build_model(cfg)
    images = torch.randn(batch_size, cfg.vision.in_channels, image_size, image_size)
    labels = torch.randint(0, cfg.vision.num_classes, (batch_size,))

    def steps_of_training():
        while True:
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            yield images

    return images_per_second(steps_of_training(), steps * batch_size, "model forward+backward")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--data", "--shards", dest="data", required=True, help="image shards: a directory or a pattern")
    parser.add_argument("--images", type=int, default=10_000, help="images per measurement")
    parser.add_argument("--image-size", type=int, default=224, help="output side (training crop, eval crop)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--crop-scale", type=float, nargs=2, default=(0.08, 1.0))
    parser.add_argument("--eval-crop-ratio", type=float, default=0.875)
    parser.add_argument("--workers", type=int, default=2, help="also measure with this many DataLoader workers")
    parser.add_argument("--model-config", default=None, help="a vision config: also time its backbone")
    parser.add_argument("--model-steps", type=int, default=10, help="forward+backward steps to time the model")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); on a shared machine 1 can be far faster")
    args = parser.parse_args()
    if args.torch_threads:
        import torch
        torch.set_num_threads(args.torch_threads)

    from pretrain.data import ImageLoader

    def loader(**options):
        return ImageLoader(args.data, image_size=args.image_size, batch_size=args.batch_size,
                           crop_scale=args.crop_scale, eval_crop_ratio=args.eval_crop_ratio, **options)

    def batch_size(batch):
        return len(batch["labels"])

    rates = {"decode": images_per_second(decoded(args.data), args.images, "decode", lambda _: 1),
             "train, 0 workers": images_per_second(loader(num_workers=0), args.images, "train, 0 workers",
                                                   batch_size)}
    if args.workers:
        rates[f"train, {args.workers} workers"] = images_per_second(
            loader(num_workers=args.workers), args.images, f"train, {args.workers} workers", batch_size)
    rates["eval, 0 workers"] = images_per_second(loader(train=False, epochs=1000), args.images, "eval, 0 workers",
                                                 batch_size)
    if args.model_config:
        rates["model"] = model_images_per_second(args.model_config, args.image_size, args.batch_size,
                                                 args.model_steps)

    print(f"\nshards: {args.data}; image_size={args.image_size} batch_size={args.batch_size} "
          f"crop_scale={tuple(args.crop_scale)} eval_crop_ratio={args.eval_crop_ratio}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, rate in rates.items():
        print(f"  {name:<18} {rate:9.0f} images/s   ({rate / rates['decode']:.2f} x decode)")
    if "model" in rates:
        fastest = max(r for name, r in rates.items() if name.startswith("train"))
        print(f"  loader / model: {fastest / rates['model']:.2f} (the fastest training loader; > 1 keeps it fed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
