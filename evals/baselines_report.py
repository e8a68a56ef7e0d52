"""Combine scored models into the baselines report: rows with intervals, paired NLL differences, plot.

    .venv/bin/python evals/baselines_report.py --rows ROW.json... --out PREFIX --command CMD \
        [--seeds JSON] [--load-start X --load-end Y]

Writes PREFIX.json (a `rows` list: model, train_policy, eval_policy, mode, worlds_128, worlds_32,
readbacks_exact, memory_action_em, recovery_nll, action_nll, each with _lo/_hi), PREFIX.md and
PREFIX.png. Details: ds_ttt/evaluation/comparison.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.comparison import compare_rows, markdown, write_report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", required=True)
    p.add_argument("--out", required=True, help="output prefix (PREFIX.json / .md / .png)")
    p.add_argument("--command", required=True, help="the command that produced the rows (recorded)")
    p.add_argument("--seeds", default="{}", help="JSON object of the seeds used (recorded)")
    p.add_argument("--load-start", default=None)
    p.add_argument("--load-end", default=None)
    p.add_argument("--extra", default="{}", help="JSON object merged into the report (timings, settings)")
    a = p.parse_args(argv)
    models = [json.loads(pathlib.Path(r).read_text()) for r in a.rows]
    report = compare_rows(models, command=a.command, seeds=json.loads(a.seeds),
                          load={"start": a.load_start, "end": a.load_end})
    report.update(json.loads(a.extra))
    paths = write_report(report, a.out)
    print(markdown(report))
    print(json.dumps(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
