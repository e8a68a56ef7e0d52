"""The issue-7 adaptation report: ttt vs frozen on the targets, current_round and full context side by side.

    .venv/bin/python evals/adaptation_report.py --eval EVAL --memory MEM --eval-full EVAL_FULL \
        --memory-full MEM_FULL --minutes M --command "CMD" --out benchmarks/results/adaptation.json \
        [--seeds JSON_OR_FILE] [--run-config PATH] [--no-plot]

EVAL / MEM: evals/evaluate.py and evals/memory_test.py output directories (or their results.json)
under the current_round context policy; EVAL_FULL / MEM_FULL: the same checkpoint with
--context-policy full. Writes OUT (JSON), OUT with .md and OUT with .png. Refuses (exit 2, naming the
file and the key) when a results file is missing, lacks a key, has the wrong context policy, or the
runs come from different checkpoints. Details: ds_ttt/evaluation/adaptation.py, docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval", required=True, help="evals/evaluate.py output, current_round context policy")
    p.add_argument("--memory", required=True, help="evals/memory_test.py output, current_round context policy")
    p.add_argument("--eval-full", required=True, help="evals/evaluate.py output, --context-policy full")
    p.add_argument("--memory-full", required=True, help="evals/memory_test.py output, --context-policy full")
    p.add_argument("--minutes", type=float, required=True, help="wall time of the main command (minutes)")
    p.add_argument("--command", required=True, help="the exact main command that produced the runs")
    p.add_argument("--out", required=True, help="output JSON (Markdown and PNG are written beside it)")
    p.add_argument("--seeds", default=None, help="seeds used, as JSON text or a JSON file")
    p.add_argument("--run-config", default=None, help="the training run config (recorded with its sha256)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    from ds_ttt.evaluation.adaptation import ReportInputError, build_report, markdown, write_report

    seeds = None
    if args.seeds is not None:
        src = pathlib.Path(args.seeds)
        try:
            seeds = json.loads(src.read_text() if src.is_file() else args.seeds)
        except json.JSONDecodeError as e:
            print(f"adaptation_report: refused: --seeds is neither JSON nor a JSON file ({e})", file=sys.stderr)
            return 2
    try:
        report = build_report(args.eval, args.memory, args.eval_full, args.memory_full, minutes=args.minutes,
                              command=args.command, seeds=seeds, run_config=args.run_config)
    except ReportInputError as e:
        print(f"adaptation_report: refused: {e}", file=sys.stderr)
        return 2
    files = write_report(report, args.out, plot=not args.no_plot)
    print(markdown(report))
    print("wrote " + ", ".join(files.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
