"""Learning rate as a pure function of the optimizer step, so a resumed run needs only the step to continue it."""
import math

from pretrain.config import fitted_warmup


def lr_at(step: int, *, lr: float, min_lr: float, name: str, warmup_steps: int, decay_steps: int,
          max_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    - ``cosine``: linear warmup to ``lr``, then a half cosine down to ``min_lr`` at ``max_steps``.
    - ``wsd`` (warmup-stable-decay): warmup, ``lr`` held, then a linear decay to ``min_lr`` over the final
      ``decay_steps`` steps.
    - ``constant``: warmup, then ``lr``.

    A warmup longer than ``max_steps`` is shortened to fit (``fitted_warmup``).
    """
    warmup_steps = fitted_warmup(warmup_steps, max_steps)
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


class Plan:
    """``lr_at`` with this run's settings, re-planned when a resume changes ``train.max_steps`` mid-decay: from
    the resumed step ``start[0]`` on, the decay runs from the LR it had reached (``start[1]``) down to ``min_lr`` at
    the new ``max_steps`` (the same curve: a half cosine, or wsd's line), so the LR never jumps. The plan is saved
    with every checkpoint (``state``), so later resumes follow it."""

    def __init__(self, start: tuple[int, float] | None = None, **settings):
        self.settings, self.start = settings, start

    def __call__(self, step: int) -> float:
        if self.start is None or step < self.start[0]:
            return lr_at(step, **self.settings)
        (first, lr), s = self.start, self.settings
        progress = min(1.0, (step - first) / max(1, s["max_steps"] - first))
        if s["name"] == "cosine":
            return s["min_lr"] + 0.5 * (lr - s["min_lr"]) * (1.0 + math.cos(math.pi * progress))
        return lr + (s["min_lr"] - lr) * progress

    def warmup_notice(self) -> str | None:
        """One line when the configured warmup is longer than the run and was shortened (None otherwise)."""
        asked, steps = self.settings["warmup_steps"], self.settings["max_steps"]
        fitted = fitted_warmup(asked, steps)
        if fitted == asked:
            return None
        return (f"schedule.warmup_steps {asked} is longer than train.max_steps {steps}: warming up over {fitted} "
                f"step{'s' if fitted > 1 else ''} instead (a tenth of the run)")

    def state(self) -> dict:
        return {"max_steps": self.settings["max_steps"], "start": self.start}

    def resume(self, saved: dict | None, step: int) -> str | None:
        """Follow the plan a checkpoint saved at ``step``; if this run's ``max_steps`` differs, re-plan from ``step``
        and say so in one line (None: nothing changed). Without a saved plan (older checkpoints) keep this one."""
        if saved is None:
            return None
        before = Plan(saved["start"] and tuple(saved["start"]), **{**self.settings, "max_steps": saved["max_steps"]})
        if saved["max_steps"] == self.settings["max_steps"]:
            self.start = before.start
            return None
        lr = before(step)
        self.start = None if math.isclose(lr_at(step, **self.settings), lr, rel_tol=1e-12) else (step, lr)
        how = (f"the decay re-planned from step {step}'s LR {lr:.3g} to {self.settings['min_lr']:.3g} at step "
               f"{self.settings['max_steps']}" if self.start else "the LR schedule is unchanged up to here")
        return f"train.max_steps changed from {saved['max_steps']} to {self.settings['max_steps']}: {how}"
