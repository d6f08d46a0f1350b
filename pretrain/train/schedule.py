"""Learning rate as a pure function of the optimizer step, so a resumed run needs only the step to continue it."""
import math


def lr_at(step: int, *, lr: float, min_lr: float, name: str, warmup_steps: int, decay_steps: int,
          max_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    - ``cosine``: linear warmup to ``lr``, then a half cosine down to ``min_lr`` at ``max_steps``.
    - ``wsd`` (warmup-stable-decay): warmup, ``lr`` held, then a linear decay to ``min_lr`` over the final
      ``decay_steps`` steps.
    - ``constant``: warmup, then ``lr``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if name == "constant":
        return lr
    if name == "cosine":
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if name == "wsd":
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
        return lr + (min_lr - lr) * progress
    raise ValueError(f"schedule.name: unknown schedule {name!r}; known: cosine, wsd, constant")
