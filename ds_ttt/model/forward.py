"""One incremental forward through a stack of decoder layers, shared by training, evaluation and serving.

    out = forward_chunk(layers, hidden_BTC, pos_emb, cache, fast_weights=W, key_prev=prev)
    out.hidden_BTC, out.key_last, out.write_rate_BT

Every pass of ds_ttt through decoder layers is this loop: the whole-sequence pass of the frozen layers
(qwen3.run_decoder_layers), a training or evaluation event (event_loop.forward_event) and every
serving step (`TTTQwen3ForCausalLM.step`: one session's chunk, a decode step of many sessions, a
batched prefill). What differs between them is only where attention's keys and values come from and
where the new ones go: the cache. A cache answers `attend(layer_index)` with the attention function
of that layer, which reads the visible keys/values, records or writes the new ones, and runs the
kernel; which keys are visible is the ContextPolicy's answer (context.py). A cache that the model's
`step` is handed (a `StepCache`) also owns the memory key's state: `key_prev()` before the chunk,
`commit_keys(...)` after it. The two caches of the model live here:

  WholeSequence  every token at once under one attention function (the policy's mask); nothing kept
  EventCache     new tokens of one event against the per-layer rows the event loop selected (once per
                 event, ContextPolicy.select_chunks); records each layer's (kept rows, new k, new v)

Serving's caches (a session's KV cache, a batch of sessions) are in ds_ttt/serve/. Per layer the loop
takes, in layer order, three fast-weight tensors for each adaptive layer (none: W_0) and one key state
of `key_prev` for each layer whose key reads or writes a KeyHistory (none: a fresh segment).

Shape letters: B batch, T new tokens, C hidden, S key-state rows, H kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from torch import nn

from ds_ttt.model.context import AttentionSpan, LayerCache
from ds_ttt.model.fast_weights import KeyHistory

class ChunkCache(Protocol):
    """Where one forward's attention keys and values come from and go to."""

    def attend(self, layer_index: int):
        """The attention function (q, k_new, v_new) -> o of decoder layer `layer_index` of the stack."""


class StepCache(ChunkCache, Protocol):
    """A ChunkCache that also owns the memory key's state across chunks (what `TTTQwen3ForCausalLM.step`
    is handed: ds_ttt/serve/session_chunk.py, ds_ttt/serve/pooled_chunk.py)."""

    def key_prev(self) -> list | None:
        """The key state entering the chunk, per key-state layer [B, S, C] (None: a fresh segment, zeros)."""

    def commit_keys(self, key_last: list, write_rate_BT: torch.Tensor | None) -> None:
        """Take the key state after the chunk (per key-state layer [B, S, C]) and the write rate of its
        tokens (None: the model has none)."""


@dataclass
class ChunkOutput:
    hidden_BTC: torch.Tensor
    key_last: list = field(default_factory=list)  # per key-state layer: its state after the chunk [B, S, C]
    write_rate_BT: torch.Tensor | None = None  # the write rate per token, from the layer that has one


def uses_key_state(layer: nn.Module) -> bool:
    """Does the layer's key read or write a KeyHistory (key shift, round address or write rate)?"""
    return getattr(layer, "is_adaptive", False) and layer.prime_mlp.has_key_io


def forward_chunk(layers: Sequence[nn.Module], hidden_BTC: torch.Tensor, pos_emb, cache: ChunkCache, *,
                  fast_weights: Sequence[torch.Tensor] | None = None, key_prev: Sequence | None = None,
                  segments_BT: torch.Tensor | None = None) -> ChunkOutput:
    """New tokens through `layers` against `cache`. fast_weights: flat (gate, up, down) per adaptive layer
    (None or empty: every adaptive layer uses its W_0). key_prev: the key state before the chunk per
    key-state layer ([B, S, C], or None for zeros); None: zeros for all. segments_BT: a segment id per
    token (the key state restarts where it changes; None: one segment)."""
    weights = iter(fast_weights) if fast_weights else None
    prev = iter(key_prev) if key_prev is not None else None
    out = ChunkOutput(hidden_BTC)
    for i, layer in enumerate(layers):
        w = (next(weights), next(weights), next(weights)) if weights is not None and layer.is_adaptive else None
        history = None
        if uses_key_state(layer):
            history = KeyHistory(prev_BSC=next(prev) if prev is not None else None, segments_BT=segments_BT)
        out.hidden_BTC, _ = layer(out.hidden_BTC, pos_emb, cache.attend(i), w, history)
        if history is not None:
            out.key_last.append(history.last_BSC)
            if history.write_rate_BT is not None:
                out.write_rate_BT = history.write_rate_BT
    return out


class WholeSequence:
    """Every layer attends with the same function over the whole sequence (the frozen layers' pass)."""

    def __init__(self, attend):
        self._attend = attend

    def attend(self, layer_index: int):
        return self._attend


class EventCache:
    """One event's new tokens against each layer's earlier keys and values, as the event loop selected
    them: per layer a pair (kept LayerCache chunks, AttentionSpan) from ContextPolicy.select_chunks. Used
    as given (no selection here: the event loop selects once per event, however often the event is
    scored), attention concatenates kept ++ new once per layer. Attention by `backend`; `outs[i]` =
    (kept chunks, k_new, v_new) of layer i after the forward."""

    def __init__(self, selected: Sequence[tuple[Sequence[LayerCache], AttentionSpan]], backend: str):
        self.selected = selected
        self.backend = backend
        self.outs: list = [None] * len(selected)

    def attend(self, layer_index: int):
        from ds_ttt.ops.flashbob import attention

        kept, span = self.selected[layer_index]

        def attend(q, k, v, span: AttentionSpan = span):
            self.outs[layer_index] = (kept, k, v)
            return attention(q, torch.cat([*(c.k_1HSD for c in kept), k], 2), torch.cat([*(c.v_1HSD for c in kept), v], 2),
                             causal=True, window=span.window, q_offset=span.q_offset, k_offset=span.k_offset,
                             backend=self.backend)
        return attend
