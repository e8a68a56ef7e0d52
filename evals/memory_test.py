"""Memory test: 32 fresh generated worlds, two keys each, read back rounds later (ttt vs frozen).

    .venv/bin/python evals/memory_test.py --checkpoint RUN_OR_EXPORT --out MEM [--num-worlds 32] \
        [--seed-base 1000000] [--device cpu] [--context-policy {full,window,current_round} [--window N]] \
        [--attention-backend {auto,reference,cpu,cuda}]

Reports x/32 worlds passed (both readbacks exact) and y/64 exact readbacks for ttt and frozen under
the model's configured context policy (or --context-policy; results record both); writes
MEM/results.json and MEM/summary.md. A readback is exact when the `cat` output is predicted
greedily from the command, end token included. --attention-backend: `reference` (default, O(N^2)
memory), `auto` (cuda on a GPU, the cpu kernel on a CPU), `cpu`, `cuda`; recorded in the results.
Details: ds_ttt/evaluation/memory.py, docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from ds_ttt.config import ATTENTION_BACKENDS, CONTEXT_POLICIES
    from ds_ttt.evaluation.memory import MEMORY_SEED_BASE

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training run / checkpoint directory, or an export directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-worlds", type=int, default=32)
    p.add_argument("--seed-base", type=int, default=MEMORY_SEED_BASE, help="world seeds are seed_base + i")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES, default=None,
                   help="evaluate under this context policy instead of the model's trained one (recorded with both)")
    p.add_argument("--window", type=int, default=None,
                   help="attention window (tokens) for --context-policy window, if the model was not trained with one")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention kernel: reference (default), auto (cuda on a GPU, cpu kernel on a CPU), cpu, cuda")
    args = p.parse_args(argv)
    from ds_ttt.evaluation.memory import markdown, run_memory_test

    results = run_memory_test(args.checkpoint, args.out, num_worlds=args.num_worlds, seed_base=args.seed_base,
                              device=args.device, context_policy=args.context_policy, window=args.window,
                              attention_backend=args.attention_backend)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
