"""A session's key/value cache for decoding: preallocated per-layer buffers, written in place.

    cache = KVCache.for_model(model, capacity=1024)      # grows geometrically, never per token
    cache.write(layer, slot, k_1HTD, v_1HTD)              # keys/values of new tokens at slots slot..
    k, v = cache.view(layer, lo, hi)                      # slots lo..hi-1: a view, no copy

Decoding one token appends it with one in-place copy per layer instead of re-concatenating the
whole cache (the torch.cat-per-token cost is O(S) per token, O(S^2) per reply). Capacity doubles
when full (amortized O(1) per token); the serving session decides which slot each token takes and
which slots a query may see, so the context policy needs no gather:

  full, window    slot = absolute position; a query sees slots [lo, its own slot] with lo = 0
                  (full) or the first position inside the window (window);
  current_round   slots [0, n0) hold round 0 (system prompt + task), slots from n0 on the current
                  round only: a new round overwrites the previous one, which no later query may see.

The memory key's state (ds_ttt/model/fast_weights.py: the token shift's last S prime-MLP inputs,
ttt.key_shift, and the round address's running pool, ttt.round_address) is needed before each chunk
of every adaptive layer, and the cache owns it. It keeps two such states (not one per slot): the one
ending at the last written slot (`key_tail`, continued by every decode step) and the one at the start
of the open round (`key_round`: `observe` re-runs the round from there). `key_prev(slot, policy,
prompt_slots)` is the state entering a chunk at `slot` (None, zeros, where the policy starts a
segment: slot 0, or round 0's end under current_round); `commit_keys(end, state)` stores the state
after a chunk ending at slot `end`.

Either way the visible keys are one contiguous slice, and FlashBoB's causal (and window) mask over
"cached slots ++ new slots" with compressed offsets (q_offset = slot - lo, k_offset = 0) equals the
training mask (ds_ttt/model/context.py explains why compressed indexing is exact).

While a reply is decoded by the batched scheduler, the cache is a handle onto one row of a KVPool
(kv_pool.py: `KVPool.admit` moves its written slots, 0..used-1, into the row; `leave_pool` moves them
back into private buffers and frees the row): write/view/ensure/k/v then read and write the row in
place, `capacity` stays this cache's own, and a pooled `ensure` grows the pool (doubling) instead of
private buffers. Everything else (forks, the prefix cache, memory accounting) sees private buffers.
Tests: tests/unit/test_serve.py (growth, clone), tests/unit/test_serve_pool.py (the pool).

Shape letters: L layers, H kv heads, S slots (capacity), T new tokens, D head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    """Private per-layer buffers, or (while its reply is decoded in a batch) a handle onto one row of a
    KVPool (kv_pool.py): the same write/view/ensure either way."""

    def __init__(self, k_L1HSD: list[torch.Tensor], v_L1HSD: list[torch.Tensor], max_capacity: int):
        self._k, self._v = k_L1HSD, v_L1HSD
        self.max_capacity = max_capacity
        self.pool, self.row = None, -1  # the KVPool and row it is a handle onto (None: private buffers)
        self._capacity = k_L1HSD[0].shape[2]
        self.used = 0  # slots 0..used-1 may hold something (what moving between pool and buffers copies)
        # key states: (slot they end at, [1, S, C] per key-state layer); see the module docstring
        self.key_tail: tuple[int, list[torch.Tensor]] | None = None
        self.key_round: tuple[int, list[torch.Tensor]] | None = None

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer [1, H, capacity, D]: the private buffers, or views of the pool row."""
        if self.pool is None:
            return self._k
        return [t[self.row:self.row + 1, :, :self._capacity] for t in self.pool.k]

    @property
    def v(self) -> list[torch.Tensor]:
        if self.pool is None:
            return self._v
        return [t[self.row:self.row + 1, :, :self._capacity] for t in self.pool.v]

    def bind(self, pool, row: int) -> None:
        """Become a handle onto `row` of `pool` (KVPool.admit copied the contents); the buffers are dropped."""
        self.pool, self.row = pool, row
        self._k = self._v = None

    def leave_pool(self) -> None:
        """Back to private buffers of this cache's capacity (slots 0..used-1 copied), freeing the pool row."""
        if self.pool is None:
            return
        pool, row, used = self.pool, self.row, self.used
        with torch.inference_mode(False):  # buffers usable by a later observe's autograd
            ks = [t.new_empty(1, t.shape[1], self._capacity, t.shape[3]) for t in pool.k]
            vs = [t.new_empty(1, t.shape[1], self._capacity, t.shape[3]) for t in pool.v]
        for dst, src in zip(ks + vs, pool.k + pool.v):
            dst[:, :, :used].copy_(src[row:row + 1, :, :used])
        self._k, self._v = ks, vs
        self.pool, self.row = None, -1
        pool.free(row)

    def __del__(self):
        if getattr(self, "pool", None) is not None:  # dropped while pooled (a failed reply): free the row
            self.pool.free(self.row)

    def key_prev(self, slot: int, policy, prompt_slots: int | None) -> list[torch.Tensor] | None:
        """The key state entering a chunk at `slot` under `policy` (ds_ttt/model/context.py): None (zeros)
        where a segment starts there (`policy.segment_starts_at`; prompt_slots: round 0's slots, None while
        round 0 is laid out), else the stored state ending right before it (the open round's start or the
        last write)."""
        if policy.segment_starts_at(slot, prompt_slots):
            return None
        for entry in (self.key_tail, self.key_round):
            if entry is not None and entry[0] == slot:
                return entry[1]
        raise AssertionError(f"KVCache: no key state ends at slot {slot} "
                             f"(tail at {self.key_tail and self.key_tail[0]}, round at {self.key_round and self.key_round[0]})")

    def commit_keys(self, end: int, state: list[torch.Tensor]) -> None:
        """The key state after a chunk whose last slot is end - 1 (per key-state layer [1, S, C]; never
        written in place afterwards, so forks and the prefix cache share it)."""
        self.key_tail = (end, state)

    def start_round(self) -> None:
        """The history at the last written slot becomes the open round's start (after reset / observe)."""
        self.key_round = self.key_tail

    @classmethod
    def for_model(cls, model, *, capacity: int, max_capacity: int) -> "KVCache":
        """Empty buffers for every decoder layer of a TTTQwen3ForCausalLM (its device and dtype)."""
        ks, vs = [], []
        capacity = max(1, min(capacity, max_capacity))
        for layer in model.model.layers:
            attn = layer.self_attn
            p = attn.k_proj.weight
            ks.append(p.new_empty(1, attn.config.num_key_value_heads, capacity, attn.head_dim))
            vs.append(p.new_empty(1, attn.config.num_key_value_heads, capacity, attn.head_dim))
        return cls(ks, vs, max_capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    def ensure(self, num_slots: int) -> None:
        """Make room for slots 0..num_slots-1 (doubling; existing contents are kept). A pooled cache grows
        the pool's slot capacity if it must (KVPool.reserve_slots, doubling too)."""
        if num_slots <= self.capacity:
            return
        if num_slots > self.max_capacity:
            raise ValueError(f"KV cache: {num_slots} slots exceed the capacity {self.max_capacity}")
        if torch.is_inference_mode_enabled():  # new buffers would be inference tensors, unusable by autograd
            raise RuntimeError("KVCache: grow the cache (ensure) before entering torch.inference_mode")
        new_cap = min(max(num_slots, 2 * self.capacity), self.max_capacity)
        if self.pool is not None:
            self.pool.reserve_slots(new_cap)
        else:
            for buf in (self._k, self._v):
                for i, old in enumerate(buf):
                    grown = old.new_empty(old.shape[0], old.shape[1], new_cap, old.shape[3])
                    grown[:, :, :old.shape[2]].copy_(old)
                    buf[i] = grown
        self._capacity = new_cap

    def write(self, layer: int, slot: int, k_1HTD: torch.Tensor, v_1HTD: torch.Tensor) -> None:
        t = k_1HTD.shape[2]
        if slot + t > self._capacity:
            raise ValueError(f"KVCache.write: slots {slot}..{slot + t - 1} exceed the capacity {self._capacity}; "
                             f"call ensure({slot + t}) first")
        if self.pool is None:
            self._k[layer][:, :, slot:slot + t].copy_(k_1HTD)
            self._v[layer][:, :, slot:slot + t].copy_(v_1HTD)
        else:
            self.pool.k[layer][self.row:self.row + 1, :, slot:slot + t].copy_(k_1HTD)
            self.pool.v[layer][self.row:self.row + 1, :, slot:slot + t].copy_(v_1HTD)
        self.used = max(self.used, slot + t)

    def view(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pool is None:
            return self._k[layer][:, :, lo:hi], self._v[layer][:, :, lo:hi]
        r = self.row
        return self.pool.k[layer][r:r + 1, :, lo:hi], self.pool.v[layer][r:r + 1, :, lo:hi]

    def clone(self, num_slots: int) -> "KVCache":
        """An independent (private) copy holding slots 0..num_slots-1 (for forking a session), allocated at num_slots."""
        cap = max(1, min(num_slots, self.max_capacity))  # its used length, not the capacity (grows on demand)

        def copy(t):
            out = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
            out[:, :, :num_slots].copy_(t[:, :, :num_slots])
            return out
        twin = KVCache([copy(t) for t in self.k], [copy(t) for t in self.v], self.max_capacity)
        twin.used = num_slots
        twin.key_tail, twin.key_round = self.key_tail, self.key_round  # tensors never written in place
        return twin
