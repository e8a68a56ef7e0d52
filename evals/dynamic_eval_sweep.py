"""Pick dynamic evaluation's inner step for one SFT model from its sweep on the dev task suite.

    .venv/bin/python evals/dynamic_eval_sweep.py --scored DEV_A.json DEV_B.json ... --label dyn_sft_full \
        --out SWEEP.json [--train-seed S]

Each DEV file is evals/agent_tasks.py's output for the same SFT model with --dynamic-eval-from and one
--inner setting, on the dev split's suite (evals/task_suite.py --split dev). The pick
(ds_ttt.evaluation.dynamic_eval.pick_inner_setting): the highest success in mode ttt; ties go to the
smaller inner_lr, then the smaller inner_max_norm. Writes SWEEP.json (the grid, each setting's success
and the choice; evals/agent_tasks_report.py --sweeps shows it) whole or not at all, and prints the
choice as the --inner arguments of the test run: `inner_lr=0.3 inner_max_norm=5.0`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

SWEEP_FORMAT = "ds_ttt-dynamic-eval-sweep-v1"


def main(argv=None) -> int:
    from ds_ttt.evaluation.dynamic_eval import pick_inner_setting

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scored", nargs="+", required=True, help="evals/agent_tasks.py files, one per inner setting")
    p.add_argument("--label", required=True, help="the dynamic-evaluation row the choice is for (e.g. dyn_sft_full)")
    p.add_argument("--out", required=True)
    p.add_argument("--train-seed", type=int, default=None)
    a = p.parse_args(argv)
    grid, suites = [], set()
    for f in a.scored:
        s = json.loads(pathlib.Path(f).read_text())
        inner, row = s["provenance"].get("dynamic_eval_inner"), s["modes"].get("ttt", {}).get("row")
        if inner is None or row is None:
            p.error(f"--scored {f}: not a dynamic-evaluation run in mode ttt (evals/agent_tasks.py --dynamic-eval-from)")
        suites.add(json.dumps(s["suite"], sort_keys=True))
        grid.append({"inner_lr": inner["inner_lr"], "inner_max_norm": inner["inner_max_norm"],
                     "solved": row["solved"], "tasks": row["tasks"], "success": row["success"],
                     "dynamic_eval_from": s["provenance"]["dynamic_eval_from"], "file": str(f)})
    if len(suites) != 1:
        p.error("the sweep's files were scored on different task suites")
    chosen = pick_inner_setting(grid)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(json.dumps({"format": SWEEP_FORMAT, "label": a.label, "seed": a.train_seed,
                               "suite": json.loads(suites.pop()), "grid": grid,
                               "chosen": {k: chosen[k] for k in ("inner_lr", "inner_max_norm")}}, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"inner_lr={chosen['inner_lr']} inner_max_norm={chosen['inner_max_norm']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
