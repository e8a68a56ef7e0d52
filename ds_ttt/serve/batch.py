"""The batched decode forward: the next-token logits of B sessions' replies in one pass over the model.

    logits_BV = batched_decode_logits(agent, decodes, stacks, pool)   # decodes: session.Decode, one token each
    python -m pytest tests/unit/test_serve_batch.py tests/unit/test_serve_pool.py      # what checks it

Each row b is one session's reply (ds_ttt/serve/session.py `Decode`): the token it chose last, its
position, its cache slot, its own KV cache, its own fast weights W_b and key-shift history. One
forward serves them all, on the model's own modules (no copy of the model):
  * embedding, q/k/v/o projections, the frozen MLPs, the norms and lm_head run once over [B, 1, C]
    (the backbone is shared, so its products are batched);
  * the prime MLP of an adaptive layer: a matrix that every row holds in the same storage (W_0 before
    a session's first update, which AgentModel.initial_weights shares; gate/up for good under
    `fast_matrices="down"`) is one batched product, as for the backbone; a matrix the rows hold apart
    is stacked per row, [B, F, D] (PrimeMLP's per-row fast weights, ds_ttt/model/fast_weights.py):
    for a bf16 model x W_0ᵀ is one batched product and the fp32 delta x (W_b − W_0)ᵀ is applied per
    row (the Punica / S-LoRA layout); for an fp32 model the product is per row (a batched matmul);
  * attention is ONE call per layer for all rows (`pooled_attention`): each row's cache is a row of the
    decode pool (ds_ttt/serve/kv_pool.py: shared per-layer [R, H, S, D] tensors; a cache is moved in
    at its first step and out when its reply is closed), every row's new key/value is written at its
    slot with one indexed write, and SDPA reads the pool's rows 0..n-1 up to the longest slice as one
    view, each row masked to its visible slice [policy.visible_from(slot), slot] (no per-step copy,
    stack or gather of anyone's cache; a padded key is masked, a hole row gets a dummy query); a step
    of a single row attends to its own slice unmasked, as the unbatched step does;
  * the key state (ttt.key_shift's history, ttt.round_address's running pool) is read per row from
    its cache and written back, as the unbatched `_forward` does, so it carries across decode steps;
  * the layers run through the model's one layer loop (ds_ttt/model/forward.py `forward_chunk`); this
    module only supplies the cache: `PooledChunk` (the pool's rows, one write and one attention call
    per layer; batched prefill, prefill.py, uses it too) or, for one row, `SessionChunk`.
Nothing here touches the inner update: observations (with their gradient step) stay per session,
run by the scheduler between decode steps. A stack is kept while the rows keep the same matrix
(W does not change during a reply), so a steady batch stacks each matrix once.

Shape letters: B rows (sessions), H heads, S key-shift width, C hidden, F prime width, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_ttt.model.forward import forward_chunk, uses_key_state
from ds_ttt.serve.session_chunk import SessionChunk
from ds_ttt.serve.kv_pool import KVPool


def storage_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys are views of the same memory with the same layout: the same matrix
    (fast weights are never written in place; an inner step makes new tensors)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class WeightStacks:
    """The fast weights of a batch, one entry per matrix of each adaptive layer: the shared [F, D]
    matrix itself when every row holds the same one, else the rows' matrices stacked, [B, F, D]. A
    stack is rebuilt only when its rows' matrices change (one per scheduler: not thread-safe)."""

    def __init__(self):
        self.keys: list = []  # per matrix: the rows' storage keys of the cached entry
        self.refs: list = []  # per matrix: the rows' tensors (kept alive, so their keys stay unique)
        self.weights: list = []

    def of(self, decodes: list) -> list:
        num = len(decodes[0].w)
        if len(self.weights) != num:
            self.keys, self.refs, self.weights = [None] * num, [None] * num, [None] * num
        for j in range(num):
            rows = [d.w[j] for d in decodes]
            keys = [storage_key(w) for w in rows]
            if keys != self.keys[j]:
                shared = all(k == keys[0] for k in keys)
                self.weights[j] = rows[0] if shared else torch.stack(rows)
                self.keys[j], self.refs[j] = keys, rows
        return self.weights


def pooled_attention(q_BHTD: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor | None,
                     span: int, length: int, mask: torch.Tensor) -> torch.Tensor:
    """One attention call for every row of a step, over the pool's rows 0..span-1 read in place.

    q_BHTD: the step's queries (row b of the batch lives in pool row rows[b]; rows None: row b is pool
    row b, span == B). The G query heads of a kv head are laid out along the query axis ([span, Hkv,
    G*T, D], the head grouping SDPA's enable_gqa uses), so no backend repeats the keys per query head.
    mask: [span, 1, T, length], boolean or additive (KVPool.visibility / slices_mask / additive).
    Returns [B, H, T, D]."""
    b, hq, t, d = q_BHTD.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    if rows is None:
        q = q_BHTD
    else:  # holes (pool rows not in this step) get a zero query; their output is dropped
        q = q_BHTD.new_zeros(span, hq, t, d)
        q[rows] = q_BHTD
    out = F.scaled_dot_product_attention(q.reshape(span, hkv, g * t, d), k_pool[:span, :, :length],
                                         v_pool[:span, :, :length], attn_mask=mask if t == 1 else mask.repeat(1, 1, g, 1))
    out = out.reshape(span, hq, t, d)
    return out if rows is None else out[rows]


class PooledChunk:
    """A chunk of several rows through a KV pool, as a cache of ds_ttt.model.forward: per layer, one
    indexed write of the real tokens' keys/values (token tok_t of batch row tok_b goes to pool row
    tok_row, slot tok_slot) and one `pooled_attention` call for every row."""

    def __init__(self, pool: KVPool, tok_b, tok_t, tok_row, tok_slot, rows, span: int, length: int, mask):
        self.pool, self.tok_b, self.tok_t, self.tok_row, self.tok_slot = pool, tok_b, tok_t, tok_row, tok_slot
        self.rows, self.span, self.length, self.mask = rows, span, length, mask

    def attend(self, layer_index: int):
        def attend(q, k, v):
            k_pool, v_pool = self.pool.k[layer_index], self.pool.v[layer_index]
            k_pool[self.tok_row, :, self.tok_slot] = k[self.tok_b, :, self.tok_t]  # [N, H, D]: one op per layer
            v_pool[self.tok_row, :, self.tok_slot] = v[self.tok_b, :, self.tok_t]
            return pooled_attention(q, k_pool, v_pool, self.rows, self.span, self.length, self.mask)
        return attend


def has_key_state(layers) -> bool:
    return any(uses_key_state(layer) for layer in layers)


def stacked_key_state(layers, prev_rows: list, like: torch.Tensor) -> list | None:
    """The key state entering a batch, per key-state layer [B, S, C], from each row's own (a list per
    layer, or None: a new segment, zeros); None when no layer has a key state."""
    key_layers = [layer for layer in layers if uses_key_state(layer)]
    if not key_layers:
        return None
    return [torch.cat([p[j] if p is not None else layer.prime_mlp.empty_key_state(1, like) for p in prev_rows], 0)
            for j, layer in enumerate(key_layers)]


def row_key_states(key_last: list, num_rows: int) -> list[list]:
    """The key state after a batch, split back per row: [[state [1, S, C] per key-state layer] per row]."""
    return [[state[r:r + 1] for state in key_last] for r in range(num_rows)]


def batched_decode_logits(agent, decodes: list, stacks: WeightStacks | None = None, pool: KVPool | None = None
                          ) -> torch.Tensor:
    """The logits [B, V] of each row's next token (call under torch.inference_mode, caches grown).
    With two rows or more every row's cache is moved into `pool` if it is not there yet (its first
    batched step; kv_pool.py), by default the pool the first row's cache is already in, else the
    agent's own. A single row attends to its own cache slice (pooled or not), unmasked."""
    m, dev = agent.model, agent.device
    b = len(decodes)
    ids = torch.tensor([[d.action[-1]] for d in decodes], device=dev)
    positions = torch.tensor([[d.pos - 1] for d in decodes], device=dev)
    slots = [d.slot - 1 for d in decodes]
    caches = [d.s.cache for d in decodes]
    los = [m.policy.visible_from(slot) for slot in slots]
    if len({id(c) for c in caches}) != b:
        raise ValueError("batched_decode_logits: two rows share one KV cache; fork the session for each reply")
    # one row: its own cache slice, unmasked (what the unbatched step does; nothing to batch, so no pool)
    alone = b == 1
    if not alone:
        pool = pool or caches[0].pool or decode_pool(agent)
        for cache in caches:
            pool.admit(cache)
        rows_list = [c.row for c in caches]
        span = pool.span
        length = max(slots) + 1
        mask = KVPool.additive(pool.visibility(rows_list, los, slots, span, length), pool.k[0].dtype)
        rows = None if rows_list == list(range(span)) else torch.tensor(rows_list, device=dev)
        write_rows = torch.tensor(rows_list, device=dev)
        write_slots = torch.tensor(slots, device=dev)
        for c, slot in zip(caches, slots):
            c.used = max(c.used, slot + 1)
    h = m.model.embed_tokens(ids)  # [B, 1, C]
    pos_emb = m.model.rotary_emb(h, positions)
    has_weights = all(len(d.w) for d in decodes)
    weights = (stacks or WeightStacks()).of(decodes) if has_weights else None
    prev_rows = [None if m.policy.segment_starts_at(slot, d.s.prompt_slots) else cache.key_history_at(slot)
                 for d, cache, slot in zip(decodes, caches, slots)] if has_key_state(m.model.layers) else []
    if alone:  # one row: its own cache slice, as the unbatched step reads it
        chunk = SessionChunk(caches[0], slots[0], 1, policy=m.policy, backend=m.ttt.attention_backend,
                             keep_graph=False, device=dev)
    else:
        every = torch.arange(b, device=dev)
        chunk = PooledChunk(pool, every, torch.zeros_like(every), write_rows, write_slots, rows, span, length, mask)
    key_prev = stacked_key_state(m.model.layers, prev_rows, h)
    out = forward_chunk(m.model.layers, h, pos_emb, chunk, fast_weights=weights, key_prev=key_prev)
    h = out.hidden_BTC
    if key_prev is not None:
        for cache, slot, state in zip(caches, slots, row_key_states(out.key_last, b)):
            cache.key_tail = (slot + 1, state)
    logits = m.lm_head(m.model.norm(h[:, -1]))
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def decode_pool(agent) -> KVPool:
    """The agent's own decode pool (made on first use), for callers that bring none (the scheduler has its own)."""
    pool = getattr(agent, "_decode_pool", None)
    if pool is None:
        pool = agent._decode_pool = KVPool.for_model(agent.model)
    return pool
