"""One serving session's chunk as a cache of ds_ttt.model.forward: where its attention reads and writes.

    chunk = SessionChunk(kv_cache, slot, num_new, policy=model.policy, backend=..., keep_graph=False)
    out = forward_chunk(model.model.layers, hidden, pos_emb, chunk, fast_weights=W, key_prev=prev)
    chunk.new_kv          # keep_graph: [(k, v) per layer] for the caller to commit

New tokens take cache slots slot..slot+n-1 (kv_cache.py lays the slots out per context policy) and see
the slots the policy makes visible from their first one (`policy.visible_from`), which are contiguous.

Default: the new keys/values are written into the cache at their slots and attention reads the
visible slice in place, on PyTorch's fused SDPA: one new token (a decode step) sees every slot of its
slice; a chunk on an empty slice (a prompt's prefill) is plain causal attention (SDPA's is_causal, O(N)
memory in its flash kernels); any other chunk (after cached keys: the rest of round 0, a generation
prompt, a turn's end; or in a window) gets FlashBoB's visibility mask as an explicit one.

keep_graph=True (the inner step): the cache is only read, its slice concatenated with the new
keys/values once per layer so that the inner gradient flows through them, attention runs the model's
FlashBoB backend, and the new keys/values are kept in `new_kv` for the caller to commit.

Shape letters: H kv heads, T new tokens, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_ttt.model.context import ContextPolicy
from ds_ttt.ops.flashbob import attention
from ds_ttt.ops.flashbob.reference import visibility_mask
from ds_ttt.serve.kv_cache import KVCache


class SessionChunk:
    def __init__(self, cache: KVCache, slot: int, num_new: int, *, policy: ContextPolicy, backend: str,
                 keep_graph: bool, device):
        self.cache, self.slot, self.num_new = cache, slot, num_new
        self.lo = policy.visible_from(slot)
        self.window = policy.attention_window
        self.backend, self.keep_graph = backend, keep_graph
        self.new_kv: list | None = [] if keep_graph else None
        self.fused, self.mask = None, None
        if not keep_graph:
            self.fused = "one" if num_new == 1 else "causal" if slot == self.lo and self.window == 0 else "mask"
            if self.fused == "mask":
                self.mask = visibility_mask(num_new, slot + num_new - self.lo, causal=True, window=self.window,
                                            q_offset=slot - self.lo, k_offset=0, device=device)

    def attend(self, layer_index: int):
        cache, lo, slot, n = self.cache, self.lo, self.slot, self.num_new

        def attend(q, k, v):
            if self.keep_graph:
                k_old, v_old = cache.view(layer_index, lo, slot)
                self.new_kv.append((k, v))
                k_all, v_all = torch.cat([k_old, k], 2), torch.cat([v_old, v], 2)
            else:
                cache.write(layer_index, slot, k, v)
                k_all, v_all = cache.view(layer_index, lo, slot + n)
            if self.fused is not None:
                return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=self.mask,
                                                      is_causal=self.fused == "causal", enable_gqa=True)
            return attention(q, k_all, v_all, causal=True, window=self.window, q_offset=slot - lo, k_offset=0,
                             backend=self.backend)
        return attend
