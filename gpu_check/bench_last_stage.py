"""One meta-training step of the last pipeline stage (the adaptive layers, final norm, LM head).

    python gpu_check/bench_last_stage.py --out benchmarks/results/gpu/last_stage.json
        [--run-config ds_configs/run_qwen3_8b.json] [--contexts 2048,8192,16384,32768]
        [--backends cuda,reference] [--repeats 2] [--budget-s 150]
        [--preset qwen3-8b] [--device cuda] [--dtype bf16]

The TTT settings are the recipe's: `TTTConfig.from_dict(json["ttt"])` of --run-config (default
ds_configs/run_qwen3_8b.json, read when the benchmark starts), so the step measured is the one users
train (fast matrices, inner step, context policy, key shift, round address, ...). What runs: the
recipe's adaptive layers (9 for Qwen3-8B) of a Qwen3-8B-shaped model (hidden 4096, 32 / 8 heads,
head_dim 128, MLP 12288, prime MLP as the recipe sets it), built with `TTTDecoderLayer.adaptive`
exactly as the pipeline's last stage builds them, the final RMSNorm and the LM head (vocab 151936),
directly on the device with random weights (nothing is downloaded). The input is what the previous
stage would send: random hidden states [1, T, C] that require grad, plus token kinds and round ids of
a synthetic trajectory (a context prompt, then rounds of header / action / observation, the last
round cut at T). One step = `run_event_loop(..., create_graph=True)` (event by event, the recipe's
per-event checkpointing, a differentiable inner step per observation) + `loss.backward()`; the
optimizer step is not included. Trainable: what the recipe's trainable_scope names within the
stage (prime: the prime MLPs and their norms) and the input hidden states.

Order: the first backend of --backends (default: the recipe's attention_backend, then "reference")
runs every T in ascending order; every other backend runs only at the smallest T, right after the
first one there, for the cross-check (so a long T that is killed at the phase limit cannot lose
it). Before each T starts its row is written with status "running"; it is rewritten when that T
ends: "ok", "oom" (torch.cuda.OutOfMemoryError caught; the row keeps the error and the peak reached
before it; longer T of that backend are then recorded as skipped), "error", or "skipped (time
budget)" when its predicted step time is more than twice the time left. Long T run fewer repeats
when the time left holds fewer (at least one; `repeats_run` says how many).

Measured per (backend, T): wall time of the step (CUDA-synchronised, min over the repeats after one
untimed warm-up step per backend at its first T), tokens/s = T / step time, peak allocated and peak
reserved memory (torch.cuda.max_memory_allocated / max_memory_reserved over the timed steps,
absolute, weights included) beside the trainer's pre-flight estimate of it (`estimate_gib`,
ds_ttt/train/memory_budget.py), whether that reserved peak fits an 80 GB GPU (FITS_80GB_GIB), the loss,
and checks: finite loss, finite non-zero input gradient, finite prime gradients, one inner update
per observed round. At the smallest T the backends are compared (loss and the input gradient's
cosine) as a gross-error tripwire. The JSON file is rewritten after every change, so a kill keeps
every T that finished.

`last_stage_step`, `synthetic_trajectory` and `run` also run on CPU with a tiny config and the
reference backend (gpu_check/tests/test_gpu_check.py).

Shape letters: T tokens, C hidden.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
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
RECIPE = REPO / "ds_configs" / "run_qwen3_8b.json"  # the 8B recipe: its `ttt` block is what is measured
DEFAULT_CONTEXTS = (2048, 8192, 16384, 32768)
# An 80 GB GPU (H100 / A100 80GB) shows torch about 79.2 GiB; the CUDA context, cuBLAS workspaces and the
# NCCL buffers of a real run take about 1 GiB of it. A step whose reserved peak stays under this fits.
FITS_80GB_GIB = 78.0
TIME_SKIP_FACTOR = 2.0  # skip a T only when its predicted step takes more than this many times the time left
TIME_EXPONENT = 1.5  # predicted step time ~ T^1.5 from the last measured T (linear layers + causal attention)
LONG_STEP_S = 8.0  # a step predicted to take longer is timed once: its own length evens out the noise


def preflight_estimate_gib(cfg, ttt, num_tokens: int, round_tokens: int) -> float | None:
    """The trainer's pre-flight estimate (ds_ttt/train/memory_budget.py) for this stage as it is measured
    here: the last stage alone (a later stage's weights, the hidden states in with their gradient),
    the prime gradients and no optimizer state (the offload layout's trainable state), so that each
    row records the measured peak beside the estimate it checks. None if the tree has no estimate."""
    try:
        from ds_ttt.train.memory_budget import Layout, estimate
    except ImportError:
        return None
    est = estimate(cfg, ttt, tokens=num_tokens, round_tokens=round_tokens,
                   layout=Layout(stages=2, dp=1, offload_optimizer=True))
    return round(est.total_gib, 2)


def recipe_ttt(path: str | Path = RECIPE, num_hidden_layers: int | None = None):
    """The recipe's TTTConfig: `TTTConfig.from_dict(json["ttt"])` of the run-config file, validated."""
    from ds_ttt.config import TTTConfig

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_last_stage: cannot read the run config {path}: {e}") from None
    if not isinstance(data.get("ttt"), dict):
        raise SystemExit(f"bench_last_stage: {path} has no `ttt` block (the TTT settings the step measures)")
    try:
        return TTTConfig.from_dict(data["ttt"], where=f"{path}: ttt").validate(num_hidden_layers)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"bench_last_stage: {path}: {e}") from None


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


def _trainable(name: str, scope: str) -> bool:
    """Whether the stage's parameter `name` is trained under `scope` (TTTConfig.trainable_scope)."""
    return scope in ("suffix", "all") or ".prime_" in name  # "<i>.prime_mlp.*", "<i>.prime_layernorm.weight"


def build_last_stage(config, *, num_adaptive: int | None = None, ttt=None, prime_width: int | None = None,
                     device="cpu", dtype=torch.float32, std: float | None = None, seed: int = 0):
    """SuffixModules of the last stage, built directly on `device` with seeded random weights.

    The layers are `TTTDecoderLayer.adaptive(config, ttt, i, first)`, as the pipeline's last stage
    builds them (`ttt` defaults to TTTConfig(adaptive_layers=num_adaptive, prime_intermediate_size=
    prime_width)). Linear weights ~ N(0, std) (std defaults to config.initializer_range); norms are
    ones; the prime down projections are random too (not the zero init) so every path carries signal.
    What requires grad follows ttt.trainable_scope ("prime": the prime MLPs and their norms only).
    """
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.event_loop import SuffixModules
    from ds_ttt.model.qwen3 import RMSNorm, TTTDecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    if ttt is None:
        ttt = TTTConfig(adaptive_layers=num_adaptive, prime_intermediate_size=prime_width)
    num_adaptive = ttt.num_adaptive(config.num_hidden_layers) if num_adaptive is None else num_adaptive
    if not 1 <= num_adaptive <= config.num_hidden_layers:
        raise ValueError(f"num_adaptive={num_adaptive} must be in [1, {config.num_hidden_layers}]")
    ttt = dataclasses.replace(ttt, adaptive_layers=num_adaptive)
    std = config.initializer_range if std is None else std
    first = config.num_hidden_layers - num_adaptive
    torch.manual_seed(seed)
    with torch.device(device):
        # One layer at a time in fp32, then cast: the transient fp32 copy stays one layer big.
        layers = nn.ModuleList(TTTDecoderLayer.adaptive(config, ttt, first + i, first).to(dtype)
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
        p.requires_grad_(_trainable(name, ttt.trainable_scope))
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


def measurement_plan(contexts, backends) -> list[tuple[str, int]]:
    """(backend, T) in the order they run: the first backend's smallest T, every other backend at that T
    (the cross-check), then the first backend's longer T in ascending order."""
    contexts = sorted(set(contexts))
    if not contexts or not backends:
        raise ValueError("need at least one context and one backend")
    first, others = backends[0], list(dict.fromkeys(b for b in backends[1:] if b != backends[0]))
    return [(first, contexts[0])] + [(b, contexts[0]) for b in others] + [(first, t) for t in contexts[1:]]


def predicted_step_s(last: tuple[int, float] | None, num_tokens: int) -> float | None:
    """One step's predicted seconds at `num_tokens` from the last measured (T, seconds) of the backend."""
    if last is None:
        return None
    return last[1] * (num_tokens / last[0]) ** TIME_EXPONENT


def repeats_for(repeats: int, step_guess: float | None, left_s: float) -> int:
    """Timed repeats at one T: `repeats`, once for a long step, and never more than the time left holds
    (at least one)."""
    if not step_guess:
        return repeats
    n = 1 if step_guess > LONG_STEP_S else repeats
    return max(1, min(n, int(left_s // step_guess)))


def run(*, out: str, contexts: list[int], backends: list[str] | None = None, repeats: int = 2,
        budget_s: float = 150.0, preset: str = "qwen3-8b", run_config: str | Path = RECIPE, ttt=None,
        num_adaptive: int | None = None, device: str = "cuda", dtype: str = "bf16", prompt: int = 512,
        action: int = 256, observation: int = 768, config=None) -> dict:
    """Measure every (backend, T) of `measurement_plan` within `budget_s`; write `out` after each change;
    return the record. `ttt` (a TTTConfig) replaces the run config's when given (tests)."""
    from ds_ttt.model.presets import backbone_config

    t_start = time.perf_counter()
    cfg = config if config is not None else backbone_config(preset)
    recipe = recipe_ttt(run_config) if ttt is None else ttt
    num_adaptive = recipe.num_adaptive(cfg.num_hidden_layers) if num_adaptive is None else num_adaptive
    recipe = dataclasses.replace(recipe, adaptive_layers=num_adaptive).validate(cfg.num_hidden_layers)
    backends = list(backends or dict.fromkeys([recipe.attention_backend, "reference"]))
    plan = measurement_plan(contexts, backends)
    torch_dtype = DTYPES[dtype]
    prime_width = recipe.prime_intermediate_size or cfg.intermediate_size
    source = "the given TTTConfig" if ttt is not None else str(run_config)
    desc = (f"{num_adaptive} adaptive layers of `{preset}` (hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} heads, head_dim {cfg.head_dim}, MLP {cfg.intermediate_size}, prime MLP "
            f"{prime_width}) + final norm + LM head (vocab {cfg.vocab_size}), random {dtype} weights on "
            f"{device}; TTT settings of {source} (fast_matrices={recipe.fast_matrices}, "
            f"checkpoint_events={recipe.checkpoint_events}, context_policy={recipe.context_policy}, "
            f"trainable_scope={recipe.trainable_scope}); input hidden [1, T, {cfg.hidden_size}] requires grad; rounds: "
            f"prompt {prompt}, then ({synthetic.DEFAULT_HEADER_TOKENS} header, {action} action, "
            f"{synthetic.DEFAULT_SEPARATOR_TOKENS}, {observation} observation, {synthetic.DEFAULT_SEPARATOR_TOKENS}) "
            "per round; create_graph=True; step = event loop + backward (no optimizer step); step s = min over "
            "repeats after a warm-up; peak = max allocated (and reserved) bytes during the timed steps, weights "
            f"included; fits 80 GB = reserved peak <= {FITS_80GB_GIB} GiB.")
    rec = PhaseRecord(out, "last_stage", config={
        "preset": preset, "num_adaptive": num_adaptive, "device": device, "dtype": dtype, "contexts": sorted(set(contexts)),
        "backends": backends, "plan": [list(p) for p in plan], "repeats": repeats, "prompt": prompt, "action": action,
        "observation": observation, "run_config": source, "ttt": recipe.to_dict(),
        "trainable": f"scope {recipe.trainable_scope!r} of the stage, input hidden states",
        "fits_80gb_gib": FITS_80GB_GIB, "description": desc})
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    suffix = build_last_stage(cfg, ttt=recipe, device=device, dtype=torch_dtype)
    weight_bytes = sum(p.numel() * p.element_size() for layer in suffix.layers for p in layer.parameters())
    weight_bytes += sum(p.numel() * p.element_size() for p in [*suffix.norm.parameters(), *suffix.lm_head.parameters()])
    rec.set(weight_bytes=weight_bytes, build_s=round(time.perf_counter() - t_start, 2))
    ttt_cfgs = {b: dataclasses.replace(recipe, attention_backend=b).validate(cfg.num_hidden_layers) for b in backends}
    check_tokens = plan[0][1]
    reference_grads: dict[str, tuple[float, torch.Tensor]] = {}
    any_failed = False
    last: dict[str, tuple[int, float]] = {}  # backend -> (T, seconds) of its last measurement
    stopped: dict[str, str] = {}  # backend -> why its longer T are skipped
    warmed: set[str] = set()

    def remaining() -> float:
        return budget_s - (time.perf_counter() - t_start)

    for backend, num_tokens in plan:
        step_ttt = ttt_cfgs[backend]
        row = {"tokens": num_tokens, "backend": backend}
        if backend in stopped:
            rec.add_row({**row, "status": stopped[backend]})
            continue
        predicted = predicted_step_s(last.get(backend), num_tokens)
        if remaining() <= 0 or (predicted is not None and predicted > TIME_SKIP_FACTOR * remaining()):
            rec.add_row({**row, "status": "skipped (time budget)", "left_s": round(max(remaining(), 0.0), 1),
                         **({"predicted_s": round(predicted, 1)} if predicted is not None else {})})
            continue
        row["status"] = "running"  # on disk while it runs: a kill at the phase limit shows which T it was
        rec.add_row(row)
        ids, kinds, rounds = synthetic_trajectory(num_tokens, prompt=min(prompt, num_tokens // 2), action=action,
                                                  observation=observation, vocab=cfg.vocab_size, device=device)
        gen = torch.Generator(device=device).manual_seed(1234 + num_tokens)
        hidden = torch.randn(1, num_tokens, cfg.hidden_size, generator=gen, device=device,
                             dtype=torch_dtype).requires_grad_(True)
        row["num_events"] = int(rounds.max()) + 1
        row["estimate_gib"] = preflight_estimate_gib(cfg, step_ttt, num_tokens, action + observation + 4)
        try:
            if backend not in warmed:  # first call of a backend: kernel loads, cuBLAS handles, allocator
                t0 = time.perf_counter()
                last_stage_step(suffix, step_ttt, hidden, ids, kinds, rounds)
                _sync(device)
                row["warmup_s"] = round(time.perf_counter() - t0, 3)
                warmed.add(backend)
            step_guess = predicted if predicted is not None else row.get("warmup_s", 0.0)
            reps = repeats_for(repeats, step_guess, remaining())
            times = []
            _zero_grads(suffix, hidden)
            if is_cuda:
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                row["base_bytes"] = torch.cuda.memory_allocated()
            for _ in range(reps):
                _zero_grads(suffix, hidden)
                _sync(device)
                t0 = time.perf_counter()
                info = last_stage_step(suffix, step_ttt, hidden, ids, kinds, rounds)
                _sync(device)
                times.append(time.perf_counter() - t0)
                if remaining() < 0:
                    break
            step_s = min(times)
            row.update(status="ok", step_s=round(step_s, 4), step_times_s=[round(t, 4) for t in times],
                       repeats_run=len(times), tokens_per_s=round(num_tokens / step_s, 1), **info)
            if is_cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated()
                row["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
                row["fits_80gb"] = row["reserved_peak_bytes"] <= FITS_80GB_GIB * 2**30
            checks = step_checks(info, hidden, suffix, rounds, kinds)
            for name, ok, detail in checks:
                if not ok:
                    any_failed = True
                    rec.check(f"{backend} T={num_tokens}: {name}", False, detail)
            row["checks_ok"] = all(ok for _, ok, _ in checks)
            if num_tokens == check_tokens:
                reference_grads[backend] = (info["loss"], hidden.grad.detach().float().clone())
            last[backend] = (num_tokens, step_s)
        except Exception as exc:  # noqa: BLE001 - OOM and kernel errors become rows, not crashes
            if _is_oom(exc):
                row.update(status="oom", error=str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
                if is_cuda:  # how far it got: the peak allocated before the failed allocation
                    row["peak_bytes_before_oom"] = torch.cuda.max_memory_allocated()
                stopped[backend] = f"skipped (OOM at T={num_tokens})"
            else:
                row.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:500]}")
                stopped[backend] = f"skipped (error at T={num_tokens})"
                any_failed = True
                rec.check(f"{backend} T={num_tokens}: step runs", False, row["error"])
        finally:
            _zero_grads(suffix)
            del hidden
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
        rec.save()  # the row (already in the record) with its final status

    for backend in backends:
        if backend not in warmed:
            continue
        mine = [r for r in rec.data["rows"] if r["backend"] == backend]
        if not any(r.get("status") == "error" for r in mine):
            ok_rows = [r for r in mine if r.get("status") == "ok"]
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
    ap.add_argument("--run-config", default=str(RECIPE),
                    help="run-config JSON whose `ttt` block is measured (default %(default)s)")
    ap.add_argument("--contexts", type=_int_list, default=list(DEFAULT_CONTEXTS),
                    help="token counts T, run in ascending order (default %(default)s)")
    ap.add_argument("--backends", type=_str_list(("cuda", "reference", "cpu")), default=None,
                    help="the measured backend first, then the cross-check backends (smallest T only); "
                         "default: the run config's attention_backend, then reference")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--num-adaptive", type=int, default=None, help="default: the run config's adaptive_layers")
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
               preset=a.preset, run_config=a.run_config, num_adaptive=a.num_adaptive, device=a.device, dtype=a.dtype,
               prompt=a.prompt, action=a.action, observation=a.observation)
    for row in data["rows"]:
        peak = row.get("peak_bytes", row.get("peak_bytes_before_oom"))
        print(f"[last_stage] T={row['tokens']:>6} {row['backend']:<9} {row.get('status')}: "
              f"step {row.get('step_s', '-')} s, {row.get('tokens_per_s', '-')} tok/s, "
              f"peak {(peak or 0) / 2**30:.1f} GiB", flush=True)
    return 0 if data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
