"""Serving many sessions at once: the batched server against today's server, on the same export, in one run.

    .venv/bin/python benchmarks/serve_concurrency.py           # ~17 min: 1,4,8,16 sessions, 256 tokens, 5 repeats + 12 paired rounds
    .venv/bin/python benchmarks/serve_concurrency.py --levels 1,8 --max-tokens 32 --repeats 1   # quick look
    (--without-today: only this tree's two servers, for an export today's server cannot load)
    .venv/bin/python benchmarks/serve_concurrency.py --against main --without-today --repeats 1   # before/after a change
    .venv/bin/python benchmarks/serve_concurrency.py --device cuda --shape qwen3-0.6b --levels 1,8,32 --only-batched

Three servers, each `python -m ds_ttt.serve.frontends.http` in its own process (OMP_NUM_THREADS=1 each, so the
comparison is per core, not per thread count), all loading one export (benchmarks/serve_decode.py's
model: the main job's `tiny-mem` preset and TTT settings, compact vocabulary, random init):

  today     the server as it was before batching (commit --base, unpacked with `git archive` into a
            temporary directory): every request decodes alone in its own worker thread
  unbatched this tree's server with --no-batching (the same per-request path, the new API/bounds)
  batched   this tree's server: one scheduler thread steps every active session's next token in one
            forward (ds_ttt/serve/scheduler.py, batch.py)

For each concurrency level N (default 1, 4, 8, 16) and each server, in turn (levels interleaved
across servers, --repeats times): N clients start together, each one conversation (its own task, so
its own session) asking one reply of --max-tokens at temperature 0 (greedy: the three servers
generate the same tokens). Measured per server and level (medians over repeats):
  aggregate tokens/s   all completion tokens / wall time from the first request sent to the last reply
  decode tokens/s      batched server only: tokens fed through its batched forwards / the scheduler's time
                       in them (GET /health "scheduler" before and after the level): the batch's decode
                       rate without the prefill and turn-end chunks interleaved with it; each step attends
                       for all its rows in one call per layer over the scheduler's KV pool (kv_pool.py)
  mean batch, sessions prefilled in batches   batched server only (JSON): rows per batched forward, and
                       how many of the level's new sessions had their round 0 prefilled together
                       (ds_ttt/serve/prefill.py)
  per-token latency    per request: its wall time / its completion tokens; p50 and p95 over requests
Then a paired phase (--pairs rounds): the batched server alone runs its levels back to back, and each
round gives the ratio of every level to one session measured side by side (this VM's speed drifts by
tens of percent over seconds, so ratios across the interleaved table above are noisier); reported as
the median with a bootstrap 95% interval over rounds.
--against REV: before and after a change, in one run on one machine. REV's batched server (REV's ds_ttt,
unpacked with `git archive` as today's is) joins the run as the server "against", in the table and in
the paired phase: each round runs both servers' levels, interleaved (which one goes first alternates by
round), and gives per level this tree's scaling ratio (n sessions / one, decode tokens/s) over REV's,
and this tree's decode rate over REV's, each the median with a bootstrap 95% interval over rounds.
--only-batched leaves out today's server and the unbatched one (the GPU check's serve_concurrency phase).
--shape: the backbone (tiny_qwen3_config arguments; the TTT settings stay the main job's): tiny-mem (the
default), wide (--wide: hidden 512, 8 layers) or qwen3-0.6b (Qwen3-0.6B's: hidden 1024, 28 layers, 16 / 8
heads of 128, intermediate 3072; untied head, compact vocabulary, random weights). --device cuda serves
on the GPU; gpu_check/bench_serve_concurrency.py runs it so, with --budget-s (fewer paired rounds when
time is short) and, on a machine without bubblewrap, --no-isolation.
What it ran on is recorded with the results: the CPU model (/proc/cpuinfo), the GPU's name with --device
cuda, the batched server's one-session decode rate (tokens/s), and the load average of all three windows
(1, 5, 15 min) at the start and the end.
Every request starts a new conversation with the same system prompt and tools, so from the warm-up on
this tree's servers take the system block from their prompt cache (ds_ttt/serve/prefix_cache.py), as a
fleet's sessions do; today's server prefills it every time.
The run starts only when the 1-minute load is below --max-load and no other measurement holds
/tmp/ds_ttt_measuring, which this run holds while it measures.
Results: benchmarks/results/serve_concurrency.{json,md} (--shape S: serve_concurrency_S.{json,md}); the
markdown is written by serve_concurrency_report.py beside this script.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import pathlib
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # its report module, beside it in benchmarks/
from serve_concurrency_report import markdown  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
DEFAULT_BASE = "187dd17"  # the last commit whose server decodes one request at a time
# --shape: the backbone (tiny_qwen3_config arguments) instead of tiny-mem's; the TTT settings stay the main job's
WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64}
QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128}
SHAPES = {"tiny-mem": None, "wide": WIDE, "qwen3-0.6b": QWEN3_0_6B}


def load_serve_decode():
    spec = importlib.util.spec_from_file_location("serve_decode", REPO / "benchmarks" / "serve_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def machine(device: str) -> dict:
    """What the run ran on: the CPU model, the GPU's name (device cuda), the core count, the platform."""
    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    gpu = None
    if device.startswith("cuda"):
        import torch
        gpu = torch.cuda.get_device_name()
    return {"cpu_model": cpu, "gpu": gpu, "device": device, "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}


def http_module(code_dir: pathlib.Path) -> str:
    """The OpenAI-compatible server's module in that tree (it moved into ds_ttt/serve/frontends/)."""
    return ("ds_ttt.serve.frontends.http" if (code_dir / "ds_ttt" / "serve" / "frontends" / "http.py").exists()
            else "ds_ttt.serve.http")


def unpack(rev: str, into: pathlib.Path) -> str:
    """REV's ds_ttt/ unpacked into `into` (git archive: the checkout is not touched); REV's full sha."""
    into.mkdir()
    archive = subprocess.run(["git", "archive", rev, "ds_ttt"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def start_server(name: str, code_dir: pathlib.Path, export: pathlib.Path, extra: list[str], log_dir: pathlib.Path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(code_dir))
    log = open(log_dir / f"{name}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", http_module(code_dir), "--model", str(export), "--port", "0",
                             "--max-sessions", "128", "--max-new-tokens", "512", *extra],
                            stderr=log, stdout=log, env=env, cwd=code_dir)
    deadline = time.time() + 600
    while time.time() < deadline:
        log.seek(0)
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read())
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server {name} exited {proc.returncode}:\n{log.read()[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"server {name} did not start")


def one_request(url: str, model: str, task: str, max_tokens: int, tools: list, system: str) -> dict:
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
            "tools": tools, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    t1 = time.perf_counter()
    r.raise_for_status()
    reply = r.json()
    return {"start": t0, "end": t1, "tokens": reply["usage"]["completion_tokens"],
            "text": json.dumps(reply["choices"][0]["message"], sort_keys=True)}


def scheduler_stats(url: str) -> dict | None:
    return httpx.get(f"{url}/health", timeout=60).json().get("scheduler")


def level(url: str, model: str, n: int, max_tokens: int, tools: list, system: str, tag: str) -> dict:
    tasks = [f"Task {tag}-{i}: count the lines of file{i}.txt and write the number to COUNT{i}." for i in range(n)]
    before = scheduler_stats(url)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda t: one_request(url, model, t, max_tokens, tools, system), tasks))
    after = scheduler_stats(url)
    wall = max(g["end"] for g in got) - min(g["start"] for g in got)
    per_token = sorted((g["end"] - g["start"]) / max(g["tokens"], 1) for g in got)
    decode = mean_batch = prefilled_together = None  # the batched server's own counters
    if before is not None and after is not None:
        decode = (after["rows"] - before["rows"]) / (after["decode_seconds"] - before["decode_seconds"])
        mean_batch = (after["rows"] - before["rows"]) / max(after["steps"] - before["steps"], 1)
        prefilled_together = after.get("prefill_rows", 0) - before.get("prefill_rows", 0)
    return {"tokens": sum(g["tokens"] for g in got), "wall_s": wall,
            "tokens_per_s": sum(g["tokens"] for g in got) / wall, "decode_tokens_per_s": decode,
            "mean_batch": mean_batch, "sessions_prefilled_in_batches": prefilled_together,
            "p50_ms": 1000 * statistics.median(per_token),
            "p95_ms": 1000 * per_token[min(len(per_token) - 1, int(round(0.95 * (len(per_token) - 1))))],
            "replies": [g["text"] for g in got]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=256, help="reply length (long enough that one session's level lasts ~1 s)")
    p.add_argument("--repeats", type=int, default=5, help="0: the table from the paired rounds alone")
    p.add_argument("--pairs", type=int, default=12, help="rounds of the batched server's levels back to back "
                   "(the paired scaling ratio)")
    p.add_argument("--base", default=DEFAULT_BASE, help="commit of today's (unbatched) server")
    p.add_argument("--max-load", type=float, default=2.5, help="wait until the 1-min load average is below this")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny-mem", help="the backbone (SHAPES); results of a "
                   "shape other than tiny-mem go to serve_concurrency_<shape>.{json,md}")
    p.add_argument("--wide", action="store_true",
                   help="--shape wide: a wider backbone (hidden 512, 8 layers), whose weights outweigh each session's "
                        "KV cache as an 8B model's do")
    p.add_argument("--device", default="cpu", help="the servers' device (cpu, cuda)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--without-today", action="store_true",
                   help="leave out today's server (--base): it cannot load an export whose model has a feature it "
                        "predates (the main job's round address), and fails at start with an unknown config key")
    p.add_argument("--only-batched", action="store_true", help="leave out today's server and the unbatched one")
    p.add_argument("--no-isolation", action="store_true", help="build the export's vocabulary from worlds run "
                   "without the sandbox (a machine without bubblewrap, e.g. the GPU check's)")
    p.add_argument("--budget-s", type=float, default=None, help="stop the paired rounds (after the first) when the "
                   "next would end past this many seconds from the start")
    p.add_argument("--against", metavar="REV", default=None,
                   help="also REV's batched server (a git revision, e.g. main or HEAD~1): the scaling ratio and the "
                        "decode rate of this tree over REV's, paired by round")
    args = p.parse_args(argv)
    args.shape = "wide" if args.wide else args.shape
    if args.repeats < 0 or args.pairs < 1:
        p.error("--repeats must be >= 0 and --pairs >= 1")
    args.level_list = [int(x) for x in args.levels.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = args.level_list
    waited = 0
    while os.getloadavg()[0] >= args.max_load or pathlib.Path("/tmp/ds_ttt_measuring").exists():
        if waited == 0:
            print(f"waiting for load < {args.max_load} (now {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        time.sleep(10)
        waited += 10
    load_start = os.getloadavg()
    marker = pathlib.Path("/tmp/ds_ttt_measuring")  # other work on this machine waits while it exists
    marker.write_text(f"benchmarks/serve_concurrency.py pid {os.getpid()}\n")
    try:
        return measure(args, levels, load_start)
    finally:
        marker.unlink(missing_ok=True)


def measure(args, levels: list[int], load_start: tuple) -> int:
    from ds_ttt.data.generator import BASH_TOOL, SYSTEM_PROMPT

    t0 = time.monotonic()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="serve_concurrency_"))
    export, model_info = load_serve_decode().build_export(tmp / "export", SHAPES[args.shape],
                                                          isolation="none" if args.no_isolation else "required")
    with_today = not (args.without_today or args.only_batched)
    base_sha = unpack(args.base, tmp / "today") if with_today else None  # (a copy of the tree may have no .git)
    against_sha = unpack(args.against, tmp / "against") if args.against else None
    device = ["--device", args.device] if args.device != "cpu" else []
    servers = {}
    try:
        if with_today:
            servers["today"] = start_server("today", tmp / "today", export, device, tmp)
        if not args.only_batched:
            servers["unbatched"] = start_server("unbatched", REPO, export, ["--no-batching", "--max-active", "32", *device],
                                                tmp)
        servers["batched"] = start_server("batched", REPO, export, ["--max-active", "32", *device], tmp)
        if args.against:
            servers["against"] = start_server("against", tmp / "against", export, ["--max-active", "32", *device], tmp)
        model = "export"
        for name, (_, url) in servers.items():  # warm-up
            level(url, model, 1, 8, [BASH_TOOL], SYSTEM_PROMPT, f"warm-{name}")
        runs: dict = {name: {n: [] for n in levels} for name in servers}
        for rep in range(args.repeats):
            for n in levels:
                for name, (_, url) in servers.items():
                    res = level(url, model, n, args.max_tokens, [BASH_TOOL], SYSTEM_PROMPT, f"r{rep}")
                    runs[name][n].append(res)
                    dec = f"  decode {res['decode_tokens_per_s']:.1f} tok/s" if res["decode_tokens_per_s"] else ""
                    print(f"rep {rep} N={n:2d} {name:9s} {res['tokens_per_s']:8.1f} tok/s{dec}  p50 {res['p50_ms']:.1f} ms"
                          f"  p95 {res['p95_ms']:.1f} ms  ({res['tokens']} tokens, {res['wall_s']:.2f} s)",
                          file=sys.stderr, flush=True)
        # the batched server(s) alone, levels back to back in rounds: the scaling ratio measured side by side;
        # with --against both trees' servers in each round, the one going first alternating by round
        paired: dict = {name: {n: [] for n in levels} for name in ("batched", "against") if name in servers}
        rounds_start = time.monotonic()
        for rnd in range(args.pairs):
            per_round = (time.monotonic() - rounds_start) / max(rnd, 1)
            if rnd and args.budget_s is not None and time.monotonic() - t0 + 1.2 * per_round > args.budget_s:
                print(f"stopping after {rnd} paired rounds: the next would pass --budget-s {args.budget_s:.0f}",
                      file=sys.stderr, flush=True)
                break
            for name in (list(paired) if rnd % 2 == 0 else list(paired)[::-1]):
                for n in levels:
                    paired[name][n].append(level(servers[name][1], model, n, args.max_tokens, [BASH_TOOL],
                                                 SYSTEM_PROMPT, f"p{rnd}"))
                print(f"round {rnd} {name}: decode tokens/s " + ", ".join(
                    f"{n}: {paired[name][n][-1]['decode_tokens_per_s']:.0f}" for n in levels), file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=60)
    load_end = os.getloadavg()
    if args.repeats == 0:  # the table and its ratios from the paired rounds (levels back to back there too)
        runs = paired
    table = {}
    for name in runs:
        table[name] = {}
        for n in levels:
            rs = runs[name][n]
            table[name][n] = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "p50_ms", "p95_ms")}
            table[name][n]["tokens"] = rs[0]["tokens"]
            if rs[0]["decode_tokens_per_s"] is not None:
                for key in ("decode_tokens_per_s", "mean_batch", "sessions_prefilled_in_batches"):
                    table[name][n][key] = statistics.median(r[key] for r in rs)
    # the same greedy replies from every server (a check that they did the same work)
    first = next(iter(runs))
    same = all(runs[a][n][0]["replies"] == runs[first][n][0]["replies"] for a in runs for n in levels)
    ones = (runs["batched"][1] + ([] if runs is paired else paired["batched"][1])) if 1 in levels else []
    one = [r["decode_tokens_per_s"] for r in ones]
    pairs = len(paired["batched"][levels[0]])
    res = {"base_commit": base_sha, "model": model_info, "shape": args.shape, "levels": levels,
           "max_tokens": args.max_tokens, "repeats": args.repeats, "table": table, "same_replies": same,
           "machine": machine(args.device),
           "one_session_decode_tokens_per_s": statistics.median(one) if one else None,
           # ratios within each repeat (the levels of one repeat run back to back), then median [min, max]
           "speedup_vs_one": ratios(runs["batched"], runs["batched"], levels, "tokens_per_s", base=levels[0]),
           "decode_speedup_vs_one": ratios(runs["batched"], runs["batched"], levels, "decode_tokens_per_s",
                                           base=levels[0]),
           "speedup_vs_best_one": ratios(runs["batched"], best_single(runs, levels[0]), levels, "tokens_per_s",
                                         base=levels[0]),
           "speedup_vs_today": ratios(runs["batched"], runs["today"], levels, "tokens_per_s") if "today" in runs else {},
           "pairs": pairs, "pairs_planned": args.pairs, "isolation": "none" if args.no_isolation else "required",
           "paired_decode_speedup": paired_ratios(paired["batched"], levels, "decode_tokens_per_s"),
           "paired_speedup": paired_ratios(paired["batched"], levels, "tokens_per_s"),
           "against": against(paired, levels, args.against, against_sha) if args.against else None,
           "load_start": load_start, "load_end": load_end, "cpu_count": os.cpu_count(),
           "platform": platform.platform(), "python": platform.python_version()}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "serve_concurrency" if args.shape == "tiny-mem" else f"serve_concurrency_{args.shape}"
    res["wide"] = WIDE if args.shape == "wide" else None
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if same else 1


def ratios(num: dict, den: dict, levels: list[int], key: str, base: int | None = None) -> dict:
    """Per level n: num[n][r][key] / den[base or n][r][key] for each repeat r -> median, min, max."""
    out = {}
    for n in levels:
        rs = [a[key] / b[key] for a, b in zip(num[n], den[n if base is None else base])]
        out[n] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}
    return out


def median_interval(rs: list[float], resamples: int = 2000) -> dict:
    """The median of per-round values with a percentile-bootstrap 95% interval over rounds."""
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(rs, k=len(rs))) for _ in range(resamples))
    return {"median": statistics.median(rs), "lo": boot[int(0.025 * resamples)],
            "hi": boot[int(0.975 * resamples) - 1], "ratios": rs}


def paired_ratios(paired: dict, levels: list[int], key: str) -> dict:
    """Per level n: the ratio n / levels[0] within each round; its median with a bootstrap interval over rounds."""
    return {n: median_interval([a[key] / b[key] for a, b in zip(paired[n], paired[levels[0]])]) for n in levels}


def against(paired: dict, levels: list[int], rev: str, sha: str) -> dict:
    """--against: per level, within each round, this tree's scaling ratio (decode tokens/s at n sessions over
    one) over REV's, and this tree's decode rate over REV's; medians with bootstrap intervals over rounds."""
    key = "decode_tokens_per_s"
    mine, theirs = paired_ratios(paired["batched"], levels, key), paired_ratios(paired["against"], levels, key)
    return {"rev": rev, "commit": sha, "paired_decode_speedup": theirs,
            "scaling_ratio_over_against": {n: median_interval([a / b for a, b in zip(mine[n]["ratios"],
                                                                                     theirs[n]["ratios"])])
                                           for n in levels},
            "decode_over_against": {n: median_interval([a[key] / b[key] for a, b in zip(paired["batched"][n],
                                                                                        paired["against"][n])])
                                    for n in levels}}


def best_single(runs: dict, one: int) -> dict:
    """Per repeat, the fastest server at one session (the strongest single-session baseline)."""
    reps = len(runs["batched"][one])
    return {one: [max((runs[name][one][r] for name in runs), key=lambda x: x["tokens_per_s"]) for r in range(reps)]}


if __name__ == "__main__":
    sys.exit(main())
