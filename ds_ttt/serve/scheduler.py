"""Where the server's model work runs: one scheduler thread that decodes every active session in one batch.

    engine = BatchScheduler(agent, max_batch=16)       # or DirectEngine(): each request on its own thread
    engine.reset(session, messages, tools=tools, cancel=cancel)    # round 0 (batched with other new sessions)
    engine.run(lambda: session.observe_messages(msgs), cancel)     # an observe / forced chunk
    engine.generate([session.begin_decode(...)], cancel)           # decode until every reply ends

ConversationStore (conversations.py) hands the engine three kinds of work for a request:
  * resets (`engine.reset`): a new session's round 0 (AgentSession.begin_reset / end_reset around the
    prefill of its task);
  * chunks: an observation with its inner step, a forced assistant turn. Each is one call on the
    session, exact and per session, as AgentSession runs it;
  * decodes (`decode.Decode`): a reply generated one token at a time.
The BatchScheduler's loop, on one thread that owns the model:
    1. prefills every new session waiting (up to max_batch): each one's system block per session
       (prefix cache, or alone), then the rests of their round 0 in ONE padded forward
       (`batched_prefill`, ds_ttt/serve/prefill.py; a single one alone, as reset_messages does),
    2. runs one waiting chunk (so a long chunk delays the decoders by one chunk, not by a whole
       request: chunks and decode steps interleave),
    3. starts the replies that arrived (their generation prompt, one chunk each),
    4. takes ONE forward for the next token of every active reply: `batched_decode_logits`
       (ds_ttt/serve/batch.py): the backbone batched over the B sessions, each session's own fast
       weights applied to its own row, attention in one call per layer over the scheduler's KV pool
       (ds_ttt/serve/kv_pool.py: each active reply's cache is a row of it until its turn closes);
then each reply chooses its token from its row (its own RNG, options, stop strings: `Decode.step`;
the rows' logsumexp and argmax come from one batched reduction, `decode.row_stats`).
A reply whose `cancel` event is set (the client went away) is dropped between steps and its request
gets `Cancelled`; nothing it did is committed (the request works on a fork).
DirectEngine is today's path (every request's thread runs the model itself, one token per forward);
`--no-batching` selects it, and the tests compare the two token for token.
Tests: python -m pytest tests/unit/test_serve_batch.py tests/unit/test_serve_pool.py tests/unit/test_serve_prefill.py
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import threading
import time
import traceback

import torch


class Cancelled(Exception):
    """The request was cancelled (its client disconnected); nothing was committed."""


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("the client disconnected")


class DirectEngine:
    """The calling thread runs the model: one forward per token of one reply (the unbatched path)."""

    batched = False

    def run(self, fn, cancel: threading.Event | None = None):
        _check(cancel)
        return fn()

    def reset(self, session, messages: list[dict], *, tools: list | None = None, cache_salt: str | None = None,
              cancel: threading.Event | None = None) -> dict:
        """A new episode's round 0 (AgentSession.reset_messages), prefilled alone."""
        return self.run(lambda: session.reset_messages(messages, tools=tools, cache_salt=cache_salt), cancel)

    def generate(self, decodes: list, cancel: threading.Event | None = None) -> None:
        with torch.inference_mode():
            for d in decodes:
                logits_V = d.first_logits()
                while d.step(logits_V):
                    _check(cancel)
                    logits_V = d.forward_next()
                d.close()

    def stop(self) -> None:
        pass


class _Reset:
    def __init__(self, session, messages: list[dict], tools, cache_salt, cancel):
        self.session, self.messages, self.tools, self.cache_salt, self.cancel = session, messages, tools, cache_salt, cancel
        self.future: concurrent.futures.Future = concurrent.futures.Future()


class _Group:
    def __init__(self, decodes: list, cancel: threading.Event | None):
        self.decodes, self.cancel = decodes, cancel
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.left = len(decodes)


class BatchScheduler:
    """One thread steps every active reply's next token in one batched forward (module docstring)."""

    batched = True

    def __init__(self, agent, *, max_batch: int = 16):
        from ds_ttt.serve.batch import WeightStacks, batched_decode_logits
        from ds_ttt.serve.kv_pool import KVPool
        from ds_ttt.serve.prefill import batched_prefill
        from ds_ttt.serve.decode import row_stats

        self.agent, self.max_batch = agent, max_batch
        self._forward = batched_decode_logits
        self._row_stats = row_stats
        self._stacks = WeightStacks()
        self.pool = KVPool.for_model(agent.model)  # the active replies' caches, one row each (kv_pool.py)
        self.prefill_pool = KVPool.for_model(agent.model)  # new sessions' caches during a batched prefill
        self._prefill = batched_prefill
        self._resets: collections.deque = collections.deque()  # _Reset: new episodes waiting for round 0
        self._cv = threading.Condition()
        self._chunks: collections.deque = collections.deque()  # (fn, future, cancel)
        self._new: collections.deque = collections.deque()  # (_Group, decode)
        self._active: list = []  # (_Group, decode, logits_V, RowStats or None)
        self._closed = False
        self.steps = 0  # batched forwards taken
        self.rows = 0  # rows over all of them (rows / steps = mean batch): tokens decoded
        self.decode_seconds = 0.0  # wall time in the batched forwards and the rows' token choices
        self.chunk_seconds = 0.0  # wall time in chunks (prefill, observe, forced turns) and reply starts/ends
        self.prefill_batches = 0  # batched prefills of two or more new sessions (batched_prefill)
        self.prefill_rows = 0  # new sessions prefilled in them
        self._thread = threading.Thread(target=self._loop, name="ds_ttt-scheduler", daemon=True)
        self._thread.start()

    # ---- called from request threads -------------------------------------------------------------
    def run(self, fn, cancel: threading.Event | None = None):
        _check(cancel)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._chunks.append((fn, fut, cancel))
            self._cv.notify()
        return fut.result()

    def reset(self, session, messages: list[dict], *, tools: list | None = None, cache_salt: str | None = None,
              cancel: threading.Event | None = None) -> dict:
        """A new episode's round 0 (AgentSession.reset_messages); the rests of round 0 of every new session
        waiting at once are prefilled in one forward (ds_ttt/serve/prefill.py)."""
        _check(cancel)
        item = _Reset(session, messages, tools, cache_salt, cancel)
        with self._cv:
            self._resets.append(item)
            self._cv.notify()
        return item.future.result()

    def generate(self, decodes: list, cancel: threading.Event | None = None) -> None:
        _check(cancel)
        group = _Group(decodes, cancel)
        with self._cv:
            self._new.extend((group, d) for d in decodes)
            self._cv.notify()
        group.future.result()

    def stop(self, timeout: float | None = 60.0) -> None:
        """End the loop after its current iteration and wait for its thread (a daemon thread left inside a
        torch op when the interpreter exits aborts the process: "terminate called without an active exception")."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stats(self) -> dict:
        """Counters since start (GET /health "scheduler"): rows (one per token fed through a batched
        forward) / decode_seconds is the decode throughput of the batch alone, without the prefill and
        observation chunks interleaved with it (a reply's first token comes from its start chunk)."""
        return {"steps": self.steps, "rows": self.rows, "mean_batch": self.rows / max(self.steps, 1),
                "decode_seconds": self.decode_seconds, "chunk_seconds": self.chunk_seconds,
                "prefill_batches": self.prefill_batches, "prefill_rows": self.prefill_rows,
                "pool": self.pool.stats()}

    # ---- the scheduler thread ----------------------------------------------------------------------
    def _fail(self, group: _Group, e: BaseException) -> None:
        if not group.future.done():
            group.future.set_exception(e)
        for d in group.decodes:  # a dropped reply gives its pool row back
            d.state.cache.leave_pool()
        self._active = [a for a in self._active if a[0] is not group]

    def _finish_row(self, group: _Group, d) -> None:
        d.close()
        group.left -= 1
        if group.left == 0 and not group.future.done():
            group.future.set_result(None)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._chunks or self._new or self._active or self._resets or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
                chunk = self._chunks.popleft() if self._chunks else None
                resets = [self._resets.popleft() for _ in range(min(self.max_batch, len(self._resets)))]
                room = self.max_batch - len(self._active)
                starting = [self._new.popleft() for _ in range(min(room, len(self._new)))]
            try:
                self._iteration(chunk, starting, resets)
            except BaseException:  # noqa: BLE001 - a bug here must not leave requests waiting forever
                traceback.print_exc(file=sys.stderr)
                e = RuntimeError("scheduler failure (see the server log)")
                for group in {id(a[0]): a[0] for a in self._active}.values():
                    self._fail(group, e)

    def _iteration(self, chunk, starting, resets=()) -> None:
        t0 = time.perf_counter()
        try:
            self._run_resets(resets)
            self._run_chunk_and_starts(chunk, starting)
        finally:
            t1 = time.perf_counter()
            self.chunk_seconds += t1 - t0
        try:
            self._decode_step()
        finally:
            self.decode_seconds += time.perf_counter() - t1

    def _run_resets(self, resets: list) -> None:
        """New episodes: each one's system block (prefix cache or alone), then every rest of round 0 in one
        batched forward; a single waiting session is prefilled alone, exactly as reset_messages does."""
        ready = []
        for item in resets:
            try:
                _check(item.cancel)
                ready.append((item, item.session.begin_reset(item.messages, tools=item.tools,
                                                             cache_salt=item.cache_salt)))
            except BaseException as e:  # noqa: BLE001 - delivered to the request
                item.future.set_exception(e)
        if not ready:
            return
        try:
            if len(ready) == 1:
                ready[0][0].session.prefill_rest(ready[0][1])
            else:
                self._prefill(self.agent, [r0 for _, r0 in ready], self.prefill_pool)
                self.prefill_batches += 1
                self.prefill_rows += len(ready)
        except BaseException as e:  # noqa: BLE001 - every session of this prefill fails alike
            for item, _ in ready:
                item.future.set_exception(e)
            return
        for item, r0 in ready:
            try:
                item.future.set_result(item.session.end_reset(r0))
            except BaseException as e:  # noqa: BLE001
                item.future.set_exception(e)

    def _run_chunk_and_starts(self, chunk, starting) -> None:
        if chunk is not None:
            fn, fut, cancel = chunk
            try:
                _check(cancel)
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the request
                fut.set_exception(e)
        with torch.inference_mode():
            for group, d in starting:
                if group.future.done():
                    continue
                try:
                    _check(group.cancel)
                    self._active.append((group, d, d.first_logits(), None))
                except BaseException as e:  # noqa: BLE001
                    self._fail(group, e)

    def _decode_step(self) -> None:
        if not self._active:
            return
        with torch.inference_mode():
            # choose every row's next token from its logits; the rows that continue take one forward
            stepping = []
            for group, d, logits_V, stats in self._active:
                if group.future.done():
                    continue
                try:
                    _check(group.cancel)
                    if d.step(logits_V, stats):
                        stepping.append((group, d))
                    else:
                        t = time.perf_counter()
                        self._finish_row(group, d)  # the turn's end into the cache: a chunk, not a decode
                        dt = time.perf_counter() - t
                        self.chunk_seconds += dt
                        self.decode_seconds -= dt
                except BaseException as e:  # noqa: BLE001
                    self._fail(group, e)
            stepping = [(g, d) for g, d in stepping if not g.future.done()]
            self._active = []
            if not stepping:
                return
            try:
                logits = self._forward(self.agent, [d for _, d in stepping], self._stacks, self.pool)
            except BaseException as e:  # noqa: BLE001 - every row of this step fails alike
                for g, _ in stepping:
                    self._fail(g, e)
                return
            self.steps += 1
            self.rows += len(stepping)
            stats = self._row_stats(logits)  # every row's logsumexp / argmax in one batched op (Decode.step)
            self._active = [(g, d, logits[b], stats[b]) for b, (g, d) in enumerate(stepping)]
