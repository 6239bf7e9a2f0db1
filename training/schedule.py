"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay."""

from __future__ import annotations

import math

__all__ = ["DECAY_STYLES", "lr_at"]

DECAY_STYLES = ("cosine", "linear", "constant")


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int,
    max_steps: int,
    min_lr_ratio: float = 0.1,
    decay: str = "cosine",
) -> float:
    """Return the learning rate for 0-based ``step`` (the step about to be taken).

    Warmup (``step < warmup_steps``): ``lr * (step + 1) / warmup_steps``, i.e. linear from
    ``lr / warmup_steps`` at step 0 up to ``lr`` at step ``warmup_steps - 1``.
    Decay (``step >= warmup_steps``), with ``min_lr = lr * min_lr_ratio`` and
    ``p = (step - warmup_steps) / (max_steps - warmup_steps)`` clamped to ``[0, 1]``:

    - ``cosine``:   ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``
    - ``linear``:   ``lr - (lr - min_lr) * p``
    - ``constant``: ``lr``

    so the rate is ``lr`` at ``step == warmup_steps`` and reaches ``min_lr`` at
    ``step == max_steps`` (and stays there after). ``warmup_steps == 0`` skips warmup;
    ``warmup_steps == max_steps`` means warmup only. Raises ValueError for an unknown
    ``decay`` or inconsistent numbers.
    """
    if decay not in DECAY_STYLES:
        raise ValueError(f"unknown lr decay {decay!r}; allowed: {', '.join(DECAY_STYLES)}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if max_steps <= 0:
        raise ValueError(f"max_steps must be positive, got {max_steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps > max_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) exceeds max_steps ({max_steps}); "
            "lower the warmup or raise trainer.max_steps"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    min_lr = lr * min_lr_ratio
    decay_steps = max_steps - warmup_steps
    progress = 1.0 if decay_steps == 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress
