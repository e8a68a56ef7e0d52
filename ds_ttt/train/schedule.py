"""The outer learning-rate schedule: the plan (`Plan`, `make_plan`) and DeepSpeed's WarmupCosineLR driven
by it (`resolved_deepspeed`, `start_schedule`).

The plan is fixed when a data stage starts and saved in
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

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from ds_ttt.train.run_config import RunConfig

SCHEDULER = "WarmupCosineLR"
WARMUP_FRACTION = 0.1


@dataclass(frozen=True)
class Plan:
    """The schedule plan, fixed at the first launch of a stage and saved in every checkpoint."""

    planned_steps: int
    warmup_steps: int
    steps_per_epoch: int
    num_train: int
    retained_rounds: int
    train_batch_size: int
    min_lr_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(run: RunConfig, num_train: int, retained_rounds: int, train_batch_size: int) -> Plan:
    steps_per_epoch = num_train // train_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"the train split has {num_train} trajectories, fewer than train_batch_size="
                         f"{train_batch_size}: lower train_batch_size or add data")
    planned = run.max_steps if run.max_steps is not None else run.epochs * steps_per_epoch
    warmup = max(2, math.ceil(WARMUP_FRACTION * planned))  # DeepSpeed's WarmupCosineLR warms up >= 2 steps
    if planned < 3:
        raise ValueError(f"the plan has {planned} step(s); warmup (>= 2 steps) + cosine needs at least 3: "
                         "raise --max_steps or epochs")
    return Plan(planned, warmup, steps_per_epoch, num_train, retained_rounds, train_batch_size, run.min_lr_ratio)


def resolved_deepspeed(ds: dict, plan: Plan) -> dict:
    """The DeepSpeed dict the engine gets: the scheduler's step counts filled from the plan."""
    ds = json.loads(json.dumps(ds))
    params = ds["scheduler"].setdefault("params", {})
    # The engine steps the scheduler once at the start of a stage (schedule.start_schedule), so optimizer
    # step s (1-based) runs at ratio(s - 1): step 1 at 0, step warmup+1 at the peak, step `planned` at
    # the floor (WarmupCosineLR's progress (s - warmup) / (total - warmup) reaches 1 there).
    params.update(total_num_steps=plan.planned_steps, warmup_num_steps=plan.warmup_steps,
                  warmup_min_ratio=0.0, warmup_type="linear", cos_min_ratio=plan.min_lr_ratio)
    return ds


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
