"""Per-step training metrics: a rank-0 progress bar, RUN_DIR/metrics.jsonl, and optional wandb.

Every optimizer step logs one JSON line (rank 0 only): step (cumulative), stage_step, data_stage,
epoch, loss (the step's outer objective: token-weighted over the whole global batch, exactly what the
gradient is of; ds_ttt/train/objective.py), action_loss and obs_loss (token-weighted NLL over the
global batch, obs with the pre-update fast weights over the observation-loss labels),
inner_updates / inner_skipped (fast-weight steps made / skipped for a non-finite gradient), tokens,
tokens_per_s, step_time_s, peak_mem_gb (max over ranks: peak RSS on CPU, max allocated on CUDA),
lr (outer, the lr this step ran at) and inner_lr.

wandb runs only when enabled (`"wandb": true` in the run config), in offline mode unless WANDB_MODE
says otherwise; it writes under RUN_DIR/wandb and never needs the network.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import sys

import torch


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class MetricsLogger:
    def __init__(self, run_dir: pathlib.Path, *, enabled: bool, total: int, initial: int, resume_step: int | None,
                 wandb_config: dict | None = None, wandb_project: str = "ds_ttt"):
        self.enabled = enabled
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.bar = self.wandb = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():  # drop steps a resumed run will redo
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in keep))
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        if wandb_config is not None:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb
            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=wandb_config,
                                    mode=os.environ["WANDB_MODE"], resume="allow")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
        self.bar.update(1)
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
