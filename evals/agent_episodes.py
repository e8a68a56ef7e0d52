"""Commit what the agent did: each scored model's episodes (the commands it ran, its stop, its test's verdict) as JSONL.

    .venv/bin/python evals/agent_episodes.py --scored runs/baselines/seed_0/ttt_current.tasks.json ... \
        --out benchmarks/results/agent_tasks_episodes

For every --scored file (evals/agent_tasks.py's output) and every mode in it, writes
OUT/seed<train_seed>/<label>.<mode>.jsonl (OUT/<label>.<mode>.jsonl for a file without a training seed):
one line per episode, sorted by task, with task, kind, attempt, success, stop, rounds, updates, actions
(the tool calls in order) and test_log (what the task's test printed). Each file is written whole or not
at all. benchmarks/adaptation_baselines.sh runs it for the rows of the closed-loop table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.agent_report import episode_log

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scored", nargs="+", required=True, help="files evals/agent_tasks.py wrote")
    p.add_argument("--out", required=True, help="folder for the JSONL files")
    a = p.parse_args(argv)
    for f in a.scored:
        try:
            scored = json.loads(pathlib.Path(f).read_text())
            modes = episode_log(scored)
        except (OSError, ValueError) as e:
            p.error(f"--scored {f}: {e}")
        seed = scored.get("train_seed")
        folder = pathlib.Path(a.out) / (f"seed{seed}" if seed is not None else "")
        folder.mkdir(parents=True, exist_ok=True)
        for mode, episodes in modes.items():
            dest = folder / f"{scored['label']}.{mode}.jsonl"
            partial = dest.with_name(f".{dest.name}.partial")
            partial.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in episodes))
            os.replace(partial, dest)
            solved = sum(e["success"] for e in episodes)
            print(f"{dest}: {len(episodes)} episodes, {solved} solved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
