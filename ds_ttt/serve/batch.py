"""The batched decode forward: the next-token logits of B sessions' replies in one pass over the model.

    logits_BV = batched_decode_logits(agent, decodes, stacks, pool)   # decodes: decode.Decode, one token each
    python -m pytest tests/unit/test_serve_batch.py tests/unit/test_serve_pool.py      # what checks it

Each row b is one session's reply (ds_ttt/serve/decode.py `Decode`): the token it chose last, its
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
  * attention is ONE call per layer for all rows (pooled_chunk.py `pooled_attention`): each row's
    cache is a row of the decode pool (ds_ttt/serve/kv_pool.py: shared per-layer [R, H, S, D] tensors;
    a cache is moved in at its first step and out when its reply is closed), every row's new key/value
    is written at its slot with one indexed write, and SDPA reads the pool's rows 0..n-1 up to the
    longest slice as one view, each row masked to its visible slice [policy.visible_from(slot), slot]
    (no per-step copy, stack or gather of anyone's cache; a padded key is masked, a hole row gets a
    dummy query); a step of a single row attends to its own slice unmasked, as the unbatched step does;
  * the key state (ttt.key_shift's history, ttt.round_address's running pool) is each row's cache's
    own: read before the step and committed after it (`KVCache.key_prev` / `commit_keys`), so it
    carries across decode steps as in the unbatched step;
  * the forward is the model's one incremental entry, `model.step` (ds_ttt/model/qwen3.py); this
    module only builds its cache: a `PooledChunk` (pooled_chunk.py; the batched prefill, prefill.py,
    uses it too) or, for one row, a `SessionChunk` (session_chunk.py).
Nothing here touches the inner update: observations (with their gradient step) stay per session,
run by the scheduler between decode steps. A stack is kept while the rows keep the same matrix
(W does not change during a reply), so a steady batch stacks each matrix once.

Shape letters: B rows (sessions), H heads, S key-shift width, C hidden, F prime width, V vocab.
"""

from __future__ import annotations

import torch

from ds_ttt.serve.kv_pool import KVPool
from ds_ttt.serve.pooled_chunk import PooledChunk, RowKeys
from ds_ttt.serve.session_chunk import SessionChunk


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


def batched_decode_logits(agent, decodes: list, stacks: WeightStacks | None = None, pool: KVPool | None = None
                          ) -> torch.Tensor:
    """The logits [B, V] of each row's next token (call under torch.inference_mode, caches grown).
    With two rows or more every row's cache is moved into `pool` if it is not there yet (its first
    batched step; kv_pool.py), by default the pool the first row's cache is already in, else the
    agent's own (AgentModel.decode_pool). A single row attends to its own cache slice (pooled or not),
    unmasked."""
    m, dev = agent.model, agent.device
    policy = m.policy
    b = len(decodes)
    ids = torch.tensor([[d.action[-1]] for d in decodes], device=dev)
    positions = torch.tensor([[d.pos - 1] for d in decodes], device=dev)
    slots = [d.slot - 1 for d in decodes]
    caches = [d.state.cache for d in decodes]
    if len({id(c) for c in caches}) != b:
        raise ValueError("batched_decode_logits: two rows share one KV cache; fork the session for each reply")
    has_weights = all(len(d.w) for d in decodes)
    weights = (stacks or WeightStacks()).of(decodes) if has_weights else None
    if b == 1:  # one row: its own cache slice, unmasked (what the unbatched step does; nothing to batch, so no pool)
        chunk = SessionChunk(caches[0], slots[0], 1, policy=policy, backend=m.ttt.attention_backend,
                             keep_graph=False, device=dev, prompt_slots=decodes[0].state.prompt_slots)
        return m.step(ids, positions, chunk, fast_weights=weights)
    pool = pool or caches[0].pool or agent.decode_pool()
    for cache in caches:
        pool.admit(cache)
    rows_list = [c.row for c in caches]
    span = pool.span
    length = max(slots) + 1
    los = [policy.visible_from(slot) for slot in slots]
    mask = KVPool.additive(pool.visibility(rows_list, los, slots, span, length), pool.k[0].dtype)
    rows = None if rows_list == list(range(span)) else torch.tensor(rows_list, device=dev)
    for c, slot in zip(caches, slots):
        c.used = max(c.used, slot + 1)
    every = torch.arange(b, device=dev)
    keys = RowKeys(caches, slots, [slot + 1 for slot in slots], [d.state.prompt_slots for d in decodes], policy,
                   m.empty_key_state())
    chunk = PooledChunk(pool, every, torch.zeros_like(every), torch.tensor(rows_list, device=dev),
                        torch.tensor(slots, device=dev), rows, span, length, mask, keys=keys)
    return m.step(ids, positions, chunk, fast_weights=weights)
