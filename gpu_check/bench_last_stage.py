"""One meta-training step of the last pipeline stage (the adaptive layers, final norm, LM head).

    python gpu_check/bench_last_stage.py --out benchmarks/results/gpu/last_stage.json
        [--contexts 2048,8192,16384] [--backends cuda,reference] [--repeats 2] [--budget-s 150]
        [--preset qwen3-8b] [--device cuda] [--dtype bf16]

What runs: the 9 adaptive TTTDecoderLayers of a Qwen3-8B-shaped model (hidden 4096, 32 / 8 heads,
head_dim 128, MLP 12288, prime MLP 12288), the final RMSNorm and the LM head (vocab 151936), built
directly on the device with random weights (nothing is downloaded). The input is what the
previous stage would send: random hidden states [1, T, C] that require grad, plus token kinds
and round ids of a synthetic trajectory (a context prompt, then rounds of header / action /
observation, the last round cut at T). One step = `run_event_loop(..., create_graph=True)`
(event by event, per-event non-reentrant checkpointing, a differentiable inner SGD step per
observation) + `loss.backward()`; the optimizer step is not included. Trainable: the prime MLPs
and their norms (TTTConfig's default scope) and the input hidden states.

Measured per (attention backend, T): wall time of the step (CUDA-synchronised, min over
--repeats after one untimed warm-up step per backend), tokens/s = T / step time, peak allocated
memory (absolute, weights included), the loss, and checks: finite loss, finite non-zero input
gradient, finite prime gradients, one inner update per observed round. At the smallest T the
"cuda" and "reference" attention backends are compared (loss and the input gradient's cosine) as a
gross-error tripwire. Out-of-memory is caught and recorded, and larger T are then skipped for that
backend. The JSON file is rewritten after every measurement.

`last_stage_step` and `synthetic_trajectory` also run on CPU with a tiny config and the reference
backend (gpu_check/tests/test_gpu_check.py).

Shape letters: T tokens, C hidden.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ds_ttt.data import synthetic  # noqa: E402
from ds_ttt.data.token_kind import TokenKind  # noqa: E402
from gpu_results import PhaseRecord, positive_ints  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def synthetic_trajectory(num_tokens: int, *, prompt: int, action: int, observation: int, vocab: int,
                         seed: int = 0, device="cpu"):
    """ids, kinds, rounds [1, T] of one trajectory with exactly `num_tokens` tokens.

    Round 0 is `prompt` context tokens; round r >= 1 is a 2-token header (context), `action` action
    tokens, a separator, `observation` observation tokens and a separator; the last round is cut
    at T (ds_ttt.data.synthetic's default round).
    """
    if prompt < 1 or action < 1 or observation < 1:
        raise ValueError("prompt, action and observation must each be >= 1 token")
    tensors = synthetic.synthetic_trajectory(num_tokens, vocab_size=vocab, seed=seed, prompt=prompt, action=action,
                                             observation=observation)
    return tuple(t[None].to(device) for t in tensors)


def build_last_stage(config, *, num_adaptive: int, prime_width: int | None = None, device="cpu",
                     dtype=torch.float32, std: float | None = None, seed: int = 0):
    """SuffixModules of the last stage, built directly on `device` with seeded random weights.

    Linear weights ~ N(0, std) (std defaults to config.initializer_range); norms are ones; the
    prime down projections are random too (not the zero init) so every path carries signal.
    Only the prime MLPs and their norms require grad (the default trainable scope "prime").
    """
    from ds_ttt.model.event_loop import SuffixModules
    from ds_ttt.model.qwen3 import RMSNorm, TTTDecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    if not 1 <= num_adaptive <= config.num_hidden_layers:
        raise ValueError(f"num_adaptive={num_adaptive} must be in [1, {config.num_hidden_layers}]")
    std = config.initializer_range if std is None else std
    prime_width = prime_width or config.intermediate_size
    first = config.num_hidden_layers - num_adaptive
    torch.manual_seed(seed)
    with torch.device(device):
        # One layer at a time in fp32, then cast: the transient fp32 copy stays one layer big.
        layers = nn.ModuleList(TTTDecoderLayer(config, first + i, prime_width).to(dtype)
                               for i in range(num_adaptive))
        norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps).to(dtype)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(dtype)
        rotary = Qwen3RotaryEmbedding(config)  # inv_freq stays fp32
    with torch.no_grad():
        for module in [*layers.modules(), lm_head]:
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
    for name, p in [*layers.named_parameters(), *norm.named_parameters(prefix="norm"),
                    *lm_head.named_parameters(prefix="lm_head")]:
        p.requires_grad_(".prime_" in name)  # "<i>.prime_mlp.*", "<i>.prime_layernorm.weight"
    return SuffixModules(layers=list(layers), norm=norm, lm_head=lm_head, rotary_emb=rotary)


def trainable_parameters(suffix) -> list[torch.Tensor]:
    params = [p for layer in suffix.layers for p in layer.parameters()]
    params += list(suffix.norm.parameters()) + list(suffix.lm_head.parameters())
    return [p for p in params if p.requires_grad]


def last_stage_step(suffix, ttt, hidden_1TC: torch.Tensor, ids_1T, kinds_1T, rounds_1T) -> dict:
    """Event loop with create_graph=True, then backward; returns scalars for the record."""
    from ds_ttt.model.event_loop import run_event_loop

    out = run_event_loop(suffix, ttt, hidden_1TC, ids_1T, kinds_1T, rounds_1T, create_graph=True)
    out.loss.backward()
    return {"loss": float(out.loss.detach()), "num_updates": out.num_updates, "num_skipped": out.num_skipped,
            "num_action_tokens": out.num_action_tokens, "num_obs_tokens": out.num_obs_tokens}


def step_checks(info: dict, hidden_1TC: torch.Tensor, suffix, rounds_1T, kinds_1T) -> list[tuple[str, bool, str]]:
    """(name, ok, detail) for one finished step."""
    checks = [("loss finite", math.isfinite(info["loss"]), f"loss={info['loss']:.6g}")]
    g = hidden_1TC.grad
    gnorm = float(g.float().norm()) if g is not None else float("nan")
    checks.append(("input gradient finite and non-zero", math.isfinite(gnorm) and gnorm > 0, f"|dL/dh|={gnorm:.4g}"))
    pnorms = [float(p.grad.float().norm()) if p.grad is not None else 0.0 for p in trainable_parameters(suffix)]
    checks.append(("prime gradients finite and not all zero",
                   all(math.isfinite(x) for x in pnorms) and any(x > 0 for x in pnorms),
                   f"{sum(x > 0 for x in pnorms)}/{len(pnorms)} non-zero"))
    # Label position t (round rounds[t]) predicts token t+1, so a round is "observed" when some
    # t in it has kinds[t+1] == observation (the event loop's rule).
    obs_rounds = len({r for r, k in zip(rounds_1T[0, :-1].tolist(), kinds_1T[0, 1:].tolist()) if k == TokenKind.OBSERVATION})
    checks.append(("one inner update per observed round",
                   info["num_updates"] + info["num_skipped"] == obs_rounds and info["num_skipped"] == 0,
                   f"updates={info['num_updates']} skipped={info['num_skipped']} observed rounds={obs_rounds}"))
    return checks


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _zero_grads(suffix, hidden=None) -> None:
    for p in trainable_parameters(suffix):
        p.grad = None
    if hidden is not None:
        hidden.grad = None


def run(*, out: str, contexts: list[int], backends: list[str], repeats: int = 2, budget_s: float = 150.0,
        preset: str = "qwen3-8b", num_adaptive: int = 9, device: str = "cuda", dtype: str = "bf16",
        prompt: int = 512, action: int = 256, observation: int = 768, config=None) -> dict:
    """Measure every (backend, T) within `budget_s`; write `out` after each; return the record."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import backbone_config

    t_start = time.perf_counter()
    cfg = config if config is not None else backbone_config(preset)
    torch_dtype = DTYPES[dtype]
    desc = (f"{num_adaptive} adaptive layers of `{preset}` (hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} heads, head_dim {cfg.head_dim}, MLP {cfg.intermediate_size}, prime MLP "
            f"{cfg.intermediate_size}) + final norm + LM head (vocab {cfg.vocab_size}), random {dtype} weights on "
            f"{device}; input hidden [1, T, {cfg.hidden_size}] requires grad; rounds: prompt {prompt}, then "
            f"({synthetic.DEFAULT_HEADER_TOKENS} header, {action} action, {synthetic.DEFAULT_SEPARATOR_TOKENS}, "
            f"{observation} observation, {synthetic.DEFAULT_SEPARATOR_TOKENS}) per round; "
            "per-event non-reentrant checkpointing, create_graph=True; "
            "step = event loop + backward (no optimizer step); step s = min over repeats after a warm-up; "
            "peak = max allocated bytes during the steps, weights included.")
    rec = PhaseRecord(out, "last_stage", config={
        "preset": preset, "num_adaptive": num_adaptive, "device": device, "dtype": dtype, "contexts": contexts,
        "backends": backends, "repeats": repeats, "prompt": prompt, "action": action, "observation": observation,
        "checkpoint_events": True, "trainable": "prime MLPs + prime norms, input hidden states",
        "description": desc})
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    suffix = build_last_stage(cfg, num_adaptive=num_adaptive, device=device, dtype=torch_dtype)
    weight_bytes = sum(p.numel() * p.element_size() for layer in suffix.layers for p in layer.parameters())
    weight_bytes += sum(p.numel() * p.element_size() for p in [*suffix.norm.parameters(), *suffix.lm_head.parameters()])
    rec.set(weight_bytes=weight_bytes, build_s=round(time.perf_counter() - t_start, 2))
    ttt_cfgs = {b: TTTConfig(adaptive_layers=num_adaptive, attention_backend=b, checkpoint_events=True)
                .validate(cfg.num_hidden_layers) for b in backends}
    check_tokens = min(contexts)
    reference_grads: dict[str, tuple[float, torch.Tensor]] = {}
    any_failed = False

    def remaining() -> float:
        return budget_s - (time.perf_counter() - t_start)

    for backend in backends:
        ttt = ttt_cfgs[backend]
        last = None  # (T, seconds) of the previous measurement of this backend
        stop_reason = None
        warmed = False
        for num_tokens in contexts:
            row = {"tokens": num_tokens, "backend": backend}
            if stop_reason:
                rec.add_row({**row, "status": stop_reason})
                continue
            if last is not None:
                predicted = last[1] * num_tokens / last[0] * (repeats + 0.5) * 1.5
                if predicted > remaining():
                    rec.add_row({**row, "status": "skipped (time budget)", "predicted_s": round(predicted, 1)})
                    continue
            ids, kinds, rounds = synthetic_trajectory(num_tokens, prompt=min(prompt, num_tokens // 2), action=action,
                                                      observation=observation, vocab=cfg.vocab_size, device=device)
            gen = torch.Generator(device=device).manual_seed(1234 + num_tokens)
            hidden = torch.randn(1, num_tokens, cfg.hidden_size, generator=gen, device=device,
                                 dtype=torch_dtype).requires_grad_(True)
            row["num_events"] = int(rounds.max()) + 1
            try:
                if not warmed:  # first call of a backend: kernel builds, cuBLAS handles, allocator
                    t0 = time.perf_counter()
                    last_stage_step(suffix, ttt, hidden, ids, kinds, rounds)
                    _sync(device)
                    row["warmup_s"] = round(time.perf_counter() - t0, 3)
                    warmed = True
                times = []
                if is_cuda:
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(repeats):
                    _zero_grads(suffix, hidden)
                    _sync(device)
                    t0 = time.perf_counter()
                    info = last_stage_step(suffix, ttt, hidden, ids, kinds, rounds)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                    if remaining() < 0:
                        break
                step_s = min(times)
                row.update(status="ok", step_s=round(step_s, 4), step_times_s=[round(t, 4) for t in times],
                           tokens_per_s=round(num_tokens / step_s, 1), **info)
                if is_cuda:
                    row["peak_bytes"] = torch.cuda.max_memory_allocated()
                checks = step_checks(info, hidden, suffix, rounds, kinds)
                for name, ok, detail in checks:
                    if not ok:
                        any_failed = True
                        rec.check(f"{backend} T={num_tokens}: {name}", False, detail)
                row["checks_ok"] = all(ok for _, ok, _ in checks)
                if num_tokens == check_tokens:
                    reference_grads[backend] = (info["loss"], hidden.grad.detach().float().clone())
                last = (num_tokens, step_s)
            except Exception as exc:  # noqa: BLE001 - OOM and kernel errors become rows, not crashes
                if _is_oom(exc):
                    row.update(status="oom", error=str(exc).splitlines()[0][:300])
                    stop_reason = f"skipped (OOM at T={num_tokens})"
                else:
                    row.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:500]}")
                    stop_reason = f"skipped (error at T={num_tokens})"
                    any_failed = True
                    rec.check(f"{backend} T={num_tokens}: step runs", False, row["error"])
            finally:
                _zero_grads(suffix)
                del hidden
                gc.collect()
                if is_cuda:
                    torch.cuda.empty_cache()
            rec.add_row(row)
        if warmed and not any(r.get("status") == "error" for r in rec.data["rows"] if r["backend"] == backend):
            ok_rows = [r for r in rec.data["rows"] if r["backend"] == backend and r.get("status") == "ok"]
            rec.check(f"{backend}: steps finite, gradients non-zero, one update per observed round",
                      all(r.get("checks_ok") for r in ok_rows), f"{len(ok_rows)} context(s) measured")

    if len(reference_grads) >= 2 and "reference" in reference_grads:
        loss_ref, g_ref = reference_grads["reference"]
        for backend, (loss, g) in reference_grads.items():
            if backend == "reference":
                continue
            rel = abs(loss - loss_ref) / max(abs(loss_ref), 1e-12)
            cos = float(torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0))
            # Tripwire against gross errors (wrong mask, missing gradient term), not an accuracy
            # test: bf16 runs of the same function agree far better; tests/ops owns accuracy.
            ok = rel < 2e-2 and cos > 0.95
            any_failed |= not ok
            rec.check(f"{backend} vs reference at T={check_tokens}: loss and input gradient agree", ok,
                      f"loss rel diff {rel:.2e} (< 2e-2), input-gradient cosine {cos:.5f} (> 0.95)")
    elif len(backends) >= 2:
        rec.note(f"backend cross-check at T={check_tokens} did not run (a backend has no result there)")
    rec.finish("failed" if any_failed else "ok", time.perf_counter() - t_start)
    return rec.data


def _int_list(text: str) -> list[int]:
    return sorted(positive_ints(text))


def _str_list(choices):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"choose from {list(choices)}, got {text!r}")
        return values
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to (re)write")
    ap.add_argument("--contexts", type=_int_list, default=[2048, 8192, 16384])
    ap.add_argument("--backends", type=_str_list(("cuda", "reference", "cpu")), default=["cuda", "reference"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--num-adaptive", type=int, default=9)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--action", type=int, default=256)
    ap.add_argument("--observation", type=int, default=768)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    a = parse_args(argv)
    data = run(out=a.out, contexts=a.contexts, backends=a.backends, repeats=a.repeats, budget_s=a.budget_s,
               preset=a.preset, num_adaptive=a.num_adaptive, device=a.device, dtype=a.dtype, prompt=a.prompt,
               action=a.action, observation=a.observation)
    for row in data["rows"]:
        print(f"[last_stage] T={row['tokens']:>6} {row['backend']:<9} {row.get('status')}: "
              f"step {row.get('step_s', '-')} s, {row.get('tokens_per_s', '-')} tok/s, "
              f"peak {row.get('peak_bytes', 0) / 2**30:.1f} GiB", flush=True)
    return 0 if data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
