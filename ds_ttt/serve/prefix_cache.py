"""The system-prompt cache: the keys/values of round 0's system block, computed once and shared by every
new session that starts with the same block.

    cache = PrefixCache(max_entries=4)                    # AgentModel.prefix_cache
    n = cache.restore(ids[:b], kv, salt=owner)   # b = the system block's length: copies slots 0..b-1 (and
                                                 # the key shift's history at b) into a new session's KVCache;
                                                 # 0 on a miss
    cache.store(ids[:b], kv, salt=owner)         # after that block was prefilled into `kv` (copied)

Why it is exact: round 0 runs with W_0 in every session (fast weights change only at an observation),
and attention is causal, so the keys/values of the first b tokens depend on those tokens alone. A
session therefore prefills round 0 in two chunks, the system block (tools included) and the rest,
whether the block is cached or not (AgentSession.reset_messages): a hit copies what a miss computes,
bit for bit, and a reply never depends on which other sessions ran before it.

A fleet of harness sessions sends one system prompt and its tool schemas with every new task, so a hit
skips most of round 0's prefill (the task itself is short); `usage.prompt_tokens_details.cached_tokens`
counts those tokens. An entry is found only with the `salt` it was stored with (the server passes the
request's API key id), so one key's hits never tell it what another key's sessions were told. Entries are evicted least recently used beyond `max_entries`; `admit(nbytes)`,
when set (the server's memory budget, conversations.py), may refuse a new entry (it is then simply
recomputed next time). Thread-safe: the unbatched server resets sessions on several threads.

Shape letters: H kv heads, B block slots, D head dim, S key-shift width, C hidden.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from ds_ttt.serve.kv_cache import KVCache


@dataclass
class _Entry:
    k_1HBD: list[torch.Tensor]  # per layer
    v_1HBD: list[torch.Tensor]
    key_tail: list[torch.Tensor] | None  # the key shift's history at the block's end, per shift layer
    nbytes: int


class PrefixCache:
    def __init__(self, max_entries: int = 4):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self.admit: Callable[[int], bool] | None = None
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def restore(self, block_ids: list[int], kv: KVCache, *, salt: str | None = None) -> int:
        """Copy a cached block into slots 0..len-1 of `kv` (grown beforehand); its length, or 0 on a miss."""
        key = (salt, tuple(block_ids))
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return 0
            self._entries.move_to_end(key)
            self.hits += 1
        n = len(block_ids)
        for layer, (k, v) in enumerate(zip(entry.k_1HBD, entry.v_1HBD)):
            kv.write(layer, 0, k, v)
        if entry.key_tail is not None:
            kv.commit_keys(n, entry.key_tail)  # never written in place: shared as the cache's own are
        return n

    def store(self, block_ids: list[int], kv: KVCache, *, salt: str | None = None) -> None:
        """Keep slots 0..len-1 of `kv` (just prefilled with exactly `block_ids`) for later sessions."""
        if self.max_entries == 0:
            return
        key, n = (salt, tuple(block_ids)), len(block_ids)
        with self._lock:
            if key in self._entries:
                return
        ks = [kv.k[i][:, :, :n].clone() for i in range(len(kv.k))]
        vs = [kv.v[i][:, :, :n].clone() for i in range(len(kv.v))]
        tail = None
        if kv.key_tail is not None:
            assert kv.key_tail[0] == n, "PrefixCache.store: the key-shift history does not end at the block's end"
            tail = kv.key_tail[1]
        nbytes = sum(t.nbytes for t in ks + vs) + sum(t.nbytes for t in tail or [])
        if self.admit is not None and not self.admit(nbytes):
            return
        with self._lock:
            self._entries[key] = _Entry(ks, vs, tail, nbytes)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
