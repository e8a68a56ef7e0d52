"""GPU check phase `balance`: each PP4 stage's module timed alone on the one GPU (stdlib only).

    python gpu_check/bench_balance.py --out DIR/pipeline_balance_gpu.json [--budget-s 90]
    (run by gpu_check/run.sh; needs a CUDA GPU)

Runs benchmarks/pipeline_balance --device cuda --preset qwen3-8b --tokens 8192 --dtype bf16
--ttt attention_backend=cuda --layouts PP4xDP1 --global-batch 32 --repeats 2 --no-trainer (the real
TTTPipelineModule stages of PP4, one process, each stage on the input it really receives) in a child
killed at the budget, and turns its pipeline_balance.json into the phase file: one row per stage
(forward / backward median seconds, parameters, measured activation peak), the 1F1B schedule's step
time and bubble from those stage times, and the script's whole JSON under "pipeline_balance".
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from gpu_check import REPO, Log, last_lines, run_child
from gpu_results import PhaseRecord, read_json

LAYOUT = "PP4xDP1"
TOKENS = 8192
GLOBAL_BATCH = 32  # micro-batches per step of ds_configs/qwen3_8b_pp4.json's layout


def balance_command(python: str, out_dir: Path) -> list[str]:
    return [python, str(REPO / "benchmarks" / "pipeline_balance"), "--device", "cuda", "--preset", "qwen3-8b",
            "--tokens", str(TOKENS), "--dtype", "bf16", "--ttt", "attention_backend=cuda", "--layouts", LAYOUT,
            "--global-batch", str(GLOBAL_BATCH), "--repeats", "2", "--no-trainer", "--out", str(out_dir)]


def stage_rows(res: dict, layout: str = LAYOUT) -> list[dict]:
    """One row per stage from pipeline_balance.json (KeyError naming what is missing)."""
    if layout not in res.get("stage_times", {}):
        raise KeyError(f"pipeline_balance.json has no stage_times for {layout}")
    memory = {m["stage"]: m for m in res.get("memory", {}).get(layout, [])}
    rows = []
    for st in res["stage_times"][layout]:
        mem = memory.get(st["stage"], {})
        fwd, bwd = st["fwd_s"]["median"], st["bwd_s"]["median"]
        rows.append({"stage": st["stage"], "fwd_s": fwd, "bwd_s": bwd, "total_s": fwd + bwd,
                     "backward_ran": st.get("backward_ran"), "params": st.get("params"),
                     "trainable_params": st.get("trainable_params"),
                     "activation_peak_bytes": (mem.get("measured") or {}).get("peak_bytes"),
                     "weights_bytes": mem.get("weights")})
    return rows


def run(*, out: str, budget_s: float, python: str = sys.executable, runner=run_child) -> PhaseRecord:
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_balance."))
    cmd = balance_command(python, tmp)
    rec = PhaseRecord(out, "pipeline_balance_gpu", config={"command": " ".join(cmd[1:]), "layout": LAYOUT,
                                                           "tokens": TOKENS, "global_batch": GLOBAL_BATCH})
    r = runner(cmd, timeout=budget_s, log=Log(), prefix="[balance] ")
    res = read_json(tmp / "pipeline_balance.json")
    if r["timed_out"] or r["rc"] != 0 or res is None:
        why = f"timed out after {budget_s:.0f} s" if r["timed_out"] else f"exit {r['rc']}"
        rec.check("balance: every PP4 stage timed on the GPU", False, f"{why}: {last_lines(r['tail'], 3)}")
        rec.finish("timeout" if r["timed_out"] else "failed", time.monotonic() - t0)
        return rec
    rows = stage_rows(res)
    for row in rows:
        rec.add_row(row)
    good = [row for row in rows if math.isfinite(row["total_s"]) and row["fwd_s"] > 0]
    rec.check("balance: every PP4 stage timed on the GPU", len(good) == len(rows) == 4,
              ", ".join(f"stage {row['stage']}: {row['fwd_s']:.3g} + {row['bwd_s']:.3g} s" for row in rows))
    sched = (res.get("schedule") or {}).get(LAYOUT, {})
    rec.set(schedule={k: sched.get(k) for k in ("step_s", "bubble", "uniform_bubble", "num_micro",
                                                "tokens_per_s_dedicated", "utilisation")},
            pipeline_balance=res)
    rec.finish_by_checks(time.monotonic() - t0)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the phase's JSON file")
    ap.add_argument("--budget-s", type=float, default=90.0)
    a = ap.parse_args(argv)
    return 0 if run(out=a.out, budget_s=a.budget_s).data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
