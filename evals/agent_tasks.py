"""Put one model to work on the closed-loop task suite: episodes in sandboxes, scored by the tasks' tests.

    .venv/bin/python evals/agent_tasks.py --model RUN_OR_EXPORT --tasks TASKS --label NAME --out SCORED.json \
        [--modes ttt frozen] [--attempts K --temperature T] [--max-rounds 12] [--max-new-tokens 256] [--concurrency 16] \
        [--train-seed S] [--dynamic-eval-from TTT_RUN [--inner inner_lr=0.3 --inner inner_max_norm=5]]

Default modes: ttt and its frozen ablation for a TTT model, sft for a model without adaptive layers.
--dynamic-eval-from TTT_RUN: the control without meta-learning (ds_ttt/evaluation/dynamic_eval.py);
--inner KEY=VALUE overrides one of that run's inner-step settings (INNER_FIELDS, e.g. inner_lr, inner_max_norm).
--train-seed: the model's training seed, written as `train_seed` (the report pools models over it).
The SCORED file is written whole or not at all (a temporary file renamed), so a killed run leaves none.
Greedy by default (pass@1); --attempts K with --temperature > 0 samples K episodes per task (pass@K).
Prints one line per mode; evals/agent_tasks_report.py turns several SCORED files into the report.
Details: ds_ttt/evaluation/closed_loop.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.closed_loop import MODES, score_model_on_tasks
    from ds_ttt.evaluation.dynamic_eval import DynamicEvalRecipe, parse_inner_overrides

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a training run (or checkpoint) or an export directory")
    p.add_argument("--tasks", required=True, help="the suite evals/task_suite.py wrote")
    p.add_argument("--label", required=True, help="the model's name in the report (e.g. ttt_current)")
    p.add_argument("--out", required=True)
    p.add_argument("--modes", nargs="+", choices=MODES, default=None)
    p.add_argument("--attempts", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-rounds", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--command-timeout", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamic-eval-from", default=None, metavar="TTT_RUN",
                   help="dynamic evaluation: the SFT model at --model takes this TTT run's inner step at test time "
                        "on its own last layers' MLPs (mode ttt; frozen = the SFT model)")
    p.add_argument("--inner", action="append", metavar="KEY=VALUE",
                   help="with --dynamic-eval-from: override one of the TTT run's inner-step settings (repeatable)")
    p.add_argument("--train-seed", type=int, default=None, help="the model's training seed (recorded for the report)")
    a = p.parse_args(argv)
    if a.inner and not a.dynamic_eval_from:
        p.error("--inner overrides dynamic evaluation's inner step: it needs --dynamic-eval-from")
    try:
        overrides = parse_inner_overrides(a.inner)
    except ValueError as e:
        p.error(str(e))
    source = DynamicEvalRecipe(a.dynamic_eval_from, overrides) if a.dynamic_eval_from else None
    scored = score_model_on_tasks(a.model, a.tasks, label=a.label, modes=tuple(a.modes) if a.modes else None,
                                  attempts=a.attempts, temperature=a.temperature, concurrency=a.concurrency,
                                  seed=a.seed, max_rounds=a.max_rounds, max_new_tokens=a.max_new_tokens,
                                  command_timeout=a.command_timeout, dynamic_eval_from=source)
    scored["train_seed"] = a.train_seed
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(json.dumps(scored) + "\n")
    os.replace(tmp, out)
    for mode, res in scored["modes"].items():
        r = res["row"]
        print(f"{a.label} {mode}: {r['metric']} {r['solved']}/{r['tasks']} = {100 * r['success']:.1f}% "
              f"[{100 * r['success_lo']:.1f}, {100 * r['success_hi']:.1f}], {r['episodes']} episodes in "
              f"{r['seconds']:.0f} s ({r['episodes'] / r['seconds']:.2f} episodes/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
