"""The TTT Qwen3 as a DeepSpeed `PipelineModule`, built from the model's own block classes.

Spec list (one LayerSpec each, built only on the stage that owns it):
    0            EmbedPipe        model.embed_tokens                                  (stage 0)
    1 .. P       DecoderPipe      model.layers.i (the P = num_layers - num_adaptive   (stages 0..S-2)
                                  non-adaptive layers, SDPA over the whole sequence under the policy)
    P + 1        LastStagePipe    model.layers.P.. (every adaptive layer) + model.norm + lm_head;
                                  runs the event loop (inner SGD steps with create_graph=True,
                                  per-event non-reentrant checkpointing) and returns the outer loss (last stage)
`loss_fn` only reduces that loss. With one stage, everything sits on stage 0.

Stage boundary schema (fixed, never variable-arity): (hidden_BTC float, input_ids_BT int64,
kinds_BT int64, rounds_BT int64). The hidden states are the only float tensor crossing a boundary
and always receive a gradient (DeepSpeed asserts otherwise): a stage whose parameters are all frozen
(trainable_scope 'prime') carries one zero-effect `stage_anchor` parameter so that its output still
requires grad and its optimizer is not empty. Token kinds and round ids travel as integers (the
context-policy mask of every decoder layer and the event loop need them).

Parameter names: `layer_name_map` maps each spec's local state-dict names to the Hugging Face names of
`TTTQwen3ForCausalLM`, used to load HF weights per stage, to reassemble a checkpoint into the
single-device model (checkpoint.py) and by the tests.

Shape letters: B batch, T tokens, C hidden.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from ds_ttt.config import TTTConfig
from ds_ttt.model.context import ContextPolicy
from ds_ttt.model.event_loop import SuffixModules, run_event_loop
from ds_ttt.model.qwen3 import RMSNorm, TTTDecoderLayer, frozen_path_attend, is_suffix_param
from ds_ttt.train.run_config import Layout

ANCHOR = "stage_anchor"
STAT_KEYS = ("action_nll_sum", "num_action_tokens", "obs_nll_sum", "num_obs_tokens", "num_updates",
             "num_skipped", "num_tokens", "num_micro_batches", "loss_sum")


def is_trainable(hf_name: str, scope: str, first_adaptive: int) -> bool:
    """The same rule as TTTQwen3ForCausalLM.set_trainable_scope, on Hugging Face names."""
    if scope == "all":
        return True
    if scope == "suffix":
        return is_suffix_param(hf_name, first_adaptive)
    return ".prime_" in hf_name


def init_weights(module: nn.Module, std: float, prime_std: float | None = None) -> None:
    """TTTQwen3ForCausalLM.reset_parameters for one pipeline layer (prime down projections at zero,
    prime gate/up at `prime_std` when given)."""
    with torch.no_grad():
        for name, m in module.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, Qwen3RMSNorm):
                m.weight.fill_(1.0)
        for name, m in module.named_modules():
            if name.endswith("prime_mlp"):
                if prime_std is not None:
                    m.gate_proj.weight.normal_(0.0, prime_std)
                    m.up_proj.weight.normal_(0.0, prime_std)
                m.down_proj.weight.zero_()


class _PipeLayer(nn.Module):
    """Shared: scope-based requires_grad, optional stage anchor, HF-style init."""

    def _finish(self, config: Qwen3Config, ttt: TTTConfig, first_adaptive: int, anchor: bool, name_map) -> None:
        init_weights(self, config.initializer_range, ttt.prime_init_std)
        for local, p in self.named_parameters():
            p.requires_grad_(is_trainable(name_map(local), ttt.trainable_scope, first_adaptive))
        if anchor:  # shape (1,): a 0-dim parameter crashes deepspeed.initialize
            self.stage_anchor = nn.Parameter(torch.zeros(1))

    def anchored(self, hidden_BTC: torch.Tensor) -> torch.Tensor:
        if hasattr(self, ANCHOR):
            return hidden_BTC + 0.0 * self.stage_anchor.to(hidden_BTC.dtype)
        return hidden_BTC


class EmbedPipe(_PipeLayer):
    def __init__(self, config: Qwen3Config, ttt: TTTConfig, first_adaptive: int, anchor: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self._finish(config, ttt, first_adaptive, anchor, lambda n: "model." + n)

    def forward(self, inputs):
        input_ids_BT, kinds_BT, rounds_BT = inputs
        return self.anchored(self.embed_tokens(input_ids_BT)), input_ids_BT, kinds_BT, rounds_BT


class DecoderPipe(_PipeLayer):
    """One non-adaptive decoder layer over the whole sequence (TTTQwen3ForCausalLM.run_layers)."""

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, first_adaptive: int, layer_idx: int,
                 anchor: bool = False):
        super().__init__()
        self.layer = TTTDecoderLayer(config, layer_idx)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.policy = ContextPolicy.from_ttt(ttt)
        self._finish(config, ttt, first_adaptive, anchor,
                     lambda n: n.replace("layer.", f"model.layers.{layer_idx}.", 1))

    def forward(self, inputs):
        hidden_BTC, input_ids_BT, kinds_BT, rounds_BT = inputs
        b, t, _ = hidden_BTC.shape
        positions_BT = torch.arange(t, device=hidden_BTC.device).expand(b, t)
        pos_emb = self.rotary_emb(hidden_BTC, positions_BT)
        attend = frozen_path_attend(self.policy, hidden_BTC, rounds_BT, self.layer.self_attn.scaling)
        hidden_BTC, _ = self.layer(self.anchored(hidden_BTC), pos_emb, attend)
        return hidden_BTC, input_ids_BT, kinds_BT, rounds_BT


class LastStagePipe(_PipeLayer):
    """Adaptive layers + final norm + LM head; forward = the event loop; returns the outer loss [1].

    Per-micro-batch statistics (detached) accumulate in `self.stats` for logging; the trainer
    resets them before each optimizer step.
    """

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, first_adaptive: int, anchor: bool = False):
        super().__init__()
        prime_width = ttt.prime_intermediate_size or config.intermediate_size
        self.ttt = ttt
        self.first_adaptive = first_adaptive
        self.layers = nn.ModuleList(TTTDecoderLayer(config, i, prime_width)
                                    for i in range(first_adaptive, config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._finish(config, ttt, first_adaptive, anchor, self.hf_name)
        self.reset_stats()

    def hf_name(self, local: str) -> str:
        if local.startswith("layers."):
            _, j, rest = local.split(".", 2)
            return f"model.layers.{self.first_adaptive + int(j)}.{rest}"
        return local if local.startswith("lm_head.") else "model." + local

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(STAT_KEYS, 0.0)

    def forward(self, inputs):
        hidden_BTC, input_ids_BT, kinds_BT, rounds_BT = inputs
        suffix = SuffixModules(layers=list(self.layers), norm=self.norm, lm_head=self.lm_head,
                               rotary_emb=self.rotary_emb)
        out = run_event_loop(suffix, self.ttt, self.anchored(hidden_BTC), input_ids_BT, kinds_BT, rounds_BT,
                             create_graph=torch.is_grad_enabled())
        s = self.stats
        s["action_nll_sum"] += float(out.action_nll_sum)
        s["num_action_tokens"] += out.num_action_tokens
        s["obs_nll_sum"] += float(out.obs_nll_sum)
        s["num_obs_tokens"] += out.num_obs_tokens
        s["num_updates"] += out.num_updates
        s["num_skipped"] += out.num_skipped
        s["num_tokens"] += int((kinds_BT >= 0).sum())
        s["num_micro_batches"] += 1
        s["loss_sum"] += float(out.loss.detach())
        return out.loss.reshape(1)


def reduce_outer_loss(outputs: torch.Tensor, labels) -> torch.Tensor:
    """loss_fn: the last stage already computed the outer loss; only reduce it to a scalar."""
    return outputs.mean()


def layer_name_map(layout: Layout, spec_idx: int):
    """Local state-dict name -> Hugging Face name for the spec at `spec_idx` (see module docstring)."""
    p = layout.first_adaptive
    if spec_idx == 0:
        return lambda n: "model." + n
    if 1 <= spec_idx <= p:
        return lambda n, i=spec_idx - 1: n.replace("layer.", f"model.layers.{i}.", 1)
    if spec_idx == p + 1:
        def last(n):
            if n.startswith("layers."):
                _, j, rest = n.split(".", 2)
                return f"model.layers.{p + int(j)}.{rest}"
            return n if n.startswith("lm_head.") else "model." + n
        return last
    raise IndexError(f"spec index {spec_idx} out of range 0..{p + 1}")


def stage_trainable(layout: Layout, config: Qwen3Config, ttt: TTTConfig) -> list[bool]:
    """Does stage s have any trainable parameter under the scope? (one representative name per spec)"""
    scope, fa = ttt.trainable_scope, layout.first_adaptive
    parts = layout.spec_parts()
    out = []
    for s in range(layout.num_stages):
        names = []
        for idx in range(parts[s], parts[s + 1]):
            if idx == 0:
                names.append("model.embed_tokens.weight")
            elif idx <= fa:
                names.append(f"model.layers.{idx - 1}.mlp.up_proj.weight")
            else:
                names += ["lm_head.weight"] + ([f"model.layers.{fa}.prime_mlp.up_proj.weight"]
                                               if layout.num_adaptive else [])
        out.append(any(is_trainable(n, scope, fa) for n in names))
    return out


def build_specs(config: Qwen3Config, ttt: TTTConfig, layout: Layout) -> list[LayerSpec]:
    fa = layout.first_adaptive
    parts = layout.spec_parts()
    needs_anchor = [not t for t in stage_trainable(layout, config, ttt)]
    first_of_stage = {parts[s]: needs_anchor[s] for s in range(layout.num_stages)}
    specs = [LayerSpec(EmbedPipe, config, ttt, fa, anchor=first_of_stage.get(0, False))]
    specs += [LayerSpec(DecoderPipe, config, ttt, fa, i, anchor=first_of_stage.get(i + 1, False)) for i in range(fa)]
    specs.append(LayerSpec(LastStagePipe, config, ttt, fa, anchor=first_of_stage.get(fa + 1, False)))
    return specs


class TTTPipelineModule(PipelineModule):
    """PipelineModule with our explicit partition (DeepSpeed's methods cannot pin layers to a stage)."""

    def __init__(self, config: Qwen3Config, ttt: TTTConfig, layout: Layout, *, seed: int = 0,
                 activation_checkpoint_interval: int = 0, topology=None):
        self.layout = layout
        super().__init__(
            layers=build_specs(config, ttt, layout), num_stages=None if topology else layout.num_stages,
            topology=topology, loss_fn=reduce_outer_loss, seed_layers=True, base_seed=seed,
            partition_method="explicit", activation_checkpoint_interval=activation_checkpoint_interval,
            # Only the frozen-path decoder layers may be recomputed by DeepSpeed: its checkpointing cannot
            # contain the inner loop's torch.autograd.grad (the event loop checkpoints itself per event).
            checkpointable_layers=["DecoderPipe"], dynamic_shape=True)

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
        """(spec index, local name, HF name, parameter) of this stage (anchors excluded)."""
        for spec_idx in range(self._local_start, self._local_stop):
            layer = self.forward_funcs[spec_idx - self._local_start]
            names = layer_name_map(self.layout, spec_idx)
            for local, p in layer.named_parameters():
                if local != ANCHOR:
                    yield spec_idx, local, names(local), p
