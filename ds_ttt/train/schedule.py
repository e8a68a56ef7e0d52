"""The outer learning-rate schedule: DeepSpeed's WarmupCosineLR driven by the saved plan.

The plan (ds_ttt/train/run_config.py: `make_plan`) is fixed when a data stage starts and saved in
every checkpoint: planned steps P (= --max_steps, else epochs x steps per epoch), warmup W =
max(2, ceil(0.1 P)) (DeepSpeed's minimum is 2). The trainer fills the scheduler's `total_num_steps = P`, `warmup_num_steps = W`,
`cos_min_ratio = min_lr_ratio` and steps the scheduler once when the stage starts, so optimizer step
s (1-based) runs at

    lr(s) = peak * (s - 1) / W                                          for s <= W
    lr(s) = peak * (m + (1 - m) * (1 + cos(pi * (s - W) / (P - W))) / 2) for s > W    (m = min_lr_ratio)

i.e. 0 at step 1, the peak at step W + 1, the floor exactly at the last planned step P. Resuming loads
the scheduler state (never restarts warmup); a new data stage (--start-stage-from) starts a new plan.
"""

from __future__ import annotations

import math

from ds_ttt.train.run_config import Plan, make_plan, resolved_deepspeed  # noqa: F401  (re-exported)


def start_schedule(engine) -> None:
    """Advance a fresh WarmupCosineLR to its step-0 position (lr 0), so step 1 trains at ratio(0)."""
    engine.lr_scheduler.step()


def expected_lr(plan: Plan, peak: float, step: int) -> float:
    """The lr of optimizer step `step` (1-based) under the formula above."""
    s, w, p, m = step, plan.warmup_steps, plan.planned_steps, plan.min_lr_ratio
    if s - 1 < w:
        return peak * (s - 1) / w
    progress = min(1.0, (s - w) / max(1, p - w))
    return peak * max(0.0, m + (1 - m) * (1 + math.cos(math.pi * progress)) / 2)
