"""The inner loop: a trajectory, event by event, through the adaptive layers (the last pipeline stage).

For each trajectory (one row of the right-padded batch) and each round r = 0, 1, 2, ... (an "event"):
  1. run the round's tokens through the adaptive layers with the current fast weights W_{r-1},
     attending to the key/value cache of earlier rounds as the context policy allows;
  2. score the action tokens (outer loss, "before the observation is learned") and the
     observation tokens (inner loss L_obs) with the same W_{r-1};
  3. W_r = inner_sgd_step(L_obs, W_{r-1}) with create_graph=True, so the outer loss of every later
     action back-propagates through the update (full second order);
  4. append the round's keys/values to the cache (they were computed with W_{r-1}, exactly as a
     deployed agent computes them while it acts).
Label position t predicts token t+1, so a position's loss kind is the kind of the *next* token.

Memory: with `checkpoint_events`, each event step runs under non-reentrant activation checkpointing,
so the autograd graph keeps only what is carried between events (W, the KV cache, the hidden
states entering the stage) and recomputes each event's activations during backward.
(Reentrant checkpointing cannot contain `torch.autograd.grad`; non-reentrant can.)

Shape letters: T tokens, C hidden, H kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_ttt.config import TTTConfig
from ds_ttt.model.context import ContextPolicy, LayerCache
from ds_ttt.model.fast_weights import FastWeights, inner_sgd_step

PAD, CONTEXT, ACTION, OBSERVATION = -1, 0, 1, 2


@dataclass
class SuffixModules:
    """What the last stage owns: the adaptive layers, the final norm, the LM head, RoPE."""

    layers: Sequence[nn.Module]
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module

    def initial_fast_weights(self) -> FastWeights:
        return tuple(w for layer in self.layers for w in layer.prime_mlp.initial_weights())


@dataclass
class EventRecord:
    """Per-event details for evaluation (record=True); all tensors detached, on CPU."""

    round: int
    label_positions: torch.Tensor  # absolute position t of each scored label (predicts token t+1)
    labels: torch.Tensor
    label_kinds: torch.Tensor
    token_nll: torch.Tensor  # NLL per label position, with the pre-update W
    argmax: torch.Tensor  # greedy prediction per label position
    obs_nll_after: torch.Tensor | None  # observation NLL per label with the updated W (if updated)
    updated: bool
    skipped: bool


@dataclass
class EventLoopOutput:
    loss: torch.Tensor  # outer objective: mean action NLL (+ obs_loss_weight * mean pre-update obs NLL)
    action_nll_sum: torch.Tensor  # detached sums over tokens, for logging and token-weighted reduction
    num_action_tokens: int
    obs_nll_sum: torch.Tensor
    num_obs_tokens: int
    num_updates: int
    num_skipped: int
    records: list[list[EventRecord]] = field(default_factory=list)  # per trajectory, when record=True
    final_weights: list[FastWeights] = field(default_factory=list)  # per trajectory


def attention_for_event(backend: str, span):
    from ds_ttt.ops.flashbob import attention

    def attend(q, k, v):
        return attention(q, k, v, causal=True, window=span.window, q_offset=span.q_offset,
                         k_offset=span.k_offset, backend=backend)
    return attend


def forward_event(layers: Sequence[nn.Module], caches: list[LayerCache], hidden_1TC: torch.Tensor,
                  pos_emb, start: int, round_id: int, policy: ContextPolicy, backend: str,
                  fast_weights: FastWeights | None):
    """New tokens (positions start.., round `round_id`) through `layers` against their caches.

    Returns (hidden, [(kept_cache, k_new, v_new) per layer]). Layers with a prime MLP consume three
    fast-weight tensors each, in order. Also used by serving for the whole stack.
    """
    it = iter(fast_weights or ())
    outs = []
    for layer, cache in zip(layers, caches):
        kept, span = policy.select(cache, start, round_id)
        inner = attention_for_event(backend, span)

        def attend(q, k, v, kept=kept, inner=inner):
            return inner(q, torch.cat([kept.k_1HSD, k], 2), torch.cat([kept.v_1HSD, v], 2))
        w = (next(it), next(it), next(it)) if getattr(layer, "is_adaptive", False) and fast_weights else None
        hidden_1TC, (k, v) = layer(hidden_1TC, pos_emb, attend, w)
        outs.append((kept, k, v))
    return hidden_1TC, outs


def _nll(suffix: SuffixModules, hidden_1TC, label_idx, labels, in_graph=None):
    """NLL and logits at `label_idx`. With `in_graph` (a bool mask over label_idx), only those rows
    enter the autograd graph; the others (context rows scored for evaluation) are computed under
    no_grad, so the inner step's backward never touches them."""
    def logits_of(idx):
        logits = suffix.lm_head(suffix.norm(hidden_1TC[0, idx]))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    if in_graph is None or bool(in_graph.all()):
        logits = logits_of(label_idx)
        return F.cross_entropy(logits, labels, reduction="none"), logits
    logits_g = logits_of(label_idx[in_graph])
    with torch.no_grad():
        logits_c = logits_of(label_idx[~in_graph])
    logits = logits_g.new_empty(label_idx.numel(), logits_g.shape[-1])
    logits = logits.index_put((in_graph.nonzero().squeeze(1),), logits_g)
    logits = logits.index_put(((~in_graph).nonzero().squeeze(1),), logits_c)
    return F.cross_entropy(logits, labels, reduction="none"), logits


def observation_labels(label_kinds: torch.Tensor, *, with_end: bool) -> torch.Tensor:
    """Which labels of one round the observation loss covers: the observation tokens, and with
    `with_end` also the label right after each observation span (the token that closes the terminal
    output), so the inner step also stores where an output ends."""
    obs = label_kinds == OBSERVATION
    if not with_end:
        return obs
    closes = torch.zeros_like(obs)
    closes[1:] = obs[:-1] & (label_kinds[1:] == CONTEXT)  # never an action token, never padding
    return obs | closes


def run_event_loop(suffix: SuffixModules, ttt: TTTConfig, hidden_BTC: torch.Tensor, input_ids_BT: torch.Tensor,
                   kinds_BT: torch.Tensor, rounds_BT: torch.Tensor, *, create_graph: bool, update: bool = True,
                   record: bool = False, fast_weights: FastWeights | None = None) -> EventLoopOutput:
    """Outer loss of a right-padded batch (rows are independent trajectories, each with its own W)."""
    policy = ContextPolicy.from_ttt(ttt)
    backend = ttt.attention_backend
    w0 = fast_weights if fast_weights is not None else suffix.initial_fast_weights()
    can_update = update and len(w0) > 0 and ttt.inner_lr > 0
    if can_update:  # the inner gradient needs W in the graph; at inference W is a fresh leaf
        w0 = tuple(w.detach().requires_grad_(True) if not (create_graph and w.requires_grad) else w for w in w0)
    total_action = hidden_BTC.new_zeros((), dtype=torch.float32)
    total_obs = hidden_BTC.new_zeros((), dtype=torch.float32)
    n_action = n_obs = n_updates = n_skipped = 0
    all_records, finals = [], []

    for b in range(hidden_BTC.shape[0]):
        n = int((kinds_BT[b] != PAD).sum())
        ids, kinds, rounds = input_ids_BT[b, :n], kinds_BT[b, :n], rounds_BT[b, :n]
        if n > 1 and bool((rounds[1:] < rounds[:-1]).any()):
            raise ValueError(f"trajectory {b}: round ids must be non-decreasing along the sequence")
        labels, label_kinds = ids[1:], kinds[1:]
        bounds = torch.nonzero(rounds[1:] != rounds[:-1]).squeeze(1) + 1
        starts = [0] + bounds.tolist()
        ends = starts[1:] + [n]
        weights = w0
        caches = None
        records = []
        for start, end in zip(starts, ends):
            round_id = int(rounds[start])
            label_idx = torch.arange(start, min(end, n - 1), device=ids.device)
            lk = label_kinds[label_idx]
            obs_like = observation_labels(lk, with_end=ttt.obs_loss_with_end)
            wanted = label_idx if record else label_idx[(lk == ACTION) | obs_like]
            local, tgt = wanted - start, labels[wanted]
            act_mask, obs_mask = label_kinds[wanted] == ACTION, obs_like[wanted - start]
            pure_obs = label_kinds[wanted] == OBSERVATION  # the metrics' observation tokens
            k_obs = int(obs_mask.sum())
            do_update = can_update and k_obs > 0
            positions = torch.arange(start, end, device=ids.device)[None]
            h_event = hidden_BTC[b:b + 1, start:end]
            if caches is None:
                caches = [LayerCache.empty(_kv_like(layer, h_event)) for layer in suffix.layers]
            # Prune the caches to what this event may see (outside the checkpointed step: the
            # kept keys/values are its tensor inputs, positions/rounds are plain metadata).
            kept = [policy.select(c, start, round_id)[0] for c in caches]

            def score(h, ws, kvs, kept=kept, positions=positions, start=start, round_id=round_id,
                      local=local, tgt=tgt, act_mask=act_mask, obs_mask=obs_mask):
                cs = [LayerCache(kvs[2 * i], kvs[2 * i + 1], c.positions_S, c.rounds_S) for i, c in enumerate(kept)]
                h_out, outs = forward_event(suffix.layers, cs, h, suffix.rotary_emb(h, positions), start,
                                            round_id, policy, backend, ws)
                nll, logits = _nll(suffix, h_out, local, tgt, in_graph=(act_mask | obs_mask) if record else None)
                return nll, logits, [t for _, k, v in outs for t in (k, v)]

            def step(h, *flat, score=score, act_mask=act_mask, obs_mask=obs_mask, k_obs=k_obs,
                     do_update=do_update, nw=len(weights)):
                ws, kvs = tuple(flat[:nw]), flat[nw:]
                nll, logits, new_kv = score(h, ws, kvs)
                act_sum, obs_sum = (nll * act_mask).sum(), (nll * obs_mask).sum()
                new_ws, skipped = ws, False
                if do_update:
                    res = inner_sgd_step(obs_sum / k_obs, ws, lr=ttt.inner_lr, max_norm=ttt.inner_max_norm,
                                         create_graph=create_graph)
                    new_ws, skipped = res.weights, res.skipped
                extra = (nll.detach(), logits.detach().argmax(-1)) if record else ()
                return (*new_ws, *new_kv, act_sum, obs_sum, torch.tensor(float(skipped)), *extra)

            flat_in = [t for c in kept for t in (c.k_1HSD, c.v_1HSD)]
            if not create_graph:
                h_event = h_event.detach()
            if ttt.checkpoint_events and create_graph and torch.is_grad_enabled():
                out = checkpoint(step, h_event, *weights, *flat_in, use_reentrant=False)
            else:
                # Inference still needs a graph from W to L_obs for the inner gradient.
                with torch.enable_grad() if do_update else contextlib.nullcontext():
                    out = step(h_event, *weights, *flat_in)
            nw, nkv = len(weights), 2 * len(kept)
            new_weights, new_kv = tuple(out[:nw]), out[nw:nw + nkv]
            act_sum, obs_sum, skipped_t = out[nw + nkv: nw + nkv + 3]
            skipped = bool(skipped_t.item())
            if record:
                after = None
                if do_update and not skipped:
                    with torch.no_grad():
                        after = score(h_event, new_weights, flat_in)[0][pure_obs].cpu()
                records.append(EventRecord(
                    round=round_id, label_positions=wanted.cpu(), labels=tgt.cpu(),
                    label_kinds=label_kinds[wanted].cpu(), token_nll=out[-2].cpu(), argmax=out[-1].cpu(),
                    obs_nll_after=after, updated=do_update and not skipped, skipped=do_update and skipped))
            caches = []
            for i, c in enumerate(kept):
                k, v = new_kv[2 * i], new_kv[2 * i + 1]
                kk, vv = flat_in[2 * i], flat_in[2 * i + 1]
                if not create_graph:
                    k, v = k.detach(), v.detach()
                caches.append(LayerCache(kk, vv, c.positions_S, c.rounds_S).append(
                    k, v, positions[0], rounds[start:end]))
            total_action = total_action + act_sum
            total_obs = total_obs + obs_sum
            n_action += int(act_mask.sum())
            n_obs += k_obs
            n_updates += int(do_update and not skipped)
            n_skipped += int(do_update and skipped)
            weights = new_weights
        all_records.append(records)
        finals.append(tuple(w.detach() for w in weights))

    loss = total_action / max(n_action, 1)
    if ttt.obs_loss_weight > 0:
        loss = loss + ttt.obs_loss_weight * total_obs / max(n_obs, 1)
    return EventLoopOutput(loss=loss, action_nll_sum=total_action.detach(), num_action_tokens=n_action,
                           obs_nll_sum=total_obs.detach(), num_obs_tokens=n_obs, num_updates=n_updates,
                           num_skipped=n_skipped, records=all_records, final_weights=finals)


def _kv_like(layer, h_1TC):
    attn = layer.self_attn
    return h_1TC.new_zeros(1, attn.config.num_key_value_heads, 0, attn.head_dim)
