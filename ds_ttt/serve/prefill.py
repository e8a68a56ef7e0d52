"""The batched prefill: the rest of round 0 (the task, after the system block) of several new sessions in
one padded forward.

    r0s = [s.begin_reset(messages, tools=tools) for s, messages in new]    # block from the prefix cache
    batched_prefill(agent, r0s, pool)                                       # every rest, one forward
    results = [r0.session.end_reset(r0) for r0 in r0s]

Every new session runs round 0 with the same W_0 (AgentModel.initial_weights, one shared matrix per
prime weight), so the whole model, prime MLP included, runs once over [B, T, C] (T the longest rest;
shorter rows are right-padded). Each row's cache is moved into `pool` (kv_pool.py) for the forward,
so attention is ONE call per layer over the pool's rows, each query masked to its visible slice
[policy.visible_from(slot), slot]; only the real tokens' keys/values are written (one indexed write
per layer), and a padded query sees slot 0 only (finite, discarded). Afterwards each cache leaves the
pool with its slots copied back.

What stays per session (AgentSession.begin_reset): rendering, the cache's allocation and the system
block, restored from the prefix cache or prefilled alone. The block is never batched: a prefix-cache
hit must equal a miss bit for bit, which a block computed in a padded batch (another reduction order)
would not guarantee. A model with a key state (ttt.key_shift, ttt.round_address) needs the state after
each row's last real token, which right padding would shift: its rows are batched only with rows of the
same rest length (no padding at all).

Rounding: the padded batch reduces in another order than a session alone (longer key rows in the
attention kernel, a larger matrix product), so caches and logits equal the one-at-a-time prefill to
a few ulps of the model's dtype, not bit for bit (tests/unit/test_serve_prefill.py bounds it).

The forward is the model's one incremental entry, `model.step` (ds_ttt/model/qwen3.py), over a
PooledChunk (pooled_chunk.py), with no logits taken.

Shape letters: B rows (sessions), H heads, T tokens (the longest rest), S slots, C hidden.
"""

from __future__ import annotations

import torch

from ds_ttt.serve.kv_pool import KVPool
from ds_ttt.serve.pooled_chunk import PooledChunk, RowKeys


def batched_prefill(agent, r0s: list, pool: KVPool) -> None:
    """Prefill every Round0's rest into its cache (call outside or inside torch.inference_mode)."""
    todo = [r0 for r0 in r0s if r0.rest]
    if not todo:
        return
    m = agent.model
    if m.has_key_state:
        groups: dict[int, list] = {}
        for r0 in todo:
            groups.setdefault(len(r0.rest), []).append(r0)
        batches = list(groups.values())
    else:
        batches = [todo]
    with torch.inference_mode():
        for batch in batches:
            try:
                _prefill(agent, batch, pool)
            finally:
                for r0 in batch:
                    r0.cache.leave_pool()


def _prefill(agent, r0s: list, pool: KVPool) -> None:
    m, dev = agent.model, agent.device
    policy = m.policy
    weights = r0s[0].weights
    if any(r0.weights is not weights for r0 in r0s):
        raise ValueError("batched_prefill: every row must start from the same W_0 (AgentModel.initial_weights)")
    b = len(r0s)
    lengths = [len(r0.rest) for r0 in r0s]
    t_max = max(lengths)
    starts = [r0.block for r0 in r0s]  # round 0: slot = position
    for r0, t in zip(r0s, lengths):
        r0.cache.used = max(r0.cache.used, r0.block + t)
    ids = torch.zeros(b, t_max, dtype=torch.long)
    positions = torch.zeros(b, t_max, dtype=torch.long)
    for i, (r0, t) in enumerate(zip(r0s, lengths)):
        ids[i, :t] = torch.tensor(r0.rest)
        positions[i] = torch.arange(r0.block, r0.block + t_max)  # padded tokens: positions past the row's end
    for r0 in r0s:
        pool.admit(r0.cache)
    rows_list = [r0.cache.row for r0 in r0s]
    span = pool.span
    length = max(s + t for s, t in zip(starts, lengths))
    # per query: the visible slice [lo, slot]; padded queries see slot 0 only
    lo = torch.zeros(span, t_max, dtype=torch.long)
    hi = torch.zeros(span, t_max, dtype=torch.long)
    for r, s0, t in zip(rows_list, starts, lengths):
        lo[r, :t] = torch.tensor([policy.visible_from(s0 + j) for j in range(t)])
        hi[r, :t] = torch.arange(s0, s0 + t)
    mask = KVPool.additive(KVPool.slices_mask(lo, hi, length).to(dev), pool.k[0].dtype)
    rows = None if rows_list == list(range(span)) else torch.tensor(rows_list, device=dev)
    # the real tokens' (row, slot) pairs and where they sit in the padded batch
    tok_b = torch.cat([torch.full((t,), i) for i, t in enumerate(lengths)]).to(dev)
    tok_t = torch.cat([torch.arange(t) for t in lengths]).to(dev)
    tok_row = torch.tensor(rows_list, device=dev)[tok_b]
    tok_slot = torch.cat([torch.arange(s0, s0 + t) for s0, t in zip(starts, lengths)]).to(dev)
    keys = RowKeys([r0.cache for r0 in r0s], starts, [s0 + t for s0, t in zip(starts, lengths)], [None] * b,
                   policy, m.empty_key_state())  # rows of one length only when they have a key state: no padding
    chunk = PooledChunk(pool, tok_b, tok_t, tok_row, tok_slot, rows, span, length, mask, keys=keys)
    m.step(ids.to(dev), positions.to(dev), chunk, fast_weights=weights, logits_at=[])
