"""The TTT Qwen3 as a DeepSpeed `PipelineModule`, built from the model's own block classes.

Spec list (one spec each, built only on the stage that owns it; ds_ttt/train/layout.py has the indices):
    0            EmbedPipe        model.embed_tokens                                  (stage 0)
    1 .. P       DecoderPipe      model.layers.i (the P = num_layers - num_adaptive   (stages 0..S-2)
                                  non-adaptive layers, SDPA over the whole sequence under the policy)
    P + 1        LastStagePipe    model.layers.P.. (every adaptive layer) + model.norm + lm_head;
                                  runs the event loop (inner SGD steps with create_graph=True,
                                  per-event non-reentrant checkpointing) and returns this micro-batch's
                                  share of the token-weighted outer loss (ds_ttt/train/objective.py)
    P + 2        (tied embeddings only) the last stage's TiedLayerSpec of the embedding: no compute
`loss_fn` only reduces that loss. With one stage, everything sits on stage 0.

Tied embeddings (config.tie_word_embeddings, Qwen3-0.6B..4B): spec 0 and spec P+2 are DeepSpeed
`TiedLayerSpec`s with one key, so DeepSpeed builds one EmbedPipe per owning stage, broadcasts its
weight from stage 0 at start and all-reduces its gradient between stage 0 and the last stage after
every backward (`ReduceTiedGrads`). The last stage's LM head uses that same Parameter
(`LastStagePipe.tie_lm_head`); DeepSpeed counts it once in the gradient norm (stage 0's copy).

Stage boundary schema (fixed, never variable-arity): (hidden_BTC, input_ids_BT int64, kinds_BT int64,
rounds_BT int64). Token kinds and round ids travel as integers (the context-policy mask of every
decoder layer and the event loop need them). The hidden states carry a gradient only where some
parameter at or before the sending layer is trainable. Where none is (the frozen prefix under
trainable_scope 'prime' or 'suffix'), the layer sends its hidden states bit-reinterpreted as bytes
(`grad_free`: a uint8 view, lossless, no copy; uint8 because NCCL has no int16 for bf16) and the
receiver views them back in its own parameter dtype (the compute dtype). DeepSpeed exchanges gradients only for floating-point boundary tensors, so such a
boundary carries no gradient and the frozen stages run no backward at all (instead of a backward
through every frozen layer that only produced zeros). A stage with no trainable parameter still needs
a non-empty optimizer for `deepspeed.initialize`: `TTTPipelineModule` gives it one `stage_anchor`
parameter of shape (1,) that no forward uses (its gradient stays None; DeepSpeed reduces it as zeros).

Seeding: DeepSpeed reseeds python, numpy and torch before every layer of every micro-batch
(`seed_layers`); `layer_seed_fn` does it with torch's CPU generator alone where there is no accelerator
(`seed_cpu_rngs`: the same streams, without torch.manual_seed's lazy accelerator seeds).

Parameter names: `Layout.hf_name(spec_idx, local)` maps each layer's local names to the Hugging Face
names of `TTTQwen3ForCausalLM` (per-stage HF loading, the trainable scope, checkpoint reassembly).

Shape letters: B batch, T tokens, C hidden.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.utils import set_random_seed
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ds_ttt.config import TTTConfig
from ds_ttt.model.context import ContextPolicy
from ds_ttt.model.event_loop import SuffixModules, run_event_loop
from ds_ttt.model.qwen3 import (FrozenPathAttention, RMSNorm, TTTDecoderLayer, aliases, is_trainable,
                                reset_qwen3_parameters, run_decoder_layers)
from ds_ttt.train.layout import Layout
from ds_ttt.train.objective import StepObjective

ANCHOR = "stage_anchor"  # the optimizer's one parameter on a stage with nothing to train (never used)
TIED_EMBEDDING = "embed_tokens"  # the TiedLayerSpec key of the tied embedding / LM head
STAT_KEYS = ("action_nll_sum", "num_action_tokens", "obs_nll_sum", "num_obs_tokens", "num_updates",
             "num_skipped", "num_tokens", "num_micro_batches", "loss_sum")

def grad_free(hidden_BTC: torch.Tensor) -> torch.Tensor:
    """The hidden states as bytes [B, T, C * itemsize] (a bit-exact view): DeepSpeed sends no gradient
    for a non-floating-point boundary tensor."""
    return hidden_BTC.detach().contiguous().view(torch.uint8)


def as_hidden(boundary_BTC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The received hidden states as `dtype` (undoes `grad_free`; float input is returned as is)."""
    if boundary_BTC.is_floating_point():
        return boundary_BTC
    if boundary_BTC.dtype != torch.uint8:
        raise TypeError(f"stage boundary: hidden states arrived as {boundary_BTC.dtype}, expected a float "
                        "tensor or grad_free's uint8 view")
    return boundary_BTC.view(dtype)


class _PipeLayer(nn.Module):
    """Shared: HF-style init, scope-based requires_grad (via the layout's HF names), boundary output."""

    def _finish(self, config: Qwen3Config, ttt: TTTConfig, layout: Layout, spec_idx: int, grad_out: bool) -> None:
        reset_qwen3_parameters(self, config.initializer_range, ttt.prime_init_std)
        for local, p in self.named_parameters():
            names = aliases(layout.hf_name(spec_idx, local), config)
            p.requires_grad_(any(is_trainable(n, ttt.trainable_scope, layout.first_adaptive) for n in names))
        self.grad_out = grad_out  # does the hidden output need a gradient (anything trainable upstream)?

    def boundary(self, hidden_BTC: torch.Tensor) -> torch.Tensor:
        return hidden_BTC if self.grad_out else grad_free(hidden_BTC)


class EmbedPipe(_PipeLayer):
    """model.embed_tokens (with tied embeddings also the LM head's weight: a TiedLayerSpec module)."""

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, layout: Layout, grad_out: bool = True):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self._finish(config, ttt, layout, 0, grad_out)

    def forward(self, inputs):
        input_ids_BT, kinds_BT, rounds_BT = inputs
        return self.boundary(self.embed_tokens(input_ids_BT)), input_ids_BT, kinds_BT, rounds_BT


class DecoderPipe(_PipeLayer):
    """One non-adaptive decoder layer over the whole sequence (qwen3.run_decoder_layers). The decoder
    layers of one stage share `frozen_attention` (build_specs), so the context-policy mask is built once
    per micro-batch, not once per layer; without one the layer builds its own."""

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, layout: Layout, layer_idx: int, grad_out: bool = True,
                 frozen_attention: FrozenPathAttention | None = None):
        super().__init__()
        self.layer = TTTDecoderLayer(config, layer_idx)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.policy = ContextPolicy.from_ttt(ttt)
        self.frozen_attention = frozen_attention if frozen_attention is not None else FrozenPathAttention()
        self._finish(config, ttt, layout, layer_idx + 1, grad_out)

    def forward(self, inputs):
        hidden_BTC, input_ids_BT, kinds_BT, rounds_BT = inputs
        hidden_BTC = as_hidden(hidden_BTC, self.layer.input_layernorm.weight.dtype)
        hidden_BTC = run_decoder_layers([self.layer], hidden_BTC, rounds_BT, policy=self.policy,
                                        rotary_emb=self.rotary_emb, frozen_attention=self.frozen_attention)
        return self.boundary(hidden_BTC), input_ids_BT, kinds_BT, rounds_BT


class TiedLMHead(nn.Module):
    """The LM head of a tied model: the embedding's Parameter, used as a linear map."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden):
        return F.linear(hidden, self.weight)


class LastStagePipe(_PipeLayer):
    """Adaptive layers + final norm + LM head; forward = the event loop; returns loss [1].

    The returned loss is this micro-batch's share of the step's token-weighted objective, scaled for
    DeepSpeed's averaging (`set_objective` before every optimizer step; ds_ttt/train/objective.py).
    Per-micro-batch statistics (detached) accumulate in `self.stats` for logging; the trainer
    resets them before each optimizer step.
    """

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, layout: Layout):
        super().__init__()
        self.ttt = ttt
        self.layers = nn.ModuleList(TTTDecoderLayer.adaptive(config, ttt, i, layout.first_adaptive)
                                    for i in range(layout.first_adaptive, config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # tied: the embedding's Parameter, set by tie_lm_head once DeepSpeed has built the tied module
        self.lm_head = None if layout.tied_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._finish(config, ttt, layout, layout.last_spec, grad_out=True)
        self.objective: StepObjective | None = None
        self.reset_stats()

    def tie_lm_head(self, weight: nn.Parameter) -> None:
        self.lm_head = TiedLMHead(weight)

    def set_objective(self, objective: StepObjective) -> None:
        self.objective = objective

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(STAT_KEYS, 0.0)

    def forward(self, inputs):
        if self.objective is None:
            raise RuntimeError("LastStagePipe.set_objective(StepObjective...) must be called before each "
                               "optimizer step (the token counts of the global batch normalise the loss)")
        if self.lm_head is None:
            raise RuntimeError("tied embeddings: tie_lm_head(embedding weight) was not called")
        hidden_BTC, input_ids_BT, kinds_BT, rounds_BT = inputs
        suffix = SuffixModules(layers=list(self.layers), norm=self.norm, lm_head=self.lm_head,
                               rotary_emb=self.rotary_emb)
        out = run_event_loop(suffix, self.ttt, as_hidden(hidden_BTC, self.norm.weight.dtype), input_ids_BT,
                             kinds_BT, rounds_BT,
                             create_graph=torch.is_grad_enabled())
        loss = self.objective.micro_batch_loss(out.action_loss_sum, out.obs_loss_sum)
        s = self.stats
        s["action_nll_sum"] += float(out.action_nll_sum)
        s["num_action_tokens"] += out.num_action_tokens
        s["obs_nll_sum"] += float(out.obs_nll_sum)
        s["num_obs_tokens"] += out.num_obs_tokens
        s["num_updates"] += out.num_updates
        s["num_skipped"] += out.num_skipped
        s["num_tokens"] += int((kinds_BT >= 0).sum())
        s["num_micro_batches"] += 1
        s["loss_sum"] += float(loss.detach()) / self.objective.loss_scale  # sums to the step loss
        return loss.reshape(1)


def _tied_head_reference(embed: EmbedPipe, outputs):
    """forward_fn of the last stage's TiedLayerSpec: no compute (LastStagePipe uses the weight)."""
    return outputs


def reduce_outer_loss(outputs: torch.Tensor, labels) -> torch.Tensor:
    """loss_fn: the last stage already computed the outer loss; only reduce it to a scalar."""
    return outputs.mean()


def _spec_args(config: Qwen3Config, ttt: TTTConfig, layout: Layout) -> list[tuple]:
    """(class, args) of every spec that holds parameters, in spec order."""
    return ([(EmbedPipe, (config, ttt, layout))]
            + [(DecoderPipe, (config, ttt, layout, i)) for i in range(layout.first_adaptive)]
            + [(LastStagePipe, (config, ttt, layout))])


def spec_trainable(config: Qwen3Config, ttt: TTTConfig, layout: Layout) -> list[bool]:
    """Does the spec at each index (0..P+1) hold a trainable parameter? Decided by building each layer
    on the meta device (no memory) and reading the requires_grad its HF names give it."""
    out = []
    with torch.device("meta"):
        for cls, args in _spec_args(config, ttt, layout):
            out.append(any(p.requires_grad for p in cls(*args).parameters()))
    return out


def build_specs(config: Qwen3Config, ttt: TTTConfig, layout: Layout) -> list[LayerSpec]:
    if layout.tied_embeddings != bool(config.tie_word_embeddings):
        raise ValueError(f"layout.tied_embeddings={layout.tied_embeddings} but the backbone config sets "
                         f"tie_word_embeddings={config.tie_word_embeddings}; resolve the layout with "
                         "tied_embeddings=config.tie_word_embeddings")
    flags = spec_trainable(config, ttt, layout)
    grad_out = [any(flags[:i + 1]) for i in range(len(flags))]  # anything trainable at or before spec i
    fa = layout.first_adaptive
    if layout.tied_embeddings:
        specs = [TiedLayerSpec(TIED_EMBEDDING, EmbedPipe, config, ttt, layout, grad_out[0],
                               tied_weight_attr=["embed_tokens.weight"])]
    else:
        specs = [LayerSpec(EmbedPipe, config, ttt, layout, grad_out[0])]
    frozen_attention = FrozenPathAttention()  # one per process: every decoder layer of this rank's stage
    specs += [LayerSpec(DecoderPipe, config, ttt, layout, i, grad_out[i + 1], frozen_attention) for i in range(fa)]
    specs.append(LayerSpec(LastStagePipe, config, ttt, layout))
    if layout.tied_embeddings:
        specs.append(TiedLayerSpec(TIED_EMBEDDING, EmbedPipe, config, ttt, layout, grad_out[0],
                                   forward_fn=_tied_head_reference, tied_weight_attr=["embed_tokens.weight"]))
    assert len(specs) == layout.num_specs
    return specs


def seed_cpu_rngs(seed: int) -> None:
    """DeepSpeed's per-layer seeding (`set_random_seed`: python, numpy, torch) with torch's CPU generator
    seeded directly: `torch.manual_seed` also queues a lazy seed for every accelerator, formatting a
    stack trace each time (about a millisecond, for each layer of each micro-batch). The same streams
    bit for bit on a machine with no accelerator, where that lazy seed is never used."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.random.default_generator.manual_seed(seed % (2**63))


def layer_seed_fn():
    """The PipelineModule's seed_fn: `seed_cpu_rngs` where torch sees no accelerator, else DeepSpeed's
    own `set_random_seed` (torch.manual_seed, which seeds the accelerator's generators too)."""
    return set_random_seed if torch.accelerator.is_available() else seed_cpu_rngs


class TTTPipelineModule(PipelineModule):
    """PipelineModule with our explicit partition (DeepSpeed's methods cannot pin layers to a stage)."""

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, layout: Layout, *, seed: int = 0,
                 activation_checkpoint_interval: int = 0, topology=None):
        self.layout = layout
        super().__init__(
            layers=build_specs(config, ttt, layout), num_stages=None if topology else layout.num_stages,
            topology=topology, loss_fn=reduce_outer_loss, seed_layers=True, seed_fn=layer_seed_fn(), base_seed=seed,
            partition_method="explicit", activation_checkpoint_interval=activation_checkpoint_interval,
            # Only the frozen-path decoder layers may be recomputed by DeepSpeed: its checkpointing cannot
            # contain the inner loop's torch.autograd.grad (the event loop checkpoints itself per event).
            checkpointable_layers=["DecoderPipe"], dynamic_shape=True)
        last = self.last_stage_layer()
        if last is not None and layout.tied_embeddings:
            last.tie_lm_head(self.tied_modules[TIED_EMBEDDING].embed_tokens.weight)
        if not any(p.requires_grad for p in self.parameters()):
            # deepspeed.initialize needs a non-empty optimizer; no forward uses this (shape (1,): a 0-dim
            # parameter crashes deepspeed.initialize)
            self.register_parameter(ANCHOR, nn.Parameter(torch.zeros(1)))

    def _partition_layers(self, method="explicit"):
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self.parts = self.layout.spec_parts()
        assert len(self.parts) == self.num_stages + 1 and self.parts[-1] == len(self._layer_specs)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    # ---- helpers for the trainer -----------------------------------------------------------------
    def last_stage_layer(self) -> LastStagePipe | None:
        for layer in self.forward_funcs:
            if isinstance(layer, LastStagePipe):
                return layer
        return None

    def local_hf_named_parameters(self):
        """(spec index, local name, HF name, parameter) of this stage's layers (a tied parameter once per
        layer that holds it; the anchor is not a layer parameter)."""
        for spec_idx in range(self._local_start, self._local_stop):
            layer = self.forward_funcs[spec_idx - self._local_start]
            if not isinstance(layer, nn.Module):  # the tied head reference (a functools.partial)
                continue
            for local, p in layer.named_parameters():
                yield spec_idx, local, self.layout.hf_name(spec_idx, local), p
