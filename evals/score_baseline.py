"""Score one trained model (TTT or SFT) on the held-out sets: one row per mode (ttt, frozen ablation, sft).

    .venv/bin/python evals/score_baseline.py --checkpoint RUN_OR_EXPORT --sets SETS --label NAME --out ROW.json \
        [--dynamic-eval-from TTT_RUN]        # the SFT model at --checkpoint with TTT_RUN's inner step at test time

Details: ds_ttt/evaluation/comparison.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.comparison import score_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--sets", required=True, help="the folder evals/heldout_sets.py wrote")
    p.add_argument("--label", required=True, help="the model's name in the report (e.g. ttt_current)")
    p.add_argument("--out", required=True)
    p.add_argument("--dynamic-eval-from", default=None, metavar="TTT_RUN",
                   help="dynamic evaluation: the SFT model at --checkpoint takes this TTT run's inner step at test "
                        "time on its own last layers' MLPs (ds_ttt/evaluation/dynamic_eval.py)")
    a = p.parse_args(argv)
    row = score_checkpoint(a.checkpoint, a.sets, label=a.label, dynamic_eval_from=a.dynamic_eval_from)
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.out).write_text(json.dumps(row, default=str) + "\n")
    for mode, res in row["modes"].items():
        print(f"{a.label} {mode}: worlds {res['worlds_128_count']}, readbacks {res['readbacks_exact_count']}, "
              f"memory-check EM {res['memory_action_em_count']}, recovery NLL {res['recovery_nll']:.3f}, "
              f"action NLL {res['action_nll']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
