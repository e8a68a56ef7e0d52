"""The closed-loop report from several scored models: rows, per-family success, paired differences, plot.

    .venv/bin/python evals/agent_tasks_report.py --scored A.json B.json ... --out PREFIX \
        --command "..." --seeds '{"...": 0}' --load-start 0.4 --load-end 1.1 [--pair ttt_full/ttt dyn_sft_full/ttt ...] \
        [--sweeps SWEEP.json ...]

Writes PREFIX.json / .md / .png (ds_ttt/evaluation/agent_report.py) and prints the markdown table.
The first file's first mode is the row every other row is compared with.
Several training seeds: pass every seed's files in one --scored list; each file says its seed
(`train_seed`, evals/agent_tasks.py --train-seed), the files are grouped by it, every seed needs the same
rows, and the report adds `pooled` (each pair over the seeds, kind-resampling interval, wins):
    ... --scored runs/baselines/seed_{0,1,2}/ttt_current.tasks.json runs/baselines/seed_{0,1,2}/sft_full.tasks.json ...
(the headline row is still the first file's first mode: name the main recipe's files first).
--sweeps SWEEP.json ...: the dev sweeps of dynamic evaluation's inner step (evals/dynamic_eval_sweep.py),
recorded in the report.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.agent_report import build_report, markdown, write_report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scored", nargs="+", required=True, help="files evals/agent_tasks.py wrote")
    p.add_argument("--out", required=True, help="output prefix (.json/.md/.png)")
    p.add_argument("--command", default="")
    p.add_argument("--seeds", default="{}", help="JSON object")
    p.add_argument("--load-start", type=float, default=None)
    p.add_argument("--load-end", type=float, default=None)
    p.add_argument("--extra", default="{}", help="JSON object merged into the report (e.g. timings)")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"),
                   help="one more paired comparison, rows named MODEL/MODE (repeatable)")
    p.add_argument("--sweeps", nargs="*", default=[], help="files evals/dynamic_eval_sweep.py wrote")
    a = p.parse_args(argv)
    scored, sweeps = [], []
    for option, files, into in (("--scored", a.scored, scored), ("--sweeps", a.sweeps, sweeps)):
        for f in files:
            try:
                into.append(json.loads(pathlib.Path(f).read_text()))
            except (OSError, ValueError) as e:
                p.error(f"{option} {f}: {e}")
    try:
        report = build_report(scored, command=a.command, seeds=json.loads(a.seeds),
                              load={"start": a.load_start, "end": a.load_end}, pairs=[tuple(x) for x in a.pair],
                              sweeps=sweeps)
    except ValueError as e:
        p.error(str(e))
    report.update(json.loads(a.extra))
    write_report(report, a.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
