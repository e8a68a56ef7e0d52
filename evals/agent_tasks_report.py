"""The closed-loop report from several scored models: rows, per-family success, paired differences, plot.

    .venv/bin/python evals/agent_tasks_report.py --scored A.json B.json ... --out PREFIX \
        --command "..." --seeds '{"...": 0}' --load-start 0.4 --load-end 1.1 [--pair ttt_full/ttt dyn_sft_full/ttt ...]

Writes PREFIX.json / .md / .png (ds_ttt/evaluation/agent_report.py) and prints the markdown table.
The first file's first mode is the row every other row is compared with.
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
    a = p.parse_args(argv)
    scored = []
    for f in a.scored:
        try:
            scored.append(json.loads(pathlib.Path(f).read_text()))
        except (OSError, ValueError) as e:
            p.error(f"--scored {f}: {e}")
    report = build_report(scored, command=a.command, seeds=json.loads(a.seeds),
                          load={"start": a.load_start, "end": a.load_end}, pairs=[tuple(x) for x in a.pair])
    report.update(json.loads(a.extra))
    write_report(report, a.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
