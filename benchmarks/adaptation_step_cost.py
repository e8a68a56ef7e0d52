"""What one meta-training step of the main job's model costs with each adaptive-layer setting, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adaptation_step_cost.py --manifest DATA/manifest.json \
        [--run-config ds_configs/run_cpu_tiny.json] [--repeats 6] [--out benchmarks/results/adaptation_step_cost]

The main job's model (run config preset + ttt block) on real batches of the manifest's train split
(2 trajectories: one rank's micro-batches of a step in the 1-stage x 2-rank layout). Four settings,
interleaved repeat by repeat on the same batches so machine noise hits them alike:
attention_backend reference | cpu (the FlashBoB C++ kernels) x checkpoint_events off | on.
One step = trajectory_loss (the inner loop, create_graph=True) + backward. Reports the median and
range of wall seconds and CPU seconds per step, the load average at start and end, and the tokens.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import statistics
import time

import torch

SETTINGS = [("reference", False), ("reference", True), ("cpu", False), ("cpu", True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--run-config", default="ds_configs/run_cpu_tiny.json")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/adaptation_step_cost")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from ds_ttt.config import TTTConfig
    from ds_ttt.data.manifest import load_manifest
    from ds_ttt.data.token_kind import TokenKind
    from ds_ttt.model.presets import backbone_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
    from ds_ttt.train.data_loader import collate, samples_from_manifest

    load_start = os.getloadavg()[0]
    run = json.loads(pathlib.Path(args.run_config).read_text())
    man = load_manifest(args.manifest)
    cfg = backbone_config(run["preset"])
    cfg.vocab_size = -(-man.data["tokenizer"]["vocab_size"] // 64) * 64  # as the trainer pads it
    samples = samples_from_manifest(man, "train")
    rng = random.Random(0)
    batches = []
    for _ in range(2):
        ids, kinds, rounds = collate(rng.sample(samples, args.batch), bucket=run.get("bucket", 64), capacity=0)
        batches.append({"input_ids": ids, "kinds": kinds, "rounds": rounds})
    models = {}
    for backend, ckpt in SETTINGS:
        ttt = dataclasses.replace(TTTConfig.from_dict(run["ttt"]), attention_backend=backend, checkpoint_events=ckpt)
        torch.manual_seed(0)
        models[(backend, ckpt)] = TTTQwen3ForCausalLM(cfg, ttt)
    wall = {s: [] for s in SETTINGS}
    cpu = {s: [] for s in SETTINGS}
    losses = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms up (the cpu kernels' JIT build, allocator)
        for s in SETTINGS:
            m = models[s]
            t0, c0 = time.perf_counter(), time.process_time()
            for b in batches:
                out = m.trajectory_loss(b["input_ids"], b["kinds"], b["rounds"], create_graph=True)
                out.loss.backward()
            if rep:
                wall[s].append((time.perf_counter() - t0) / len(batches))
                cpu[s].append((time.process_time() - c0) / len(batches))
            losses[s] = float(out.loss)
            m.zero_grad(set_to_none=True)
    tokens = sum(int((b["kinds"] != TokenKind.PAD).sum()) for b in batches) / len(batches)
    rows = [{"attention_backend": s[0], "checkpoint_events": s[1], "wall_s_median": statistics.median(wall[s]),
             "wall_s_min": min(wall[s]), "wall_s_max": max(wall[s]), "cpu_s_median": statistics.median(cpu[s]),
             "loss": losses[s]} for s in SETTINGS]
    base = rows[0]["wall_s_median"]
    for r in rows:
        r["vs_reference_no_checkpoint"] = r["wall_s_median"] / base
    report = {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adaptation_step_cost.py "
                         f"--manifest {args.manifest} --run-config {args.run_config} --repeats {args.repeats}",
              "tokens_per_trajectory": tokens, "batch": args.batch, "repeats": args.repeats,
              "load_start": load_start, "load_end": os.getloadavg()[0], "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# One meta-training step of the main job's model, per adaptive-layer setting", "",
             f"`{report['command']}`", "",
             f"{args.batch} real trajectories per step ({tokens:.0f} tokens each on average), one thread; "
             f"median [min, max] of {args.repeats} interleaved repeats; load {load_start:.2f} at start, "
             f"{report['load_end']:.2f} at end.", "",
             "| attention | per-event checkpointing | wall s / step | CPU s / step | vs reference, no checkpointing |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention_backend']} | {'on' if r['checkpoint_events'] else 'off'} | "
                     f"{r['wall_s_median']:.3f} [{r['wall_s_min']:.3f}, {r['wall_s_max']:.3f}] | {r['cpu_s_median']:.3f} | "
                     f"x{r['vs_reference_no_checkpoint']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
