"""Validated settings of ds_ttt that are not plain DeepSpeed: the TTT (fast-weight) settings.

The backbone itself is described by transformers' `Qwen3Config` (see `ds_ttt/model/presets.py`);
everything about test-time training lives in `TTTConfig`. Training-run settings (data, steps,
schedule) are added next to it by the trainer. Every config is a `@dataclass(kw_only=True,
slots=True)`: a misspelled attribute raises, required fields have no default, and `validate()`
raises `ValueError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CONTEXT_POLICIES = ("full", "window", "current_round")
TRAINABLE_SCOPES = ("prime", "suffix", "all")
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "cuda")
INNER_LOSSES = ("mean", "sum")
INNER_CLIPS = ("global", "per_matrix")
FAST_MATRICES = ("all", "down")
MAX_KEY_SHIFT = 8
MAX_INNER_STEPS = 4


@dataclass(kw_only=True, slots=True)
class TTTConfig:
    """How the fast-weight ("prime") MLPs are placed, updated and trained.

    adaptive_layers: number of final decoder layers that carry a prime MLP (None -> num_layers // 4;
        0 -> plain SFT, no inner loop).
    prime_intermediate_size: width of each prime SwiGLU (None -> the backbone's intermediate_size).
    inner_lr / inner_max_norm: the inner step W <- W - inner_lr * clip_global_norm(grad, inner_max_norm)
        (inner_max_norm <= 0 disables clipping).
    context_policy: what attention may see ("full" up to capacity, "window" of `window` tokens,
        "current_round" = the task prompt (round 0) plus the current round). Beyond it, only W carries
        information. The same policy holds in training, evaluation and serving.
    checkpoint_events: checkpoint the inner loop event by event while meta-training: each event keeps only its
        update and is recomputed in the backward (ds_ttt/model/event_checkpoint.py).
    attention_backend: attention of the adaptive layers (must be twice differentiable).
    trainable_scope: which backbone parameters the outer optimizer trains besides the prime MLPs:
        "prime" (none: prime MLPs + their norms only), "suffix" (the adaptive layers, final norm and LM
        head), "all". With tied embeddings (Qwen3-0.6B..4B) the LM head IS the embedding matrix, so
        "suffix" trains the embedding too (its gradient sums both uses, and reaching the embedding
        needs a backward through every frozen layer); "prime" leaves it frozen.
    obs_loss_weight: weight of the pre-update observation loss in the outer objective (TTT-E2E style);
        both terms are token means over the whole global batch (ds_ttt/train/objective.py).
    obs_loss_with_end: the observation loss (inner step and outer term) also covers the token right
        after each observation span, the one that closes the terminal output. Without it the fast
        weights store an output's content but never where it ends, so a recalled output runs on.
    prime_init_std: std of the prime gate/up projections at init (None -> the backbone's
        initializer_range). The down projection starts at zero, so this leaves W_0's output unchanged,
        but what one inner step stores grows with the prime activations' norm squared (the update of
        down is an outer product with them): a larger value starts the memory strong instead of
        leaving the outer loop to grow it from ~0.
    key_shift: S > 0 gives the memory key local context: the prime MLP's input becomes
        x_t + sum_{j<=S} a_j * x_{t-j} with learned per-channel a_j (zero at init, so a fresh model
        computes exactly what key_shift=0 computes). Under `current_round` the history restarts at
        each round (no key sees an earlier round). 0 = off. See ds_ttt/model/fast_weights.py.
    round_address: the memory key also carries an address pooled over the current round's tokens so far
        (the command names what the observation is about): the prime MLP's input gains P a_t, a_t a
        learned soft-capped softmax pool over the round's prime inputs, P zero at init (a fresh model
        computes exactly what it computes without it). Needs `current_round` (the pool restarts with
        each round). See ds_ttt/model/fast_weights.py.
    The levers on the write (what one inner step stores):
    write_rate: a learned per-token write rate beta_t = 2 sigmoid(w . u_t + b) (DeltaNet's beta, LaCT's
        learned lr) weighs each observation label of the inner loss; u_t is the first adaptive layer's
        key, w and b zero at init (beta = 1: today's step bit for bit).
    inner_loss: "mean" (the observation loss averaged over its tokens) or "sum" (summed: every token
        of a long output writes as hard as a short output's tokens; the clip still bounds the step).
    inner_clip: "global" (one norm over every adaptive layer's matrices) or "per_matrix" (each
        matrix's gradient clipped to inner_max_norm on its own).
    fast_matrices: "all" (gate, up and down are fast weights) or "down" (only the down projection
        changes at test time; gate/up stay W_0, so the key is fixed and only the value is written).
    inner_steps: SGD steps on each observation (1 = the classic step; k > 1 re-scores the
        observation with the updated W before each further step; the outer loss differentiates
        through all of them).
    first_order: the meta-gradient without second order (a control, "TTT without meta-learning"):
        the write W' = W - lr * clip(g) is applied in training but g is not differentiated, so the
        outer loss reaches W_0 only through W' = W_0 + const, as first-order MAML does. Evaluation and
        serving are unchanged (they never differentiate the write). false = the full second order.
    """

    adaptive_layers: int | None = None
    prime_intermediate_size: int | None = None
    inner_lr: float = 0.1
    inner_max_norm: float = 1.0
    context_policy: str = "full"
    window: int = 0
    checkpoint_events: bool = True
    attention_backend: str = "reference"
    trainable_scope: str = "prime"
    obs_loss_weight: float = 0.0
    prime_init_std: float | None = None
    obs_loss_with_end: bool = False
    key_shift: int = 0
    inner_loss: str = "mean"
    inner_clip: str = "global"
    fast_matrices: str = "all"
    inner_steps: int = 1
    first_order: bool = False
    round_address: bool = False
    write_rate: bool = False

    def validate(self, num_hidden_layers: int | None = None) -> "TTTConfig":
        """Check every field; with `num_hidden_layers`, also the layer count. Returns self."""
        if self.adaptive_layers is not None and (isinstance(self.adaptive_layers, bool) or self.adaptive_layers < 0):
            raise ValueError(f"ttt.adaptive_layers must be an int >= 0 or null, got {self.adaptive_layers!r}")
        if num_hidden_layers is not None and self.num_adaptive(num_hidden_layers) > num_hidden_layers:
            raise ValueError(
                f"ttt.adaptive_layers={self.adaptive_layers} exceeds the model's num_hidden_layers="
                f"{num_hidden_layers}; use at most {num_hidden_layers} (default num_layers // 4)")
        if self.prime_intermediate_size is not None and self.prime_intermediate_size <= 0:
            raise ValueError(f"ttt.prime_intermediate_size must be positive, got {self.prime_intermediate_size}")
        if not (self.inner_lr >= 0.0 and self.inner_lr < float("inf")):
            raise ValueError(f"ttt.inner_lr must be a finite number >= 0, got {self.inner_lr}")
        if not self.inner_max_norm < float("inf"):
            raise ValueError(f"ttt.inner_max_norm must be finite (<= 0 disables clipping), got {self.inner_max_norm}")
        if self.context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"ttt.context_policy must be one of {CONTEXT_POLICIES}, got {self.context_policy!r}")
        if self.context_policy == "window" and self.window <= 0:
            raise ValueError("ttt.context_policy='window' needs ttt.window > 0 (tokens of attention context)")
        if self.context_policy != "window" and self.window != 0:
            raise ValueError(f"ttt.window={self.window} is only used with context_policy='window'; set it to 0")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"ttt.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.trainable_scope not in TRAINABLE_SCOPES:
            raise ValueError(f"ttt.trainable_scope must be one of {TRAINABLE_SCOPES}, got {self.trainable_scope!r}")
        if self.obs_loss_weight < 0:
            raise ValueError(f"ttt.obs_loss_weight must be >= 0, got {self.obs_loss_weight}")
        if not isinstance(self.obs_loss_with_end, bool):
            raise ValueError(f"ttt.obs_loss_with_end must be true or false, got {self.obs_loss_with_end!r}")
        if self.prime_init_std is not None and not (0.0 < self.prime_init_std < float("inf")):
            raise ValueError(f"ttt.prime_init_std must be a positive number or null, got {self.prime_init_std!r}")
        if isinstance(self.key_shift, bool) or not isinstance(self.key_shift, int) or not 0 <= self.key_shift <= MAX_KEY_SHIFT:
            raise ValueError(f"ttt.key_shift must be an int in 0..{MAX_KEY_SHIFT} (0 = off), got {self.key_shift!r}")
        if self.context_policy == "window" and 0 < self.window <= self.key_shift:
            raise ValueError(f"ttt.window={self.window} must exceed ttt.key_shift={self.key_shift} "
                             "(the key's history would reach past the attention window)")
        for name, choices in (("inner_loss", INNER_LOSSES), ("inner_clip", INNER_CLIPS), ("fast_matrices", FAST_MATRICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"ttt.{name} must be one of {choices}, got {getattr(self, name)!r}")
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or not 1 <= self.inner_steps <= MAX_INNER_STEPS:
            raise ValueError(f"ttt.inner_steps must be an int in 1..{MAX_INNER_STEPS}, got {self.inner_steps!r}")
        for name in ("first_order", "round_address", "write_rate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ttt.{name} must be true or false, got {getattr(self, name)!r}")
        if self.round_address and self.context_policy != "current_round":
            raise ValueError(f"ttt.round_address pools over the current round, so it needs context_policy='current_round' "
                             f"(got {self.context_policy!r}); set round_address to false or change the policy")
        return self

    def num_adaptive(self, num_hidden_layers: int) -> int:
        """Number of adaptive (prime-carrying) layers for a backbone of `num_hidden_layers`."""
        return num_hidden_layers // 4 if self.adaptive_layers is None else self.adaptive_layers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "ttt") -> "TTTConfig":
        """Build from a JSON dict; unknown keys raise naming them (no silently ignored settings)."""
        reject_unknown_keys(cls, data, where)
        return cls(**data)


def reject_unknown_keys(config_cls, data: dict[str, Any], where: str) -> None:
    """Raise naming every key of `data` that is not a field of the dataclass `config_cls`."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(known)}")
