"""The report: OUT/pipeline_balance.md from the run's JSON, and the Qwen3-8B recommendation and its
reasoning (text derived from the estimate's numbers).

    .venv/bin/python benchmarks/pipeline_balance --render OUT/pipeline_balance.json   # re-render only
"""

from __future__ import annotations

from .estimate import FP32_FAST_WEIGHTS_COMMIT, longest_fitting_context
from .memory import GIB, USABLE_80GB, USABLE_141GB, ZERO1_FP32_GRAD_BYTES, ZERO1_OPTIMIZER_BYTES

def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def markdown(res: dict) -> str:
    ttt = res["ttt"]
    L = [f"# Pipeline balance ({res['preset']}, {res['tokens']} tokens, {res['device']}, {res['dtype']})", "",
         f"Command: `{res['command']}`", "",
         f"Machine: {res['machine']['cpus']} CPUs shared with other engineers (load average at start "
         f"{res['machine']['load_avg_at_start'][0]:.1f}, at end {res['machine']['load_avg_at_end'][0]:.1f}), "
         "OMP_NUM_THREADS=1. Timings are medians of repeats interleaved over every stage of every layout; "
         "`min..max` is the spread. Absolute numbers move with the load; the ratios between stages were "
         "measured side by side.", "",
         f"TTT: {res['num_adaptive']} adaptive layers of {res['num_layers']}, scope `{ttt['trainable_scope']}`, "
         f"attention `{ttt['attention_backend']}`, per-event checkpointing {ttt['checkpoint_events']}, "
         f"context policy `{ttt['context_policy']}`; hidden {res['hidden_size']}, vocabulary {res['vocab_size']}"
         + (" (the trainer data's compact vocabulary, which the preset adopts as the trainer does)"
            if res.get("trainer") else "") + f". Global batch {res['global_batch']} trajectories, micro-batch 1.", "",
         "## Per-stage forward / backward of one micro-batch (ms)", "",
         "| layout | stage | layers | fwd median (min..max) | bwd median (min..max) | fwd+bwd | backward runs | trainable params |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in res["stage_times"].items():
        parts = res["layouts"][name]["spec_parts"]
        for r in rows:
            f, b = r["fwd_s"], r["bwd_s"]
            L.append(f"| {name} | {r['stage']} | specs {parts[r['stage']]}..{parts[r['stage'] + 1] - 1} | "
                     f"{_ms(f['median'])} ({_ms(f['min'])}..{_ms(f['max'])}) | {_ms(b['median'])} "
                     f"({_ms(b['min'])}..{_ms(b['max'])}) | {_ms(f['median'] + b['median'])} | "
                     f"{'yes' if r['backward_ran'] else 'no'} | {r['trainable_params']:,} |")
    L += ["", "Spec indices: 0 = embedding, 1..P = the non-adaptive decoder layers, P+1 = the last stage "
          "(every adaptive layer, final norm, LM head, event loop).", ""]
    st = res["stage_times"]
    tot = lambda r: r["fwd_s"]["median"] + r["bwd_s"]["median"]  # noqa: E731
    if all(k in st for k in ("PP4xDP1", "PP2xDP2", "PP1xDP4")):
        last4, last2, pp1 = tot(st["PP4xDP1"][-1]), tot(st["PP2xDP2"][-1]), tot(st["PP1xDP4"][0])
        frozen4 = sum(tot(r) for r in st["PP4xDP1"][:-1])
        L += [f"Plausibility: the last stage is the same modules in every layout: {_ms(last4)} ms (PP4 stage 3) vs "
              f"{_ms(last2)} ms (PP2 stage 1), x{last2 / last4:.2f}; PP1 runs the frozen layers and the last stage in "
              f"one stage: {_ms(pp1)} ms measured vs {_ms(frozen4 + last4)} ms for PP4's stages summed "
              f"(x{pp1 / (frozen4 + last4):.2f}). The frozen stages together cost {frozen4 / last4:.1%} of the last stage.", ""]
    L += ["## DeepSpeed TrainSchedule (1F1B) with these stage times", "",
          "Simulated from `TrainSchedule(...).steps()` instruction by instruction (dedicated device per rank, "
          "blocking p2p, no transfer time, no optimizer step). Utilisation = busy / step per stage.", "",
          "| layout | M | step (ms) | bubble (simulated) | bubble if stages were equal | utilisation per stage | tokens/s (dedicated) |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, sch in res["schedule"].items():
        util = ", ".join(f"{v:.2f}" for k, v in sch["utilisation"].items() if k.startswith("0/"))
        L.append(f"| {name} | {sch['num_micro']} | {_ms(sch['step_s'])} | {sch['bubble']:.2f} | "
                 f"{sch['uniform_bubble']:.2f} | {util} | {sch['tokens_per_s_dedicated']:.0f} |")
    L += ["", "## Memory per stage", "",
          f"Activation bytes measured ({next(iter(res['memory'].values()))[0]['measured']['method']}); "
          "weights and gradients from the stage's parameters; optimizer = DeepSpeed ZeRO-1 "
          f"({ZERO1_OPTIMIZER_BYTES} B per trainable parameter / dp; plus {ZERO1_FP32_GRAD_BYTES} B/param/dp fp32 "
          "gradient partition at the step, after activations are freed). Activations = (in-flight - 1) x held + "
          "peak of one micro-batch; in flight = min(S - s, M) under 1F1B.", "",
          "| layout | stage | weights MiB | grads MiB | optimizer MiB | act. held / micro MiB | act. peak one micro MiB | in flight | total MiB |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in res["memory"].items():
        for r in rows:
            L.append(f"| {name} | {r['stage']} | {_mib(r['weights'])} | {_mib(r['grads'])} | {_mib(r['optimizer'])} | "
                     f"{_mib(r['activation_held_per_micro'])} | {_mib(r['activation_peak_one_micro'])} | {r['in_flight']} | "
                     f"{_mib(r['total'])} |")
    if res["device"].startswith("cuda"):  # a real-size model: which layouts fit which GPU
        L += ["", "Busiest rank per layout: " + "; ".join(
            f"{name} {_gib(max(r['total'] for r in rows))} GiB (fits 80 GB: "
            f"{'yes' if max(r['total'] for r in rows) <= USABLE_80GB else 'no'}, 141 GB: "
            f"{'yes' if max(r['total'] for r in rows) <= USABLE_141GB else 'no'})" for name, rows in res["memory"].items())
            + f". Usable: {_gib(USABLE_80GB)} and {_gib(USABLE_141GB)} GiB."]
    tr = res.get("trainer")
    if tr:
        L += ["", "## Measured with the trainer vs predicted from the stage times", "",
              f"`deepspeed --num_gpus 4 launch/train.py` per layout ({tr.get('rounds', 1)} launches each, layouts "
              f"round-robin), {tr['steps']} steps on {tr['manifest_trajectories']} "
              f"generated real-shell trajectories (capacity {tr['capacity']}, bucket {tr['bucket']}; micro-batches of "
              f"{min(tr['micro_batch_tokens'])}..{max(tr['micro_batch_tokens'])} tokens); tokens/s over steps "
              f"{tr['timed_steps']} from metrics.jsonl. The prediction simulates the same micro-batches (each timed on every "
              f"stage, median of {tr['repeats']}): with a dedicated device per rank, with the 4 ranks sharing the "
              f"{res['cores']:.0f} cores, and with them sharing the cores with the background load.", "",
              "| layout | measured tokens/s: median (each launch) | predicted: dedicated devices | predicted: 4 ranks on the idle machine's cores | predicted: with the background load | measured / predicted (background load) | background processes | measured step s (first launch) | predicted step s (background load) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in tr["layouts"].items():
            m = r["measured"]
            each = ", ".join(f"{x:.0f}" for x in m.get("rounds_tokens_per_s", [m["tokens_per_s"]]))
            L.append(f"| {name} | {m['tokens_per_s']:.0f} ({each}) | {r['predicted_tokens_per_s_dedicated']:.0f} | "
                     f"{r['predicted_tokens_per_s_shared']:.0f} | {r['predicted_tokens_per_s_loaded']:.0f} | "
                     f"{r['measured_over_predicted_loaded']:.2f} | {r['background_processes']:.1f} | "
                     f"{', '.join(f'{x:.2f}' for x in m['step_time_s'][1:])} | "
                     f"{', '.join(f'{x:.2f}' for x in r['predicted_step_s_loaded'])} |")
        L += ["", "Rank 0 (stage 0 of replica 0; in PP1xDP4 a whole replica) inside the trainer (first launch), from "
              "DeepSpeed's wall_clock_breakdown timers, against the single-process probe of the same micro-batches "
              "(a pipeline stage's optimizer time includes waiting for the other stages at the step's collectives):", "",
              "| layout | rank 0 forward + backward in the trainer, s per step | the same in the probe, s | slowdown | rank 0 optimizer step, s |",
              "| --- | --- | --- | --- | --- |"]
        for name, r in tr["layouts"].items():
            t0s = r["measured"].get("rank0_fwd_bwd_step_s", [])[1:]
            if len(t0s) != len(r["rank0_probe_fwd_bwd_s"]):
                L.append(f"| {name} | timers not found in the launch output | | | |")
                continue
            inside = [f + b for f, b, _ in t0s]
            L.append(f"| {name} | {', '.join(f'{x:.2f}' for x in inside)} | "
                     f"{', '.join(f'{x:.2f}' for x in r['rank0_probe_fwd_bwd_s'])} | "
                     f"x{sum(inside) / sum(r['rank0_probe_fwd_bwd_s']):.1f} | {', '.join(f'{st:.3f}' for _, _, st in t0s)} |")
        slow = {}
        for name, r in tr["layouts"].items():
            t0s = r["measured"].get("rank0_fwd_bwd_step_s", [])[1:]
            if len(t0s) == len(r["rank0_probe_fwd_bwd_s"]):
                slow[name] = sum(f + b for f, b, _ in t0s) / sum(r["rank0_probe_fwd_bwd_s"])
        ratios = {name: r["measured_over_predicted_loaded"] for name, r in tr["layouts"].items()}
        spread = {name: max(r["measured"].get("rounds_tokens_per_s", [1])) / min(r["measured"].get("rounds_tokens_per_s", [1]))
                  for name, r in tr["layouts"].items()}
        worst = max(spread, key=spread.get)
        if slow:
            L += ["", f"Reading: measured / predicted ranges {min(ratios.values()):.2f}..{max(ratios.values()):.2f}; two "
                  f"launches of one layout differ by up to x{spread[worst]:.1f} ({worst}); rank 0 computes "
                  f"x{min(slow.values()):.1f}..x{max(slow.values()):.1f} slower inside the trainer than the same "
                  "micro-batches in the one-process probe (4 ranks and the other engineers' jobs share 2 cores). "
                  + ("Within that noise this machine cannot rank the layouts by measured tokens/s; "
                     if spread[worst] > 1.3 or max(ratios.values()) / min(ratios.values()) > 1.3 else
                     "The measurement agrees with the prediction; ")
                  + "what it does measure is the balance itself: the frozen stages cost a few percent of the last "
                  "stage and run no backward, so every pipelined layout leaves its frozen ranks idle. On GPUs each "
                  "rank computes on its own device: the dedicated-device prediction."]
        L += ["", "Background processes = the 1-minute load average just before each launch, less this process: "
              "a crude stand-in for the other engineers' jobs. The prediction leaves out the optimizer step, the "
              "gradient all-reduce, the p2p transfers and the engine's per-step collectives, which the measured "
              "step includes."]
    est = res.get("qwen3_8b")
    if est:
        L += qwen3_8b_markdown(est)
    return "\n".join(L) + "\n"


def recommendation(est: dict) -> list[str]:
    """The layout to use per GPU memory, derived from `est` (the fastest layout whose busiest rank fits,
    at the conservative frozen-layer rate; memory with the fp32 fast weights when that estimate exists)."""
    key = "fp32_fast_weights" if est["fast_weight_factor"] is not None else "recorded_inner_loop"
    lines = []
    for gpu in est["usable_bytes"]:
        for t in sorted({r["tokens"] for r in est["rows"]}):
            cands = []
            for r in est["rows"]:
                if r["tokens"] != t or not r["fits"][gpu][key]:
                    continue
                rate = min(r["by_rate"], key=float)
                cands.append((r["by_rate"][rate]["tokens_per_s"], r))
            pp4 = {r["backend"]: r for r in est["rows"] if r["tokens"] == t and r["layout"] == "PP4xDP1"}
            if not cands:
                lines.append(f"- {gpu}, {t // 1024}K tokens: no layout fits "
                             f"(smallest busiest rank {_gib(min(r['busiest_rank_bytes'][key] for r in est['rows'] if r['tokens'] == t))} GiB "
                             f"of {_gib(est['usable_bytes'][gpu])} usable).")
                continue
            tps, best = max(cands, key=lambda x: x[0])
            ref = pp4[best["backend"]]
            ref_tps = ref["by_rate"][min(ref["by_rate"], key=float)]["tokens_per_s"]
            margin = est["usable_bytes"][gpu] - best["busiest_rank_bytes"][key]
            tight = " (tight: under 10% headroom, within this estimate's error)" if margin < 0.1 * est["usable_bytes"][gpu] else ""
            lines.append(f"- {gpu}, {t // 1024}K tokens: **{best['layout']}**, attention `{best['backend']}`: "
                         f"{tps:,.0f} tokens/s on 4 GPUs (PP4xDP1 with the same attention: {ref_tps:,.0f}, "
                         f"x{tps / ref_tps:.1f}); busiest rank {_gib(best['busiest_rank_bytes'][key])} of "
                         f"{_gib(est['usable_bytes'][gpu])} GiB usable{tight}.")
        fit = longest_fitting_context(est, gpu, key)
        lines.append(f"- {gpu}, longest context that fits (interpolated between the recorded lengths): "
                     + "; ".join(f"{layout} `{backend}` {fit[(backend, layout)] or 'under 2K'}"
                                 for backend, layout in sorted(fit)) + ".")
    return lines


def reasoning(est: dict) -> list[str]:
    """Why, with the numbers of `est` at the recorded length closest to 8K."""
    key = "fp32_fast_weights" if est["fast_weight_factor"] is not None else "recorded_inner_loop"
    t = min({r["tokens"] for r in est["rows"]}, key=lambda x: abs(x - 8192))
    at = {(r["backend"], r["layout"]): r for r in est["rows"] if r["tokens"] == t}
    backend = "cuda" if ("cuda", "PP4xDP1") in at else next(iter(at))[0]
    pp4, pp2, pp1 = (at[(backend, n)] for n in ("PP4xDP1", "PP2xDP2", "PP1xDP4"))
    lo = min(pp4["by_rate"], key=float)
    u4 = pp4["by_rate"][lo]["utilisation_last"]
    frozen_share = 1 - pp4["last_stage_step_s"] * pp4["num_micro"] / pp4["by_rate"][lo]["step_s"]
    gib = lambda r: _gib(r["busiest_rank_bytes"][key])  # noqa: E731
    return [
        f"Why ({t // 1024}K, attention `{backend}`): the last stage's meta-step ({pp4['last_stage_step_s']:.2f} s per "
        f"micro-batch) is the whole step. In PP4xDP1 the last stage is busy {u4:.0%} of the step and the three "
        f"frozen stages together add {max(frozen_share, 0):.1%}; they wait the rest, so 4 GPUs give one GPU's "
        "meta-step throughput. Throughput is set by how many copies of the last stage run at once: PP2xDP2 "
        f"runs 2 ({pp2['by_rate'][lo]['tokens_per_s']:,.0f} tokens/s), PP1xDP4 runs 4 "
        f"({pp1['by_rate'][lo]['tokens_per_s']:,.0f} tokens/s) against {pp4['by_rate'][lo]['tokens_per_s']:,.0f}.",
        f"Memory does not favour PP4 either: its last rank holds the whole ZeRO-1 optimizer state "
        f"({_gib(est['optimizer_bytes_dp1'])} GiB, dp = 1). PP1xDP4 adds the 27 frozen layers + embedding "
        f"({_gib(est['weight_bytes_all'] - est['weight_bytes_last_stage'])} GiB) but splits the optimizer 4 ways, "
        f"so its busiest rank ({gib(pp1)} GiB) is within a GiB of PP4's ({gib(pp4)} GiB); PP2xDP2's is the "
        f"smallest ({gib(pp2)} GiB: last-stage weights, optimizer / 2).",
        "Other partitions do not change this. Every adaptive layer must stay on the last stage, so moving frozen "
        "layers between stages 0..S-2 only rebalances stages that are idle anyway, and no frozen layer may move "
        "onto the last stage (the partition must sum to the non-adaptive layers). PP2 with 27 frozen + 9 adaptive "
        "is the PP2xDP2 row; PP1 with data parallelism is PP1xDP4. Pipelining pays only when the last stage "
        "does not fit one GPU with the rest of the model: then PP2xDP2 is the fallback (it also saves "
        "optimizer memory), and PP4 is never the better choice for this model under the `prime` scope.",
    ]


def qwen3_8b_markdown(est: dict) -> list[str]:
    lay = est["layer_fwd_flops_8k"]
    fw = est["fast_weight_factor"]
    L = ["", f"## Qwen3-8B on GPUs: which layout (global batch {est['global_batch']}, 4 GPUs)", "",
         "**Basis, measured:** the last stage (9 adaptive layers + final norm + LM head; one meta-step = event loop "
         f"+ backward; bf16, per-event checkpointing) recorded on the {est['gpu']} "
         f"(benchmarks/results/gpu/last_stage.json, commit {str(est['recorded_commit'])[:7]}).", "",
         f"**Basis, estimated:** a frozen decoder layer's forward from FLOPs (at 8K tokens {lay['total'] / 1e12:.2f} "
         f"TFLOP: {lay['linear'] / 1e12:.2f} linear + {lay['attention'] / 1e12:.2f} causal attention) at the SDPA "
         "flash fwd+bwd rate measured on the same H200 at that length (benchmarks/results/gpu/flashbob_cuda.json: "
         + ", ".join(f"{n // 1024}K {r:.0f}" for n, r in sorted((int(n), r) for n, r in est["measured_flash_tflops"].items()))
         + f" TFLOP/s), and in brackets at an assumed {est['assumed_gemm_tflops']:.0f} TFLOP/s (~60% of the H200's "
         "989 TFLOP/s dense bf16). Frozen-stage backward: "
         + ("recompute + 2x forward (this tree runs it)." if est["frozen_backward"] else
            "none (this tree sends grad-free boundaries; the CPU probe above shows the frozen stages run no backward).")
         + f" The last stage's step is split {est['last_stage_fwd_fraction']:.0%} forward (the CPU ratio) for the "
         "schedule; its F and B are adjacent, so the split hardly moves the step.", "",
         "**Memory of the busiest rank** (always the last stage's): its weights (PP1: the whole model, "
         f"{_gib(est['weight_bytes_all'])} GiB; PP2/PP4: the last stage, {_gib(est['weight_bytes_last_stage'])} GiB) + bf16 "
         f"prime gradients ({_gib(est['grad_bytes'])} GiB) + ZeRO-1 optimizer state {_gib(est['optimizer_bytes_dp1'])} GiB / dp "
         "+ activations (the recorded peak minus the last stage's weights and gradients). "
         + (f"The recording predates the fp32 fast weights (commit {FP32_FAST_WEIGHTS_COMMIT}); the column 'fp32 fast "
            f"weights' adds what they hold more: measured on CPU with the current code, each inner update keeps "
            f"{fw:.2f} fp32 copies of the prime weights, so per update +{fw:.2f} x {_gib(est['prime_mlp_params'] * 2)} GiB "
            f"over bf16, plus the fp32 copy of W_0 ({_gib(est['prime_mlp_params'] * 4)} GiB)." if fw is not None else "")
         + " DeepSpeed's transient gradient buckets at the optimizer step (after the activations are freed) are "
         "not counted." + f" Usable: 78 GiB of an 80 GB GPU, {_gib(est['usable_bytes']['141 GB'])} GiB of the H200 (2 GiB for the "
         "CUDA context and allocator). The step times are those of the recorded inner loop; the fp32 path's extra "
         "x (W - W_0)^T products make the last stage somewhat slower for every layout alike.", "",
         "| T | attention | layout | M | last-stage utilisation | step s | tokens/s, frozen layers at the measured flash "
         f"rate (at {est['assumed_gemm_tflops']:.0f} TFLOP/s) "
         "| busiest rank GiB, recorded inner loop | busiest rank GiB, fp32 fast weights | fits 80 GB | fits 141 GB |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    key = "fp32_fast_weights" if fw is not None else "recorded_inner_loop"
    for r in est["rows"]:
        lo, hi = r["by_rate"][min(r["by_rate"], key=float)], r["by_rate"][max(r["by_rate"], key=float)]
        mem = r["busiest_rank_bytes"]
        L.append(f"| {r['tokens'] // 1024}K | {r['backend']} | {r['layout']} | {r['num_micro']} | {lo['utilisation_last']:.2f} | "
                 f"{lo['step_s']:.1f} | {lo['tokens_per_s']:,.0f} ({hi['tokens_per_s']:,.0f}) | "
                 f"{_gib(mem['recorded_inner_loop'])} | {_gib(mem[key]) if fw is not None else '-'} | "
                 f"{'yes' if r['fits']['80 GB'][key] else 'no'} | {'yes' if r['fits']['141 GB'][key] else 'no'} |")
    L += ["", "### Recommendation", ""] + est.get("recommendation", []) + [""] + est.get("reasoning", [])
    return L
