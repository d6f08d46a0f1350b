"""Image classification: augmented image batches, (mixed, smoothed) soft-target cross-entropy, top-1/top-5.

Mixup (Zhang et al. 2018) blends each image with another of the batch, ``λ·x + (1−λ)·x[perm]``, and its targets
alike; CutMix (Yun et al. 2019) pastes a box of area ``(1−λ)·H·W`` from the other image and mixes the targets by
the box's actual share. ``λ ~ Beta(α, α)``; with both on, each batch uses one of the two at random. Label
smoothing (Szegedy et al. 2016) puts ``1 − ε + ε/K`` on the true class and ``ε/K`` on every other. The mixing
draws come from this rank's own seeded generator, saved with the data stream, so a resumed run mixes the same way.

``score_images`` is the one definition of validation figures, shared by the trainer and ``tools/eval_cls.py``.
"""
from itertools import islice

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig

from pretrain.config import ConfigError
from pretrain.distributed.lockstep import until_every_rank_is_done

from . import build_model, verify_training_shards


def smoothed_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """``[B, K]`` fp32 target distributions: one-hot with ``smoothing`` of the mass spread over all K classes."""
    return F.one_hot(labels, num_classes).float() * (1 - smoothing) + smoothing / num_classes


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of a box of about ``(1−λ)`` of the image, centred uniformly, clipped."""
    cut = np.sqrt(1 - lam)
    box_h, box_w = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    return (max(cy - box_h // 2, 0), min(cy + box_h // 2, height),
            max(cx - box_w // 2, 0), min(cx + box_w // 2, width))


def mix_batch(images: torch.Tensor, targets: torch.Tensor, *, mixup_alpha: float, cutmix_alpha: float,
              rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or CutMix of a batch with a permutation of itself; unchanged when both alphas are 0."""
    modes = [m for m, alpha in (("mixup", mixup_alpha), ("cutmix", cutmix_alpha)) if alpha > 0]
    if not modes:
        return images, targets
    mode = modes[int(rng.integers(len(modes)))]
    lam = float(rng.beta(*(2 * [mixup_alpha if mode == "mixup" else cutmix_alpha])))
    perm = torch.from_numpy(rng.permutation(images.shape[0])).to(images.device)
    if mode == "mixup":
        images = lam * images + (1 - lam) * images[perm]
    else:
        height, width = images.shape[-2:]
        top, bottom, left, right = cutmix_box(height, width, lam, rng)
        images = images.clone()
        images[..., top:bottom, left:right] = images[perm][..., top:bottom, left:right]
        lam = 1 - (bottom - top) * (right - left) / (height * width)
    return images, lam * targets + (1 - lam) * targets[perm]


def soft_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ over the batch of −Σ_k target_k · log softmax(logits)_k, in fp32."""
    return -(targets * F.log_softmax(logits.float(), dim=-1)).sum()


class VisionTask:
    unit = "images"

    def __init__(self, cfg: DictConfig, world):
        from pretrain.data.image_loader import ImageLoader

        self.cfg, self.world = cfg, world
        v, a, d = cfg.vision, cfg.augment, cfg.data
        try:
            self.loader = ImageLoader(d.train_shards, image_size=v.image_size, batch_size=cfg.train.micro_batch_size,
                                      rank=world.rank, world_size=world.world_size, seed=cfg.run.seed,
                                      num_workers=d.num_workers, train=True, crop_scale=tuple(a.crop_scale),
                                      hflip=a.hflip, allow_pipe=d.allow_pipe, skip_corrupt=d.skip_corrupt)
        except (OSError, ValueError) as err:
            raise ConfigError("data.train_shards", str(err)) from None
        if d.verify_shards:
            verify_training_shards(self.loader.shard_urls, world)
        self.val_loader = None
        if d.val_shards:
            try:
                self.val_loader = ImageLoader(d.val_shards, image_size=v.image_size,
                                              batch_size=cfg.train.micro_batch_size, rank=world.rank,
                                              world_size=world.world_size, train=False,
                                              eval_crop_ratio=a.eval_crop_ratio, allow_pipe=d.allow_pipe)
            except (OSError, ValueError) as err:
                raise ConfigError("data.val_shards", str(err)) from None
        self.mixing = np.random.default_rng([cfg.run.seed, world.rank])
        self.units_per_micro_batch = cfg.train.micro_batch_size

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def has_validation(self) -> bool:
        return self.val_loader is not None

    def train_metrics(self) -> dict[str, float]:
        """Corrupt shards left out so far (``data.skip_corrupt``), over all ranks: each reads shards of its own."""
        skipped = torch.tensor(float(self.loader.skipped_shards), device=self.world.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(skipped)
        return {"train/skipped_shards": skipped.item()}

    def build_model(self):
        return build_model(self.cfg)

    def train_flops_per_unit(self, model) -> float:
        size = self.cfg.vision.image_size
        return 3 * model.flops_per_image(size, size)

    def batches(self):
        return iter(self.loader)

    def loss(self, model, batch, device):
        a = self.cfg.augment
        images, labels = batch["images"].to(device), batch["labels"].to(device)
        targets = smoothed_targets(labels, self.cfg.vision.num_classes, a.label_smoothing)
        images, targets = mix_batch(images, targets, mixup_alpha=a.mixup_alpha, cutmix_alpha=a.cutmix_alpha,
                                    rng=self.mixing)
        return soft_cross_entropy_sum(model(images), targets), len(labels)

    def validate(self, model, device) -> dict[str, float]:
        size = self.cfg.vision.image_size
        return score_images(model, self.val_loader, image_shape=(self.cfg.vision.in_channels, size, size),
                            device=device, max_batches=self.cfg.log.val_batches)

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "mixing": self.mixing.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.mixing.bit_generator.state = state["mixing"]


@torch.no_grad()
def score_images(model, batches, *, image_shape: tuple[int, int, int], device: torch.device,
                 max_batches: int | None = None, progress=None) -> dict[str, float]:
    """``val/loss`` (mean cross-entropy, no smoothing), ``val/top1``, ``val/top5`` (percent) and ``val/images``
    over ``batches`` (at most ``max_batches`` of them on this rank).

    Under a process group every rank passes its own share and gets the totals over all ranks; a rank out of batches
    runs a blank image whose scores are dropped, since a ZeRO-3 forward is a collective call.
    """
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # nll, top-1 hits, top-5 hits, images
    for batch in until_every_rank_is_done(islice(batches, max_batches), device):
        if batch is None:
            model(torch.zeros(1, *image_shape, device=device))
            continue
        labels = batch["labels"].to(device)
        logits = model(batch["images"].to(device)).float()
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        hits = top == labels[:, None]
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                               hits[:, 0].sum().double(), hits.any(-1).sum().double(),
                               torch.tensor(len(labels), dtype=torch.float64, device=device)])
        if progress is not None:
            progress.update(len(labels))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    nll, top1, top5, images = totals.tolist()
    images = max(images, 1)  # an empty set scores 0, not a division error
    return {"val/loss": nll / images, "val/top1": 100 * top1 / images, "val/top5": 100 * top5 / images,
            "val/images": int(totals[3].item())}
