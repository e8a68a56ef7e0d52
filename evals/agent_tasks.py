"""Put one model to work on the closed-loop task suite: episodes in sandboxes, scored by the tasks' tests.

    .venv/bin/python evals/agent_tasks.py --model RUN_OR_EXPORT --tasks TASKS --label NAME --out SCORED.json \
        [--modes ttt frozen] [--attempts K --temperature T] [--max-rounds 12] [--max-new-tokens 256] [--concurrency 16]

Default modes: ttt and its frozen ablation for a TTT model, sft for a model without adaptive layers.
--dynamic-eval-from TTT_RUN: the control without meta-learning (ds_ttt/evaluation/dynamic_eval.py).
Greedy by default (pass@1); --attempts K with --temperature > 0 samples K episodes per task (pass@K).
Prints one line per mode; evals/agent_tasks_report.py turns several SCORED files into the report.
Details: ds_ttt/evaluation/closed_loop.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.closed_loop import MODES, score_model_on_tasks

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
    a = p.parse_args(argv)
    scored = score_model_on_tasks(a.model, a.tasks, label=a.label, modes=tuple(a.modes) if a.modes else None,
                                  attempts=a.attempts, temperature=a.temperature, concurrency=a.concurrency,
                                  seed=a.seed, max_rounds=a.max_rounds, max_new_tokens=a.max_new_tokens,
                                  command_timeout=a.command_timeout, dynamic_eval_from=a.dynamic_eval_from)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scored) + "\n")
    for mode, res in scored["modes"].items():
        r = res["row"]
        print(f"{a.label} {mode}: {r['metric']} {r['solved']}/{r['tasks']} = {100 * r['success']:.1f}% "
              f"[{100 * r['success_lo']:.1f}, {100 * r['success_hi']:.1f}], {r['episodes']} episodes in "
              f"{r['seconds']:.0f} s ({r['episodes'] / r['seconds']:.2f} episodes/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
