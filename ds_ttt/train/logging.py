"""Per-step training metrics: a rank-0 progress bar, RUN_DIR/metrics.jsonl, and optional wandb.

Every optimizer step logs one JSON line (rank 0 only): step (cumulative), stage_step, data_stage,
epoch, loss (the step's outer objective: token-weighted over the whole global batch, exactly what the
gradient is of; ds_ttt/train/objective.py), action_loss and obs_loss (token-weighted NLL over the
global batch, obs with the pre-update fast weights over the observation-loss labels),
inner_updates / inner_skipped (fast-weight steps made / skipped for a non-finite gradient), tokens,
tokens_per_s, step_time_s, peak_mem_gb (max over ranks: peak RSS on CPU, max allocated on CUDA),
lr (outer, the lr this step ran at) and inner_lr.

The progress bar advances every optimizer step; metrics are written every `log_interval` steps.

Resume: at the start of a launch metrics.jsonl is cut back (once, atomically) to the lines of steps
<= the step the launch starts from, so a resumed run never holds a step twice; a last line cut short
by a kill is dropped.

wandb runs only when enabled (`"wandb": true` in the run config), in offline mode unless WANDB_MODE
says otherwise; it writes under RUN_DIR/wandb and never needs the network. Its run id is stored in
RUN_DIR/wandb_run_id: a `--resume` in the same RUN_DIR continues that W&B run (resume="allow"), a
fresh launch or a new data stage (a new RUN_DIR) starts a new one.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import sys
import uuid

import torch


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


WANDB_ID_FILE = "wandb_run_id"


def cut_metrics(path: pathlib.Path, resume_step: int) -> None:
    """Keep the metrics lines of steps <= resume_step (atomic rewrite); drop a last line a kill cut short."""
    if not path.exists():
        return
    keep = []
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no newline after it: the write was killed
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line; the metrics file is corrupt (move it away to resume)")
        if record["step"] <= resume_step:
            keep.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def wandb_run_id(run_dir: pathlib.Path, *, resume: bool) -> str:
    """The W&B run id of RUN_DIR: the stored one on --resume, else a new one (stored)."""
    path = pathlib.Path(run_dir) / WANDB_ID_FILE
    if resume and path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:8]  # W&B's own ids are 8 lowercase alphanumerics too
    path.write_text(run_id + "\n")
    return run_id


class MetricsLogger:
    def __init__(self, run_dir: pathlib.Path, *, enabled: bool, total: int, initial: int, resume_step: int | None,
                 wandb_config: dict | None = None, wandb_project: str = "ds_ttt", resume: bool = False):
        """resume_step: the step this launch starts from (metrics of later steps are dropped); resume:
        a --resume launch (continues the stored W&B run)."""
        self.enabled = enabled
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.bar = self.wandb = None
        if not enabled:
            return
        if resume_step is not None:
            cut_metrics(self.path, resume_step)
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        if wandb_config is not None:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb
            self.wandb_id = wandb_run_id(run_dir, resume=resume)
            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=wandb_config, id=self.wandb_id,
                                    mode=os.environ["WANDB_MODE"], resume="allow")

    def step(self, record: dict | None = None, *, loss: float | None = None) -> None:
        """One optimizer step done: advance the bar; write `record` (a logged step) when given."""
        if not self.enabled:
            return
        if record is not None:
            self.log(record)
        self.bar.update(1)
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", act=f"{record['action_loss']:.3f}",
                             tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{record['lr']:.2e}", refresh=False)

    def message(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
