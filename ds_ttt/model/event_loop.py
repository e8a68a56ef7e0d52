"""The inner loop: a trajectory, event by event, through the adaptive layers (the last pipeline stage).

For each trajectory (one row of the right-padded batch) and each round r = 0, 1, 2, ... (an "event"):
  1. run the round's tokens through the adaptive layers with the current fast weights W_{r-1},
     attending to the key/value cache of earlier rounds as the context policy allows
     (forward.forward_chunk with an EventCache: the same layer loop as serving's);
  2. score the action tokens (outer loss, "before the observation is learned") and the
     observation tokens (inner loss L_obs) with the same W_{r-1};
  3. W_r = inner_sgd_step(L_obs, W_{r-1}) with create_graph=True, so the outer loss of every later
     action back-propagates through the update (full second order);
  4. keep the round's keys/values as one more chunk of the cache (they were computed with W_{r-1},
     exactly as a deployed agent computes them while it acts), and keep the last `key_shift` prime-MLP
     inputs of each adaptive layer as the next round's key history (zeros instead under `current_round`).
With `inner_steps` k > 1, step 3 repeats k times, re-scoring the observation with each new W.
Label position t predicts token t+1, so a position's loss kind is the kind of the *next* token.

Host syncs: none per event. Event boundaries, label positions and token counts come from one host
copy of the batch's kinds and round ids (taken once per batch, before any event runs); the cache's
positions/round ids are host metadata; a non-finite inner step is skipped on the device
(`inner_sgd_step`) and skips are counted as a device tensor. Only `record=True` (evaluation) reads
values back per event.

Precision: fast weights are carried in fp32 (`inner_loop_weights`, see fast_weights.py).

Memory: with `checkpoint_events` (while meta-training) each event is one EventFunction
(event_checkpoint.py): its forward runs once, takes the inner gradient on its live graph and keeps
only the update (the gradient's factors or the gradient, in the compute dtype); the fast weights pass
between events as zero-storage stand-ins, and each event's backward rebuilds its W bit for bit and
recomputes the event with the inner step differentiable. Keys and values stay per-event chunks (no
re-copy per event); an event is handed only the rows its context policy shows it, selected once per
event (ContextPolicy.select_chunks; a window's partial chunk as a view).
(docs/training.md, "Memory at long context".)

The inner gradient holds the earlier events' cache fixed (an alias of W per event), as evaluation and
serving compute it, while the outer loss reaches W through every path.

Shape letters: T tokens, C hidden, H kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from ds_ttt.config import TTTConfig
from ds_ttt.data.token_kind import TokenKind
from ds_ttt.model.context import AttentionSpan, ContextPolicy, LayerCache
from ds_ttt.model.event_checkpoint import EventFunction, EventRun, FastWeightChain, StepOut
from ds_ttt.model.fast_weights import FactorTaps, FastWeights, inner_loop_weights
from ds_ttt.model.inner_step import inner_update, trainable_fast_weights
from ds_ttt.model.forward import EventCache, forward_chunk, uses_key_state



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
    loss: torch.Tensor  # outer objective of this batch alone: mean action NLL (+ obs_loss_weight * mean obs NLL)
    action_loss_sum: torch.Tensor  # in the graph: summed action NLL (token-weighted reduction across batches)
    obs_loss_sum: torch.Tensor  # in the graph: summed pre-update observation-loss NLL (observation_labels)
    num_action_tokens: int
    num_obs_tokens: int
    num_update_attempts: int  # events with observation tokens and a nonzero inner lr
    skipped_count: torch.Tensor  # 0-dim int64 on the device: attempts skipped for a non-finite gradient
    records: list[list[EventRecord]] = field(default_factory=list)  # per trajectory, when record=True
    final_weights: list[FastWeights] = field(default_factory=list)  # per trajectory (fp32 when updated)

    @property
    def action_nll_sum(self) -> torch.Tensor:  # detached, for logging
        return self.action_loss_sum.detach()

    @property
    def obs_nll_sum(self) -> torch.Tensor:
        return self.obs_loss_sum.detach()

    @property
    def num_skipped(self) -> int:  # reads the device counter (one sync): for logging, not the hot path
        return int(self.skipped_count)

    @property
    def num_updates(self) -> int:
        return self.num_update_attempts - self.num_skipped


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
    obs = label_kinds == TokenKind.OBSERVATION
    if not with_end:
        return obs
    closes = torch.zeros_like(obs)
    closes[1:] = obs[:-1] & (label_kinds[1:] == TokenKind.CONTEXT)  # never an action token, never padding
    return obs | closes


@dataclass
class _EventPlan:
    """One event's host-side metadata, computed from the batch's single host copy (no device work)."""

    start: int  # the round's first position
    end: int  # one past its last position
    round_id: int
    wanted_h: torch.Tensor  # label positions scored: every one with record=True, else action + observation
    kinds_h: torch.Tensor  # their label kinds
    act_mask_h: torch.Tensor  # over wanted_h: action labels (the outer loss)
    obs_mask_h: torch.Tensor  # over wanted_h: labels of the observation loss (the inner step)
    num_obs: int  # obs_mask_h.sum(): zero means no inner step this event


def _plan_events(b: int, kinds_h: torch.Tensor, rounds_h: torch.Tensor, *, record: bool,
                 with_end: bool) -> list[_EventPlan]:
    """The events of trajectory `b` (its unpadded host kinds and round ids): one per round."""
    n = len(kinds_h)
    if n > 1 and bool((rounds_h[1:] < rounds_h[:-1]).any()):
        raise ValueError(f"trajectory {b}: round ids must be non-decreasing along the sequence")
    label_kinds_h = kinds_h[1:]
    starts = [0] + (torch.nonzero(rounds_h[1:] != rounds_h[:-1]).squeeze(1) + 1).tolist()
    ends = starts[1:] + [n]
    plans = []
    for start, end in zip(starts, ends):
        label_idx_h = torch.arange(start, min(end, n - 1))
        lk_h = label_kinds_h[label_idx_h]
        obs_like_h = observation_labels(lk_h, with_end=with_end)
        wanted_h = label_idx_h if record else label_idx_h[(lk_h == TokenKind.ACTION) | obs_like_h]
        obs_mask_h = obs_like_h[wanted_h - start]
        plans.append(_EventPlan(start=start, end=end, round_id=int(rounds_h[start]), wanted_h=wanted_h,
                                kinds_h=label_kinds_h[wanted_h], act_mask_h=label_kinds_h[wanted_h] == TokenKind.ACTION,
                                obs_mask_h=obs_mask_h, num_obs=int(obs_mask_h.sum())))
    return plans


@dataclass
class _Loop:
    """What every event of one `run_event_loop` call shares."""

    suffix: SuffixModules
    ttt: TTTConfig
    policy: ContextPolicy
    create_graph: bool
    record: bool
    can_update: bool  # fast weights exist, updates are on and the inner lr is nonzero
    no_skip: torch.Tensor  # the 0-dim int64 "not skipped" of events without an update
    checkpointed: bool  # each event an EventFunction (event_checkpoint.py)
    params: list = field(default_factory=list)  # checkpointed: the trainable parameters the events read


@dataclass
class _Totals:
    """The loop's running sums, added to event by event in trajectory order."""

    action_loss: torch.Tensor  # in the graph
    obs_loss: torch.Tensor  # in the graph
    skipped: torch.Tensor  # 0-dim int64 on the device
    num_action: int = 0
    num_obs: int = 0
    num_attempts: int = 0


@dataclass
class _Carried:
    """What one event hands the next within a trajectory."""

    weights: FastWeights  # W_r; checkpointed: the fast entries are the chain's stand-ins (event_checkpoint.py)
    chunks: list[list[LayerCache]] | None  # per layer, the earlier events' keys/values a later event may see
    key_tails: list[torch.Tensor]  # the key state of each key-state layer (shift rows, address rows)
    chain: FastWeightChain | None = None  # checkpointed: W_0 and the stored updates


def run_event_loop(suffix: SuffixModules, ttt: TTTConfig, hidden_BTC: torch.Tensor, input_ids_BT: torch.Tensor,
                   kinds_BT: torch.Tensor, rounds_BT: torch.Tensor, *, create_graph: bool, update: bool = True,
                   record: bool = False, fast_weights: FastWeights | None = None) -> EventLoopOutput:
    """Outer loss of a right-padded batch (rows are independent trajectories, each with its own W)."""
    device = hidden_BTC.device
    w_init = fast_weights if fast_weights is not None else suffix.initial_fast_weights()
    can_update = update and len(w_init) > 0 and ttt.inner_lr > 0
    fast = trainable_fast_weights(ttt.fast_matrices, len(w_init))
    w0 = w_init
    if can_update:  # fp32 copies of the fast matrices, in the graph (meta-training) or fresh leaves (inference)
        w0 = inner_loop_weights(w_init, differentiable=create_graph, trainable=fast)
    # The one host copy of the batch's metadata: every event boundary, label position and count below
    # is computed from it, so the events themselves never wait for the device.
    kinds_host_BT, rounds_host_BT = kinds_BT.cpu(), rounds_BT.cpu()
    totals = _Totals(action_loss=hidden_BTC.new_zeros((), dtype=torch.float32),
                     obs_loss=hidden_BTC.new_zeros((), dtype=torch.float32),
                     skipped=torch.zeros((), dtype=torch.int64, device=device))
    checkpointed = bool(ttt.checkpoint_events and create_graph and torch.is_grad_enabled() and not record)
    loop = _Loop(suffix=suffix, ttt=ttt, policy=ContextPolicy.from_ttt(ttt), create_graph=create_graph, record=record,
                 can_update=can_update, no_skip=torch.zeros((), dtype=torch.int64, device=device),
                 checkpointed=checkpointed,
                 params=_trainable_parameters(suffix, w_init, fast if can_update else None) if checkpointed else [])
    all_records, finals = [], []
    for b in range(hidden_BTC.shape[0]):
        n = int((kinds_host_BT[b] != TokenKind.PAD).sum())
        rounds_h = rounds_host_BT[b, :n]
        plans = _plan_events(b, kinds_host_BT[b, :n], rounds_h, record=record, with_end=ttt.obs_loss_with_end)
        labels = input_ids_BT[b, 1:n]
        carried = _Carried(weights=w0, chunks=[[] for _ in suffix.layers], key_tails=[
            layer.prime_mlp.empty_key_state(1, hidden_BTC) for layer in suffix.layers if uses_key_state(layer)],
            chain=FastWeightChain(w_init, fast if can_update else (False,) * len(w_init), ttt.inner_lr)
            if checkpointed else None)
        records = []
        for plan in plans:
            carried, rec = _run_event(loop, plan, carried, hidden_BTC[b:b + 1, plan.start:plan.end], labels,
                                      rounds_h, totals)
            if rec is not None:
                records.append(rec)
        all_records.append(records)
        if carried.chain is not None:  # the chain's W_E goes to the output only: the backward rebuilds what it needs
            final, carried.chain.current = carried.chain.current, ()
        else:
            final = carried.weights
        finals.append(tuple(w.detach() for w in final))

    loss = totals.action_loss / max(totals.num_action, 1)
    if ttt.obs_loss_weight > 0:
        loss = loss + ttt.obs_loss_weight * totals.obs_loss / max(totals.num_obs, 1)
    return EventLoopOutput(loss=loss, action_loss_sum=totals.action_loss, obs_loss_sum=totals.obs_loss,
                           num_action_tokens=totals.num_action, num_obs_tokens=totals.num_obs,
                           num_update_attempts=totals.num_attempts, skipped_count=totals.skipped,
                           records=all_records, final_weights=finals)


def _run_event(loop: _Loop, plan: _EventPlan, carried: _Carried, h_event: torch.Tensor, labels: torch.Tensor,
               rounds_h: torch.Tensor, totals: _Totals) -> tuple[_Carried, EventRecord | None]:
    """One event (steps 1-4 of the module docstring) of one trajectory: adds its losses and counts to
    `totals`; returns what the next event carries and, with `record`, this event's EventRecord."""
    suffix, ttt, policy, create_graph = loop.suffix, loop.ttt, loop.policy, loop.create_graph
    device = h_event.device
    start, end, round_id, wanted_h = plan.start, plan.end, plan.round_id, plan.wanted_h
    do_update = loop.can_update and plan.num_obs > 0
    wanted = wanted_h.to(device, non_blocking=True)
    local, tgt = (wanted_h - start).to(device, non_blocking=True), labels[wanted]
    act_mask = plan.act_mask_h.to(device, non_blocking=True)
    obs_mask = plan.obs_mask_h.to(device, non_blocking=True)
    positions = torch.arange(start, end, device=device)[None]
    # The earlier events' keys/values this event may see, per layer, as they were stored (one chunk per
    # event: nothing is re-copied per event), and of them the rows it sees: selected here, once per event
    # from host metadata (a window's partial chunk is a view), however often the event is scored.
    visible = [[c for c in chunks if policy.may_see_event(start, round_id, int(c.positions_S[-1]) + 1,
                                                          int(c.rounds_S[0]))] for chunks in carried.chunks]
    selected = [policy.select_chunks(chunks, start, round_id) for chunks in visible]

    def pairs_of(kvs) -> list[tuple[list[LayerCache], AttentionSpan]]:
        """Per layer, the selected rows with the step's own key/value tensors, and their span (EventCache
        concatenates them once, with the event's new keys and values, inside attention)."""
        out, i = [], 0
        for kept, span in selected:
            out.append(([LayerCache(kvs[i + 2 * j], kvs[i + 2 * j + 1], c.positions_S, c.rounds_S)
                         for j, c in enumerate(kept)], span))
            i += 2 * len(kept)
        return out

    def score(h, ws, kvs, tails, in_graph=act_mask | obs_mask):
        cache = EventCache(pairs_of(kvs), ttt.attention_backend)
        out = forward_chunk(suffix.layers, h, suffix.rotary_emb(h, positions), cache, fast_weights=ws, key_prev=tails)
        nll, logits = _nll(suffix, out.hidden_BTC, local, tgt, in_graph=in_graph if loop.record else None)
        # the inner loss's weights: the observation labels, each at its write rate when the model has one
        rate = out.write_rate_BT
        inner_w = obs_mask if rate is None else obs_mask * rate[0, local]
        return nll, logits, [t for _, k, v in cache.outs for t in (k, v)], out.key_last, inner_w

    def step(h, ws, kvs, tails, differentiable: bool, values: bool = True) -> StepOut:
        # The inner gradient is dL_obs/dW through this event's own forward, the earlier events' keys,
        # values and key state held fixed, as a deployed agent computes it (its cache is constants). An
        # alias of W per event makes autograd.grad count only the paths through this event even where W
        # also computed an earlier event's cache (W_0 computes round 0's); the outer loss still reaches
        # W through every path.
        ws = tuple(w.view_as(w) if w.requires_grad else w for w in ws)
        # checkpointed: the inner gradient in factors, which the chain may store instead of the matrix
        taps = FactorTaps(ws) if loop.checkpointed and do_update else None
        with taps or contextlib.nullcontext():
            nll, logits, new_kv, key_last, inner_w = score(h, ws, kvs, tails)
        act_sum, obs_sum = (nll * act_mask).sum(), (nll * obs_mask).sum()
        new_ws, skipped, updates = ws, loop.no_skip, []
        if do_update:
            inner_sum = obs_sum if inner_w is obs_mask else (nll * inner_w).sum()
            res = inner_update(inner_sum, plan.num_obs, ws, ttt, create_graph=differentiable, grad_dtype=h.dtype,
                               taps=taps, values=values or ttt.inner_steps > 1)
            updates.append(res)
            skip_any = res.skipped
            for _ in range(1, ttt.inner_steps):  # further steps re-score the observation with W'
                taps = FactorTaps(res.weights) if taps is not None else None
                with taps or contextlib.nullcontext():
                    again = score(h, res.weights, kvs, tails)
                res = inner_update((again[0] * again[4]).sum(), plan.num_obs, res.weights, ttt,
                                   create_graph=differentiable, grad_dtype=h.dtype, taps=taps,
                                   values=values or _ + 1 < ttt.inner_steps)
                updates.append(res)
                skip_any = skip_any | res.skipped
            new_ws, skipped = res.weights, skip_any.to(torch.int64)
        extra = (nll.detach(), logits.detach().argmax(-1)) if loop.record else ()
        return StepOut(weights=new_ws, updates=updates, new_kv=new_kv, key_last=key_last, act_sum=act_sum,
                       obs_sum=obs_sum, skipped=skipped, extras=extra)

    # the key history entering this event: the last event's, or none at a round boundary the
    # context policy closes (current_round: no key sees an earlier round)
    tails_in = ([torch.zeros_like(t) for t in carried.key_tails] if policy.rounds_are_segments
                else carried.key_tails)
    flat_in = [t for kept, _ in selected for c in kept for t in (c.k_1HSD, c.v_1HSD)]
    if not create_graph:
        h_event = h_event.detach()
        tails_in = [t.detach() for t in tails_in]
    chain = carried.chain
    if chain is not None:
        # one checkpointed event: nothing of its graph is kept but its inputs (event_checkpoint.py)
        fast_in = [carried.weights[i] for i in chain.fast_index]
        run = EventRun(step=step, chain=chain, index=len(chain.events), num_kv=len(flat_in), num_tails=len(tails_in),
                       params=loop.params)
        outs = EventFunction.apply(run, h_event, *fast_in, *flat_in, *tails_in, *loop.params)
        nf = len(fast_in)
        new_weights = list(chain.current)
        for i, t in zip(chain.fast_index, outs[:nf]):
            new_weights[i] = t
        new_weights = tuple(new_weights)
        nkv_new, nk = 2 * len(suffix.layers), len(tails_in)
        new_kv = outs[nf:nf + nkv_new]
        key_tails = list(outs[nf + nkv_new:nf + nkv_new + nk])
        act_sum, obs_sum, skipped_t = outs[nf + nkv_new + nk:]
    else:
        # Inference still needs a graph from W to L_obs for the inner gradient.
        with torch.enable_grad() if do_update else contextlib.nullcontext():
            out = step(h_event, carried.weights, flat_in, tails_in, create_graph)
        new_weights, new_kv, key_tails = out.weights, out.new_kv, list(out.key_last)
        act_sum, obs_sum, skipped_t = out.act_sum, out.obs_sum, out.skipped
    totals.skipped = totals.skipped + skipped_t
    rec = None
    if loop.record:  # evaluation reads values back per event; training never takes this branch
        rec = _event_record(plan, out.extras, tgt, skipped_t, do_update,
                            rescore=lambda: score(h_event, new_weights, flat_in, tails_in)[0])
    chunks = _append_event(visible, new_kv, plan, rounds_h, detach=not create_graph)
    totals.action_loss = totals.action_loss + act_sum
    totals.obs_loss = totals.obs_loss + obs_sum
    totals.num_action += int(plan.act_mask_h.sum())
    totals.num_obs += plan.num_obs
    totals.num_attempts += int(do_update)
    return _Carried(weights=new_weights, chunks=chunks, key_tails=key_tails, chain=chain), rec


def _event_record(plan: _EventPlan, extras, tgt: torch.Tensor, skipped_t: torch.Tensor, do_update: bool,
                  rescore) -> EventRecord:
    """The event's EventRecord from the step's extras (per-label NLL and argmax with the pre-update W);
    `rescore()` gives the per-label NLL with the updated W, read for the observation."""
    skipped = bool(skipped_t)
    after = None
    if do_update and not skipped:
        with torch.no_grad():
            nll_after = rescore()
            after = nll_after[(plan.kinds_h == TokenKind.OBSERVATION).to(nll_after.device)].cpu()
    return EventRecord(round=plan.round_id, label_positions=plan.wanted_h, labels=tgt.cpu(), label_kinds=plan.kinds_h,
                       token_nll=extras[0].cpu(), argmax=extras[1].cpu(), obs_nll_after=after,
                       updated=do_update and not skipped, skipped=do_update and skipped)


def _append_event(visible: list[list[LayerCache]], new_kv, plan: _EventPlan, rounds_h: torch.Tensor, *,
                  detach: bool) -> list[list[LayerCache]]:
    """Each layer's chunks for the next event (step 4): the chunks this event could see (a later event
    sees a subset of them under every policy) and this event's keys/values as one more chunk."""
    chunks = []
    for i, layer_chunks in enumerate(visible):
        k, v = new_kv[2 * i], new_kv[2 * i + 1]
        if detach:
            k, v = k.detach(), v.detach()
        chunks.append(layer_chunks + [LayerCache(k, v, torch.arange(plan.start, plan.end),
                                                 rounds_h[plan.start:plan.end])])
    return chunks


def _trainable_parameters(suffix: SuffixModules, w_init: FastWeights, fast) -> list[torch.Tensor]:
    """Every tensor an event reads that requires grad, once each (a tied LM head is the embedding): the
    modules' parameters, and a caller's W_0 of a matrix that is not fast (the step reads it as it is)."""
    seen, out = set(), []
    slow = [w for i, w in enumerate(w_init) if fast is None or not fast[i]]
    for p in [p for m in (*suffix.layers, suffix.norm, suffix.lm_head, suffix.rotary_emb) for p in m.parameters()] + slow:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
