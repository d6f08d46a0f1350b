"""Image transforms for classification, on PIL and numpy: decode, random resized crop + flip, resize + center crop.

Each transform ends in one ``Image.resize`` with a ``box``: cropping and scaling in one resampling step costs less
than resizing the whole image and cropping after, and it is the same map from output to input pixels. Outputs are
``uint8`` ``[S, S, 3]`` arrays; ``normalize`` makes the float batch of them.

Random resized crop (Szegedy et al., "Going deeper with convolutions", 2015): a crop of a random fraction of the
area (``scale``) and a random aspect ratio (log-uniform in ``ratio``) at a random place; up to 10 draws, then the
whole image cut to the nearest allowed aspect ratio.
"""
import io
import math
import random

import numpy as np
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ASPECT_RATIO = (3 / 4, 4 / 3)
_RESAMPLE = Image.Resampling.BILINEAR
_MEAN = np.array(IMAGENET_MEAN, dtype=np.float32).reshape(1, 3, 1, 1) * 255
_INV_STD = 1 / (np.array(IMAGENET_STD, dtype=np.float32).reshape(1, 3, 1, 1) * 255)


def decode_rgb(data: bytes) -> Image.Image:
    """The image in ``data``, as RGB (grayscale is repeated, alpha and palettes are dropped); raises on bad bytes."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def random_resized_crop_box(width: int, height: int, rng: random.Random, scale: tuple[float, float],
                            ratio: tuple[float, float] = ASPECT_RATIO) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a crop covering a fraction in ``scale`` of the area, aspect ratio in ``ratio``."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    aspect = width / height
    w, h = width, height
    if aspect < ratio[0]:
        h = round(width / ratio[0])
    elif aspect > ratio[1]:
        w = round(height * ratio[1])
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def center_crop_box(width: int, height: int, size: int, crop_ratio: float) -> tuple[float, float, float, float]:
    """The box of the input that "resize the short side to ``size / crop_ratio``, then take the center ``size`` ×
    ``size``" keeps, in input pixels (fractional: the crop lies on the resized image's pixel grid)."""
    short = round(size / crop_ratio)
    factor = short / min(width, height)
    resized_w, resized_h = round(width * factor), round(height * factor)  # both >= size, as crop_ratio <= 1
    left, top = round((resized_w - size) / 2), round((resized_h - size) / 2)
    fx, fy = resized_w / width, resized_h / height
    return left / fx, top / fy, (left + size) / fx, (top + size) / fy


def train_transform(data: bytes, size: int, rng: random.Random, scale: tuple[float, float], hflip: bool) -> np.ndarray:
    image = decode_rgb(data)
    box = random_resized_crop_box(image.width, image.height, rng, scale)
    pixels = np.asarray(image.resize((size, size), _RESAMPLE, box=box))
    if hflip and rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    return pixels


def eval_transform(data: bytes, size: int, crop_ratio: float) -> np.ndarray:
    image = decode_rgb(data)
    box = center_crop_box(image.width, image.height, size, crop_ratio)
    return np.asarray(image.resize((size, size), _RESAMPLE, box=box))


def normalize(images: np.ndarray) -> np.ndarray:
    """``uint8 [B, H, W, 3]`` → ``float32 [B, 3, H, W]``, standardized by the ImageNet mean and std.

    numpy, not torch: in a DataLoader worker it runs beside the decoding, and in a training process torch's thread
    pool, busy with the model, made these few element-wise passes up to a hundred times slower."""
    out = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32)
    out -= _MEAN
    out *= _INV_STD
    return out
