"""PP4 step time under trainable_scope='prime' before and after frozen stages stopped running a backward.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frozen_stage_backward.py --before REV [--after REV]
        [--steps 6] [--repeats 3] [--out benchmarks/results]

Under 'prime' stages 0-2 hold no trainable parameter. Before (e.g. commit 8a7fc85) a zero-effect
`stage_anchor` made their outputs require grad, so DeepSpeed ran a full backward through every frozen
layer only to produce zeros; after, those boundaries carry integer views of the hidden states and no
gradient (ds_ttt/train/pipeline.py), so the frozen stages run forward only.

Both revisions are extracted with `git archive` into temporary trees and run with the same worker
(this file, `--mode worker`, one torchrun launch of 4 CPU ranks over gloo per measurement, the tree on
PYTHONPATH): the real DeepSpeed pipeline engine (ZeRO-1, clipping, AdamW) on the same synthetic global
batch (built once by this tree's ds_ttt.data.synthetic and handed to every worker as JSON, since an
older tree may lack that module), one warm-up step, then `--steps` timed optimizer steps. The launches alternate before/after
`--repeats` times (the machine is shared: interleaving spreads the load drift over both). Reported per
revision, medians over all timed steps: the wall step time, the process CPU seconds per step summed
over the 4 ranks (the work done; robust to waiting for a shared core) and the CPU seconds each stage
spends in DeepSpeed's BackwardPass instructions; and the before/after ratios. Model: the
tiny 8-layer Qwen3 (hidden 128, vocab 4096), 2 adaptive layers on stage 3 and 2 frozen layers on each
of stages 0-2 (the 27:9 split of Qwen3-8B in miniature); global batch 4 = 1 x 4 x 1 of 512-token
trajectories (4 rounds of 128 tokens); attention_backend 'reference'.
Writes OUT/frozen_stage_backward.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROUND = dict(header=8, action=40, observation=80, separator=0)  # one event: header, action, observation
NUM_ROUNDS, GAS, VOCAB = 4, 4, 4096
DATA_SEED = 1
TTT = dict(adaptive_layers=2, trainable_scope="prime", attention_backend="reference", inner_lr=0.1)


def trajectories() -> list[list[list[int]]]:
    """The global batch: GAS trajectories of NUM_ROUNDS rounds (numbered from 0, no prompt) as
    [ids, kinds, rounds] lists, ids drawn in turn from one generator."""
    import torch

    from ds_ttt.data.synthetic import synthetic_trajectory

    g = torch.Generator().manual_seed(DATA_SEED)
    return [[t.tolist() for t in synthetic_trajectory(vocab_size=VOCAB, generator=g, num_rounds=NUM_ROUNDS,
                                                      first_round=0, **ROUND)] for _ in range(GAS)]


def worker(args) -> None:
    """One 4-rank run of the pipeline engine (whichever ds_ttt PYTHONPATH provides)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_ttt
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.train.data_loader import Sample, TrajectoryBatches
    from ds_ttt.train.pipeline import TTTPipelineModule
    try:
        from ds_ttt.train.layout import resolve_layout
    except ImportError:  # revisions before run_config.py was split
        from ds_ttt.train.run_config import resolve_layout

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = tiny_qwen3_config(hidden_size=128, intermediate_size=256, head_dim=32, vocab_size=VOCAB)
    ttt = TTTConfig(**TTT)
    torch.manual_seed(0)
    module = TTTPipelineModule(cfg, ttt, resolve_layout(4, cfg.num_hidden_layers, ttt), seed=0)
    ds = {"train_batch_size": GAS, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS,
          "pipeline": {"stages": 4, "activation_checkpoint_interval": 1, "use_reentrant": False},
          "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()
                                                                          if p.requires_grad], config=ds)
    data = json.loads(pathlib.Path(args.samples).read_text())
    samples = [Sample(f"s{i}", ids, kinds, rounds) for i, (ids, kinds, rounds) in enumerate(data)]
    batches = TrajectoryBatches(samples, num_samples=GAS, train_batch_size=GAS, micro_batch_size=1,
                                gradient_accumulation_steps=GAS, dp_rank=0, dp_size=1, seed=0, bucket=64,
                                capacity=len(data[0][0]))
    it = batches.iterate(0)
    last = module.last_stage_layer()
    # CPU seconds this rank spends in DeepSpeed's BackwardPass instructions (process CPU time: on shared
    # cores it counts the work done, not the time spent waiting for a core).
    backward_cpu = [0.0]
    from deepspeed.runtime.pipe import schedule
    timed_map = dict(engine._INSTRUCTION_MAP)
    plain_backward = timed_map[schedule.BackwardPass]

    def timed_backward(self, buffer_id):
        t0 = time.process_time()
        plain_backward(self, buffer_id)
        backward_cpu[0] += time.process_time() - t0
    timed_map[schedule.BackwardPass] = timed_backward
    engine._INSTRUCTION_MAP = timed_map
    rows = []
    for step in range(args.steps + 1):
        if last is not None and hasattr(last, "set_objective"):  # revisions with the token-weighted objective
            from ds_ttt.train.engine import set_step_objective
            set_step_objective(last, engine, batches, step, ttt)
        dist.barrier()
        backward_cpu[0] = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        engine.train_batch(data_iter=it)
        cpu = time.process_time() - c0
        dist.barrier()
        rows.append([time.perf_counter() - t0, cpu, backward_cpu[0]])
    mine = torch.tensor(rows, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        per_rank = torch.stack(every)[:, 1:]  # [rank, timed step, (wall, cpu, backward cpu)]
        pathlib.Path(args.result).write_text(json.dumps({
            "ds_ttt": ds_ttt.__file__, "step_s": per_rank[0, :, 0].tolist(),
            "cpu_s_per_step_all_ranks": per_rank[:, :, 1].sum(0).tolist(),
            "backward_cpu_s_per_step_by_stage": per_rank[:, :, 2].T.tolist()}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extract(rev: str, dest: pathlib.Path) -> str:
    sha = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha, "ds_ttt"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha


def measure(tree: pathlib.Path, steps: int, samples: pathlib.Path, result: pathlib.Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(tree),
           "TORCH_EXTENSIONS_DIR": str(ROOT / ".torch_extensions")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(pathlib.Path(__file__).resolve()), "--mode", "worker", "--steps", str(steps), "--samples", str(samples),
           "--result", str(result)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed in {tree}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(result.read_text())
    if not out["ds_ttt"].startswith(str(tree)):
        raise RuntimeError(f"the worker imported {out['ds_ttt']}, not the tree {tree}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["orchestrate", "worker"], default="orchestrate")
    ap.add_argument("--before", help="git revision with the anchored frozen-stage backward")
    ap.add_argument("--after", default="HEAD", help="git revision with gradient-free frozen boundaries")
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per launch (after 1 warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="launches per revision, interleaved")
    ap.add_argument("--samples", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.mode == "worker":
        return worker(args)
    if not args.before:
        ap.error("--before REV is required (the revision to compare against)")
    with tempfile.TemporaryDirectory(prefix="frozen_bwd_") as tmp:
        tmp = pathlib.Path(tmp)
        trees = {name: tmp / name for name in ("before", "after")}
        shas = {name: extract(rev, trees[name]) for name, rev in (("before", args.before), ("after", args.after))}
        batch = trajectories()
        tokens = len(batch[0][0])
        (tmp / "samples.json").write_text(json.dumps(batch))
        runs = {"before": [], "after": []}
        for r in range(args.repeats):
            for name in ("before", "after"):
                out = measure(trees[name], args.steps, tmp / "samples.json", tmp / f"{name}_{r}.json")
                runs[name].append(out)
                print(f"[{r}] {name}: step {statistics.median(out['step_s']):.3f} s, CPU "
                      f"{statistics.median(out['cpu_s_per_step_all_ranks']):.3f} s (all ranks), backward CPU by "
                      f"stage {[round(statistics.median(s), 3) for s in zip(*out['backward_cpu_s_per_step_by_stage'])]}",
                      flush=True)

    def median_of(name, key):
        return statistics.median([v for run in runs[name] for v in run[key]])

    def stage_backward(name):
        return [statistics.median([step[s] for run in runs[name] for step in run["backward_cpu_s_per_step_by_stage"]])
                for s in range(4)]
    med = {name: {"step_s": median_of(name, "step_s"), "cpu_s_all_ranks": median_of(name, "cpu_s_per_step_all_ranks"),
                  "backward_cpu_s_by_stage": stage_backward(name)} for name in runs}
    result = {
        "what": "PP4 step, trainable_scope=prime, before/after frozen stages skip the backward",
        "revisions": shas, "steps_per_launch": args.steps, "repeats": args.repeats, "runs": runs, "median": med,
        "ratio_before_over_after": {k: med["before"][k] / med["after"][k] for k in ("step_s", "cpu_s_all_ranks")},
        "setup": {"layers": 8, "adaptive": 2, "hidden": 128, "vocab": VOCAB, "tokens_per_trajectory":
                  tokens, "global_batch": f"1 x {GAS} x 1", "ranks": 4, "ttt": TTT},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m_end": os.getloadavg()[0]},
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frozen_stage_backward.json").write_text(json.dumps(result, indent=2))
    lines = ["# Frozen-stage backward under trainable_scope='prime' (PP4, CPU)", "",
             "`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frozen_stage_backward.py "
             f"--before {args.before} --after {args.after} --steps {args.steps} --repeats {args.repeats}`", "",
             f"4 CPU ranks (gloo) on {os.cpu_count()} shared cores; tiny 8-layer Qwen3 (hidden 128, vocab {VOCAB}), "
             f"stages 0-2 frozen (2 layers each), stage 3 = 2 adaptive layers; global batch {GAS} x "
             f"{tokens} tokens; {args.repeats} launches per revision, interleaved, "
             f"{args.steps} timed steps each; medians over all timed steps. CPU seconds are process CPU time "
             "(the work done, robust to waiting for a shared core); the wall step time includes that wait.", "",
             "| revision | commit | step wall (s) | CPU s / step, all ranks | backward CPU s / step, stages 0 / 1 / 2 / 3 |",
             "| --- | --- | --- | --- | --- |"]
    for name in ("before", "after"):
        m = med[name]
        lines.append(f"| {name} | {shas[name][:10]} | {m['step_s']:.3f} | {m['cpu_s_all_ranks']:.3f} | "
                     + " / ".join(f"{v:.3f}" for v in m["backward_cpu_s_by_stage"]) + " |")
    ratio = result["ratio_before_over_after"]
    lines += ["", f"before / after: wall step x{ratio['step_s']:.2f}, CPU per step x{ratio['cpu_s_all_ranks']:.2f}; "
              f"1-minute load average at the end {result['machine']['load_avg_1m_end']:.1f} (other jobs share the "
              "cores, so the wall times are noisy; the CPU columns are not).", ""]
    (out / "frozen_stage_backward.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
