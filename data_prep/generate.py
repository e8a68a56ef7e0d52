"""Generate trajectories by running scripted expert policies in real bash sandboxes.

    python data_prep/generate.py --out DIR --num N --seed S [--workers W] [--family memory|error_recovery|explore_edit]

Writes DIR/trajectories.jsonl (canonical) and DIR/atif/<id>.json (ATIF), then prints a summary table
(families, rounds, tokens by kind with the Qwen3 tokenizer, speed). Deterministic for a seed.
Feed either output to data_prep/prepare.py (not both: the ids would collide).
"""

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_ttt.data.generator import FAMILY_NAMES, generate, write_outputs  # noqa: E402
from ds_ttt.data.render import TokenKind, render_trajectory  # noqa: E402
from ds_ttt.data.sandbox import network_isolation_available  # noqa: E402
from ds_ttt.data.summary import format_table  # noqa: E402
from ds_ttt.data.tokenizer import build_qwen3_tokenizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--family", choices=FAMILY_NAMES, default=None)
    ap.add_argument("--no-token-stats", action="store_true", help="skip tokenizing for the summary")
    args = ap.parse_args(argv)

    if not network_isolation_available():
        print("note: unshare -rn unavailable; commands run without a network namespace (they never use the network)", file=sys.stderr)
    t0 = time.time()
    trajs = generate(args.num, args.seed, workers=args.workers, progress=True, family=args.family)
    gen_s = time.time() - t0
    paths = write_outputs(trajs, args.out)
    stats = collections.defaultdict(lambda: collections.Counter())
    tok = None if args.no_token_stats else build_qwen3_tokenizer()
    for t in trajs:
        s = stats[t["meta"]["family"]]
        s["trajectories"] += 1
        s["rounds"] += t["meta"]["num_rounds"]
        s["failed"] += not t["meta"]["success"]
        if tok is not None:
            r = render_trajectory(t, tok)
            s["tokens"] += len(r)
            s["action"] += r.count(TokenKind.ACTION)
            s["observation"] += r.count(TokenKind.OBSERVATION)
            s["max_tokens"] = max(s["max_tokens"], len(r))
    rows = []
    for fam in sorted(stats):
        s = stats[fam]
        n = s["trajectories"]
        rows.append([fam, n, s["failed"], f"{s['rounds'] / n:.1f}", f"{s['tokens'] / n:.0f}", s["max_tokens"], s["action"], s["observation"]])
    print(format_table(rows, ["family", "trajectories", "failed", "rounds/traj", "tokens/traj", "max tokens", "action tok", "observation tok"]))
    print(f"generated {len(trajs)} trajectories in {gen_s:.1f}s ({len(trajs) / max(gen_s, 1e-9):.0f}/s); "
          f"wrote {paths['jsonl']} and {paths['atif']}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
