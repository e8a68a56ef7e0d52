"""Trainer benchmark on CPU: tokens/s and peak RSS of the tiny preset (full Qwen3 vocabulary).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer.py [--contexts 1024 2048 4096 8192] [--out benchmarks/results]
        [--attention_backend cpu|reference] [--max_off_context N]

The adaptive layers use the FlashBoB C++ CPU kernels (`cpu`, O(N d) memory, JIT-built once into
.torch_extensions/) by default; `reference` is the O(N^2) PyTorch specification (with glibc's default
allocator its growing per-event temporaries also fragment the heap, inflating peak RSS).

Two tables, each configuration in its own process(es) so peak RSS is its own:
  stages    the real DeepSpeed pipeline engine (torchrun, gloo, ZeRO-1, AdamW) for 1 stage (1 rank) and
            4 stages (4 ranks) on the same global batch of synthetic trajectories; tokens/s over the
            timed optimizer steps, peak RSS max over ranks and summed over ranks.
  contexts  one outer step (forward + second-order backward) of the meta-objective at 1K/2K/4K/8K
            tokens with per-event checkpointing on and off, side by side. Trajectories are rounds of
            128 tokens (8 context, 40 action, 80 observation), so every context has context/128 events.
            With checkpointing the graph keeps only what is carried between events (W, KV cache,
            the stage input), so peak memory grows ~linearly with context (target: 4K -> 8K <= x2.2).
Writes OUT/trainer.json and OUT/trainer.md. Internal modes (--mode stage_worker/context_worker) are
what the orchestrator spawns.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROUND = dict(header=8, action=40, observation=80, separator=0)  # one event: header, action, observation
PROMPT_TOKENS = 16
TTT = dict(adaptive_layers=2, trainable_scope="prime")


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def trajectory(num_tokens: int, vocab: int, seed: int):
    """ids, kinds, rounds (lists): the prompt, then num_tokens // 128 rounds, cut at num_tokens."""
    from ds_ttt.data.synthetic import round_kinds, synthetic_trajectory

    tensors = synthetic_trajectory(num_tokens, vocab_size=vocab, seed=seed, prompt=PROMPT_TOKENS,
                                   num_rounds=num_tokens // len(round_kinds(**ROUND)), **ROUND)
    return tuple(t.tolist() for t in tensors)


# ---------------------------------------------------------------------------------------------------
def context_worker(args) -> dict:
    import torch

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import backbone_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
    from ds_ttt.train.data_loader import collate

    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(backbone_config("tiny"), TTTConfig(**TTT, attention_backend=args.attention_backend,
                                                          checkpoint_events=args.checkpoint == "on"))
    model.set_trainable_scope()
    batch = collate([trajectory(args.context, model.config.vocab_size, 0)], bucket=1, capacity=args.context)
    base = rss_gb()
    t0 = time.perf_counter()
    out = model.trajectory_loss(*batch)
    out.loss.backward()
    dt = time.perf_counter() - t0
    return {"context": args.context, "checkpoint_events": args.checkpoint == "on", "events": int(batch[2].max()),
            "tokens_per_s": args.context / dt, "step_s": dt, "peak_rss_gb": rss_gb(), "rss_before_step_gb": base,
            "loss": float(out.loss.detach()), "inner_updates": out.num_updates, "load_avg_1m": os.getloadavg()[0]}


def stage_worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import backbone_config
    from ds_ttt.train.data_loader import Sample, TrajectoryBatches
    from ds_ttt.train.pipeline import TTTPipelineModule
    from ds_ttt.train.engine import set_step_objective
    from ds_ttt.train.layout import resolve_layout

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    cfg, ttt = backbone_config("tiny"), TTTConfig(**TTT, attention_backend=args.attention_backend)
    stages, gas, steps = args.stages, 4, args.steps
    module = TTTPipelineModule(cfg, ttt, resolve_layout(stages, cfg.num_hidden_layers, ttt), seed=0)
    ds = {"train_batch_size": gas, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
          "pipeline": {"stages": stages, "activation_checkpoint_interval": 1, "use_reentrant": False},
          "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()
                                                                           if p.requires_grad], config=ds)
    samples = [Sample(str(i), *trajectory(args.context, cfg.vocab_size, i)) for i in range(gas)]
    data = TrajectoryBatches(samples, num_samples=gas, train_batch_size=gas, micro_batch_size=1,
                             gradient_accumulation_steps=gas, dp_rank=0, dp_size=1, seed=0, bucket=64,
                             capacity=args.context)
    it = data.iterate(0) if engine.is_first_stage() or engine.is_last_stage() else None
    last = module.last_stage_layer()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        if last is not None:  # the token-weighted objective's normalisers for this step (counted on the host)
            set_step_objective(last, engine, data, step, ttt)
        engine.train_batch(data_iter=it)
        times.append(time.perf_counter() - t0)
    mem = torch.tensor([rss_gb()], dtype=torch.float64)
    gathered = [torch.zeros_like(mem) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mem)
    if dist.get_rank() == 0:
        timed = times[1:] if len(times) > 1 else times  # the first step includes warm-up
        per_rank = [float(g) for g in gathered]
        res = {"stages": stages, "ranks": dist.get_world_size(), "context": args.context, "global_batch": gas,
               "tokens_per_s": gas * args.context * len(timed) / sum(timed), "step_s": sum(timed) / len(timed),
               "peak_rss_gb_max_rank": max(per_rank), "peak_rss_gb_sum": sum(per_rank), "peak_rss_gb_per_rank": per_rank,
               "load_avg_1m": os.getloadavg()[0]}
        pathlib.Path(args.result).write_text(json.dumps(res))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def orchestrate(args) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"attention_backend": args.attention_backend, "max_off_context": args.max_off_context,
               "command": " ".join(["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer.py"] + sys.argv[1:]),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "omp_threads": 1,
                           "load_avg_at_start": os.getloadavg()}, "stages": [], "contexts": []}
    for stages in args.stages:
        res_file = out / f".stage{stages}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(stages), "--master_port",
               str(free_port()), __file__, "--mode", "stage_worker", "--stages", str(stages), "--context",
               str(args.stage_context), "--steps", str(args.steps), "--result", str(res_file),
               "--attention_backend", args.attention_backend]
        proc = spawn(cmd, 1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
        results["stages"].append(json.loads(res_file.read_text()))
        res_file.unlink()
        print(json.dumps(results["stages"][-1]), flush=True)
    for context in args.contexts:
        for ck in ("on", "off"):
            if ck == "off" and context > args.max_off_context:
                continue
            proc = spawn([sys.executable, __file__, "--mode", "context_worker", "--context", str(context),
                          "--checkpoint", ck, "--attention_backend", args.attention_backend], 3600)
            if proc.returncode != 0:
                raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
            results["contexts"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results["contexts"][-1]), flush=True)
    (out / "trainer.json").write_text(json.dumps(results, indent=2))
    (out / "trainer.md").write_text(markdown(results))
    print(markdown(results))


def markdown(res: dict) -> str:
    lines = ["# Trainer benchmark (CPU, tiny preset, full Qwen3 vocabulary)", "",
             f"Adaptive-layer attention backend: `{res.get('attention_backend', 'reference')}`. "
             f"Command: `{res.get('command', 'OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer.py')}`.", "",
             f"Machine: {res['machine']['cpus']} CPUs (shared; load average at start "
             f"{res['machine']['load_avg_at_start'][0]:.1f}), OMP_NUM_THREADS=1 per process.", "",
             "## Pipeline stages (DeepSpeed engine, ZeRO-1, AdamW, global batch 4 x "
             f"{res['stages'][0]['context'] if res['stages'] else '?'} tokens)", "",
             "| stages | ranks | tokens/s | s/step | peak RSS max rank (GB) | peak RSS sum (GB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["stages"]:
        lines.append(f"| {r['stages']} | {r['ranks']} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | "
                     f"{r['peak_rss_gb_max_rank']:.2f} | {r['peak_rss_gb_sum']:.2f} |")
    lines += ["", "## Context length x per-event checkpointing (one outer step, one process)", "",
              "| context | events | ckpt on: tokens/s | ckpt on: peak RSS (GB) | ckpt off: tokens/s | ckpt off: peak RSS (GB) |",
              "| --- | --- | --- | --- | --- | --- |"]
    by = {(r["context"], r["checkpoint_events"]): r for r in res["contexts"]}
    ctxs = sorted({r["context"] for r in res["contexts"]})
    for c in ctxs:
        on, off = by.get((c, True)), by.get((c, False))
        off_cells = f"{off['tokens_per_s']:.0f} | {off['peak_rss_gb']:.2f}" if off else "not run | not run"
        lines.append(f"| {c} | {on['events']} | {on['tokens_per_s']:.0f} | {on['peak_rss_gb']:.2f} | {off_cells} |")
    def growth(a, b):
        total = b["peak_rss_gb"] / a["peak_rss_gb"]
        step = (b["peak_rss_gb"] - b["rss_before_step_gb"]) / (a["peak_rss_gb"] - a["rss_before_step_gb"])
        return f"x{total:.2f} (peak RSS), x{step:.2f} (peak RSS above the pre-step baseline)"

    lines.append("")
    for ck, label in ((True, "with"), (False, "without")):
        for lo, hi in ((1024, 2048), (2048, 4096), (4096, 8192)):
            if (lo, ck) in by and (hi, ck) in by:
                target = " (target <= x2.2)" if (ck and lo == 4096) else ""
                lines.append(f"- {lo // 1024}K -> {hi // 1024}K {label} checkpointing: "
                             f"{growth(by[(lo, ck)], by[(hi, ck)])}{target}")
    offs = sorted(c for (c, ck) in by if not ck)
    skipped = [c for c in ctxs if (c, False) not in by]
    if skipped and len(offs) >= 2:
        a, b = by[(offs[-2], False)], by[(offs[-1], False)]
        grow = (b["peak_rss_gb"] - b["rss_before_step_gb"]) / (a["peak_rss_gb"] - a["rss_before_step_gb"])
        proj = b["rss_before_step_gb"] + (b["peak_rss_gb"] - b["rss_before_step_gb"]) * grow ** (len(skipped))
        lines.append(f"- without checkpointing at {', '.join(str(c) for c in skipped)}: not run (`--max_off_context "
                     f"{offs[-1]}`); at the measured x{grow:.2f} per doubling that is ~{proj:.0f} GB peak RSS, more "
                     "than this shared machine can safely give one process")
    lines += ["", "Timings share 2 cores with other jobs (see the load average); compare columns measured "
              "together rather than absolute numbers. Peak RSS includes the process baseline (Python, torch, the model: ~0.4 GB); "
              "`rss_before_step_gb` in trainer.json gives it per context run."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="orchestrate", choices=["orchestrate", "stage_worker", "context_worker"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--stage_context", type=int, default=512)
    ap.add_argument("--max_off_context", type=int, default=8192,
                    help="skip checkpointing-off runs above this context (their graph grows ~linearly in events)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--checkpoint", choices=["on", "off"], default="on")
    ap.add_argument("--attention_backend", default="cpu", choices=["cpu", "reference"],
                    help="adaptive-layer attention: the O(N d) C++ FlashBoB kernels or the O(N^2) PyTorch reference")
    ap.add_argument("--result")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    if args.mode == "context_worker":
        print(json.dumps(context_worker(args)))
    elif args.mode == "stage_worker":
        args.stages = args.stages[0]
        stage_worker(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
