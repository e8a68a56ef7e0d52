"""Held-out evaluation of a TTT checkpoint or export: ttt (fast weights adapt) vs frozen, side by side.

    .venv/bin/python evals/evaluate.py --checkpoint RUN_OR_EXPORT --manifest DATA/manifest.json --out EVAL \
        [--limit N] [--device cpu] [--no-plots] [--context-policy {full,window,current_round} [--window N]] \
        [--attention-backend {auto,reference,cpu,cuda}]

Reads only the manifest's test split. Writes EVAL/results.json (summary, per round, per family, per
trajectory per round; exposure label; checkpoint, manifest and config hashes), EVAL/summary.md and
EVAL/loss_vs_round.png, EVAL/exact_vs_round.png. --context-policy overrides the model's trained
context policy (default: the trained one); results record both. --attention-backend picks the
inner loop's attention kernel: `reference` (default; O(N^2) memory), `auto` (the FlashBoB kernel of
the device: cuda on a GPU, cpu on a CPU; O(N) memory, for long contexts), `cpu`, `cuda`; the results
record the concrete backend (`attention_backend`). Metrics: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from ds_ttt.config import ATTENTION_BACKENDS, CONTEXT_POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training run / checkpoint directory, or an export directory")
    p.add_argument("--manifest", required=True, help="prepared data (DIR or DIR/manifest.json); its test split is used")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N test trajectories")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES, default=None,
                   help="evaluate under this context policy instead of the model's trained one (recorded with both)")
    p.add_argument("--window", type=int, default=None,
                   help="attention window (tokens) for --context-policy window, if the model was not trained with one")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention kernel: reference (default), auto (cuda on a GPU, cpu kernel on a CPU), cpu, cuda")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    from ds_ttt.evaluation.heldout import run_heldout
    from ds_ttt.evaluation.report import markdown_summary

    results = run_heldout(args.checkpoint, args.manifest, args.out, device=args.device, limit=args.limit,
                          plots=not args.no_plots, context_policy=args.context_policy, window=args.window,
                          attention_backend=args.attention_backend)
    print(markdown_summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
