"""What the blind-policy gate's policies without a command cost, run one sandbox each or sharing one, side by side.

    .venv/bin/python evals/task_suite.py --out SUITE --split test --num-per-kind 3 --no-verify
    .venv/bin/python benchmarks/blind_gate_cost.py --suite SUITE [--tasks 24] [--repeats 2] \
        [--out benchmarks/results/blind_gate_cost]

For each of the suite's first --tasks tasks, its blind policies that run no command (ds_ttt/tasks/
blind_policies.py: nothing, the instruction, the answers of a task without answer files) are scored two
ways: `separate`, run_blind per policy (an agent sandbox and a verifier sandbox each: the gate before
the change), and `shared`, run_blind_replies (one agent sandbox per task, a verifier sandbox per reply:
the gate's way). The two arms alternate task by task, their order swapped every repeat, so machine noise
hits both alike. Cost is what the whole machine spent (busy jiffies of /proc/stat, which counts the
sandboxes' processes that the host's rusage misses), and wall time. Every verdict must be the same in
both arms (and must be a failure: the suite passed the gate), or the script stops. Writes OUT.json and
OUT.md with the load average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system irq softirq of the `cpu` line; idle and iowait left out


def machine_busy_seconds() -> float:
    fields = open("/proc/stat").readline().split()[1:]
    return sum(int(fields[i]) for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", required=True, help="a suite written by evals/task_suite.py")
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/blind_gate_cost")
    args = ap.parse_args()
    from tqdm import tqdm

    from ds_ttt.tasks.blind_policies import policies, run_blind, run_blind_replies
    from ds_ttt.tasks.suite import load_suite

    meta, tasks = load_suite(args.suite)
    guesses = {k: v.get("guess") for k, v in meta["kinds"].items()}
    tasks = tasks[:args.tasks]
    load_start = os.getloadavg()[0]
    cost = {"separate": [0.0, 0.0], "shared": [0.0, 0.0]}  # busy core-seconds, wall seconds
    runs = 0
    with tqdm(total=args.repeats * len(tasks), desc="tasks", unit="task") as bar:
        for rep in range(args.repeats):
            for t in tasks:
                replies = [p.reply for p in policies(t, guesses.get(t.kind)) if not p.commands]
                verdicts = {}
                for arm in (("separate", "shared") if rep % 2 == 0 else ("shared", "separate")):
                    b0, w0 = machine_busy_seconds(), time.perf_counter()
                    if arm == "separate":
                        verdicts[arm] = [run_blind(t, (), r)[0] for r in replies]
                    else:
                        verdicts[arm] = [ok for ok, _ in run_blind_replies(t, replies)]
                    cost[arm][0] += machine_busy_seconds() - b0
                    cost[arm][1] += time.perf_counter() - w0
                if verdicts["separate"] != verdicts["shared"] or any(verdicts["shared"]):
                    raise SystemExit(f"{t.id}: verdicts differ or a blind policy passes: {verdicts}")
                runs += len(replies)
                bar.update(1)
    rows = {arm: {"busy_core_seconds": c[0], "wall_seconds": c[1]} for arm, c in cost.items()}
    ratio = rows["shared"]["busy_core_seconds"] / rows["separate"]["busy_core_seconds"]
    report = {"command": f".venv/bin/python benchmarks/blind_gate_cost.py --suite SUITE --tasks {args.tasks} "
                         f"--repeats {args.repeats}", "suite_sha256": meta.get("sha256"), "tasks": len(tasks),
              "repeats": args.repeats, "policy_runs_per_arm": runs, "rows": rows, "shared_over_separate_busy": ratio,
              "load_start": load_start, "load_end": os.getloadavg()[0]}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# The gate's policies without a command: one sandbox each, or one shared per task", "",
             f"`{report['command']}` (suite sha256 {str(meta.get('sha256'))[:12]}…, "
             "`evals/task_suite.py --split test --num-per-kind 3 --no-verify`)", "",
             f"{len(tasks)} tasks x {args.repeats} repeats, {runs} policy runs per arm, arms alternating; load "
             f"{load_start:.2f} at start, {report['load_end']:.2f} at end. Every verdict equal in both arms.", "",
             "| arm | machine busy, core-s | wall, s |", "|---|---|---|"]
    for arm, r in rows.items():
        lines.append(f"| {arm} | {r['busy_core_seconds']:.1f} | {r['wall_seconds']:.1f} |")
    lines += ["", f"shared / separate, busy core-seconds: x{ratio:.2f}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
