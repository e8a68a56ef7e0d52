"""The command line of pipeline_balance (what it measures and writes: the package docstring, __init__.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_balance [--help]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a folder: import the package from benchmarks/, not the folder's modules
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import pipeline_balance  # noqa: E402
from pipeline_balance import ROOT  # noqa: E402
from pipeline_balance.estimate import fast_weight_bytes_per_update, qwen3_8b_estimate  # noqa: E402
from pipeline_balance.launches import trainer_comparison, trainer_data  # noqa: E402
from pipeline_balance.memory import measure_stage_memory, stage_memory  # noqa: E402
from pipeline_balance.report import markdown, reasoning, recommendation  # noqa: E402
from pipeline_balance.simulate import simulate_train_schedule, uniform_bubble  # noqa: E402
from pipeline_balance.timing import (LAYOUTS, build_stage, init_single_process_group, layout_inputs,  # noqa: E402
                                     layout_name, resolve_layouts, stage_params, summarize, synthetic_micro_batch,
                                     time_stages)


def parse_ttt(items) -> dict:
    from ds_ttt.train.run_config import parse_ttt_overrides

    return parse_ttt_overrides(items)


def measure(args) -> dict:
    import torch

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import backbone_config

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device.startswith("cuda") else "cpu")
    init_single_process_group()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t_start = time.perf_counter()
    data = trainer_data(args) if args.trainer else None
    config = backbone_config(args.preset)
    if data is not None:  # the trainer's rule: a preset adopts the manifest's compact vocabulary
        from ds_ttt.train.engine import load_backbone

        config = load_backbone(SimpleNamespace(model=None, preset=args.preset, data=str(data[1])), data[2])
    ttt = TTTConfig.from_dict(parse_ttt(args.ttt), where="--ttt").validate(config.num_hidden_layers)
    layouts = resolve_layouts(config, ttt, [(s, d) for s, d in LAYOUTS if layout_name(s, d) in args.layouts])
    built = {}
    for name, (stages, dp, lay) in layouts.items():
        built[name] = []
        for s in range(stages):
            t0 = time.perf_counter()
            built[name].append(build_stage(config, ttt, lay, s, dtype=dtype, device=args.device, seed=args.seed))
            print(f"[pipeline_balance] built {name} stage {s} on {args.device} in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    params = {name: [stage_params(m) for m in stages] for name, stages in built.items()}
    synth = synthetic_micro_batch(config, args.tokens, device=args.device, seed=args.seed)
    per_layout_mbs = {name: mbs[0] for name, mbs in layout_inputs(built, [synth]).items()}
    res = {"preset": args.preset, "tokens": args.tokens, "device": args.device, "dtype": args.dtype,
           "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
           "num_layers": config.num_hidden_layers, "num_adaptive": ttt.num_adaptive(config.num_hidden_layers),
           "ttt": ttt.to_dict(), "repeats": args.repeats, "global_batch": args.global_batch,
           "layouts": {name: {"stages": st, "dp": dp, "prefix_per_stage": list(lay.prefix_per_stage),
                              "spec_parts": lay.spec_parts()} for name, (st, dp, lay) in layouts.items()}}

    # -- per-stage times on the synthetic micro-batch of exactly --tokens tokens (all layouts interleaved)
    timing = time_stages(built, {name: [mb] for name, mb in per_layout_mbs.items()}, args.repeats, args.device)
    res["stage_times"] = {name: [{"stage": s, "fwd_s": summarize(timing["times"][(name, s, 0)][0]),
                                  "bwd_s": summarize(timing["times"][(name, s, 0)][1]),
                                  "backward_ran": timing["backward_ran"][(name, s)], **params[name][s]}
                                 for s in range(len(stages))] for name, stages in built.items()}
    res["stage_timing_s"] = time.perf_counter() - t_start

    # -- memory of each stage (one profiled forward+backward each)
    mixed = dtype == torch.bfloat16
    res["memory"] = {}
    for name, stages in built.items():
        st, dp, _ = layouts[name]
        m = args.global_batch // dp
        rows = []
        for s, module in enumerate(stages):
            act = measure_stage_memory(module, s, s == len(stages) - 1, per_layout_mbs[name], args.device)
            rows.append({"stage": s, "measured": act,
                         **stage_memory(params[name][s], act, stage=s, num_stages=st, num_micro=m, dp=dp,
                                        mixed_bf16=mixed)})
        res["memory"][name] = rows

    # -- schedule and layout prediction from the synthetic per-stage medians
    res["schedule"] = {}
    for name, (st, dp, _) in layouts.items():
        m = args.global_batch // dp
        rows = res["stage_times"][name]
        fwd = [[[r["fwd_s"]["median"]] * m for r in rows]]
        bwd = [[[r["bwd_s"]["median"]] * m for r in rows]]
        sim = simulate_train_schedule(fwd * dp, bwd * dp)
        res["schedule"][name] = {**sim, "uniform_bubble": uniform_bubble(m, st) if st > 1 else 0.0,
                                 "tokens_per_s_dedicated": args.global_batch * args.tokens / sim["step_s"]}

    # -- CPU: the real trainer per layout, and the prediction for exactly its micro-batches
    if args.trainer:
        res["trainer"] = trainer_comparison(args, ttt, built, layouts, data)
    res["wall_s"] = time.perf_counter() - t_start
    return res


def qwen3_8b_section(res: dict, args) -> dict:
    """The Qwen3-8B estimate, tied to what this run measured: the frozen stages' backward (does this tree
    run one under the 8B scope 'prime'?), the last stage's forward share, the fp32 fast-weight bytes."""
    if res["ttt"]["trainable_scope"] != "prime":
        raise ValueError("the Qwen3-8B estimate uses this run's frozen-stage behaviour, which needs the 8B "
                         "recipe's trainable_scope=prime; rerun without --ttt trainable_scope=... or pass "
                         "--no-qwen3-estimate")
    piped = [rows for rows in res["stage_times"].values() if len(rows) > 1]
    if not piped:
        raise ValueError("the Qwen3-8B estimate reads the frozen stages' behaviour from a pipelined layout: include "
                         "PP4xDP1 or PP2xDP2 in --layouts, or pass --no-qwen3-estimate")
    pp4 = piped[0]
    last = pp4[-1]
    frac = last["fwd_s"]["median"] / (last["fwd_s"]["median"] + last["bwd_s"]["median"])
    t0 = time.perf_counter()
    probe = (res["qwen3_8b"]["fast_weight_probe"] if "qwen3_8b" in res
             else {**fast_weight_bytes_per_update(args.device), "seconds": time.perf_counter() - t0})
    est = qwen3_8b_estimate(last_stage_fwd_fraction=frac, frozen_backward=any(r["backward_ran"] for r in pp4[:-1]),
                            fast_weight_factor=probe["factor_fp32_copies_per_update"])
    est["fast_weight_probe"] = probe
    est["recommendation"] = recommendation(est)
    est["reasoning"] = reasoning(est)
    return est


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=pipeline_balance.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--ttt", action="append", metavar="KEY=VALUE", help="TTT setting (repeatable)")
    ap.add_argument("--layouts", default=",".join(layout_name(s, d) for s, d in LAYOUTS),
                    help="comma-separated subset of the layouts to build at once (a Qwen3-8B GPU holds one or two)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--cores", type=float, default=float(os.cpu_count() or 1),
                    help="cores the CPU trainer's ranks share (for the shared-core prediction)")
    ap.add_argument("--no-trainer", dest="trainer", action="store_false", help="skip the real trainer runs (CPU)")
    ap.add_argument("--full-vocab", action="store_true",
                    help="prepare the trainer data with Qwen3's full vocabulary (default: the compact vocabulary of "
                         "prepare.py --trim-vocab, which the preset adopts, so the LM head does not dwarf the layers)")
    ap.add_argument("--trainer-steps", type=int, default=4)
    ap.add_argument("--trainer-repeats", type=int, default=3, help="probe repeats of the trainer's micro-batches")
    ap.add_argument("--trainer-rounds", type=int, default=2, help="trainer launches per layout (round-robin)")
    ap.add_argument("--trainer-timeout", type=int, default=300)
    ap.add_argument("--no-qwen3-estimate", dest="qwen3_estimate", action="store_false",
                    help="skip the Qwen3-8B layout estimate from benchmarks/results/gpu/")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--render", metavar="JSON", help="only re-render OUT/pipeline_balance.md (and the Qwen3-8B "
                    "estimate) from a written pipeline_balance.json; measures nothing")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.render:
        res = json.loads(pathlib.Path(args.render).read_text())
        if res.get("qwen3_8b"):
            res["qwen3_8b"] = qwen3_8b_section(res, args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline_balance.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "pipeline_balance.md").write_text(markdown(res))
        return 0
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    known = [layout_name(s, d) for s, d in LAYOUTS]
    if not args.layouts or any(x not in known for x in args.layouts):
        ap.error(f"--layouts: choose from {known}")
    if args.trainer and args.layouts != known:
        ap.error("the trainer comparison needs every layout; pass --no-trainer with --layouts")
    if args.global_batch % 4:
        ap.error("--global-batch must be a multiple of 4 (PP1xDP4 needs one micro-batch per replica)")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device is visible (run on a GPU machine, or use --device cpu)")
        if args.trainer:
            print("[pipeline_balance] --device cuda: the trainer comparison runs on CPU only; skipping it", flush=True)
            args.trainer = False
    load0 = os.getloadavg()
    res = measure(args)
    res["command"] = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_balance"] + sys.argv[1:])
    res["cores"] = args.cores
    res["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_at_start": load0,
                      "load_avg_at_end": os.getloadavg()}
    if args.qwen3_estimate:
        res["qwen3_8b"] = qwen3_8b_section(res, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_balance.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "pipeline_balance.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
