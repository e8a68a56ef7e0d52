"""Build the held-out sets of the fair comparison: memory worlds, memory-check and recovery episodes.

    .venv/bin/python evals/heldout_sets.py --manifest DATA/manifest.json --out SETS [--split test|dev] \
        [--worlds 128] [--memory 100] [--recovery 200]

Fresh episodes whose task prompts never appear in the manifest's train split, memory worlds from the
held-out pool on the split's seeds (dev: choose settings; test: report). Writes SETS/*.jsonl and
SETS/sets.json (seeds, counts, sha256). Details: ds_ttt/evaluation/comparison.py.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from ds_ttt.evaluation.comparison import EPISODE_SEEDS, build_heldout_sets

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", required=True, help="the training manifest (its train split's prompts are excluded)")
    p.add_argument("--out", required=True)
    p.add_argument("--split", choices=sorted(EPISODE_SEEDS), default="test")
    p.add_argument("--worlds", type=int, default=128)
    p.add_argument("--memory", type=int, default=100, help="memory-check rounds to reach")
    p.add_argument("--recovery", type=int, default=200, help="recovery rounds to reach")
    a = p.parse_args(argv)
    info = build_heldout_sets(a.manifest, a.out, split=a.split, num_worlds=a.worlds, num_memory=a.memory,
                              num_recovery=a.recovery)
    print(json.dumps(info["files"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
