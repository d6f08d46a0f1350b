"""Image shards from an ImageFolder layout (a folder per class), given as a directory or a tar of one.

Layout: every image's parent folder names its class; the folder above it, if any, names its split
(``train/<class>/x.jpg``). With several splits, ``split`` picks one; a single split is taken as is.
Classes are numbered in sorted order of their names (torchvision's ImageFolder convention).

Sample format: ``KEY.jpg`` or ``KEY.png`` (the file's bytes, unchanged) and ``KEY.cls`` (the class index as
decimal text). Images are written in a seeded random order (sharded data is read shard by shard, so a class per
shard would defeat shuffling at training time). ``manifest.json`` holds ``shards``, ``images``, ``classes``
(names, index order), ``class_counts``, ``split`` and ``files``.

A directory is read lazily; a tar is read into memory once (fine for CIFAR-scale sets; extract larger ones).
"""
import io
import os
import random
from collections import Counter
from collections.abc import Callable

from PIL import Image
from tqdm import tqdm

from pretrain.data.shards import ShardError, ShardWriter, fresh_output_dir, iter_members, write_manifest

IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png"}  # file suffix → the shard member written


def _image_entries(names: list[str]) -> list[tuple[str | None, str, str]]:
    """(split, class, name) of every image name; other files are ignored."""
    entries = []
    for name in names:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if len(parts) >= 2 and os.path.splitext(parts[-1])[1].lower() in IMAGE_EXTENSIONS:
            entries.append((parts[-3] if len(parts) >= 3 else None, parts[-2], name))
    return entries


def _choose_split(entries, split: str | None, source: str):
    splits = sorted({s for s, _, _ in entries if s is not None})
    if not entries:
        raise ValueError(f"{source}: no .jpg/.jpeg/.png images in a class folder")
    if split is None:
        if len(splits) > 1:
            raise ValueError(f"{source} holds the splits {', '.join(splits)}: choose one with --split")
        return entries, splits[0] if splits else None
    chosen = [e for e in entries if e[0] == split]
    if not chosen:
        raise ValueError(f"{source}: no split {split!r}; it holds {', '.join(splits) or 'no split folders'}")
    return chosen, split


def make_image_shards(source: str, out_dir: str, *, split: str | None = None, images_per_shard: int = 5000,
                      seed: int = 0, progress: bool = False) -> dict:
    """Shard the images of ``source`` (directory or tar, optionally gzipped) into ``out_dir``; returns the manifest."""
    if os.path.isdir(source):
        names = [os.path.relpath(os.path.join(d, f), source) for d, _, files in os.walk(source) for f in files]

        def read(name: str) -> bytes:
            with open(os.path.join(source, name), "rb") as f:
                return f.read()
    elif os.path.isfile(source):
        try:
            blobs = dict(iter_members(source))
        except ShardError as err:
            raise ValueError(f"{source} is not a readable tar ({err})") from None
        names, read = list(blobs), blobs.__getitem__
    else:
        raise FileNotFoundError(f"image input {source!r} does not exist")
    entries, split = _choose_split(_image_entries(names), split, source)
    classes = sorted({c for _, c, _ in entries})
    entries.sort(key=lambda e: (e[1], e[2]))
    random.Random(seed).shuffle(entries)
    with fresh_output_dir(out_dir):
        manifest = _write(entries, read, classes, out_dir, images_per_shard, progress)
        manifest.update(split=split, source=os.path.basename(os.path.normpath(source)))
        write_manifest(out_dir, manifest)
    return manifest


def _write(entries, read: Callable[[str], bytes], classes: list[str], out_dir: str, images_per_shard: int,
           progress: bool) -> dict:
    index = {c: i for i, c in enumerate(classes)}
    writer = ShardWriter(out_dir, samples_per_shard=images_per_shard)
    for i, (_, cls, name) in enumerate(tqdm(entries, desc="sharding", unit="img", disable=not progress)):
        data = read(name)
        try:
            Image.open(io.BytesIO(data)).verify()
        except Exception as err:  # PIL raises many kinds for a broken file
            raise ValueError(f"image {name} cannot be decoded ({err})") from None
        writer.add(f"{i:08d}", {IMAGE_EXTENSIONS[os.path.splitext(name)[1].lower()]: data,
                                "cls": str(index[cls]).encode()})
    files = writer.close()
    counts = Counter(cls for _, cls, _ in entries)
    return {"format": "pretrain-image-shards-v1", "shards": len(files), "images": len(entries),
            "classes": classes, "class_counts": {c: counts[c] for c in classes}, "files": files}
