"""Several sessions' tokens through a KV pool as the cache of `model.step`: one write and one attention call per layer.

    chunk = PooledChunk(pool, tok_b, tok_t, tok_row, tok_slot, rows, span, length, mask,
                        keys=RowKeys(caches, firsts, ends, prompt_slots, policy, model.empty_key_state()))
    logits_BV = model.step(ids_BT, positions_BT, chunk, fast_weights=W)
    python -m pytest tests/unit/test_serve_pool.py tests/unit/test_serve_batch.py     # what checks it

The batched decode step (batch.py) and the batched prefill (prefill.py) hand the model this cache.
Each row b of the batch is one session, whose KVCache is a row of the pool (kv_pool.py) for the call:
  * attention (`pooled_attention`) is ONE call per layer for every row, over the pool's rows
    0..span-1 read in place up to the longest visible end, each query masked to its row's visible
    slice (the mask the caller builds from `policy.visible_from`); a hole row gets a dummy query;
  * every real token's new key/value is written at its row and slot with one indexed write per layer
    (token tok_t of batch row tok_b goes to pool row tok_row, slot tok_slot; padding is never written);
  * the memory key's state is each row's own, owned by its KVCache (`RowKeys`): the state entering the
    call is stacked from the rows' (`KVCache.key_prev`; zeros where a row starts a segment) and the
    state after it is split back and committed per row (`KVCache.commit_keys`).

Shape letters: B rows (sessions), H heads, T tokens, S key-state rows, C hidden, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_ttt.model.context import ContextPolicy
from ds_ttt.serve.kv_pool import KVPool


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


@dataclass
class RowKeys:
    """The rows' key state: row b's KVCache `caches[b]`, its chunk's first slot `firsts[b]` and its end
    slot `ends[b]` (one past its last real token), round 0's slots `prompt_slots[b]` (None while round 0
    is laid out), the policy that says where segments start, and the zeros of a fresh segment (one
    [1, S, C] per key-state layer: TTTQwen3ForCausalLM.empty_key_state)."""

    caches: list
    firsts: list[int]
    ends: list[int]
    prompt_slots: list[int | None]
    policy: ContextPolicy
    empty: list[torch.Tensor]

    def stacked(self) -> list[torch.Tensor]:
        """The state entering the call, per key-state layer [B, S, C]."""
        prev = [c.key_prev(s, self.policy, p) for c, s, p in zip(self.caches, self.firsts, self.prompt_slots)]
        return [torch.cat([p[j] if p is not None else zeros for p in prev], 0) for j, zeros in enumerate(self.empty)]

    def commit(self, key_last: list[torch.Tensor]) -> None:
        """Split the state after the call back per row and commit it to each row's cache."""
        for r, (cache, end) in enumerate(zip(self.caches, self.ends)):
            cache.commit_keys(end, [state[r:r + 1] for state in key_last])


class PooledChunk:
    """A StepCache (ds_ttt/model/forward.py) over the rows of a KVPool; see the module docstring."""

    def __init__(self, pool: KVPool, tok_b, tok_t, tok_row, tok_slot, rows, span: int, length: int, mask, *,
                 keys: RowKeys):
        self.pool, self.tok_b, self.tok_t, self.tok_row, self.tok_slot = pool, tok_b, tok_t, tok_row, tok_slot
        self.rows, self.span, self.length, self.mask = rows, span, length, mask
        self.keys = keys

    def attend(self, layer_index: int):
        def attend(q, k, v):
            k_pool, v_pool = self.pool.k[layer_index], self.pool.v[layer_index]
            k_pool[self.tok_row, :, self.tok_slot] = k[self.tok_b, :, self.tok_t]  # [N, H, D]: one op per layer
            v_pool[self.tok_row, :, self.tok_slot] = v[self.tok_b, :, self.tok_t]
            return pooled_attention(q, k_pool, v_pool, self.rows, self.span, self.length, self.mask)
        return attend

    def key_prev(self) -> list[torch.Tensor]:
        return self.keys.stacked()

    def commit_keys(self, key_last: list, write_rate_BT: torch.Tensor | None) -> None:
        self.keys.commit(key_last)
