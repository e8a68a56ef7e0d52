"""Peak memory of one last-stage meta-step, before (a git ref) and after (this tree), side by side.

    .venv/bin/python benchmarks/ttt_memory.py                      # ~6 min on 2 cores, run alone
        [--ref 5fcd2aa] [--events 4,8,16,32] [--out benchmarks/results/ttt_memory]

What is measured. A scaled model whose fast weights dominate: Qwen3 architecture, hidden 512, MLP and
prime width 2048, 3 layers (the last 2 adaptive; the frozen one gives the stage its input), one
attention head of 128 (the reference attention is O(N^2) in memory on the CPU, FlashBoB on a GPU is
not: one head keeps its share small), vocab 512, bf16 (the
fp32 fast-weight path of a bf16 model: split_linear), reference attention. One trajectory: a 32-token
prompt, then E rounds of 256 tokens (header 2, action 48, separator 1, observation 204, separator 1),
so E inner updates. One step = `model.trajectory_loss(..., create_graph=True)` (the event loop with the
recipe's per-event checkpointing) then `loss.backward()`, the output dropped before the backward as
the trainer drops it. Each (side, E) runs in a fresh process; the peak is torch.profiler's CPU
allocator "Total Allocated", which counts what is allocated while the profiler runs: the step's own
memory (the weights, allocated before, are not in it; the GPU recording's max_memory_allocated has them).

Each side runs with its own tree's recipe: the TTT block of ds_configs/run_qwen3_8b.json at that ref
(before: gate, up and down fast; after: the recipe as shipped), with adaptive_layers=2 and the
reference backend. `after_all_fast` runs this tree with the old recipe's fast matrices, to separate
what the code saves from what the recipe saves.

Unit: one fp32 copy of the three prime matrices (gate, up, down) of the adaptive layers, whichever of
them are fast (3 x 512 x 2048 x 2 layers x 4 B = 24 MiB), so choosing fewer fast matrices counts.
Fit: peak = intercept + slope x E by least squares, in units.

Projection. `ds_ttt.train.memory_budget` is the trainer's pre-flight estimate of the busiest rank
(Qwen3-8B last stage at 8K..64K, PP1 and PP2, ZeRO-1, optimizer offload where DeepSpeed allows it).
Two projections: (1) 'fit': the H200 recording of the code before at 2K
(benchmarks/results/gpu/last_stage.json), carried by this run's fits in units (the fast-weight terms
scale with the fast parameters; docs/training.md "Memory at long context"); checked first on the code
before: the 2K recording and the before slope must give the 8K recording (100.1 GiB) and the 16K OOM.
(2) the trainer's pre-flight estimate for each layout.

Writes OUT.json (`before` / `after` / `after_all_fast`: points, `slope_copies_per_event`,
`intercept_copies`; `projection`: {tokens, layout, busiest_rank_gib, fits_80gb}), OUT.md and OUT.png.
Load average is recorded at start and end (peaks do not depend on it; the step times do).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_REF = "5fcd2aa"  # the code the H200 recording measured (fp32 fast weights checkpointed per event)
HIDDEN, WIDTH, LAYERS, VOCAB = 512, 2048, 2, 512
PROMPT, HEADER, ACTION, SEP, OBSERVATION = 32, 2, 48, 1, 204
ROUND = HEADER + ACTION + SEP + OBSERVATION + SEP  # 256
UNIT_BYTES = 3 * HIDDEN * WIDTH * LAYERS * 4
MIB = 2**20


# ---- the probe: one step in this process (run with PYTHONPATH at the side's tree) ------------------------
def probe(events: int, recipe: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=LAYERS + 1, hidden_size=HIDDEN, intermediate_size=WIDTH,
                            num_attention_heads=1, num_key_value_heads=1, head_dim=128, vocab_size=VOCAB)
    ttt = dict(recipe, adaptive_layers=LAYERS, attention_backend="reference", prime_intermediate_size=None)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig.from_dict(ttt).validate(LAYERS + 1)).to(torch.bfloat16)
    model.set_trainable_scope()  # the recipe's (prime: the prime MLPs and their norms)
    with torch.no_grad():
        for layer in model.adaptive_layers:  # leave the zero init so every path carries signal
            layer.prime_mlp.down_proj.weight.normal_(0, 0.02)
    kinds = [0] * PROMPT + ([0] * HEADER + [1] * ACTION + [0] * SEP + [2] * OBSERVATION + [0] * SEP) * events
    rounds = [0] * PROMPT + [r for r in range(1, events + 1) for _ in range(ROUND)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, len(kinds)), generator=g)
    kinds_t, rounds_t = torch.tensor([kinds]), torch.tensor([rounds])

    def step():
        with torch.profiler.record_function("forward"):
            out = model.trajectory_loss(ids, kinds_t, rounds_t, create_graph=True)
            loss, updates = out.loss, out.num_updates
            del out
        loss.backward()
        return updates

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        updates = step()
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in trace
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    peak = max(a for _, a, _ in mem)
    fwd = next(e for e in trace if e.get("name") == "forward" and e.get("ph") == "X")
    held = [a for t, a, _ in mem if t <= fwd["ts"] + fwd["dur"]][-1]
    return {"events": events, "tokens": len(kinds), "updates": updates, "peak_bytes": int(peak),
            "held_after_forward_bytes": int(held), "step_wall_s": round(wall, 3),
            "peak_copies": peak / UNIT_BYTES, "held_copies": held / UNIT_BYTES}


# ---- the runner ---------------------------------------------------------------------------------------
def export_tree(ref: str, dest: pathlib.Path) -> pathlib.Path:
    """The tree of `ref` (git archive) under dest; refuses an unknown ref by name."""
    known = subprocess.run(["git", "cat-file", "-e", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        raise SystemExit(f"ttt_memory: --ref {ref} is not a commit of this clone (a shallow clone? "
                         "run `git fetch --unshallow`, or pass another ref)")
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "ds_ttt", "ds_configs"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    tree = dest / ref
    tree.mkdir(parents=True)
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(tree, filter="data")
    return tree


def recipe_of(tree: pathlib.Path) -> dict:
    return json.loads((tree / "ds_configs" / "run_qwen3_8b.json").read_text())["ttt"]


def run_side(tree: pathlib.Path, recipe: dict, events: list[int], label: str) -> dict:
    points = []
    for e in events:
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--probe", str(e), "--recipe", json.dumps(recipe)]
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"ttt_memory: the {label} probe at {e} events failed:\n{done.stderr[-3000:]}")
        point = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {label:15s} E={e:3d}  peak {point['peak_bytes'] / MIB:8.1f} MiB = {point['peak_copies']:6.2f} "
              f"copies  ({point['step_wall_s']:.1f} s)", flush=True)
        points.append(point)
    slope, intercept = fit([p["events"] for p in points], [p["peak_copies"] for p in points])
    held_slope, _ = fit([p["events"] for p in points], [p["held_copies"] for p in points])
    return {"tree": label, "ttt": recipe, "points": points, "slope_copies_per_event": slope,
            "intercept_copies": intercept, "held_after_forward_slope": held_slope}


def fit(x: list[float], y: list[float]) -> tuple[float, float]:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    return slope, my - slope * mx


def head_commit() -> str:
    """This tree's commit, with '+dirty' when ds_ttt/ or ds_configs/ differ from it (what 'after' ran)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "ds_ttt", "ds_configs"], cwd=ROOT).returncode != 0
    return head + ("+dirty" if dirty else "")


def load() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default=DEFAULT_REF, help="the 'before' commit (default %(default)s)")
    ap.add_argument("--events", default="4,8,16,32", help="event counts (>= 3 of them)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ttt_memory"))
    ap.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe is not None:
        print(json.dumps(probe(args.probe, json.loads(args.recipe))))
        return 0
    events = sorted({int(e) for e in args.events.split(",")})
    if len(events) < 3:
        raise SystemExit(f"ttt_memory: --events needs >= 3 event counts for a slope and its check, got {events}")
    started, load_start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), load()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        old = export_tree(args.ref, pathlib.Path(tmp))
        old_recipe, new_recipe = recipe_of(old), recipe_of(ROOT)
        print(f"ttt_memory: before = {args.ref} ({old_recipe.get('fast_matrices', 'all')} fast), "
              f"after = this tree ({new_recipe.get('fast_matrices', 'all')} fast); load {load_start}", flush=True)
        before = run_side(old, old_recipe, events, f"before {args.ref}")
        after = run_side(ROOT, new_recipe, events, "after")
        after_all = run_side(ROOT, dict(new_recipe, fast_matrices=old_recipe.get("fast_matrices", "all")), events,
                             "after, all fast")
    res = {"benchmark": "ttt_memory", "started": started, "load_start": load_start, "load_end": load(),
           "seconds": round(time.perf_counter() - t0, 1), "ref": args.ref, "after_commit": head_commit(),
           "model": {"hidden": HIDDEN, "prime_width": WIDTH, "adaptive_layers": LAYERS, "vocab": VOCAB,
                     "dtype": "bfloat16", "attention": "reference", "round_tokens": ROUND, "prompt_tokens": PROMPT},
           "unit": "one fp32 copy of gate, up and down of every adaptive layer",
           "unit_bytes": UNIT_BYTES, "method": "torch.profiler(profile_memory=True): the CPU allocator's 'Total "
                                                "Allocated' peak over the step (allocations while profiling: the "
                                                "weights excluded); one fresh process per point",
           "before": before, "after": after, "after_all_fast": after_all}
    res.update(projection(res))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_md(res))
    render_png(res, out.with_suffix(".png"))
    print(f"ttt_memory: wrote {out}.{{json,md,png}} in {res['seconds']:.0f} s (load {load_start} -> {res['load_end']})")
    return 0


# ---- Qwen3-8B --------------------------------------------------------------------------------------------
RECORDING = ROOT / "benchmarks" / "results" / "gpu" / "last_stage.json"  # the H200 run of the code before
BENCH_PROMPT, BENCH_ROUND, BENCH_OBS_START = 512, 1028, 259  # gpu_check/bench_last_stage.py's trajectory
PROJECTED_TOKENS = (8192, 16384, 32768, 65536)
FITS_GIB = 78.0  # an 80 GB GPU less the CUDA context and allocator slack (pipeline_balance's USABLE_80GB)


def updates_at(tokens: int) -> int:
    """Inner updates of the GPU check's trajectory at `tokens` (rounds whose observation is in the cut)."""
    return math.ceil((tokens - BENCH_PROMPT - BENCH_OBS_START) / BENCH_ROUND)


def projection(res: dict) -> dict:
    """Qwen3-8B from this run's fits: the check of the code before against the H200 recording, the last
    stage after, and every layout's busiest rank from the trainer's own estimate (memory_budget)."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import qwen3_8b_config
    from ds_ttt.train import memory_budget
    from ds_ttt.train.memory_budget import GIB, Layout

    cfg = qwen3_8b_config()
    rec = json.loads(RECORDING.read_text())
    rows = {r["tokens"]: r for r in rec["rows"] if r.get("backend") == "cuda"}
    unit_8b = 9 * 3 * cfg.hidden_size * cfg.intermediate_size * 4 / GIB  # one fp32 copy of gate, up, down x 9
    b, a = res["before"], res["after"]
    base = rows[2048]["peak_bytes"] / GIB
    u2 = updates_at(2048)

    def before(t):  # the recording at 2K carried by the code before's measured slope
        return base + b["slope_copies_per_event"] * (updates_at(t) - u2) * unit_8b

    check = []
    for t in (8192, 16384):
        r = rows.get(t, {})
        got = (f"{r['peak_bytes'] / GIB:.1f} GiB measured" if r.get("status") == "ok"
               else f"{r.get('status', 'not run')} on the H200's {rec.get('gpu_memory_gib', 139.8)} GiB")
        check.append(f"before at {t // 1024}K: projected {before(t):.1f} GiB from the 2K recording "
                     f"({base:.1f} GiB) and the CPU slope; {got}")
    ttt = TTTConfig.from_dict(json.loads((ROOT / "ds_configs" / "run_qwen3_8b.json").read_text())["ttt"]).validate(
        cfg.num_hidden_layers)
    proj = []
    for t in PROJECTED_TOKENS:
        for lay in (Layout(1, 4), Layout(2, 2), Layout(1, 4, offload_optimizer=True),
                    Layout(2, 2, offload_optimizer=True)):
            e = memory_budget.estimate(cfg, ttt, tokens=t, round_tokens=BENCH_ROUND, layout=lay)
            proj.append({"tokens": t, "layout": lay.describe(), "busiest_rank_gib": round(e.total_gib, 1),
                         "fits_80gb": e.total_gib <= FITS_GIB, "method": "memory_budget.estimate",
                         "parts_gib": {k: round(v, 2) for k, v in e.parts_gib.items()}})
    note = (f"Unit at 8B: one fp32 copy of gate, up and down of the 9 adaptive layers = {unit_8b:.2f} GiB. "
            "Every row is the trainer's pre-flight estimate of the busiest rank (ds_ttt/train/memory_budget.py: "
            "the last stage's weights, trainable state under ZeRO-1 with dp ranks, stored updates, fp32 "
            "fast-weight work buffers, KV chunks, hidden states, one event's activations), rounds of 1,028 "
            "tokens. Offload: DeepSpeed's ZeRO-Offload of the optimizer to the CPU "
            "(zero_optimization.offload_optimizer), projected, not run. "
            f"Recipe: ds_configs/run_qwen3_8b.json (fast_matrices={ttt.fast_matrices!r}).")
    # the same estimate on this run's CPU model, beside what was measured (the profiler sees no weights;
    # the probe has no optimizer state: the offload layout's trainable state is the gradients alone)
    from ds_ttt.model.presets import tiny_qwen3_config

    small = tiny_qwen3_config(num_hidden_layers=LAYERS + 1, hidden_size=HIDDEN, intermediate_size=WIDTH,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=128, vocab_size=VOCAB)
    small_ttt = TTTConfig.from_dict(dict(a["ttt"], adaptive_layers=LAYERS, attention_backend="reference",
                                         prime_intermediate_size=None)).validate(LAYERS + 1)
    cpu_rows = []
    for pt in a["points"]:
        e = memory_budget.estimate(small, small_ttt, tokens=pt["tokens"], round_tokens=ROUND,
                                   layout=Layout(1, 1, offload_optimizer=True))
        modeled = (e.total_gib - e.parts_gib["weights"]) * GIB / UNIT_BYTES
        cpu_rows.append({"events": pt["events"], "measured_copies": round(pt["peak_copies"], 2),
                         "estimated_copies": round(modeled, 2),
                         "estimated_parts_copies": {k: round(v * GIB / UNIT_BYTES, 2) for k, v in e.parts_gib.items()
                                                    if k != "weights"}})
    return {"projection": proj, "recording_check": check, "projection_note": note, "estimate_on_cpu_model": cpu_rows,
            "unit_8b_gib": unit_8b, "recording": str(RECORDING.relative_to(ROOT))}


def render_md(res: dict) -> str:
    lines = [f"# Last-stage meta-step memory, before ({res['ref']}) and after ({res['after_commit']})", "",
             f"Run {res['started']}, {res['seconds']:.0f} s, load {res['load_start']} -> {res['load_end']}. "
             f"Model: hidden {HIDDEN}, prime width {WIDTH}, {LAYERS} adaptive layers, bf16, rounds of {ROUND} "
             f"tokens. Unit: {res['unit']} ({UNIT_BYTES / MIB:.1f} MiB). {res['method']}.", "",
             "| side | fast | events | tokens | peak MiB | copies | step s |", "|---|---|---|---|---|---|---|"]
    for key in ("before", "after", "after_all_fast"):
        side = res[key]
        for p in side["points"]:
            lines.append(f"| {key} | {side['ttt'].get('fast_matrices', 'all')} | {p['events']} | {p['tokens']} | "
                         f"{p['peak_bytes'] / MIB:.1f} | {p['peak_copies']:.2f} | {p['step_wall_s']:.1f} |")
    lines += ["", "| side | peak slope (copies / event) | peak intercept (copies) | held after forward, slope |",
              "|---|---|---|---|"]
    for key in ("before", "after", "after_all_fast"):
        lines.append(f"| {key} | {res[key]['slope_copies_per_event']:.3f} | {res[key]['intercept_copies']:.2f} | "
                     f"{res[key]['held_after_forward_slope']:.3f} |")
    lines += ["", "## Qwen3-8B projection (ds_ttt.train.memory_budget)", "", res["projection_note"], "",
              "| tokens | layout | busiest rank GiB | fits 80 GB |", "|---|---|---|---|"]
    for p in res["projection"]:
        lines.append(f"| {p['tokens']} | {p['layout']} | {p['busiest_rank_gib']:.1f} | {'yes' if p['fits_80gb'] else 'no'} |")
    lines += ["", "The code before, carried from the H200 recording at 2K by its CPU slope (the unit transfers):", ""]
    for c in res["recording_check"]:
        lines.append(f"- {c}")
    lines += ["", "The estimate on this run's CPU model (after; weights excluded, as the profiler excludes them):", "",
              "| events | measured copies | estimated copies | estimated parts |", "|---|---|---|---|"]
    for r in res["estimate_on_cpu_model"]:
        parts = ", ".join(f"{k} {v}" for k, v in r["estimated_parts_copies"].items())
        lines.append(f"| {r['events']} | {r['measured_copies']} | {r['estimated_copies']} | {parts} |")
    return "\n".join(lines) + "\n"


def render_png(res: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, style in (("before", "o-"), ("after", "s-"), ("after_all_fast", "^--")):
        side = res[key]
        xs = [p["events"] for p in side["points"]]
        a.plot(xs, [p["peak_copies"] for p in side["points"]], style,
               label=f"{key} ({side['slope_copies_per_event']:.2f}/event + {side['intercept_copies']:.1f})")
    a.set_xlabel("events (inner updates)")
    a.set_ylabel("peak, fp32 copies of the prime matrices")
    a.set_title("CPU probe: one last-stage meta-step")
    a.legend(fontsize=8)
    layouts = sorted({p["layout"] for p in res["projection"]})
    for layout in layouts:
        pts = [p for p in res["projection"] if p["layout"] == layout]
        b.plot([p["tokens"] / 1024 for p in pts], [p["busiest_rank_gib"] for p in pts], "o-", label=layout)
    b.axhline(78.0, color="red", lw=0.8, ls="--", label="80 GB usable")
    b.set_xscale("log", base=2)
    b.set_xlabel("context (K tokens)")
    b.set_ylabel("busiest rank, GiB")
    b.set_title("Qwen3-8B projection (after)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
