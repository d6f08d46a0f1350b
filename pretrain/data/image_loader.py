"""Batches of decoded, augmented images and their class labels from image shards; resumable exactly.

The shards are ``pretrain.data.images``' (``KEY.jpg|png`` + ``KEY.cls``, ``manifest.json`` with ``classes``). The rank
split, shuffle windows, workers and resume are ``pretrain.data.stream``'s; a sample is one image's bytes and label,
and ``batch_size`` consecutive samples of the stream make a batch (across window and epoch boundaries).

Training (``train=True``): shards split whole among ranks, shuffled in windows of at least ``SHUFFLE_WINDOW``
images (one default-sized shard: a worker holds one window of encoded images in memory), forever or for ``epochs``
(the images that do not fill a last batch are dropped). Each image gets a random resized crop and a flip from an rng
seeded by (seed, epoch, rank, its position in the stream), so a resumed run, or one with another ``num_workers``,
sees the same crops. Decoding, the costly part, is shared among workers: each decodes only its own batches.

Evaluation (``train=False``): every rank reads every shard in order and takes images round-robin: image i of the
s-th shard goes to rank (i + s) mod world_size, so every image is read once over the ranks, in any number of shards.
Each iteration is one pass from the start (``epochs`` passes if given), as a DataLoader's, so a validation loop can
reuse the loader; the last batch may be short, and ranks may yield different counts.

The cursor is the ``Position`` ``(epoch, shard, index)`` of the next image. A malformed sample (no image, a missing
or bad ``.cls``) makes its shard corrupt (``ShardError`` naming shard and key, or skipped with ``skip_corrupt``);
an image that does not decode raises ``ShardError`` naming shard and key always, since it is only found in the
worker that decodes its batch.
"""
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pretrain.data.augment import eval_transform, normalize, train_transform
from pretrain.data.images import IMAGE_EXTENSIONS
from pretrain.data.shards import (
    ShardError,
    expand_shards,
    is_streamed,
    iter_samples,
    load_manifest,
    recorded_checksums,
)
from pretrain.data.stream import Position, ShardStream, Skips, StreamLoader, check_at_least, check_split

SHUFFLE_WINDOW = 5000  # images: one shard of make_image_shards' default size
IMAGE_MEMBERS = tuple(suffix.lstrip(".") for suffix in IMAGE_EXTENSIONS)  # read: what we write, and .jpeg


class _Sample(NamedTuple):
    data: bytes  # the encoded image
    label: int
    where: str  # "shard-path sample KEY", for error messages


@dataclass(frozen=True)
class _ImageStream(ShardStream):
    num_classes: int
    image_size: int
    batch_size: int
    crop_scale: tuple[float, float]
    hflip: bool
    eval_crop_ratio: float
    sample_noun = "image"

    @property
    def train(self) -> bool:
        return self.shuffle  # training shuffles; evaluation reads in shard order

    def epoch_shards(self, epoch: int) -> list[str]:
        return super().epoch_shards(epoch) if self.train else list(self.urls)

    def read_shard(self, url: str) -> list[_Sample]:
        samples = []
        for sample in iter_samples(url, self.checksums.get(url)):
            where = f"shard {url} sample {sample['__key__']}"
            data = next((sample[ext] for ext in IMAGE_MEMBERS if ext in sample), None)
            if data is None:
                raise ShardError(f"{where} has no {'/'.join(IMAGE_MEMBERS)} member (not an image shard?)")
            if "cls" not in sample:
                raise ShardError(f"{where} has no .cls member (its class index)")
            try:
                label = int(sample["cls"])
            except ValueError:
                raise ShardError(f"{where}: .cls {sample['cls'][:20]!r} is not a decimal class index") from None
            if not 0 <= label < self.num_classes:
                raise ShardError(f"{where}: .cls {label} is outside the manifest's {self.num_classes} classes")
            samples.append(_Sample(data, label, where))
        return samples

    def batches(self, start: Position, worker: int = 0, num_workers: int = 1) -> Iterator[tuple[tuple, tuple, int]]:
        batch, k, skips = [], 0, Skips(log=worker == 0)
        for sample, at in self.samples(start, skips):
            if not self.train and (at.shard + at.index) % self.world_size != self.rank:
                continue
            if len(batch) == self.batch_size:
                if k % num_workers == worker:
                    yield self._assemble(batch), tuple(at), skips.count
                batch, k = [], k + 1
            batch.append((sample, at))
        if batch and (len(batch) == self.batch_size or not self.train) and k % num_workers == worker:
            yield self._assemble(batch), (self.epochs, 0, 0), skips.count  # the end of a finite stream

    def _assemble(self, batch: list[tuple[_Sample, Position]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized ``float32 [B, 3, S, S]`` images and ``long [B]`` labels. Normalizing here shares it among the
        workers; torch tensors, unlike numpy arrays, pass from a worker through shared memory, without a copy."""
        images = normalize(np.stack([self._transform(sample, at) for sample, at in batch]))
        labels = np.array([sample.label for sample, _ in batch], dtype=np.int64)
        return torch.from_numpy(images), torch.from_numpy(labels)

    def _transform(self, sample: _Sample, at: Position) -> np.ndarray:
        try:
            if self.train:
                rng = random.Random(f"{self.seed}:{at.epoch}:{self.rank}:{at.shard}:{at.index}")
                return train_transform(sample.data, self.image_size, rng, self.crop_scale, self.hflip)
            return eval_transform(sample.data, self.image_size, self.eval_crop_ratio)
        except Exception as err:  # PIL raises many kinds for a broken image
            raise ShardError(f"{sample.where}: the image cannot be decoded ({type(err).__name__}: {err})") from err


def image_classes(urls: list[str]) -> list[str]:
    """The class names of image shards, from the ``manifest.json`` of their directories (which must agree)."""
    classes, source = None, None
    for directory in sorted({os.path.dirname(u) or "." for u in urls if not is_streamed(u)}):
        manifest = load_manifest(directory)
        path = os.path.join(directory, "manifest.json")
        found = manifest.get("classes")
        if not isinstance(found, list) or not found:
            raise ShardError(f"{path} lists no 'classes': {directory!r} holds no image shards "
                             "(write them with tools/make_shards.py images)")
        if classes is not None and found != classes:
            raise ShardError(f"{path} lists other classes than {source}: the shards belong to different sets")
        classes, source = found, path
    if classes is None:
        raise ShardError("image shards need their manifest.json for the class names; no local shard was given")
    return classes


class ImageLoader(StreamLoader):
    """Iterates dicts of ``images`` (``float32 [B, 3, S, S]``, ImageNet-normalized) and ``labels`` (``long [B]``)."""

    def __init__(self, pattern: str, *, image_size: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, num_workers: int = 0, train: bool = True, crop_scale=(0.08, 1.0), hflip: bool = True,
                 eval_crop_ratio: float = 0.875, epochs: int | None = None, allow_pipe: bool = False,
                 skip_corrupt: bool = False):
        check_at_least(image_size=(image_size, 1), batch_size=(batch_size, 1), world_size=(world_size, 1),
                       num_workers=(num_workers, 0))
        check_split(rank, world_size, epochs)
        crop_scale = tuple(float(s) for s in crop_scale)
        if len(crop_scale) != 2 or not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ValueError(f"crop_scale={crop_scale!r}: expected (low, high) with 0 < low <= high <= 1")
        if not 0 < eval_crop_ratio <= 1:
            raise ValueError(f"eval_crop_ratio={eval_crop_ratio!r}: expected 0 < ratio <= 1")
        urls = expand_shards(pattern, allow_pipe=allow_pipe)
        if train and len(urls) < world_size:
            raise ShardError(f"shard pattern {pattern!r} names {len(urls)} shards, fewer than world_size={world_size}:"
                             " in training every rank needs at least one")
        self.classes: list[str] = image_classes(urls)
        self.num_classes = len(self.classes)
        super().__init__(num_workers)
        self._stream = _ImageStream(
            tuple(urls), recorded_checksums(urls), rank, world_size, seed, shuffle=train,
            shuffle_buffer=SHUFFLE_WINDOW, epochs=epochs if train else epochs or 1, skip_corrupt=skip_corrupt,
            num_classes=self.num_classes, image_size=image_size, batch_size=batch_size,
            crop_scale=crop_scale, hflip=hflip, eval_crop_ratio=float(eval_crop_ratio))
        self._cursor = Position(0, 0, 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if not self._stream.train:
            self._cursor = Position(0, 0, 0)  # evaluation: each iteration is a whole pass, as a DataLoader's
        for images, labels in self._produce():
            yield {"images": images, "labels": labels}
