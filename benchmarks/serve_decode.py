"""Serving decode speed: AgentSession (preallocated KV cache) against transformers' `generate`, same weights.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_decode.py           # ~3 min
    .venv/bin/python benchmarks/serve_decode.py --new-tokens 64 --repeats 3 # quick look

The model is the main job's kind: the `tiny-mem` preset (5 layers, hidden 128) with the main job's
TTT settings (ds_configs/run_cpu_tiny.json: 2 adaptive layers, prime width 512) and a compact
vocabulary (the Qwen3 tokenizer trimmed to a few generated trajectories, as prepare --trim-vocab
does), random init, exported with launch/export.py's writer. Both sides load that export:

  ours  AgentModel.load(EXPORT): the TTT model. Updates off: no observation happens, so the fast
        weights stay W_0, and W_0's prime down projection is zero at init, so the prime branch adds
        exactly zero (it is still computed: ours does that extra work).
  hf    transformers.Qwen3ForCausalLM.from_pretrained(EXPORT): the backbone, the same tensors (the
        export's index has no prime weights), its default dynamic cache, SDPA attention.

The same prompt (the generator's system prompt + bash tool + a task, rendered by the training renderer,
then `<|im_start|>assistant\\n`), fp32, one thread each (torch.set_num_threads(1)), no early stop on
either side (our stop set is emptied; hf gets min_new_tokens = max_new_tokens and no eos), greedy and
sampled (temperature 1, top-p 0.9). Each repeat times, interleaved ours / hf:
  first-token latency  prompt text in -> first generated token chosen (ours: reset + act, rendering the
                       messages, the prompt prefill, the first token, stamped by act's on_token; hf:
                       tokenizing the same rendered text (same ids, checked), generate(max_new_tokens=1))
  decode tokens/s      (N - 1) / (time to the N-th token - first-token latency), per repeat (ours: the
                       N-th on_token stamp; hf: generate returning)
Medians over --repeats (after one warm-up). Checks: greedy tokens must agree (ours vs hf) on a prefix
of at least --min-agree tokens (fp32 ties can split later; the agreement is reported); the implied
GFLOP/s of each side must stay below this run's measured fp32 matmul peak (an implied rate above the
peak is an error, exit 1). Results: benchmarks/results/serve_decode.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"


def build_export(out_dir: pathlib.Path, backbone: dict | None = None, *, isolation: str = "required"
                 ) -> tuple[pathlib.Path, dict]:
    """The export described in the module docstring; `backbone`: tiny_qwen3_config arguments instead of
    the preset's (serve_concurrency.py --shape: a model whose weights, not its per-session caches, dominate);
    isolation "none": the worlds that trim the vocabulary run unsandboxed, without a cgroup (a GPU machine
    without bubblewrap: serve_concurrency.py --no-isolation)."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.data.vocab_trim import trim_tokenizer
    from ds_ttt.export import export_model
    from ds_ttt.model.presets import backbone_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    full = load_tokenizer()
    corpus = [render_trajectory(generate_memory_world(7 + i, num_distractors=1, isolation=isolation,
                                                      cgroup_caps=isolation), full).input_ids for i in range(4)]
    tok, _ = trim_tokenizer(full, corpus)
    run = json.loads((REPO / "ds_configs" / "run_cpu_tiny.json").read_text())
    cfg = backbone_config(run["preset"])
    if backbone:
        from ds_ttt.model.presets import tiny_qwen3_config
        cfg = tiny_qwen3_config(**backbone)
    cfg.vocab_size = -(-len(tok) // 64) * 64  # as the trainer pads a compact vocabulary
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**run["ttt"])).eval()
    export_model(model, out_dir, tokenizer=tok)
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    return out_dir, {"preset": run["preset"], "ttt": run["ttt"], "vocab_size": cfg.vocab_size,
                     "tokenizer_size": len(tok), "matmul_params": n_matmul,
                     "num_layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}


def matmul_peak_gflops(n: int = 512, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-agree", type=int, default=16, help="greedy tokens that must agree (ours vs hf)")
    p.add_argument("--attention-backend", default="reference", choices=["reference", "auto", "cpu"],
                   help="our prefill's attention kernel (decode steps use fused SDPA either way)")
    p.add_argument("--out", default=str(OUT / "serve_decode.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import Qwen3ForCausalLM

    from ds_ttt.serve import AgentModel, AgentSession

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="serve_decode_"))
    export, model_info = build_export(tmp / "export")
    agent = AgentModel.load(export, attention_backend=args.attention_backend)
    agent.stop_ids = set()  # no early stop: exactly N tokens on both sides
    hf = Qwen3ForCausalLM.from_pretrained(str(export)).eval()
    task = "Find the port of the api service and write it to PORT."
    probe = AgentSession(agent)
    probe.reset(task)
    prompt_ids = probe.input_ids + agent.prompt_ids
    prompt = torch.tensor([prompt_ids])
    prompt_text = agent.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert agent.tokenizer(prompt_text, add_special_tokens=False)["input_ids"] == prompt_ids
    N = args.new_tokens
    modes = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 1.0, "top_p": 0.9}}

    def ours(n, mode, seed):
        stamps = []
        t0 = time.perf_counter()
        s = AgentSession(agent, max_new_tokens=n, seed=seed, **modes[mode])
        s.reset(task)
        s.act(on_token=lambda tok: stamps.append(time.perf_counter()))
        return stamps[-1] - t0, s.history[-1].action_ids[:n]

    def theirs(n, mode, seed):
        kw = ({"do_sample": False} if mode == "greedy" else
              {"do_sample": True, "temperature": modes[mode]["temperature"], "top_p": modes[mode]["top_p"], "top_k": 0})
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        ids = agent.tokenizer(prompt_text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():  # the strongest setting for hf too (ours decodes under inference_mode)
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0, **kw)
        dt = time.perf_counter() - t0
        return dt, out[0, prompt.shape[1]:].tolist()

    peak_before = matmul_peak_gflops()
    load_before = os.getloadavg()
    rows, errors = {}, []
    for mode in modes:
        for fn in (ours, theirs):  # warm-up
            fn(4, mode, 0)
        times = {"ours": {"first": [], "full": []}, "hf": {"first": [], "full": []}}
        tokens = {}
        for r in range(args.repeats):
            for name, fn in (("ours", ours), ("hf", theirs)):
                first, _ = fn(1, mode, r)
                full, toks = fn(N, mode, r)
                assert len(toks) == N, (name, len(toks))
                times[name]["first"].append(first)
                times[name]["full"].append(full)
                tokens.setdefault(name, toks)
        row = {}
        for name in ("ours", "hf"):
            decode = [(N - 1) / max(f - s, 1e-9) for f, s in zip(times[name]["full"], times[name]["first"])]
            row[name] = {"first_token_ms_median": 1e3 * statistics.median(times[name]["first"]),
                         "decode_tokens_per_s_median": statistics.median(decode),
                         "end_to_end_tokens_per_s_median": N / statistics.median(times[name]["full"]),
                         "first_token_ms": [1e3 * x for x in times[name]["first"]],
                         "decode_tokens_per_s": decode}
        row["decode_speedup_ours_over_hf"] = (row["ours"]["decode_tokens_per_s_median"]
                                              / row["hf"]["decode_tokens_per_s_median"])
        row["first_token_speedup_ours_over_hf"] = (row["hf"]["first_token_ms_median"]
                                                   / row["ours"]["first_token_ms_median"])
        if mode == "greedy":
            agree = next((i for i, (a, b) in enumerate(zip(tokens["ours"], tokens["hf"])) if a != b), N)
            row["greedy_tokens_agree"] = agree
            if agree < min(args.min_agree, N):
                errors.append(f"greedy tokens agree on only {agree} < {args.min_agree} tokens: not the same model")
        rows[mode] = row
    peak = max(peak_before, matmul_peak_gflops())
    # a decode token costs at least 2 FLOPs per matmul weight (attention over the cache adds more)
    for mode, row in rows.items():
        for name in ("ours", "hf"):
            implied = 2 * model_info["matmul_params"] * row[name]["decode_tokens_per_s_median"] / 1e9
            row[name]["implied_gflops"] = implied
            if implied > peak:
                errors.append(f"{mode}/{name}: implied {implied:.2f} GFLOP/s exceeds the measured peak {peak:.2f}")
    result = {"format": "ds_ttt-serve-decode-v1", "new_tokens": N, "prompt_tokens": len(prompt_ids),
              "repeats": args.repeats, "threads": torch.get_num_threads(), "model": model_info,
              "attention_backend": agent.attention_backend,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "transformers": __import__("transformers").__version__,
                          "load_average_before": load_before, "load_average_after": os.getloadavg(),
                          "matmul_peak_gflops": peak},
              "results": rows, "errors": errors}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 1 if errors else 0


def markdown(res: dict) -> str:
    m = res["model"]
    lines = ["# Serving decode: AgentSession vs transformers generate (same weights, CPU, 1 thread)", "",
             f"- model: `{m['preset']}` ({m['num_layers']} layers, hidden {m['hidden']}), vocab {m['vocab_size']} "
             f"(compact tokenizer, {m['tokenizer_size']} tokens), TTT: {m['ttt']['adaptive_layers']} adaptive layers, "
             f"prime width {m['ttt']['prime_intermediate_size']}; fp32; updates off (W_0, prime down = 0)",
             f"- prompt {res['prompt_tokens']} tokens, {res['new_tokens']} new tokens (no early stop), "
             f"{res['repeats']} repeats interleaved, medians; load average {res['machine']['load_average_before'][0]:.1f} "
             f"-> {res['machine']['load_average_after'][0]:.1f} on {res['machine']['cpus']} CPUs; "
             f"matmul peak {res['machine']['matmul_peak_gflops']:.1f} GFLOP/s",
             f"- ours: prompt prefill (empty cache, causal) and decode steps: fused SDPA over the preallocated "
             f"cache; the generation-prompt chunk: FlashBoB `{res['attention_backend']}`; hf: SDPA, DynamicCache",
             f"- torch {res['machine']['torch']}, transformers {res['machine']['transformers']}", "",
             "| decoding | side | first token (ms) | decode tokens/s | end-to-end tokens/s | implied GFLOP/s |",
             "|---|---|---|---|---|---|"]
    for mode, row in res["results"].items():
        for name in ("ours", "hf"):
            r = row[name]
            lines.append(f"| {mode} | {name} | {r['first_token_ms_median']:.1f} | {r['decode_tokens_per_s_median']:.1f} | "
                         f"{r['end_to_end_tokens_per_s_median']:.1f} | {r['implied_gflops']:.3f} |")
    lines.append("")
    for mode, row in res["results"].items():
        agree = f", greedy tokens agree on {row['greedy_tokens_agree']}/{res['new_tokens']}" if "greedy_tokens_agree" in row else ""
        lines.append(f"- {mode}: decode x{row['decode_speedup_ours_over_hf']:.2f} ours/hf, first token "
                     f"x{row['first_token_speedup_ours_over_hf']:.2f}{agree}")
    if res["errors"]:
        lines += ["", "ERRORS: " + "; ".join(res["errors"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
