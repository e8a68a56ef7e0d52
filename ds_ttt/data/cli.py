"""The command lines of `data_prep/`: each script there is `sys.exit(<name>_main(description=__doc__))`.

    python data_prep/generate.py --out DIR --num N --seed S [--workers W] [--family F] [--no-isolation] [--no-cgroup-caps]
    python data_prep/prepare.py --inputs PATHS... --out DIR [...]
    python data_prep/build_tokenizer.py --out DIR [--model LOCAL_QWEN3_DIR]

Living in the package, they are importable from tests and other tools without path tricks
(`from ds_ttt.data.cli import prepare_main`); the scripts keep their docstrings as the help text.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

from .summary import format_table


def _parser(description: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def generate_main(argv: list[str] | None = None, *, description: str | None = None) -> int:
    from ds_ttt.sandbox import SandboxError

    from .generator import FAMILY_NAMES, generate, write_outputs
    from .render import render_trajectory
    from .token_kind import TokenKind
    from .tokenizer import build_qwen3_tokenizer

    ap = _parser(description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--family", choices=FAMILY_NAMES, default=None)
    ap.add_argument("--no-token-stats", action="store_true", help="skip tokenizing for the summary")
    ap.add_argument("--no-isolation", action="store_true",
                    help="run the commands without the sandbox's namespaces (no network, write and process isolation) "
                         "where they are unavailable; each trajectory records meta.isolation")
    ap.add_argument("--no-cgroup-caps", action="store_true",
                    help="run each episode without a cgroup capping its total memory, processes and CPU, where none can "
                         "be made (an unprivileged user without cgroup delegation); each trajectory records meta.cgroup_caps")
    args = ap.parse_args(argv)

    isolation = "none" if args.no_isolation else "required"
    cgroup_caps = "none" if args.no_cgroup_caps else "required"
    if args.no_cgroup_caps:
        print("warning: --no-cgroup-caps: an episode's commands can use all of this machine's memory, processes and CPU",
              file=sys.stderr)
    if args.no_isolation:
        print("warning: --no-isolation: commands run with this machine's network, write access and process table",
              file=sys.stderr)
    t0 = time.time()
    try:
        trajs = generate(args.num, args.seed, workers=args.workers, progress=True, family=args.family, isolation=isolation,
                         cgroup_caps=cgroup_caps)
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    used = sorted({t["meta"]["isolation"] for t in trajs})
    caps = sorted({t["meta"]["cgroup_caps"] for t in trajs})
    print(f"generated {len(trajs)} trajectories in {gen_s:.1f}s ({len(trajs) / max(gen_s, 1e-9):.0f}/s), sandbox isolation "
          f"{'/'.join(used) or isolation}, cgroup caps {'/'.join(caps) or cgroup_caps}; wrote {paths['jsonl']} and "
          f"{paths['atif']}/")
    return 0


def prepare_main(argv: list[str] | None = None, *, description: str | None = None) -> int:
    from .hub import HubError, download_pinned, load_pin
    from .manifest import prepare

    ap = _parser(description)
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
        ("copies of imported trajectories (dropped)", len(m["duplicate_copies"])),
        ("rejected (rejects.jsonl)", m["num_rejects"]),
        (f"excluded by capacity {m['capacity']}", len(m["excluded_by_capacity"])),
        ("skipped non-trajectory files", len(m["skipped_files"])),
        ("train/test overlap", m["split_check"]["overlap_ids"]),
    ]], ["", "count"]))
    print(f"manifest: {res.out_dir / 'manifest.json'}  tokenizer sha256 {m['tokenizer']['hash'][:16]}…")
    if res.num_rejects:
        print(f"warning: {res.num_rejects} record(s) rejected (allowed by --allow-rejects), see {res.rejects_path}", file=sys.stderr)
    return 0


def build_tokenizer_main(argv: list[str] | None = None, *, description: str | None = None) -> int:
    from .tokenizer import QWEN3_ADDED_TOKENS, load_tokenizer, save_tokenizer, tokenizer_hash

    ap = _parser(description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.model)
    save_tokenizer(tok, args.out)
    rows = [[c, tid, tok.convert_tokens_to_ids(c)] for tid, c, _ in QWEN3_ADDED_TOKENS if c in
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")]
    print(format_table(rows, ["token", "Qwen3 id", "our id"]))
    print(f"vocab {len(tok):,} (model embedding is padded to 151,936); saved to {args.out}; sha256 {tokenizer_hash(tok)}")
    return 0
