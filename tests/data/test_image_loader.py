"""ImageLoader and its transforms: coverage per epoch over ranks, exact resume, seeded crops, clear errors.

The images are flat colours, each its own, so a crop of any size still says which image it came from.
"""
import io
import pickle
import random
import re
import subprocess
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pretrain.data import ImageLoader, ShardError, make_image_shards
from pretrain.data.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    center_crop_box,
    decode_rgb,
    eval_transform,
    random_resized_crop_box,
)
from pretrain.data.shards import ShardWriter, iter_samples, write_manifest

CLASSES = ["ant", "bee", "cow"]
MODES = ["RGB", "L", "RGBA", "RGB"]  # with png, png, png, jpg


@pytest.fixture(scope="module")
def image_set(tmp_path_factory):
    """45 flat images of awkward sizes (RGB png and jpg, grayscale, RGBA) in 7 shards; (directory, {colour: label})."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(45):
        label, mode = i % 3, MODES[i % 4]
        size = (int(rng.integers(9, 40)), int(rng.integers(9, 40)))
        colour = (10 + 5 * i, 240 - 5 * i, (53 * i) % 200 + 20)
        image = Image.new("RGB", size, colour).convert(mode)
        if mode == "RGBA":
            image.putalpha(int(rng.integers(0, 256)))
        folder = root / "folder" / CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i:03d}.{'jpg' if i % 4 == 3 else 'png'}")
    shards = root / "shards"
    make_image_shards(str(root / "folder"), str(shards), images_per_shard=7)
    colours = {}
    for name in sorted(p.name for p in shards.glob("*.tar")):
        for sample in iter_samples(str(shards / name)):
            data = sample.get("png") or sample.get("jpg")
            pixels = np.asarray(decode_rgb(data), dtype=np.float64).reshape(-1, 3)
            assert np.ptp(pixels, axis=0).max() <= 2  # flat, also after jpeg
            colours[tuple(pixels.mean(0))] = int(sample["cls"])
    palette = np.array(list(colours))
    gaps = np.linalg.norm(palette[:, None] - palette[None], axis=-1) + 1e3 * np.eye(len(palette))
    assert len(colours) == 45 and gaps.min() > 6  # every image tells itself apart
    return str(shards), colours


def take(loader, n):
    return list(islice(iter(loader), n))


def identify(batches, colours) -> list[tuple]:
    """The colour (one per source image) of every image in the batches, checked against its label."""
    palette = np.array(list(colours))
    found = []
    for batch in batches:
        pixels = batch["images"] * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        pixels = pixels.flatten(2).double().numpy() * 255
        assert np.ptp(pixels, axis=2).max() < 3  # a crop of one flat image
        for mean, label in zip(pixels.mean(2), batch["labels"].tolist()):
            distance = np.linalg.norm(palette - mean, axis=1)
            assert distance.min() < 2
            colour = tuple(palette[distance.argmin()])
            assert colours[colour] == label
            found.append(colour)
    return found


def test_batches_are_normalized_rgb_float_images_and_long_labels(image_set):
    directory, colours = image_set
    loader = ImageLoader(directory, image_size=16, batch_size=5, num_workers=0)
    assert loader.classes == CLASSES and loader.num_classes == 3
    for batch in take(loader, 3):
        assert batch["images"].dtype == torch.float32 and batch["images"].shape == (5, 3, 16, 16)
        assert batch["images"].is_contiguous()
        assert batch["labels"].dtype == torch.long and batch["labels"].shape == (5,)
    identify(take(loader, 9), colours)  # also: grayscale and RGBA became RGB of the right colour


def test_white_and_black_are_normalized_by_the_imagenet_mean_and_std(tmp_path):
    write_shard_set(tmp_path / "bw", [("white", {"png": png((255, 255, 255)), "cls": b"0"}),
                                      ("black", {"png": png((0, 0, 0)), "cls": b"1"})])
    (batch,) = list(ImageLoader(str(tmp_path / "bw"), image_size=8, batch_size=2, train=False))
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    assert torch.allclose(batch["images"][0], ((1 - mean) / std).expand(3, 8, 8), atol=1e-5)
    assert torch.allclose(batch["images"][1], (-mean / std).expand(3, 8, 8), atol=1e-5)


def test_evaluation_reads_every_image_once_over_two_ranks_in_the_reference_transform(image_set):
    directory, colours = image_set
    seen, counts = [], []
    for rank, workers in ((0, 2), (1, 0)):
        loader = ImageLoader(directory, image_size=12, batch_size=4, rank=rank, world_size=2, train=False,
                             num_workers=workers)
        batches = list(loader)
        assert all(len(b["labels"]) == 4 for b in batches[:-1]) and 1 <= len(batches[-1]["labels"]) <= 4
        assert loader.epoch == 1
        again = list(loader)  # each iteration of an evaluation loader is a whole pass
        assert all(torch.equal(a["images"], b["images"]) for a, b in zip(again, batches, strict=True))
        seen += identify(batches, colours)
        counts.append(sum(len(b["labels"]) for b in batches))
    assert Counter(seen) == Counter(colours.keys()) and abs(counts[0] - counts[1]) <= 1
    # the images are the reference transform of the shards' images, in shard order, round-robin over ranks
    reference = ImageLoader(directory, image_size=12, batch_size=45, train=False, eval_crop_ratio=0.875)
    (batch,) = list(reference)
    samples = [s for url in reference.epoch_shards(0) for s in iter_samples(url)]
    expected = np.stack([eval_transform(s.get("png") or s.get("jpg"), 12, 0.875) for s in samples])
    assert torch.allclose(batch["images"], _normalized(expected), atol=1e-5)
    assert batch["labels"].tolist() == [int(s["cls"]) for s in samples]


def _normalized(pixels: np.ndarray) -> torch.Tensor:
    """The normalization written out: channels first, scaled to [0, 1], standardized per channel."""
    x = torch.from_numpy(pixels).double().permute(0, 3, 1, 2) / 255
    return ((x - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)).float()


def test_training_epoch_covers_each_ranks_shards_once(image_set):
    directory, colours = image_set
    seen = []
    for rank in range(2):
        loader = ImageLoader(directory, image_size=8, batch_size=4, rank=rank, world_size=2, seed=3)
        batches = []
        while loader.epoch == 0:
            batches += take(loader, 1)
        share = sum(1 for url in loader.epoch_shards(0) for _ in iter_samples(url))
        found = identify(batches, colours)
        assert len(found) >= share and len(set(found[:share])) == share
        seen += found[:share]
    assert Counter(seen) == Counter(colours.keys())


@pytest.mark.parametrize("workers_before,workers_after,stop", [(0, 1, 3), (1, 0, 7), (0, 0, 9)])
def test_resume_continues_with_the_same_images_and_crops(image_set, workers_before, workers_after, stop):
    directory, _ = image_set
    settings = dict(image_size=8, batch_size=5, rank=1, world_size=2, seed=7)
    reference_loader = ImageLoader(directory, **settings)
    reference = take(reference_loader, 12)
    assert reference_loader.epoch >= 2  # 12 batches cross epoch boundaries (about 24 images a rank)

    first = ImageLoader(directory, num_workers=workers_before, **settings)
    head = take(first, stop)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = ImageLoader(directory, num_workers=workers_after, **settings)
    resumed.load_state_dict(state)
    tail = take(resumed, 12 - stop)
    for got, want in zip(head + tail, reference, strict=True):
        assert torch.equal(got["images"], want["images"]) and torch.equal(got["labels"], want["labels"])
    assert resumed.state_dict() == reference_loader.state_dict()
    with pytest.raises(ValueError, match="'seed'"):
        ImageLoader(directory, **(settings | {"seed": 8})).load_state_dict(state)


def test_crops_and_flips_follow_the_seed(tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    write_shard_set(tmp_path / "one", [("noise", {"png": png_of(noise), "cls": b"0"})])

    def crops(seed, **options):  # one image, so every image of the stream is a crop of it
        options = {"image_size": 8} | options
        return next(iter(ImageLoader(str(tmp_path / "one"), batch_size=12, seed=seed, **options)))

    first = crops(0)["images"]
    assert torch.equal(first, crops(0)["images"])
    assert not torch.equal(first, crops(1)["images"])
    assert len({x.sum().item() for x in first}) == 12  # each epoch its own crop
    whole = crops(0, crop_scale=(1.0, 1.0), image_size=24)["images"]  # square: the whole image
    flipped = [torch.equal(x, whole[0].flip(-1)) for x in whole]
    assert 0 < sum(flipped) < 12 and all(f or torch.equal(x, whole[0]) for f, x in zip(flipped, whole))
    assert all(torch.equal(x, whole[0]) for x in crops(3, crop_scale=(1.0, 1.0), image_size=24, hflip=False)["images"])


def test_random_resized_crop_box_keeps_scale_and_aspect_ratio():
    def fallback(width, height):  # no draw fit: the center of the whole image cut to the nearest allowed ratio
        w, h = width, height
        if width / height < 3 / 4:
            h = round(width * 4 / 3)
        elif width / height > 4 / 3:
            w = round(height * 4 / 3)
        return (width - w) // 2, (height - h) // 2, (width - w) // 2 + w, (height - h) // 2 + h

    rng = random.Random(0)
    drawn = 0
    for _ in range(300):
        width, height = rng.randint(1, 300), rng.randint(1, 300)
        scale = sorted((rng.uniform(0.05, 1), rng.uniform(0.05, 1)))
        box = random_resized_crop_box(width, height, rng, scale)
        left, top, right, bottom = box
        w, h = right - left, bottom - top
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        if box != fallback(width, height) and min(w, h) > 20:  # w and h are rounded: 2.5% each at most
            assert scale[0] / 1.06 <= w * h / (width * height) <= scale[1] * 1.06
            assert 3 / 4 / 1.03 <= w / h <= 4 / 3 * 1.03
            drawn += 1
    assert drawn > 100
    assert random_resized_crop_box(400, 30, rng, (0.9, 1.0)) == fallback(400, 30) == (180, 0, 220, 30)
    assert random_resized_crop_box(30, 30, rng, (1.0, 1.0)) == (0, 0, 30, 30)


@pytest.mark.parametrize("width,height,size,ratio", [(37, 23, 16, 0.875), (64, 64, 32, 0.875), (100, 41, 24, 1.0),
                                                     (25, 90, 25, 1.0)])
def test_eval_transform_is_resize_short_side_then_center_crop(width, height, size, ratio):
    rng = np.random.default_rng(width)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    short = round(size / ratio)
    factor = short / min(width, height)
    resized = image.resize((round(width * factor), round(height * factor)), Image.Resampling.BILINEAR)
    left, top = round((resized.width - size) / 2), round((resized.height - size) / 2)
    expected = np.asarray(resized.crop((left, top, left + size, top + size)), dtype=np.int16)
    got = eval_transform(png_of(np.asarray(image)), size, ratio).astype(np.int16)
    assert got.shape == (size, size, 3)
    # one resampling with a fractional box vs. resize-then-crop: the float positions differ in the last bits, which
    # can flip PIL's fixed-point rounding by one level; any shift of the sampling grid would cost tens on noise
    assert np.abs(got - expected).max() <= 1
    assert center_crop_box(width, height, size, ratio)[0] >= 0


def write_shard_set(directory, samples, classes=CLASSES):
    """Image shards written by hand, 2 samples a shard: for samples make_image_shards would refuse."""
    directory.mkdir()
    writer = ShardWriter(str(directory), samples_per_shard=2)
    for key, members in samples:
        writer.add(key, members)
    files = writer.close()
    write_manifest(str(directory), {"classes": classes, "shards": len(files), "files": files})


def png_of(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png(colour=(1, 2, 3)) -> bytes:
    return png_of(np.full((6, 6, 3), colour, dtype=np.uint8))


def test_corrupt_image_and_bad_class_name_shard_and_key(tmp_path):
    good = [(f"good{i}", {"png": png(), "cls": b"1"}) for i in range(4)]
    write_shard_set(tmp_path / "broken", good + [("bad", {"png": b"\x89PNG\r\n\x1a\n garbage", "cls": b"0"})])
    with pytest.raises(ShardError, match=r"shard-000002.tar sample bad: the image cannot be decoded"):
        list(ImageLoader(str(tmp_path / "broken"), image_size=4, batch_size=2, train=False))
    for name, cls, message in (("word", b"two", "'two' is not a decimal class index"),
                               ("big", b"3", "3 is outside the manifest's 3 classes"),
                               ("none", None, "has no .cls member")):
        members = {"png": png()} | ({"cls": cls} if cls else {})
        write_shard_set(tmp_path / name, [("k0", {"png": png(), "cls": b"0"}), (f"odd_{name}", members)] + good)
        with pytest.raises(ShardError, match=rf"shard-000000.tar sample odd_{name}.*{message}"):
            take(ImageLoader(str(tmp_path / name), image_size=4, batch_size=2), 1)
    loader = ImageLoader(str(tmp_path / "word"), image_size=4, batch_size=2, skip_corrupt=True, epochs=1)
    assert len(list(loader)) == 2 and loader.skipped_shards == 1  # the shard with the bad .cls is left out whole


def test_text_shards_and_bad_arguments_are_refused_naming_them(numbered_shards, image_set):
    directory, _ = numbered_shards
    with pytest.raises(ShardError, match="manifest.json lists no 'classes'.*holds no image shards"):
        ImageLoader(directory, image_size=8, batch_size=2)
    images, _ = image_set
    for key, value in (("image_size", 0), ("batch_size", 0), ("crop_scale", (0.5, 0.2)), ("eval_crop_ratio", 1.5),
                       ("rank", 2), ("epochs", 0)):
        with pytest.raises(ValueError, match=key):
            ImageLoader(images, **{"image_size": 8, "batch_size": 2, "world_size": 2, key: value})
    with pytest.raises(ShardError, match="fewer than world_size=8"):
        ImageLoader(images, image_size=8, batch_size=2, rank=0, world_size=8)


@pytest.mark.dist
def test_bench_images_reports_each_path_side_by_side(image_set):
    directory, _ = image_set
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_images.py"
    done = subprocess.run([sys.executable, str(tool), "--shards", directory, "--images", "30", "--image-size", "8",
                           "--batch-size", "4", "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for path in ("decode", "train, 0 workers", "train, 1 workers", "eval, 0 workers"):
        assert re.search(rf"{path} +\d+ images/s", done.stdout), (path, done.stdout)


@pytest.mark.parametrize("mode,fmt", [("L", "PNG"), ("LA", "PNG"), ("RGBA", "PNG"), ("P", "PNG"), ("CMYK", "JPEG")])
def test_every_image_mode_decodes_to_rgb(mode, fmt):
    colour = (200, 120, 40)
    image = Image.new("RGB", (9, 7), colour)
    expected = np.asarray(image.convert(mode).convert("RGB"))
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, format=fmt)
    decoded = decode_rgb(buffer.getvalue())
    assert decoded.mode == "RGB" and decoded.size == (9, 7)
    assert np.abs(np.asarray(decoded, dtype=np.int16) - expected).max() <= 2  # jpeg: a little noise
    if mode in ("L", "LA"):
        assert np.ptp(np.asarray(decoded), axis=2).max() == 0  # gray: equal channels
