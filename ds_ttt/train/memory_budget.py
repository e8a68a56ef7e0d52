"""Memory of the busiest rank in a training step, estimated before the first step: the pre-flight check.

    from ds_ttt.train.memory_budget import Layout, estimate
    est = estimate(qwen3_8b_config(), ttt, tokens=32768, round_tokens=1024, layout=Layout(stages=1, dp=4))
    est.total_gib, est.parts_gib          # {"weights": ..., "update_store": ..., ...}

The busiest rank is the one holding the last pipeline stage: the adaptive layers, the final norm, the
LM head and the whole event loop (every other stage runs frozen layers). Its peak falls in the
backward of the last events (docs/training.md, "Memory at long context"). Parts, in bytes:

  weights           the stage's parameters in the compute dtype (bf16: 2 B; fp32 models 4 B)
  trainable_state   the trainable parameters' gradients (compute dtype), ZeRO-1's fp32 gradient
                    partition (4 B / dp) and AdamW's fp32 master weights and moments (12 B / dp, or 0
                    with the optimizer offloaded to the CPU)
  update_store      the checkpointed event loop's stored updates (model/event_checkpoint.py): per fast
                    matrix and event the smaller of its gradient's factors, n (in + out), and the
                    gradient, in x out, at the compute dtype's size: at most
                    min(tokens (in + out), events in out) per fast matrix
  fast_work         fp32 fast-matrix buffers alive in one event's backward: W_{r-1} rebuilt, dL/dW_r
                    coming in, dL/dW_{r-1} going out, the event's own contribution to it, and one
                    transient (FAST_WORK_COPIES, read from the CPU probe's live set, ttt_memory)
  kv_cache          the adaptive layers' keys and values as per-event chunks, and their gradients
  hidden            the stage's input hidden states (and their gradient when a stage sends them)
  event_activations one event's recompute with the differentiable inner step (activations, the inner
                    gradient's graph, fp32 logits of the scored rows): ACTIVATION_BYTES per round
                    token, per adaptive layer and per unit of width (hidden + MLP + prime width)

ACTIVATION_BYTES is the one constant not read from the code: it is the Qwen3-8B residual of the H200
recording at 2K (benchmarks/results/gpu/last_stage.json, 68.6 GiB, less what the other parts of the
code before held: 18.8 GiB for one 1,028-token round of 9 layers). On the CPU probe of
benchmarks/ttt_memory.py the same constant overestimates the measured peak about twofold, so the
estimate leans to refusing; the GPU check records each length's peak beside this estimate.

`preflight(...)` is what the trainer calls: it returns the estimate and, when the device has less
memory than the estimate, the error message naming the context, the estimate and a layout or setting
that fits (checked with this same estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GIB = 2**30
FAST_WORK_COPIES = 5  # fp32 fast-matrix buffers alive in one event's backward (see the module docstring)
ACTIVATION_BYTES = 76.0  # per round token x adaptive layer x (hidden + MLP width + prime width); see docstring
OPTIMIZER_BYTES = 12  # AdamW under ZeRO-1: fp32 master + exp_avg + exp_avg_sq per trainable parameter
FP32_GRAD_BYTES = 4  # ZeRO-1's fp32 gradient partition per trainable parameter
USABLE_FRACTION = 0.975  # of a device's memory: the CUDA context and allocator slack take the rest
DEFAULT_ROUND_TOKENS = 1024  # a Terminus-2 round (command + terminal output), when the data gives none


@dataclass
class Layout:
    """Where the step runs: pipeline stages x data-parallel ranks, ZeRO stage, optimizer offload."""

    stages: int = 1
    dp: int = 1
    zero_stage: int = 1
    offload_optimizer: bool = False

    def describe(self) -> str:
        off = " + optimizer offload" if self.offload_optimizer else ""
        return f"PP{self.stages}xDP{self.dp} ZeRO-{self.zero_stage}{off}"


@dataclass
class Estimate:
    tokens: int
    round_tokens: int
    layout: Layout
    parts_gib: dict = field(default_factory=dict)

    @property
    def total_gib(self) -> float:
        return sum(self.parts_gib.values())

    def table(self) -> str:
        return ", ".join(f"{k} {gib_text(v)}" for k, v in self.parts_gib.items())


def gib_text(gib: float) -> str:
    """GiB with one decimal, or MiB below one GiB (a tiny CPU model's parts are not all 0.0)."""
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def _layer_params(config) -> int:
    """Parameters of one Qwen3 decoder layer (attention, MLP, norms)."""
    c, f, h, kv, d = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    return c * h * d + 2 * c * kv * d + h * d * c + 3 * c * f + 2 * c + 2 * d


def stage_layers(config, ttt, stages: int) -> int:
    """Decoder layers on the last stage: all of them with one stage; with more, the adaptive ones only
    (ds_ttt/train/layout.py puts every frozen layer on an earlier stage)."""
    return config.num_hidden_layers if stages == 1 else ttt.num_adaptive(config.num_hidden_layers)


def estimate(config, ttt, *, tokens: int, round_tokens: int = DEFAULT_ROUND_TOKENS, layout: Layout | None = None,
             rows: int = 1, dtype_bytes: int = 2) -> Estimate:
    """The busiest rank's peak (module docstring) for micro-batches of `rows` trajectories of `tokens`
    in rounds of `round_tokens`. Rows run one after another, but every row's stored updates, keys,
    values and hidden states stay until the micro-batch's backward: those parts count `rows` times."""
    layout = layout or Layout()
    c, f = config.hidden_size, config.intermediate_size
    fp = ttt.prime_intermediate_size or f
    n_layers, adaptive = config.num_hidden_layers, ttt.num_adaptive(config.num_hidden_layers)
    layers_here = stage_layers(config, ttt, layout.stages)
    prime = 3 * c * fp + c  # gate, up, down and the prime norm of one adaptive layer
    embed = config.vocab_size * c
    weights = layers_here * _layer_params(config) + adaptive * prime + c + embed  # LM head (+ final norm)
    if layout.stages == 1 and not config.tie_word_embeddings:
        weights += embed  # the input embedding lives here too
    trainable = {"prime": adaptive * prime, "suffix": adaptive * (prime + _layer_params(config)) + c + embed,
                 "all": n_layers * _layer_params(config) + adaptive * prime + 2 * embed}[ttt.trainable_scope]
    # ZeRO-Offload keeps the fp32 gradient partition and the AdamW state in CPU memory
    on_device = 0 if layout.offload_optimizer else FP32_GRAD_BYTES + OPTIMIZER_BYTES
    events = max(1, math.ceil(tokens / max(1, round_tokens)))
    fast_shapes = [(fp, c), (fp, c), (c, fp)]  # (out, in) of gate, up, down
    fast = [s for s, keep in zip(fast_shapes, (ttt.fast_matrices == "all",) * 2 + (True,)) if keep]
    store = adaptive * sum(min(tokens * (o + i), events * o * i) for o, i in fast) * dtype_bytes
    fast_fp32 = adaptive * sum(o * i for o, i in fast) * 4
    kv = 2 * tokens * adaptive * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    hidden = tokens * c * dtype_bytes * (2 if layout.stages > 1 else 1)
    act = ACTIVATION_BYTES * min(round_tokens, tokens) * adaptive * (c + f + fp) * dtype_bytes / 2  # calibrated in bf16
    parts = {"weights": weights * dtype_bytes,
             "trainable_state": trainable * (dtype_bytes + on_device / layout.dp),
             "update_store": rows * store, "fast_work": FAST_WORK_COPIES * fast_fp32, "kv_cache": rows * kv,
             "hidden": rows * hidden,
             "event_activations": act}
    return Estimate(tokens=tokens, round_tokens=round_tokens, layout=layout,
                    parts_gib={k: v / GIB for k, v in parts.items()})


def candidate_layouts(world: int) -> list[Layout]:
    """Layouts of `world` ranks the trainer supports (pipeline stages dividing it, ZeRO-1), with and
    without the optimizer on the CPU, fewest stages first."""
    out = []
    for stages in (1, 2, 4):
        if world % stages == 0:
            for offload in (False, True):
                out.append(Layout(stages=stages, dp=world // stages, zero_stage=1, offload_optimizer=offload))
    return out


def preflight(config, ttt, *, tokens: int, round_tokens: int, layout: Layout, device_bytes: int | None,
              world: int, rows: int = 1, dtype_bytes: int = 2) -> tuple[Estimate, str | None]:
    """The estimate, and None when it fits `device_bytes` (None: a CPU rank, nothing to refuse), else the
    refusal: the context, the estimate by part, and what would fit (another layout of the same ranks,
    a shorter context, or more ranks), each checked with the same estimate."""
    est = estimate(config, ttt, tokens=tokens, round_tokens=round_tokens, layout=layout, rows=rows, dtype_bytes=dtype_bytes)
    if device_bytes is None:
        return est, None
    usable = device_bytes * USABLE_FRACTION / GIB
    if est.total_gib <= usable:
        return est, None
    fixes = []
    for alt in candidate_layouts(world):
        if alt != layout:
            e = estimate(config, ttt, tokens=tokens, round_tokens=round_tokens, layout=alt, rows=rows, dtype_bytes=dtype_bytes)
            if e.total_gib <= usable:
                fixes.append(f"the layout {alt.describe()} ({e.total_gib:.1f} GiB)")
                break
    more = replace(layout, dp=layout.dp * 4)
    e = estimate(config, ttt, tokens=tokens, round_tokens=round_tokens, layout=more, rows=rows, dtype_bytes=dtype_bytes)
    if e.total_gib <= usable:
        fixes.append(f"{more.dp * more.stages} ranks as {more.describe()} ({e.total_gib:.1f} GiB)")
    for t in (tokens // 2, tokens // 4, tokens // 8):
        e = estimate(config, ttt, tokens=t, round_tokens=round_tokens, layout=layout, rows=rows, dtype_bytes=dtype_bytes)
        if t > 0 and e.total_gib <= usable:
            fixes.append(f"a context of {t} tokens (prepare the data with --capacity {t}; {e.total_gib:.1f} GiB)")
            break
    if ttt.fast_matrices != "down":
        e = estimate(config, replace(ttt, fast_matrices="down"), tokens=tokens, round_tokens=round_tokens,
                     layout=layout, rows=rows, dtype_bytes=dtype_bytes)
        if e.total_gib <= usable:
            fixes.append(f"--ttt fast_matrices=down ({e.total_gib:.1f} GiB)")
    fix = "; or ".join(fixes) if fixes else "nothing this estimate knows fits: shorten the context or add ranks"
    msg = (f"memory pre-flight: a context of {tokens} tokens (rounds of {round_tokens}) needs an estimated "
           f"{est.total_gib:.1f} GiB on the busiest rank ({layout.describe()}: {est.table()}), more than the "
           f"{usable:.1f} GiB usable of this device's {device_bytes / GIB:.1f} GiB. Use {fix}. "
           "(ds_ttt/train/memory_budget.py; docs/training.md, 'Memory at long context')")
    return est, msg


def data_shape(samples) -> tuple[int, int]:
    """(longest trajectory, longest round) in tokens of rendered samples (each with `.rounds`)."""
    longest, longest_round = 0, 0
    for sample in samples:
        rounds = list(sample.rounds)
        longest = max(longest, len(rounds))
        run = 0
        for i, r in enumerate(rounds):
            run = run + 1 if i and r == rounds[i - 1] else 1
            longest_round = max(longest_round, run)
    return longest, longest_round


def layout_of(ds: dict, stages: int, dp: int) -> Layout:
    """The Layout of a DeepSpeed config (ZeRO stage, optimizer offload to the CPU)."""
    zero = ds.get("zero_optimization", {}) or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    return Layout(stages=stages, dp=dp, zero_stage=int(zero.get("stage", 0)), offload_optimizer=offload)
