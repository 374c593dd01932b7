"""Learning-rate schedules as pure functions of the step (a multiplier on the peak lr)."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based).

    Linear warm-up from 1/warmup to 1 over `warmup_steps` (Goyal et al. 2017 §2.2), then decay to
    `min_ratio` at `total_steps`: half-cosine (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle, no
    restart) or linear. A floor of 0.1 is the Chinchilla/LLaMA recipe (Hoffmann et al. 2022 §3;
    Touvron et al. 2023 §2.2: "final learning rate equal to 10% of the maximal learning rate").
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress * (1.0 - min_ratio)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
