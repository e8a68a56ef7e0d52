"""How long the main job's two data-parallel ranks wait for each other, with each way of dealing micro-batches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rank_balance.py --manifest DATA/manifest.json \
        [--run-config ds_configs/run_cpu_tiny.json] [--ds-config ds_configs/cpu_tiny_pp1_dp2.json] \
        [--steps 40] [--repeats 2] [--out benchmarks/results/rank_balance]

A data-parallel step ends at the gradient all-reduce, so it lasts as long as its slowest rank: the sum of
that rank's micro-batch times. This measures what one meta-training micro-batch of each trajectory costs
(the main job's model and ttt block, one thread: trajectory_loss with the differentiable inner loop, then
backward; the median of --repeats timings, each trajectory's repeats interleaved with the others'), for
--steps steps spread over the main job's 1000, then prices each step under two dealings of the same
length-sorted micro-batches (ds_ttt/train/data_loader.py):

  strided     rank d takes micro-batches d, d + dp, ...: with dp 2 and accumulation 2, rank 0 the longest and
              the third, rank 1 the second and the shortest (the dealing before the serpentine one)
  serpentine  round g: rank d takes g * dp + d for even g, g * dp + dp - 1 - d for odd g (the trainer's)

and the bound no dealing of whole micro-batches beats, half the step's work per rank. Both dealings are
priced from the same timings, so machine noise hits them alike. Reports, per dealing, the summed step
time (the slowest rank's), the idle share (the time the faster rank waits, over both ranks' time), and the
ratio serpentine / strided with a 95% bootstrap interval over steps. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time

import torch

MAIN_JOB_STEPS = 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--run-config", default="ds_configs/run_cpu_tiny.json")
    ap.add_argument("--ds-config", default="ds_configs/cpu_tiny_pp1_dp2.json")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/rank_balance")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tqdm import tqdm

    from ds_ttt.config import TTTConfig
    from ds_ttt.data.manifest import load_manifest
    from ds_ttt.model.presets import backbone_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
    from ds_ttt.train.data_loader import TrajectoryBatches, collate, samples_from_manifest

    load_start = os.getloadavg()[0]
    run = json.loads(pathlib.Path(args.run_config).read_text())
    ds = json.loads(pathlib.Path(args.ds_config).read_text())
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    dp = ds["train_batch_size"] // (micro * gas)
    man = load_manifest(args.manifest)
    cfg = backbone_config(run["preset"])
    cfg.vocab_size = -(-man.data["tokenizer"]["vocab_size"] // 64) * 64  # as the trainer pads it
    samples = samples_from_manifest(man, "train")
    ranks = [TrajectoryBatches(samples, num_samples=len(samples), train_batch_size=ds["train_batch_size"],
                               micro_batch_size=micro, gradient_accumulation_steps=gas, dp_rank=d, dp_size=dp,
                               seed=run.get("seed", 0), bucket=run.get("bucket", 64), capacity=man.capacity)
             for d in range(dp)]
    batches = ranks[0]
    steps = [round(i * (MAIN_JOB_STEPS - 1) / max(args.steps - 1, 1)) for i in range(args.steps)]
    per_step = {k: batches.step_micro_batches(k) for k in steps}
    mbs = {tuple(r.id for r in mb): mb for k in steps for mb in per_step[k]}
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig.from_dict(run["ttt"]))
    times: dict[tuple, list[float]] = {key: [] for key in mbs}
    order = list(mbs)
    warm = collate(mbs[order[0]], bucket=batches.bucket, capacity=batches.capacity)
    model.trajectory_loss(*warm, create_graph=True).loss.backward()
    with tqdm(total=args.repeats * len(order), desc="micro-batches", unit="mb") as bar:
        for rep in range(args.repeats):
            random.Random(rep).shuffle(order)  # each repeat in another order: drift hits every micro-batch alike
            for key in order:
                ids, kinds, rounds = collate(mbs[key], bucket=batches.bucket, capacity=batches.capacity)
                t0 = time.perf_counter()
                model.trajectory_loss(ids, kinds, rounds, create_graph=True).loss.backward()
                times[key].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
                bar.update(1)
    cost = {key: statistics.median(v) for key, v in times.items()}
    rows = {}
    for name, serp in (("strided", False), ("serpentine", True)):
        step_s, idle = [], []
        for k in steps:
            if serp:  # the trainer's own deal
                shares = [sum(cost[tuple(r.id for r in mb)] for mb in ranks[d].rank_micro_batches(k)) for d in range(dp)]
            else:  # the deal before it: rank d took micro-batches d, d + dp, ...
                shares = [sum(cost[tuple(r.id for r in per_step[k][g * dp + d])] for g in range(gas)) for d in range(dp)]
            step_s.append(max(shares))
            idle.append(sum(max(shares) - s for s in shares))
        rows[name] = {"step_s": step_s, "sum_s": sum(step_s), "idle_share": sum(idle) / (dp * sum(step_s))}
    bound = sum(sum(cost[tuple(r.id for r in mb)] for mb in per_step[k]) / dp for k in steps)
    ratios = []
    rng = random.Random(0)
    a, b = rows["serpentine"]["step_s"], rows["strided"]["step_s"]
    for _ in range(2000):
        pick = [rng.randrange(len(steps)) for _ in steps]
        ratios.append(sum(a[i] for i in pick) / sum(b[i] for i in pick))
    ratios.sort()
    report = {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rank_balance.py "
                         f"--manifest {args.manifest} --run-config {args.run_config} --ds-config {args.ds_config} "
                         f"--steps {args.steps} --repeats {args.repeats}",
              "layout": {"micro": micro, "gas": gas, "dp": dp}, "steps": steps,
              "rows": {n: {k: v for k, v in r.items() if k != "step_s"} | {"step_s": r["step_s"]} for n, r in rows.items()},
              "bound_sum_s": bound,
              "serpentine_over_strided": a and sum(a) / sum(b),
              "serpentine_over_strided_ci95": [ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]],
              "load_start": load_start, "load_end": os.getloadavg()[0]}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lo, hi = report["serpentine_over_strided_ci95"]
    lines = ["# How long the data-parallel ranks wait for each other, per dealing of micro-batches", "",
             f"`{report['command']}`", "",
             f"Layout micro {micro} x accumulation {gas} x dp {dp}; {len(steps)} steps spread over the main job's "
             f"{MAIN_JOB_STEPS}; each micro-batch timed {args.repeats} times (median), one thread; load "
             f"{load_start:.2f} at start, {report['load_end']:.2f} at end.", "",
             "| dealing | summed step time, s (slowest rank) | idle share of the ranks' time |", "|---|---|---|"]
    for n, r in rows.items():
        lines.append(f"| {n} | {r['sum_s']:.2f} | {r['idle_share']:.1%} |")
    lines += [f"| bound (half of each step's work per rank) | {bound:.2f} | 0.0% |", "",
              f"serpentine / strided: x{report['serpentine_over_strided']:.3f} [95% bootstrap over steps: "
              f"{lo:.3f}, {hi:.3f}]"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
