"""Single-device Qwen3 with fast-weight "prime" MLPs in its last layers (architecture only).

Parameter names are transformers' Qwen3 names (`model.layers.N.self_attn.q_proj.weight`, ...,
`lm_head.weight`), so a Hugging Face checkpoint loads 1:1; the adaptive layers add
`model.layers.N.prime_layernorm.weight`, `model.layers.N.prime_mlp.{gate,up,down}_proj.weight`, with
`ttt.key_shift` `model.layers.N.prime_mlp.key_shift`, with `ttt.round_address`
`model.layers.N.prime_mlp.address_{query,proj}`, and with `ttt.write_rate` (first adaptive layer)
`model.layers.N.prime_mlp.write_rate{,_bias}`.
With `config.tie_word_embeddings` (Qwen3-0.6B to 4B) `lm_head.weight` IS `model.embed_tokens.weight`
(one parameter under two names, as in transformers); the trainable scope of that parameter is the
union of its names' scopes (`is_trainable`), so under 'suffix' and 'all' the tied embedding trains.

A decoder layer computes
    h = h + attn(input_layernorm(h))
    h = h + prime_mlp(key(prime_layernorm(h)); W)   (adaptive layers only; W = fast weights;
                                                     key = the learned token shift, fast_weights.py)
    h = h + mlp(post_attention_layernorm(h))
Attention is injected as an `attend(q, k, v)` callable so the same block runs (a) over a whole
sequence with SDPA and a context-policy mask (frozen prefix layers, plain logits) and (b) event by
event against a key/value cache with the twice-differentiable FlashBoB attention (the inner loop).
The pipeline engine builds its stages from these same classes (ds_ttt/train/pipeline.py).

    from ds_ttt.model.presets import backbone_config
    from ds_ttt.config import TTTConfig
    model = TTTQwen3ForCausalLM(backbone_config("tiny"), TTTConfig())
    logits = model(input_ids)                                   # base model + W_0 (== Qwen3 at init)
    out = model.trajectory_loss(input_ids, kinds, rounds)     # inner loop, outer loss
    logits = model.step(ids_BT, positions_BT, cache, fast_weights=W)   # serving: new tokens against a cache

`step` is the one incremental entry: every serving path (a session's chunk, a batched decode step, a
batched prefill; ds_ttt/serve/) builds a cache and calls it. The model holds its context policy once,
in `ttt` (`model.policy` reads it; `set_context_policy` replaces it).

Shape letters: B batch, T tokens, C hidden, H heads, D head dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb)

from ds_ttt.config import TTTConfig
from ds_ttt.model.context import ContextPolicy
from ds_ttt.model.fast_weights import FastWeights, KeyHistory, PrimeMLP
from ds_ttt.model.forward import StepCache, WholeSequence, forward_chunk, uses_key_state

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attend(mask_B1TT: torch.Tensor | None, scale: float) -> Attend:
    """Whole-sequence attention (first order is enough: used only outside the inner loop)."""
    def attend(q_BHTD, k_BHTD, v_BHTD):
        return F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=mask_B1TT,
                                              is_causal=mask_B1TT is None, scale=scale, enable_gqa=True)
    return attend


def flash_attn_available(hidden: torch.Tensor) -> bool:
    """flash-attn serves the frozen path on CUDA bf16/fp16 when it is installed (the GPU extra)."""
    return (hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and importlib.util.find_spec("flash_attn") is not None)


def flash_attend(scale: float, window: int) -> Attend:
    """flash-attn's causal (optionally sliding-window) kernel; [B, H, T, D] in and out."""
    from flash_attn import flash_attn_func

    def attend(q_BHTD, k_BHTD, v_BHTD):
        o_BTHD = flash_attn_func(q_BHTD.transpose(1, 2), k_BHTD.transpose(1, 2), v_BHTD.transpose(1, 2),
                                 softmax_scale=scale, causal=True,
                                 window_size=(window - 1, 0) if window > 0 else (-1, -1))
        return o_BTHD.transpose(1, 2)
    return attend


def frozen_path_attend(policy: ContextPolicy, hidden_BTC: torch.Tensor, rounds_BT: torch.Tensor, scale: float) -> Attend:
    """Whole-sequence attention for layers outside the inner loop: flash-attn on CUDA when installed
    (causal or sliding window), else SDPA with the context-policy mask (CPU, and current_round)."""
    if policy.is_positional and flash_attn_available(hidden_BTC):
        return flash_attend(scale, policy.window)
    return sdpa_attend(policy.mask(rounds_BT), scale)


class FrozenPathAttention:
    """`frozen_path_attend` built once per micro-batch and reused by every frozen layer that asks for the
    same one. The pipeline runs each frozen layer as its own `DecoderPipe`, so without it every layer
    rebuilt the context-policy mask ([B, 1, T, T]) from the same round ids. A stage's layers share one
    instance (pipeline.build_specs); it answers with the function it built last when the policy, the
    scale, the hidden states' dtype and device and the round ids (equal in value: a copy is kept, so a
    new micro-batch, or one changed in place, never meets a stale mask) are those of that build."""

    def __init__(self):
        self.key = None
        self.rounds_BT: torch.Tensor | None = None
        self.attend: Attend | None = None
        self.builds = 0  # how many times it built the function (a test counts them)

    def __call__(self, policy: ContextPolicy, hidden_BTC: torch.Tensor, rounds_BT: torch.Tensor,
                 scale: float) -> Attend:
        key = (policy, scale, hidden_BTC.dtype, hidden_BTC.device, rounds_BT.device, rounds_BT.dtype)
        if (self.attend is None or key != self.key or self.rounds_BT.shape != rounds_BT.shape
                or not torch.equal(self.rounds_BT, rounds_BT)):
            self.attend = frozen_path_attend(policy, hidden_BTC, rounds_BT, scale)
            self.key, self.rounds_BT = key, rounds_BT.detach().clone()
            self.builds += 1
        return self.attend


class RMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm, computed in at least fp32 (HF's always rounds through fp32, which would make
    float64 finite-difference checks of the meta-gradient meaningless). Identical for fp32/bf16."""

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class TTTAttention(Qwen3Attention):
    """Qwen3's attention (same parameters, qk-norm, RoPE) with the attention kernel injected."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_BTC, position_embeddings, attend: Attend):
        b, t, _ = hidden_BTC.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_BTC).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_BTC).view(shape)).transpose(1, 2)
        v = self.v_proj(hidden_BTC).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o_BHTD = attend(q, k, v)
        return self.o_proj(o_BHTD.transpose(1, 2).reshape(b, t, -1)), (k, v)


class TTTDecoderLayer(nn.Module):
    """A Qwen3 decoder layer; with `prime_intermediate_size` it also carries a prime MLP."""

    def __init__(self, config: Qwen3Config, layer_idx: int, prime_intermediate_size: int | None = None,
                 key_shift: int = 0, *, round_address: bool = False, write_rate: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = TTTAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.is_adaptive = prime_intermediate_size is not None
        if self.is_adaptive:
            self.prime_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.prime_mlp = PrimeMLP(config.hidden_size, prime_intermediate_size, key_shift,
                                      round_address=round_address, write_rate=write_rate)

    @classmethod
    def adaptive(cls, config: Qwen3Config, ttt: TTTConfig, layer_idx: int, first_adaptive: int) -> "TTTDecoderLayer":
        """Adaptive layer `layer_idx` as `ttt` configures it (the one place the model and the pipeline's
        last stage build them): its prime MLP, key shift and round address; the write rate on the first."""
        return cls(config, layer_idx, ttt.prime_intermediate_size or config.intermediate_size, ttt.key_shift,
                   round_address=ttt.round_address, write_rate=ttt.write_rate and layer_idx == first_adaptive)

    def forward(self, hidden_BTC, position_embeddings, attend: Attend, prime_weights: FastWeights | None = None,
                key_history: KeyHistory | None = None):
        """Returns (hidden, (k, v)); `prime_weights` overrides W_0 of an adaptive layer; `key_history`
        carries the key shift's state across chunks (read and updated in place; None = a fresh
        sequence of one segment)."""
        attn_out, kv = self.self_attn(self.input_layernorm(hidden_BTC), position_embeddings, attend)
        h = hidden_BTC + attn_out
        if self.is_adaptive:
            h = h + self.prime_mlp(self.prime_mlp.key(self.prime_layernorm(h), key_history), prime_weights)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


@torch.no_grad()
def reset_qwen3_parameters(module: nn.Module, std: float, prime_init_std: float | None = None) -> None:
    """HF-style init of any part of the model (the whole model or one pipeline layer): normal(0, std)
    linears/embeddings, ones for norms; every prime MLP's down projection and key slow weights zero
    (so an untrained TTT model is the base Qwen3), its gate/up normal(0, prime_init_std) when set."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.normal_(0.0, std)
        elif isinstance(m, Qwen3RMSNorm):
            m.weight.fill_(1.0)
    for m in module.modules():
        if isinstance(m, PrimeMLP):
            if prime_init_std is not None:
                m.gate_proj.weight.normal_(0.0, prime_init_std)
                m.up_proj.weight.normal_(0.0, prime_init_std)
            m.zero_slow_weights()


def run_decoder_layers(layers, hidden_BTC: torch.Tensor, rounds_BT: torch.Tensor | None, *,
                       policy: ContextPolicy, rotary_emb: nn.Module,
                       frozen_attention: FrozenPathAttention | None = None) -> torch.Tensor:
    """Whole-sequence pass through `layers` (one or many) under the context policy, W_0 in adaptive
    layers. Used by the single-device model and by each pipeline decoder stage; `frozen_attention`
    (a stage's shared FrozenPathAttention) builds the attention function once per micro-batch
    rather than once per call."""
    b, t, _ = hidden_BTC.shape
    if rounds_BT is None and policy.needs_rounds:
        raise ValueError("context_policy='current_round' needs rounds_BT (round id per token)")
    positions_BT = torch.arange(t, device=hidden_BTC.device).expand(b, t)
    pos_emb = rotary_emb(hidden_BTC, positions_BT)
    attend = (frozen_attention if frozen_attention is not None else frozen_path_attend)(
        policy, hidden_BTC, rounds_BT if rounds_BT is not None else torch.zeros_like(positions_BT),
        layers[0].self_attn.scaling)
    # the key shift's history restarts where attention's context does (each round under current_round)
    segments = rounds_BT if policy.rounds_are_segments else None
    return forward_chunk(layers, hidden_BTC, pos_emb, WholeSequence(attend), segments_BT=segments).hidden_BTC


TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")  # one parameter when tie_word_embeddings


def is_trainable(name: str, scope: str, first_adaptive: int) -> bool:
    """Does the trainable scope cover the parameter named `name` (a Hugging Face name)? A tied parameter
    trains when any of its names does (see `parameter_names`)."""
    if scope == "all":
        return True
    if scope == "suffix":
        return is_suffix_param(name, first_adaptive)
    if scope == "prime":
        return ".prime_" in name
    raise ValueError(f"unknown trainable scope {scope!r}")


def aliases(name: str, config: Qwen3Config) -> tuple[str, ...]:
    """Every Hugging Face name of the parameter called `name` (both tied names when tied)."""
    if config.tie_word_embeddings and name in TIED_NAMES:
        return TIED_NAMES
    return (name,)


class TTTQwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, ttt: TTTConfig):
        super().__init__()
        num_adaptive = ttt.num_adaptive(config.num_hidden_layers)
        first_adaptive = config.num_hidden_layers - num_adaptive
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TTTDecoderLayer.adaptive(config, ttt, i, first_adaptive) if i >= first_adaptive else TTTDecoderLayer(config, i)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)


class TTTQwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config, ttt: TTTConfig):
        super().__init__()
        ttt.validate(config.num_hidden_layers)
        self.config, self.ttt = config, ttt
        self.model = TTTQwen3Model(config, ttt)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()
        self.num_adaptive = ttt.num_adaptive(config.num_hidden_layers)
        self.first_adaptive = config.num_hidden_layers - self.num_adaptive
        self.reset_parameters()

    # ---- context policy ----------------------------------------------------------------------
    @property
    def policy(self) -> ContextPolicy:
        """The context policy, read from `ttt` (context_policy, window): the one place the model holds it."""
        return ContextPolicy.from_ttt(self.ttt)

    def set_context_policy(self, policy: ContextPolicy) -> None:
        """Run under `policy` from now on (the result equals a model constructed with it)."""
        ttt = dataclasses.replace(self.ttt, **policy.ttt_fields())
        ttt.validate(self.config.num_hidden_layers)
        self.ttt = ttt

    # ---- structure -------------------------------------------------------------------------
    @property
    def prefix_layers(self) -> list[TTTDecoderLayer]:
        return list(self.model.layers[: self.first_adaptive])

    @property
    def adaptive_layers(self) -> list[TTTDecoderLayer]:
        return list(self.model.layers[self.first_adaptive:])

    def initial_fast_weights(self) -> FastWeights:
        return tuple(w for layer in self.adaptive_layers for w in layer.prime_mlp.initial_weights())

    @property
    def has_key_state(self) -> bool:
        """Does any layer's memory key carry a state across chunks (key shift, round address, write rate)?"""
        return any(uses_key_state(layer) for layer in self.model.layers)

    def empty_key_state(self) -> list[torch.Tensor]:
        """The key state of a fresh segment for one row: zeros [1, S, C] per key-state layer."""
        like = self.model.embed_tokens.weight  # the hidden states' dtype, device and width
        return [layer.prime_mlp.empty_key_state(1, like) for layer in self.model.layers if uses_key_state(layer)]

    def tie_weights(self) -> None:
        """lm_head.weight := model.embed_tokens.weight (the same Parameter), as transformers ties them."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self, std: float | None = None) -> None:
        """HF-style init (reset_qwen3_parameters): prime down projections zero, prime gate/up at
        ttt.prime_init_std when that is set."""
        reset_qwen3_parameters(self, self.config.initializer_range if std is None else std, self.ttt.prime_init_std)

    # ---- forward passes ----------------------------------------------------------------------
    def position_embeddings(self, hidden_BTC, positions_BT):
        return self.model.rotary_emb(hidden_BTC, positions_BT)

    def forward(self, input_ids_BT: torch.Tensor, rounds_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] with the initial fast weights W_0 and no updates (the context policy
        applies when `rounds_BT` is given; without it the policy must be "full" or "window")."""
        h = self.model.embed_tokens(input_ids_BT)
        h = self.run_layers(self.model.layers, h, rounds_BT)
        return self.lm_head(self.model.norm(h))

    def step(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor, cache: StepCache, *,
             fast_weights: FastWeights | None = None, logits_at: Sequence[int] = (-1,)) -> torch.Tensor:
        """New tokens through every layer against `cache` (ds_ttt/model/forward.py `StepCache`): the one
        incremental entry of serving. ids_BT / positions_BT: the tokens and their absolute positions
        (RoPE); fast_weights: flat (gate, up, down) per adaptive layer, one matrix for all rows or [B, F, D]
        per row (None: W_0). The cache supplies attention and the key state before the chunk
        (`key_prev`, asked only when a layer has one) and takes the state after it (`commit_keys`).
        Returns fp32 (at least) logits at chunk indices `logits_at` of every row, row-major:
        [B, V] for the default last token, [B * len(logits_at), V] otherwise ([0, V] for none)."""
        h = self.model.embed_tokens(ids_BT)
        pos_emb = self.model.rotary_emb(h, positions_BT)
        key_prev = cache.key_prev() if self.has_key_state else None
        out = forward_chunk(self.model.layers, h, pos_emb, cache, fast_weights=fast_weights, key_prev=key_prev)
        cache.commit_keys(out.key_last, out.write_rate_BT)
        h = out.hidden_BTC
        t = h.shape[1]
        if list(logits_at) in ([-1], [t - 1]):
            rows = h[:, -1]
        else:
            rows = h[:, torch.tensor(list(logits_at), dtype=torch.long, device=h.device)].reshape(-1, h.shape[-1])
        logits = self.lm_head(self.model.norm(rows))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def run_layers(self, layers, hidden_BTC, rounds_BT: torch.Tensor | None) -> torch.Tensor:
        """Whole-sequence pass through `layers` under the context policy (W_0 in adaptive layers)."""
        return run_decoder_layers(layers, hidden_BTC, rounds_BT, policy=self.policy, rotary_emb=self.model.rotary_emb)

    def trajectory_loss(self, input_ids_BT, kinds_BT, rounds_BT, *, create_graph: bool | None = None,
                        update: bool = True, record: bool = False):
        """Meta-training objective on a right-padded batch of rendered trajectories.

        The frozen-path prefix runs once over the whole sequence; the adaptive suffix runs the
        event loop (ds_ttt/model/event_loop.py). create_graph defaults to torch.is_grad_enabled().
        """
        from ds_ttt.model.event_loop import SuffixModules, run_event_loop

        h = self.model.embed_tokens(input_ids_BT)
        h = self.run_layers(self.prefix_layers, h, rounds_BT)
        suffix = SuffixModules(layers=self.adaptive_layers, norm=self.model.norm, lm_head=self.lm_head,
                               rotary_emb=self.model.rotary_emb)
        return run_event_loop(suffix, self.ttt, h, input_ids_BT, kinds_BT, rounds_BT,
                              create_graph=torch.is_grad_enabled() if create_graph is None else create_graph,
                              update=update, record=record)

    def to_dtype(self, dtype: torch.dtype) -> "TTTQwen3ForCausalLM":
        """Cast parameters to `dtype` but keep RoPE's inv_freq in fp32 (as transformers and DeepSpeed do);
        a plain `.to(bf16)` would round the rotary frequencies and drift at long positions."""
        self.to(dtype)
        rope = self.model.rotary_emb
        with torch.device(rope.inv_freq.device):
            self.model.rotary_emb = Qwen3RotaryEmbedding(self.config)
        return self

    # ---- training scope ----------------------------------------------------------------------
    def set_trainable_scope(self, scope: str | None = None) -> None:
        """prime: prime MLPs + their norms; suffix: the adaptive layers (+ final norm, LM head); all.
        A tied embedding (one parameter, two names) trains when either name is in scope."""
        scope = scope or self.ttt.trainable_scope
        for name, p in self.named_parameters():  # each parameter once (a tied one under its first name)
            p.requires_grad_(any(is_trainable(n, scope, self.first_adaptive) for n in aliases(name, self.config)))
        if self.num_adaptive == 0 and scope == "prime":
            raise ValueError("trainable_scope='prime' with adaptive_layers=0 trains nothing; "
                             "use 'all' for the SFT baseline (the whole backbone; 'suffix' without adaptive layers "
                             "trains only the final norm and LM head)")


def is_suffix_param(name: str, first_adaptive: int) -> bool:
    if name.startswith("lm_head.") or name.startswith("model.norm."):
        return True
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) >= first_adaptive
    return False
