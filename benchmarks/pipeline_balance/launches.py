"""CPU: the real trainer per layout (`deepspeed --num_gpus 4 launch/train.py`, DeepSpeed configs
generated into a temp dir, data from the embedded real-shell generator), and the prediction for
exactly the micro-batches it trained on (pipeline_balance's `layouts` comparison).

Run through `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_balance` (without --no-trainer).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from . import ROOT
from .simulate import simulate_train_schedule
from .timing import layout_inputs, micro_batch_from_rows, time_stages

def make_manifest(out: pathlib.Path, num: int, capacity: int, seed: int, *, trim_vocab: bool) -> pathlib.Path:
    from ds_ttt.data.generator import generate, write_outputs
    from ds_ttt.data.manifest import prepare

    write_outputs(generate(num, seed, workers=1), out / "raw")
    res = prepare([out / "raw" / "trajectories.jsonl"], out / "data", capacity=capacity, test_fraction=0.0, seed=seed,
                  trim_vocab=trim_vocab)
    if res.exit_code != 0:
        raise RuntimeError(f"prepare failed: {res.message}")
    return out / "data" / "manifest.json"


def deepspeed_config(stages: int, dp: int, global_batch: int, *, bf16: bool) -> dict:
    gas = global_batch // dp
    ds = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
          "pipeline": {"stages": stages, "activation_checkpoint_interval": 1, "use_reentrant": False},
          "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                    "torch_adam": True}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.0, "warmup_type": "linear"}},
          "steps_per_print": 10**6, "wall_clock_breakdown": False}
    if bf16:
        ds["bf16"] = {"enabled": True}
    return ds


RANK0_TIMERS = re.compile(r"\[Rank 0\] time \(ms\) \| fwd: ([\d.]+) \| bwd: ([\d.]+) .*\| step: ([\d.]+)")


def run_trainer(name: str, stages: int, dp: int, *, tmp: pathlib.Path, manifest: pathlib.Path, run_cfg: dict,
                global_batch: int, steps: int, timeout: int) -> dict:
    ds = deepspeed_config(stages, dp, global_batch, bf16=False)
    ds.update(wall_clock_breakdown=True, steps_per_print=1)  # rank 0's fwd / bwd / optimizer ms, every step
    (tmp / f"ds_{name}.json").write_text(json.dumps(ds))
    (tmp / f"run_{name}.json").write_text(json.dumps(run_cfg))
    out = tmp / f"run_{name}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(pathlib.Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(stages * dp), "--master_port",
           str(port), "launch/train.py", "--deepspeed_config", str(tmp / f"ds_{name}.json"), "--run_config",
           str(tmp / f"run_{name}.json"), "--data", str(manifest), "--output", str(out), "--max_steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rank0 = [tuple(float(x) / 1e3 for x in m.groups()) for m in RANK0_TIMERS.finditer(proc.stdout + proc.stderr)]
    timed = rows[1:]  # the first step carries warm-up (allocations, first gloo transfers)
    return {"layout": name, "stages": stages, "dp": dp, "wall_s": time.perf_counter() - t0,
            "step_time_s": [r["step_time_s"] for r in rows], "tokens": [r["tokens"] for r in rows],
            "timed_steps": [r["stage_step"] for r in timed],
            "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
            "peak_mem_gb_max_rank": max(r["peak_mem_gb"] for r in rows), "loss": [r["loss"] for r in rows],
            "rank0_fwd_bwd_step_s": rank0, "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0]}


def trainer_data(args) -> tuple:
    """The trainer runs' data, made first so a bad --tokens fails before minutes of timing: generated
    real-shell trajectories, prepared with capacity --tokens, all in the train split."""
    from ds_ttt.data.manifest import load_manifest
    from ds_ttt.train.data_loader import samples_from_manifest

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pipeline_balance_"))
    needed = args.global_batch * args.trainer_steps
    manifest_path = make_manifest(tmp / "data", needed, args.tokens, args.seed, trim_vocab=not args.full_vocab)
    manifest = load_manifest(manifest_path)
    samples = samples_from_manifest(manifest, "train")
    if len(samples) < needed:
        raise ValueError(f"--tokens {args.tokens}: only {len(samples)} of {needed} generated trajectories fit the "
                         f"capacity (their first round is longer); use --tokens >= 512")
    return tmp, manifest_path, manifest, samples


def trainer_comparison(args, ttt, built, layouts, data) -> dict:
    from ds_ttt.train.data_loader import TrajectoryBatches

    tmp, manifest_path, manifest, samples = data
    run_cfg = {"preset": args.preset, "seed": args.seed, "bucket": args.bucket, "save_interval": 0,
               "ttt": ttt.to_dict()}
    rounds: dict = {name: [] for name in layouts}
    for rnd in range(args.trainer_rounds):  # layouts round-robin, so a busy minute of the machine hits all
        for name, (st, dp, _) in layouts.items():
            r = run_trainer(f"{name}_r{rnd}", st, dp, tmp=tmp, manifest=manifest_path, run_cfg=run_cfg,
                            global_batch=args.global_batch, steps=args.trainer_steps, timeout=args.trainer_timeout)
            rounds[name].append(r)
            print(f"[pipeline_balance] trainer {name} round {rnd}: {r['tokens_per_s']:.1f} tokens/s "
                  f"(steps {[round(x, 2) for x in r['step_time_s']]})", flush=True)
    measured = {}
    for name, runs in rounds.items():
        tps = [r["tokens_per_s"] for r in runs]
        if any(r["tokens"] != runs[0]["tokens"] for r in runs):
            raise RuntimeError(f"{name}: the rounds saw different tokens per step: the data order is not reproducible")
        measured[name] = {**runs[0], "layout": name, "rounds": runs, "rounds_tokens_per_s": tps,
                          "tokens_per_s": statistics.median(tps),
                          "load_avg_1m_before": statistics.mean(r["load_avg_1m_before"] for r in runs)}
    # the trainer's micro-batches (same order code, same seed), each timed on every stage of every layout
    steps = measured[next(iter(measured))]["timed_steps"]
    by_id, mbs, order = {}, [], {}
    for name, (st, dp, _) in layouts.items():
        gas = args.global_batch // dp
        for d in range(dp):
            data = TrajectoryBatches(samples, num_samples=len(samples), train_batch_size=args.global_batch,
                                     micro_batch_size=1, gradient_accumulation_steps=gas, dp_rank=d, dp_size=dp,
                                     seed=args.seed, bucket=args.bucket, capacity=manifest.capacity)
            for k in steps:
                for g, rows in enumerate(data.rank_micro_batches(k - 1)):
                    key = tuple(r.id for r in rows)
                    if key not in by_id:
                        by_id[key] = len(mbs)
                        mbs.append(micro_batch_from_rows(rows, bucket=args.bucket, capacity=manifest.capacity,
                                                         device=args.device))
                    order[(name, d, k, g)] = by_id[key]
    per_layout_inputs = layout_inputs(built, mbs)
    t0 = time.perf_counter()
    timing = time_stages(built, per_layout_inputs, args.trainer_repeats, args.device)
    med = {key: (statistics.median(f), statistics.median(b)) for key, (f, b) in timing["times"].items()}
    timing_s = time.perf_counter() - t0
    out = {"manifest_trajectories": len(samples), "capacity": manifest.capacity, "bucket": args.bucket,
           "steps": args.trainer_steps, "timed_steps": steps, "micro_batches_timed": len(mbs),
           "micro_batch_tokens": [mb.num_tokens for mb in mbs], "micro_batch_padded": [int(mb.ids_BT.shape[1]) for mb in mbs],
           "repeats": args.trainer_repeats, "rounds": args.trainer_rounds, "stage_timing_s": timing_s, "layouts": {}}
    for name, (st, dp, _) in layouts.items():
        gas = args.global_batch // dp
        pred = {"dedicated": [], "shared": [], "loaded": []}
        # other engineers' runnable processes: the 1-minute load before the launch, less this process
        # (it had been timing stages until then)
        background = max(0.0, measured[name]["load_avg_1m_before"] - 1.0)
        tokens = []
        for k in steps:
            fwd = [[[med[(name, s, order[(name, d, k, g)])][0] for g in range(gas)]
                    for s in range(st)] for d in range(dp)]
            bwd = [[[med[(name, s, order[(name, d, k, g)])][1] for g in range(gas)]
                    for s in range(st)] for d in range(dp)]
            pred["dedicated"].append(simulate_train_schedule(fwd, bwd)["step_s"])
            pred["shared"].append(simulate_train_schedule(fwd, bwd, cores=args.cores)["step_s"])
            pred["loaded"].append(simulate_train_schedule(fwd, bwd, cores=args.cores, background=background)["step_s"])
            tokens.append(sum(mbs[order[(name, d, k, g)]].num_tokens for d in range(dp) for g in range(gas)))
        # rank 0 = stage 0 of replica 0: its own micro-batches' probe time, to set beside its in-trainer timers
        rank0_probe = [sum(sum(med[(name, 0, order[(name, 0, k, g)])]) for g in range(gas)) for k in steps]
        meas = measured[name]
        timed_tokens = sum(meas["tokens"][1:])
        if timed_tokens != sum(tokens):
            raise RuntimeError(f"{name}: the trainer logged {timed_tokens} tokens in the timed steps, the reconstructed "
                               f"micro-batches hold {sum(tokens)}: the prediction would not describe the same work")
        out["layouts"][name] = {
            "measured": meas, "predicted_step_s_dedicated": pred["dedicated"], "predicted_step_s_shared": pred["shared"],
            "predicted_tokens_per_s_dedicated": sum(tokens) / sum(pred["dedicated"]),
            "predicted_tokens_per_s_shared": sum(tokens) / sum(pred["shared"]), "rank0_probe_fwd_bwd_s": rank0_probe,
            "predicted_step_s_loaded": pred["loaded"], "background_processes": background,
            "predicted_tokens_per_s_loaded": sum(tokens) / sum(pred["loaded"]),
            "measured_over_predicted_loaded": meas["tokens_per_s"] / (sum(tokens) / sum(pred["loaded"])),
            "measured_over_predicted_shared": meas["tokens_per_s"] / (sum(tokens) / sum(pred["shared"]))}
    shutil.rmtree(tmp, ignore_errors=True)  # generated data, configs, runs and their checkpoints
    return out
