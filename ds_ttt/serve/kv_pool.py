"""The decode pool: the KV caches of the replies being decoded together, as rows of shared per-layer tensors.

    pool = KVPool.for_model(model)                   # empty; the BatchScheduler owns one
    pool.admit(cache)                                # a session's KVCache becomes a handle onto a free row
    k, v = pool.k[layer], pool.v[layer]              # [R, H, S, D]: every row, one tensor per layer
    mask = pool.visibility(rows, los, slots)         # [n, 1, 1, S]: each row's visible slice [lo, slot]
    cache.leave_pool()                               # the reply ended: the row's slots copied back, row freed

Why rows of one tensor: a batched decode step (ds_ttt/serve/batch.py) attends for every row in ONE
call per layer, over the view `pool.k[layer][:n, :, :S]` (n = the highest row in use + 1, S = the
longest row's visible end): no per-step copy or stack of anyone's cache. A row's visible slice is one
contiguous range [lo, slot] of its own slots (kv_cache.py: the slot layout makes every context policy
a contiguous slice), so a boolean mask per row over the padded length is exact; the masked-out slots
add exp(-inf) = 0. Rows not in the step (a hole left by a finished reply) get a zero query that sees
slot 0 only, so they stay finite and are discarded. The pool is zero-filled (never uninitialized),
so a masked slot never multiplies garbage (0 * NaN would poison a real row).

Memory: while rows are in use the pool holds rows x its slot capacity (every row padded to the
longest reply's need); when the last row is given back the pool drops its tensors (the next admit
regrows), so an idle server holds no pool memory. Lifetime: a cache joins when its reply's first batched step comes (one copy of its written slots,
O(S) per reply, not per step) and leaves when the reply is closed (one copy back into a private
buffer of its own capacity), so idle sessions hold no pool memory and forks, the prefix cache and the
server's memory accounting see ordinary private caches. Growth is geometric and amortized: a row
that needs more slots than the pool has doubles the pool's slot capacity, more rows than it has
double its row count (each a reallocation and one copy of the contents); a freed row is reused, the
lowest first, so a steady batch keeps its rows packed at 0..n-1.

Not thread-safe beyond admit/free (one scheduler thread decodes; a handle dropped on another
thread only frees its row).

Shape letters: R rows, H kv heads, S slots, D head dim, L layers.
"""

from __future__ import annotations

import heapq
import threading
import weakref

import torch


class KVPool:
    def __init__(self, k_RHSD: list[torch.Tensor], v_RHSD: list[torch.Tensor], max_capacity: int):
        self.k, self.v = k_RHSD, v_RHSD
        self.max_capacity = max_capacity
        self.owner: list = [None] * self.rows  # per row: a weak reference to the KVCache holding it (None: free)
        self._free = list(range(self.rows))  # a heap: the lowest free row first
        self._lock = threading.RLock()
        self._busy = False
        self.admitted = 0  # caches that joined (counters for GET /health and the benchmark)
        self.grows = 0  # reallocations (rows or slots)

    @classmethod
    def for_model(cls, model, *, rows: int = 1, capacity: int = 1, max_capacity: int | None = None) -> "KVPool":
        """A zero-filled pool for every decoder layer of a TTTQwen3ForCausalLM (its device and dtype)."""
        max_capacity = max_capacity or model.config.max_position_embeddings
        ks, vs = [], []
        with torch.inference_mode(False):  # usable outside inference_mode later (observe's autograd)
            for layer in model.model.layers:
                attn = layer.self_attn
                p = attn.k_proj.weight
                shape = (max(1, rows), attn.config.num_key_value_heads, max(1, capacity), attn.head_dim)
                ks.append(p.new_zeros(shape))
                vs.append(p.new_zeros(shape))
        return cls(ks, vs, max_capacity)

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def rows_in_use(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def span(self) -> int:
        """Rows 0..span-1 hold every row in use (what a batched step reads)."""
        used = [r for r, o in enumerate(self.owner) if o is not None]
        return used[-1] + 1 if used else 0

    def stats(self) -> dict:
        return {"rows": self.rows, "rows_in_use": self.rows_in_use, "capacity": self.capacity,
                "admitted": self.admitted, "grows": self.grows}

    # ---- rows ----------------------------------------------------------------------------------------
    def admit(self, cache) -> int:
        """Move `cache` (a private KVCache) into a free row: its written slots are copied once, and from
        now on its write/view/ensure read and write the row in place. Returns the row."""
        if cache.pool is self:
            return cache.row
        if cache.pool is not None:
            raise ValueError("KVPool.admit: the cache already belongs to another pool; call cache.leave_pool() first")
        if len(cache.k) != len(self.k) or cache.k[0].shape[1] != self.k[0].shape[1] \
                or cache.k[0].shape[3] != self.k[0].shape[3] or cache.k[0].dtype != self.k[0].dtype:
            raise ValueError(f"KVPool.admit: the cache's layers/heads/head dim/dtype "
                             f"({len(cache.k)}, {tuple(cache.k[0].shape)}, {cache.k[0].dtype}) do not match the pool's "
                             f"({len(self.k)}, {tuple(self.k[0].shape)}, {self.k[0].dtype}); build both for the same model")
        with self._lock:
            self._busy = True  # a cache collected meanwhile on this thread (KVCache.__del__) must not shrink it
            try:
                return self._admit(cache)
            finally:
                self._busy = False

    def _admit(self, cache) -> int:
        """admit's work, with the lock held: room (slots, then a row), the copy, the binding."""
        self.reserve_slots(cache.capacity)
        if not self._free:
            self._grow(rows=2 * self.rows)
        row = heapq.heappop(self._free)
        self.owner[row] = weakref.ref(cache)  # weak: a dropped cache frees its row (KVCache.__del__)
        used = cache.used
        for layer in range(len(self.k)):
            self.k[layer][row:row + 1, :, :used].copy_(cache.k[layer][:, :, :used])
            self.v[layer][row:row + 1, :, :used].copy_(cache.v[layer][:, :, :used])
        cache.bind(self, row)
        self.admitted += 1
        return row

    def free(self, row: int) -> None:
        """Give a row back (its contents stay until reused: finite, so a hole never produces NaN). The last
        row given back releases the pool's memory (one row of one slot is kept; the next admit regrows)."""
        with self._lock:
            if row < len(self.owner) and self.owner[row] is not None:
                self.owner[row] = None
                heapq.heappush(self._free, row)
                if not self._busy and not any(o is not None for o in self.owner):
                    self._shrink()

    def _shrink(self) -> None:
        with torch.inference_mode(False):
            for buf in (self.k, self.v):
                for i, old in enumerate(buf):
                    buf[i] = old.new_zeros(1, old.shape[1], 1, old.shape[3])
        self.owner, self._free = [None], [0]

    def reserve_slots(self, num_slots: int) -> None:
        """Make every row hold at least `num_slots` slots (doubling; contents kept)."""
        if num_slots <= self.capacity:
            return
        if num_slots > self.max_capacity:
            raise ValueError(f"KV pool: {num_slots} slots exceed the capacity {self.max_capacity}")
        with self._lock:
            if num_slots > self.capacity:
                self._grow(capacity=min(max(num_slots, 2 * self.capacity), self.max_capacity))

    def _grow(self, *, rows: int | None = None, capacity: int | None = None) -> None:
        """Reallocate every layer (called with the lock held); handles read the new tensors by row."""
        old_rows, old_cap = self.rows, self.capacity
        rows, capacity = rows or old_rows, capacity or old_cap
        with torch.inference_mode(False):
            for buf in (self.k, self.v):
                for i, old in enumerate(buf):
                    grown = old.new_zeros(rows, old.shape[1], capacity, old.shape[3])
                    grown[:old_rows, :, :old_cap].copy_(old)
                    buf[i] = grown
        for r in range(old_rows, rows):
            self.owner.append(None)
            heapq.heappush(self._free, r)
        self.grows += 1

    # ---- what a batched step reads -------------------------------------------------------------------
    def visibility(self, rows: list[int], los: list[int], slots: list[int], span: int, length: int) -> torch.Tensor:
        """Boolean [span, 1, 1, length] for a decode step: row rows[b] sees its slots los[b]..slots[b]; a row of
        0..span-1 not in `rows` sees slot 0 only (a finite dummy). On the pool's device."""
        lo = torch.zeros(span, 1, dtype=torch.long)
        hi = torch.zeros(span, 1, dtype=torch.long)
        idx = torch.tensor(rows, dtype=torch.long)
        lo[idx, 0] = torch.tensor(los, dtype=torch.long)
        hi[idx, 0] = torch.tensor(slots, dtype=torch.long)
        return self.slices_mask(lo, hi, length).to(self.k[0].device, non_blocking=True)

    @staticmethod
    def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A boolean visibility mask as SDPA's additive one (0 where visible, -inf elsewhere), made once per
        step instead of once per layer inside the kernel."""
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

    @staticmethod
    def slices_mask(lo_RT: torch.Tensor, hi_RT: torch.Tensor, length: int) -> torch.Tensor:
        """Boolean [R, 1, T, length]: query t of row r sees slots lo[r, t]..hi[r, t] (one contiguous slice)."""
        s = torch.arange(length)
        return ((s >= lo_RT[..., None]) & (s <= hi_RT[..., None]))[:, None]
