"""One serving session's chunk as the cache of `model.step`: where its attention reads and writes, and its key state.

    logits, chunk = run_chunk(model, token_ids, start, slot, kv_cache, W, want, prompt_slots=n0)
    chunk.new_kv, chunk.key_last, chunk.write_rate_BT   # keep_graph: for the caller to commit

`run_chunk` is what a session does to run tokens: build a SessionChunk and call the model's one
incremental entry, `TTTQwen3ForCausalLM.step` (ds_ttt/model/qwen3.py). New tokens (positions start..)
take cache slots slot..slot+n-1 (kv_cache.py lays the slots out per context policy) and see the slots
the policy makes visible from their first one (`policy.visible_from`), which are contiguous. The key
state entering the chunk is the cache's (`KVCache.key_prev`); `prompt_slots` (round 0's slots, None
while round 0 itself is laid out) tells it where the current_round policy starts a new segment.

Default: the new keys/values are written into the cache at their slots and attention reads the
visible slice in place, on PyTorch's fused SDPA: one new token (a decode step) sees every slot of its
slice; a chunk on an empty slice (a prompt's prefill) is plain causal attention (SDPA's is_causal, O(N)
memory in its flash kernels); any other chunk (after cached keys: the rest of round 0, a generation
prompt, a turn's end; or in a window) gets FlashBoB's visibility mask as an explicit one. The key state
after the chunk goes into the cache (`KVCache.commit_keys`).

keep_graph=True (the inner step): the cache is only read, its slice concatenated with the new
keys/values once per layer so that the inner gradient flows through them, attention runs the model's
FlashBoB backend, and the new keys/values and the key state after the chunk are kept on the chunk
(`new_kv`, `key_last`) for the caller to commit; the cache is not changed.

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
    """A StepCache (ds_ttt/model/forward.py) over one session's KVCache; see the module docstring."""

    def __init__(self, cache: KVCache, slot: int, num_new: int, *, policy: ContextPolicy, backend: str,
                 keep_graph: bool, device, prompt_slots: int | None = None):
        self.cache, self.slot, self.num_new = cache, slot, num_new
        self.policy, self.prompt_slots = policy, prompt_slots
        self.lo = policy.visible_from(slot)
        self.window = policy.attention_window
        self.backend, self.keep_graph = backend, keep_graph
        self.new_kv: list | None = [] if keep_graph else None
        self.key_last: list | None = None  # keep_graph: the key state after the chunk (detached), uncommitted
        self.write_rate_BT: torch.Tensor | None = None  # the write rate per token (a model with one)
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

    def key_prev(self) -> list | None:
        return self.cache.key_prev(self.slot, self.policy, self.prompt_slots)

    def commit_keys(self, key_last: list, write_rate_BT: torch.Tensor | None) -> None:
        self.write_rate_BT = write_rate_BT
        if self.keep_graph:
            self.key_last = [t.detach() for t in key_last]
        else:
            self.cache.commit_keys(self.slot + self.num_new, key_last)


def run_chunk(model, token_ids: list[int], start: int, slot: int, cache: KVCache, weights, want: list[int], *,
              keep_graph: bool = False, prompt_slots: int | None = None) -> tuple[torch.Tensor, SessionChunk]:
    """Run `token_ids` (positions start.., cache slots slot..) of one session through `model.step` with
    fast weights `weights`; the cache is grown first if it must be (outside inference_mode). Returns the
    float logits [len(want), V] at chunk indices `want`, and the chunk (its new keys/values, key state and
    write rate under keep_graph)."""
    device = model.model.embed_tokens.weight.device
    n = len(token_ids)
    cache.ensure(slot + n)
    chunk = SessionChunk(cache, slot, n, policy=model.policy, backend=model.ttt.attention_backend,
                         keep_graph=keep_graph, device=device, prompt_slots=prompt_slots)
    ids = torch.tensor([token_ids], device=device)
    positions = torch.arange(start, start + n, device=device)[None]
    return model.step(ids, positions, chunk, fast_weights=weights, logits_at=want), chunk
