"""Dynamic evaluation: the ordinary agent takes the TTT model's inner step at test time, never meta-trained for it.

    from ds_ttt.evaluation.dynamic_eval import dynamic_evaluation_model
    model = dynamic_evaluation_model(sft_model, inner=ttt_model.ttt)     # then score it in mode "ttt"
    recipe = DynamicEvalRecipe("runs/ttt_full", parse_inner_overrides(["inner_lr=0.3"]))  # a tuned inner step
    model, tok, provenance = load_model_for_scoring("runs/sft_full", dynamic_eval_from=recipe)

The control that separates meta-learning from plain test-time fine-tuning (Krause et al.'s dynamic
evaluation). An SFT model has no prime MLPs; this rewrites it, without changing what it computes, so
that the last `inner.num_adaptive` layers' own MLPs become fast weights:

    SFT layer:        h = a + mlp(post_attention_layernorm(a))                     (a = after attention)
    rewritten layer:  h = a + prime_mlp(prime_layernorm(a)) + mlp'(post_attention_layernorm(.))
                      prime_mlp := mlp (gate, up, down copied), prime_layernorm := post_attention_layernorm,
                      mlp'.down_proj := 0, so mlp' adds exactly zero

With W_0 the rewritten model is the SFT model (its "frozen" mode is the SFT row, tested bit for bit);
with updates on, every observation takes the TTT recipe's inner step on those MLPs: the same layers,
the same lr, clip, loss reduction and fast matrices (`inner`: the TTT run's TTTConfig; with
fast_matrices="down" only the down projections move). No key shift (the SFT model has none). The
context policy stays the SFT model's own.

The recipe's inner lr and clip were tuned for the meta-trained model, not for this one: a fair
control tunes them for the SFT model too (`DynamicEvalRecipe` overrides any INNER_FIELDS; the sweep on
the dev task suite and its pick rule, `pick_inner_setting`, are run by benchmarks/adaptation_baselines.sh
through evals/dynamic_eval_sweep.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

import torch

from ds_ttt.config import TTTConfig

# the inner step's settings taken from the TTT recipe (what "the same inner step" means)
INNER_FIELDS = ("inner_lr", "inner_max_norm", "inner_loss", "inner_clip", "fast_matrices", "inner_steps",
                "obs_loss_with_end")


@dataclasses.dataclass(frozen=True)
class DynamicEvalRecipe:
    """Where dynamic evaluation takes its inner step: the TTT run `ttt_run`'s settings with `overrides`
    (keys of INNER_FIELDS) replacing some of them, e.g. {"inner_lr": 0.3} tuned for the SFT model."""

    ttt_run: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.overrides) - set(INNER_FIELDS))
        if unknown:
            raise ValueError(f"dynamic evaluation overrides only the inner step's settings {INNER_FIELDS}; "
                             f"got {unknown}")

    def inner(self, recipe: TTTConfig) -> TTTConfig:
        """`recipe` (the TTT run's TTTConfig) with the overrides applied, validated."""
        return dataclasses.replace(recipe, **self.overrides).validate()


def parse_inner_overrides(items: list[str] | None) -> dict[str, Any]:
    """`--inner key=value` items (value parsed as JSON, else kept as a string), keys of INNER_FIELDS."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in INNER_FIELDS:
            raise ValueError(f"--inner expects key=value with key one of {INNER_FIELDS}, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def pick_inner_setting(results: list[dict]) -> dict:
    """The dev sweep's choice among `results` (each {"inner_lr", "inner_max_norm", "success", ...}): the
    highest success; ties go to the gentler step, the smaller inner_lr, then the smaller clip norm
    (inner_max_norm <= 0 means no clipping, the largest)."""
    if not results:
        raise ValueError("pick_inner_setting: no sweep results")

    def gentleness(r):
        norm = r["inner_max_norm"] if r["inner_max_norm"] > 0 else math.inf
        return (-r["success"], r["inner_lr"], norm)

    return min(results, key=gentleness)


def dynamic_evaluation_model(sft_model, *, inner: TTTConfig):
    """A TTT-shaped copy of `sft_model` (no adaptive layers) whose last `inner`'s-number of layers carry
    their own MLP as fast weights (module docstring). `sft_model` is not modified."""
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    if sft_model.num_adaptive:
        raise ValueError("dynamic evaluation starts from a model without adaptive layers (an SFT run); "
                         f"this one has {sft_model.num_adaptive}")
    cfg = sft_model.config
    n = inner.num_adaptive(cfg.num_hidden_layers)
    if n < 1:
        raise ValueError("the TTT recipe given as `inner` has no adaptive layers: nothing to update")
    ttt = dataclasses.replace(sft_model.ttt, adaptive_layers=n, prime_intermediate_size=cfg.intermediate_size,
                              key_shift=0, round_address=False, write_rate=False,
                              **{f: getattr(inner, f) for f in INNER_FIELDS})
    model = TTTQwen3ForCausalLM(cfg, ttt)
    missing, unexpected = model.load_state_dict(sft_model.state_dict(), strict=False)
    if unexpected or any(".prime_" not in k for k in missing):
        raise RuntimeError(f"dynamic_evaluation_model: state dicts differ beyond the prime MLPs: missing "
                           f"{[k for k in missing if '.prime_' not in k]}, unexpected {unexpected}")
    with torch.no_grad():
        for layer in model.adaptive_layers:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.prime_mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
            layer.prime_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
            layer.mlp.down_proj.weight.zero_()
    model.to(next(sft_model.parameters()).device, next(sft_model.parameters()).dtype)
    return model.eval().requires_grad_(False)


def load_model_for_scoring(path: str, *, dynamic_eval_from: str | DynamicEvalRecipe | None = None):
    """(model, tokenizer, provenance) of a checkpoint or export for the evaluation scripts; with
    `dynamic_eval_from` (a TTT run or export, or a DynamicEvalRecipe naming one with overrides) the SFT
    model at `path` is rewritten for dynamic evaluation with that recipe's inner step (its modes:
    "ttt" = dynamic evaluation, "frozen" = the SFT model itself)."""
    from ds_ttt.loading import load_for_inference

    loaded = load_for_inference(path, attention_backend="reference")
    if dynamic_eval_from is None:
        return loaded.model, loaded.tokenizer, loaded.provenance
    source = (dynamic_eval_from if isinstance(dynamic_eval_from, DynamicEvalRecipe)
              else DynamicEvalRecipe(str(dynamic_eval_from)))
    recipe = source.inner(load_for_inference(source.ttt_run, attention_backend="reference").model.ttt)
    model = dynamic_evaluation_model(loaded.model, inner=recipe)
    provenance = dict(loaded.provenance, dynamic_eval_from=source.ttt_run,
                      dynamic_eval_inner={f: getattr(recipe, f) for f in INNER_FIELDS},
                      dynamic_eval_overrides=dict(source.overrides), dynamic_eval_layers=model.num_adaptive)
    return model, loaded.tokenizer, provenance
