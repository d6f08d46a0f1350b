"""Image shards from an ImageFolder directory or a tar of one."""
import io
import json
import os
import tarfile
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from pretrain.data.images import make_image_shards
from pretrain.data.shards import iter_samples

CLASSES = {"cat": 40, "dog": 30, "eel": 20}


@pytest.fixture
def image_folder(tmp_path):
    """train/<class>/ and test/<class>/ of tiny images whose colour encodes their class; the root is returned."""
    root = tmp_path / "folder"
    for split, scale in (("train", 1), ("test", 0.25)):
        for c, (name, count) in enumerate(CLASSES.items()):
            (root / split / name).mkdir(parents=True)
            for i in range(int(count * scale)):
                pixels = np.full((8, 8, 3), 60 * c + i % 7, dtype=np.uint8)
                ext = "png" if i % 3 else "jpg"
                Image.fromarray(pixels).save(root / split / name / f"{i:04d}.{ext}")
    (root / "train" / "README.txt").write_text("not an image")
    return root


def read_shards(directory):
    manifest = json.loads((directory / "manifest.json").read_text())
    samples = [s for f in manifest["files"] for s in iter_samples(str(directory / f["name"]))]
    return manifest, samples


def test_directory_split_to_shards_with_classes_and_counts(image_folder, tmp_path):
    with pytest.raises(ValueError, match="splits test, train: choose one with --split"):
        make_image_shards(str(image_folder), str(tmp_path / "none"))
    with pytest.raises(ValueError, match="no split 'val'"):
        make_image_shards(str(image_folder), str(tmp_path / "none"), split="val")
    make_image_shards(str(image_folder), str(tmp_path / "train"), split="train", images_per_shard=25)
    manifest, samples = read_shards(tmp_path / "train")
    assert manifest["classes"] == ["cat", "dog", "eel"] and manifest["class_counts"] == CLASSES
    assert manifest["images"] == len(samples) == 90 and manifest["shards"] == 4 and manifest["split"] == "train"
    labels = [int(s["cls"]) for s in samples]
    assert Counter(labels) == {0: 40, 1: 30, 2: 20}
    assert labels[:30] != sorted(labels[:30])  # written in a shuffled order
    for sample in samples:
        ext = "png" if "png" in sample else "jpg"
        pixel = np.asarray(Image.open(io.BytesIO(sample[ext])))[0, 0, 0]
        assert abs(int(pixel) // 60 - int(sample["cls"])) == 0


def test_tar_gives_the_same_shards_as_the_directory(image_folder, tmp_path):
    archive = tmp_path / "folder.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for split in ("test", "train"):
            tar.add(image_folder / split, arcname=f"./{split}")
    make_image_shards(str(image_folder), str(tmp_path / "from_dir"), split="test")
    make_image_shards(str(archive), str(tmp_path / "from_tar"), split="test")
    names = sorted(os.listdir(tmp_path / "from_dir"))
    assert names == sorted(os.listdir(tmp_path / "from_tar"))
    for name in names:
        if name.endswith(".tar"):
            assert (tmp_path / "from_dir" / name).read_bytes() == (tmp_path / "from_tar" / name).read_bytes()


def test_broken_image_names_the_file_and_leaves_nothing(image_folder, tmp_path):
    (image_folder / "train" / "dog" / "0007.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(ValueError, match="0007.png cannot be decoded"):
        make_image_shards(str(image_folder), str(tmp_path / "out"), split="train", images_per_shard=10)
    assert os.listdir(tmp_path / "out") == []
    (tmp_path / "bad.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ValueError, match="bad.tar is not a readable tar"):
        make_image_shards(str(tmp_path / "bad.tar"), str(tmp_path / "out"))
