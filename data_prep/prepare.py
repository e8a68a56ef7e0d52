"""Import raw trajectories, validate, render, capacity-filter, split and write a verified manifest.

    python data_prep/prepare.py --inputs PATHS... --out DIR [--capacity N] [--test-fraction F] [--seed S]
                                [--allow-rejects] [--model DIR] [--hub-pin PIN.json [--hub-mirror URL|DIR]]
                                [--trim-vocab] [--train-only PATHS...]

PATHS: ATIF *.json (continuations `*.cont-N.json` beside their parent), Terminus-2 trial folders,
OpenAI-messages / canonical *.jsonl, or folders of these. With --hub-pin the pinned files are
downloaded (sha256-verified) into DIR/raw/ first and imported too. Exit status 1 when any record was
rejected (see DIR/rejects.jsonl) unless --allow-rejects; 2 on a hub error.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_ttt.data.hub import HubError, download_pinned, load_pin  # noqa: E402
from ds_ttt.data.manifest import prepare  # noqa: E402
from ds_ttt.data.summary import format_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", nargs="*", default=[])
    ap.add_argument("--train-only", nargs="*", default=[],
                    help="supplementary trajectories that always go to the train split (the held-out split of --inputs is unchanged)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--capacity", type=int, default=4096, help="max tokens of a retained prefix")
    ap.add_argument("--test-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-rejects", action="store_true")
    ap.add_argument("--trim-vocab", action="store_true",
                    help="compact Qwen3 vocabulary (the train split's tokens + byte fallback) for small models trained from scratch")
    ap.add_argument("--model", default=None, help="local Qwen3 checkpoint dir whose tokenizer to use")
    ap.add_argument("--hub-pin", default=None, help="JSON pin {repo_id, revision, files: {path: sha256}}")
    ap.add_argument("--hub-mirror", default=None, help="local dir, file:// or http(s):// mirror (HF URL layout)")
    ap.add_argument("--hub-timeout", type=float, default=5.0)
    args = ap.parse_args(argv)

    inputs = list(args.inputs)
    hub = None
    if args.hub_pin:
        pin = load_pin(args.hub_pin)
        try:
            paths = download_pinned(pin["repo_id"], pin["revision"], pin["files"], Path(args.out) / "raw",
                                    mirror=args.hub_mirror, timeout=args.hub_timeout)
        except HubError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        inputs += [str(p) for p in paths]
        hub = {"repo_id": pin["repo_id"], "revision": pin["revision"], "files": pin["files"], "mirror": args.hub_mirror}
    if not inputs:
        ap.error("no inputs (give --inputs and/or --hub-pin)")
    res = prepare(inputs, args.out, capacity=args.capacity, test_fraction=args.test_fraction, seed=args.seed,
                  allow_rejects=args.allow_rejects, model_dir=args.model, progress=True, hub=hub,
                  trim_vocab=args.trim_vocab, train_only=args.train_only)
    if res.manifest is None:
        print(f"error: {res.message}", file=sys.stderr)
        return res.exit_code
    m = res.manifest
    rows = []
    for s, info in m["splits"].items():
        t = info["tokens"]
        rows.append([s, info["num_trajectories"], info["num_groups"], info["num_rounds"], t["context"], t["action"], t["observation"], t["total"]])
    print(format_table(rows, ["split", "trajectories", "groups", "rounds", "context tok", "action tok", "observation tok", "total tok"]))
    print(format_table([[k, v] for k, v in [
        ("imported", sum(m["imported_by_format"].values())),
        *[(f"  from {k}", v) for k, v in sorted(m["imported_by_format"].items())],
        ("  of them train-only (--train-only)", m["num_train_only"]),
        ("rejected (rejects.jsonl)", m["num_rejects"]),
        (f"excluded by capacity {m['capacity']}", len(m["excluded_by_capacity"])),
        ("skipped non-trajectory files", len(m["skipped_files"])),
        ("train/test overlap", m["split_check"]["overlap_ids"]),
    ]], ["", "count"]))
    print(f"manifest: {res.out_dir / 'manifest.json'}  tokenizer sha256 {m['tokenizer']['hash'][:16]}…")
    if res.num_rejects:
        print(f"warning: {res.num_rejects} record(s) rejected (allowed by --allow-rejects), see {res.rejects_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
