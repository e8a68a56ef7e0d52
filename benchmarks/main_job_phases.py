"""Where the main job's wall time goes: its phases, read off the progress lines of one run's output.

    bash launch/main.sh > MAIN.log 2>&1
    .venv/bin/python benchmarks/main_job_phases.py MAIN.log --tasks-log runs/main/task_suite.log \
        --what "the fresh-clone main job at <commit>, alone" [--out benchmarks/results/main_job_phases.json]

launch/main.sh prints `=== [N s] <step>` as each step starts (seconds since the job began) and
`=== [N s] done in N s ...` at the end; the task suite prints `written and blind-checked in N s` (its
blind-policy gate, which runs beside generation and training). Phases: generate (step 1 to step 2),
prepare (2 to 3), train (3 to 4), after training (4 to the report, 8), the task suite's own seconds, and
the whole job. Writes the JSON (the progress lines kept verbatim) and prints it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

PROGRESS = re.compile(r"^=== \[(\d+) s\] (.*)$")
SUITE = re.compile(r"written and blind-checked in (\d+) s")


def phases(log_text: str, suite_text: str | None = None) -> dict:
    """The phases of one main-job log (module docstring); ValueError naming what is missing."""
    lines = [m for m in (PROGRESS.match(line) for line in log_text.splitlines()) if m]
    if not lines:
        raise ValueError("no `=== [N s] ...` progress line: is this the output of launch/main.sh?")
    start = {}
    for m in lines:
        step = m.group(2).split(" ", 1)[0]
        start.setdefault(step, int(m.group(1)))
    done = [int(m.group(1)) for m in lines if m.group(2).startswith("done in")]
    missing = [s for s in ("1/8", "2/8", "3/8", "4/8", "8/8") if s not in start] + ([] if done else ["done"])
    if missing:
        raise ValueError(f"progress lines missing for step(s) {', '.join(missing)}: the job did not finish")
    out = {"progress_lines": [f"[{m.group(1)} s] {m.group(2)}" for m in lines],
           "generate_seconds": start["2/8"] - start["1/8"], "prepare_seconds": start["3/8"] - start["2/8"],
           "train_seconds": start["4/8"] - start["3/8"], "after_training_seconds": start["8/8"] - start["4/8"],
           "main_seconds": done[-1]}
    if suite_text is not None:
        m = SUITE.search(suite_text)
        if m is None:
            raise ValueError("the task suite's log has no `written and blind-checked in N s` line")
        out["task_suite_seconds"] = int(m.group(1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="launch/main.sh's output")
    ap.add_argument("--tasks-log", help="WORK_DIR/task_suite.log of the same run")
    ap.add_argument("--what", required=True, help="which run this is (commit, alone or not)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        rec = phases(pathlib.Path(a.log).read_text(errors="replace"),
                     pathlib.Path(a.tasks_log).read_text(errors="replace") if a.tasks_log else None)
    except (OSError, ValueError) as e:
        print(f"error: {a.log}: {e}", file=sys.stderr)
        return 1
    rec = {"what": f"phase times of {a.what}, read off its progress lines ('=== [N s] ...')", **rec}
    text = json.dumps(rec, indent=1) + "\n"
    if a.out:
        pathlib.Path(a.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
