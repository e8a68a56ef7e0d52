"""Check a task suite against the training corpus: refuse tasks that are training episodes, report overlap.

    .venv/bin/python evals/contamination.py --suite TASKS --training DATA/manifest.json [MORE ...] \
        [--out TASKS_contamination.json]

--training: prepared manifests (their train split) and/or generator outputs (DIR or DIR/trajectories.jsonl),
e.g. the main job's `WORK/data/manifest.json`, or `WORK/raw WORK/raw_extra` (300 episodes of seed 0 and 600
memory episodes of seed 1). Exit 1, naming each task and the training trajectories it equals, when any task's
instruction and setup files equal a training trajectory's (ds_ttt/evaluation/contamination.py says how the
training worlds are regenerated); 0 otherwise. Either way it prints the instruction overlap per kind (tasks
whose instruction training shows word for word) and the tasks whose world alone is a training world, and
writes the JSON report (default: SUITE/../<suite name>_contamination.json). See docs/evaluation.md,
"Contamination".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    from ds_ttt.evaluation.contamination import build_training_index, check_suite, load_training_trajectories

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", required=True, help="a task suite directory (evals/task_suite.py)")
    ap.add_argument("--training", nargs="+", required=True, help="manifests and/or trajectories.jsonl")
    ap.add_argument("--out", default=None, help="the JSON report")
    args = ap.parse_args(argv)
    suite = Path(args.suite)
    out = Path(args.out) if args.out else suite.parent / f"{suite.name}_contamination.json"

    trajectories, sources = load_training_trajectories(args.training)
    report = check_suite(suite, build_training_index(trajectories, sources))
    out.write_text(json.dumps(report, indent=1) + "\n")

    t = report["training"]
    print(f"training: {t['trajectories']} trajectories, {t['instructions']} distinct instructions, "
          f"{t['worlds_regenerated']} worlds regenerated ({len(t['not_regenerated'])} not)")
    print(f"{'kind':24} {'seen':5} {'tasks':>5} {'exact':>5} {'verbatim':>8} {'same world':>10} {'identical':>9}")
    overlap = report["instruction_overlap"]
    for kind, r in overlap["per_kind"].items():
        print(f"{kind:24} {str(r['seen']):5} {r['tasks']:5d} {r['exact']:5d} {r['verbatim']:8d} {r['same_world']:10d} "
              f"{r['identical']:9d}")
    for side in ("seen", "unseen"):
        s = overlap[side]
        print(f"{side + ' kinds':30} {s['exact']['tasks']:5d} {s['exact']['count']:5d} {s['verbatim']['count']:8d} "
              f"{s['same_world']['count']:10d} {s['identical']['count']:9d}")
    for row in report["same_world"]:
        print(f"same world: {row['task']} = the world of {', '.join(row['training'])}")
    print(f"report: {out}")
    if report["identical"]:
        for row in report["identical"]:
            print(f"CONTAMINATED: {row['task']} ({row['kind']}) equals training trajectory "
                  f"{', '.join(row['training'])} (instruction and every setup file)", file=sys.stderr)
        print(f"refused: {len(report['identical'])} of {report['suite']['num_tasks']} tasks are training episodes; "
              "redraw them (ds_ttt.evaluation.contamination.contaminated)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
