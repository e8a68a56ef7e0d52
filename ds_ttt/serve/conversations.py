"""The OpenAI-compatible server's conversations: each one is a TTT session (AgentSession) with its own W.

    store = ConversationStore(agent, max_sessions=64, memory_budget=8 << 30, engine=BatchScheduler(agent))
    result = store.chat(parse_chat_request(body, served_model=name), owner=key_id)   # thread-safe; raises APIError

Finding the session of a request (only among the conversations of the request's API key, `owner`):
  * `session_id` in the body names it (404 if unknown, evicted, expired or another key's);
  * otherwise the stored conversation (same `ttt` mode, same tools) whose messages are the longest
    prefix of the request's messages is *copied*: the request continues a fork of it as a new
    conversation (copy-on-write); the stored one is never mutated, replaced or evicted by it;
  * a named conversation whose history is not a prefix of the request (the client edited or
    regenerated a turn) is left unchanged, and the request starts a new conversation, as does a
    request that matches none.
When a message matches a stored one is conversation_match.py's rule.

Advancing a session: the request's messages after the matched prefix are fed as the session would
have seen them: each run of tool results / user turns after an assistant turn is one observation
(`AgentSession.observe_messages`: one inner update, exactly the training event), an assistant turn the
client supplies is fed as given (`act(force=...)`), then the next assistant turn is generated (n > 1:
each choice a fork; choice 0 continues the conversation, every other choice is a new conversation).
A new conversation replays the whole request from its round-0 messages, which reproduces the fast
weights a live session would have (same tokens, same updates). The model work runs on the `engine`
(ds_ttt/serve/scheduler.py: the batched scheduler, or the direct one-request-at-a-time path).

Isolation and bounds:
  * each conversation has a lock, held for the whole request, so concurrent requests to one
    conversation run one after the other (waiting longer than `busy_timeout`: 409). The request works
    on a fork that replaces the stored session only when everything succeeded (a failed, cancelled or
    disconnected request commits nothing);
  * at most `max_active` requests are served at once, `max_queue` more wait; beyond that a 429 with
    `retry_after` seconds;
  * `memory_budget` bytes bound the KV caches + fast weights of every stored conversation *and* of
    every one being built (each request reserves an upper bound of what it will hold before it
    starts), plus what all sessions share: W_0's fp32 copies (a session counts only the matrices its
    updates made its own) and the system-prompt cache (its entries are kept only while they fit); to
    make room the least recently used idle conversation is evicted, and when nothing idle is left, a 429;
  * new conversations take round 0's system block (system prompt + tool schemas) from a cache of the
    last `prefix_cache_entries` blocks seen with the same API key (ds_ttt/serve/prefix_cache.py; exact:
    a hit equals a miss bit for bit), reported as `cached_tokens`;
  * beyond `max_sessions` the least recently used idle conversation is evicted (all busy: 429);
  * conversations idle longer than `idle_timeout` seconds are dropped (`expire`, also a reaper thread);
  * a request without `seed` samples from a fresh random seed (a new conversation, a copy, each of n
    choices); with one, choice i uses seed + i.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ds_ttt.serve.conversation_match import matched_prefix
from ds_ttt.serve.openai_api import APIError, ChatRequest, bad
from ds_ttt.serve.prefix_cache import PrefixCache
from ds_ttt.serve.scheduler import Cancelled, DirectEngine
from ds_ttt.serve.session import AgentModel, AgentSession, ContextFullError, DecodeOptions, SessionError


@dataclass
class Conversation:
    id: str
    session: AgentSession
    ttt: bool
    owner: str | None
    lock: threading.Lock
    last_used: float
    nbytes: int


@dataclass
class ChatResult:
    conversation_id: str
    choices: list[dict]  # {"message", "truncated", "completion_tokens", "ttt", "logprobs"}
    prompt_tokens: int
    cached_tokens: int
    ttt: dict

    @property
    def message(self) -> dict:
        return self.choices[0]["message"]

    @property
    def truncated(self) -> bool:
        return self.choices[0]["truncated"]

    @property
    def completion_tokens(self) -> int:
        return sum(c["completion_tokens"] for c in self.choices)


def session_bytes(session: AgentSession) -> int:
    """What a stored session holds: its KV cache buffers (at their capacity) and the fast weights it owns
    (a matrix still in W_0's shared storage, AgentModel.initial_weights, is counted once, by the store)."""
    cache = session.kv_cache
    shared = {w.data_ptr() for w in session.agent.initial_weights()}
    own = sum(w.nbytes for w in session.fast_weights if w.data_ptr() not in shared)
    return sum(t.nbytes for t in cache.k) + sum(t.nbytes for t in cache.v) + own


class ConversationStore:
    def __init__(self, agent: AgentModel, *, max_sessions: int = 64, busy_timeout: float = 60.0,
                 max_new_tokens: int = 1024, max_context: int | None = None, memory_budget: int | None = None,
                 idle_timeout: float | None = None, max_active: int = 16, max_queue: int = 64,
                 retry_after: float = 1.0, engine=None, prefix_cache_entries: int = 4):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_active < 1 or max_queue < 0:
            raise ValueError(f"max_active must be >= 1 and max_queue >= 0, got {max_active}, {max_queue}")
        model_len = agent.model.config.max_position_embeddings
        if max_context is not None and not 1 <= max_context <= model_len:
            raise ValueError(f"max_context (--max-model-len) must be in [1, {model_len}] (the model's "
                             f"max_position_embeddings), got {max_context}")
        self.agent = agent
        self.max_sessions = max_sessions
        self.busy_timeout = busy_timeout
        self.max_new_tokens = max_new_tokens
        self.max_context = max_context or model_len
        self.max_active, self.max_queue, self.retry_after = max_active, max_queue, retry_after
        self.idle_timeout = idle_timeout
        self.engine = engine or DirectEngine()
        cfg = agent.model.config
        p = next(agent.model.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # K and V of every layer, per cache slot
        self.slot_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * p.element_size()
        self.weight_bytes = sum(w.numel() * max(w.element_size(), 4) for w in agent.model.initial_fast_weights())
        one = 2 * self.weight_bytes + self.slot_bytes * self.max_context  # + W_0's shared copies
        if memory_budget is not None and memory_budget < one:
            raise ValueError(f"memory_budget (--memory-budget) of {memory_budget} bytes cannot hold one session at the "
                             f"full context ({self.max_context} tokens: {one} bytes); raise it or lower --max-model-len")
        self.memory_budget = memory_budget
        # held once, whatever the number of sessions: W_0's shared copies and the system-prompt cache
        self.shared_bytes = sum(w.nbytes for w in agent.initial_weights())
        self.prefix_cache = PrefixCache(max_entries=prefix_cache_entries)
        self.prefix_cache.admit = self._admit_prefix
        self._convs: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._reserved = 0  # bytes reserved by requests building sessions
        self._active = self._waiting = 0
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- lookup --------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._convs)

    def memory(self) -> dict:
        with self._lock:
            return {"held_bytes": self._held(), "reserved_bytes": self._reserved, "budget_bytes": self.memory_budget,
                    "prefix_cache_bytes": self.prefix_cache.nbytes, "prefix_cache_entries": len(self.prefix_cache),
                    "active": self._active, "waiting": self._waiting}

    def _held(self) -> int:
        """Bytes held now (call with self._lock): stored sessions, W_0's shared copies, the prompt cache."""
        return sum(c.nbytes for c in self._convs.values()) + self.shared_bytes + self.prefix_cache.nbytes

    def _admit_prefix(self, nbytes: int) -> bool:
        """May the system-prompt cache keep an entry of `nbytes`? Only within the budget, evicting nothing."""
        if self.memory_budget is None:
            return True
        with self._lock:
            return self._held() + self._reserved + nbytes <= self.memory_budget

    def get(self, conversation_id: str, owner: str | None = None) -> Conversation:
        with self._lock:
            conv = self._convs.get(conversation_id)
        if conv is None or conv.owner != owner:  # another key's session is as unknown as a missing one
            raise APIError(404, f"no session {conversation_id!r} (unknown, closed, evicted or expired; resend the "
                           "conversation without session_id to start a new one)", param="session_id",
                           code="session_not_found")
        return conv

    def close(self, conversation_id: str, owner: str | None = None) -> None:
        conv = self.get(conversation_id, owner)
        if not conv.lock.acquire(timeout=self.busy_timeout):
            raise APIError(409, f"session {conversation_id!r} is busy", type="conflict", code="session_busy")
        try:
            with self._lock:
                if self._convs.get(conversation_id) is conv:
                    del self._convs[conversation_id]
                self._room.notify_all()
        finally:
            conv.lock.release()

    def expire(self, now: float | None = None) -> list[str]:
        """Drop the idle conversations unused for longer than idle_timeout; returns their ids."""
        if self.idle_timeout is None:
            return []
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for conv in list(self._convs.values()):
                if now - conv.last_used > self.idle_timeout and conv.lock.acquire(blocking=False):
                    del self._convs[conv.id]
                    conv.lock.release()
                    gone.append(conv.id)
            if gone:
                self._room.notify_all()
        return gone

    def start_reaper(self, period: float | None = None) -> None:
        """A daemon thread calling `expire` every `period` seconds (default idle_timeout / 4)."""
        if self.idle_timeout is None or self._reaper is not None:
            return
        period = period or max(1.0, self.idle_timeout / 4)

        def loop():
            while not self._stop.wait(period):
                self.expire()
        self._reaper = threading.Thread(target=loop, name="ds_ttt-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()

    def _candidate(self, req: ChatRequest, owner: str | None) -> tuple[Conversation | None, bool]:
        """(conversation, named): the named one, else the longest stored prefix of this owner."""
        if req.session_id is not None:
            conv = self.get(req.session_id, owner)
            if conv.ttt != req.ttt:
                raise bad(f"session {req.session_id!r} is a {'ttt' if conv.ttt else 'frozen'} session; "
                          f"\"ttt\": {str(req.ttt).lower()} needs a conversation of its own (send it without session_id)",
                          "ttt")
            return conv, True
        with self._lock:
            convs = [c for c in self._convs.values() if c.owner == owner and c.ttt == req.ttt]
        best, best_len = None, 0  # an empty match is no reuse
        for conv in reversed(convs):  # most recently used first: it wins ties
            k = matched_prefix(conv.session, req.messages, req.tools)
            if k > best_len:
                best, best_len = conv, k
        return best, False

    # ---- admission -----------------------------------------------------------------------------
    def _too_many(self, what: str, code: str) -> APIError:
        e = APIError(429, f"{what}; retry after {self.retry_after:g} s", type="rate_limit_error", code=code)
        e.retry_after = self.retry_after
        return e

    def _admit(self) -> None:
        with self._lock:
            if self._active >= self.max_active:
                if self._waiting >= self.max_queue:
                    raise self._too_many(f"the server is busy ({self._active} requests running, {self._waiting} "
                                         "queued: --max-active / --max-queue)", "queue_full")
                self._waiting += 1
                try:
                    deadline = time.monotonic() + self.busy_timeout
                    while self._active >= self.max_active:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise self._too_many(f"waited {self.busy_timeout:g} s in the queue", "queue_timeout")
                        self._room.wait(left)
                finally:
                    self._waiting -= 1
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._room.notify_all()

    def estimate_bytes(self, req: ChatRequest, base: AgentSession | None) -> int:
        """An upper bound of what the sessions of this request will hold (each of its n choices):
        a token is at least one character, plus a few rendered tokens per message; the KV cache grows
        by doubling (ds_ttt/serve/kv_cache.py), so twice the slots, never beyond the context."""
        chars = sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or []))
                    + len(m.get("reasoning_content") or "") + 16 for m in req.messages)
        chars += len(json.dumps(req.tools or [])) + 2048  # the tool schema preamble, the system prompt's frame
        tokens = chars + (req.max_tokens or self.max_new_tokens) + 64
        tokens = max(tokens, len(base.input_ids) + (req.max_tokens or self.max_new_tokens) + 64) if base else tokens
        slots = min(self.max_context, max(2 * tokens, tokens + 2 * min(self.max_new_tokens, 1024) + 64))
        return req.n * (self.weight_bytes + self.slot_bytes * slots)

    def _reserve(self, need: int, keep: set[str]) -> None:
        """Reserve `need` bytes of the memory budget, evicting idle conversations (not in `keep`),
        least recently used first; 429 when that is not enough."""
        if self.memory_budget is None:
            with self._lock:
                self._reserved += need
            return
        with self._lock:
            while self._held() + self._reserved + need > self.memory_budget:
                victim = next((c for c in self._convs.values() if c.id not in keep and c.lock.acquire(blocking=False)),
                              None)
                if victim is None:
                    raise self._too_many(f"the memory budget ({self.memory_budget} bytes, --memory-budget) is held by "
                                         "busy sessions", "memory_exhausted")
                del self._convs[victim.id]
                victim.lock.release()
            self._reserved += need

    def _release(self, need: int) -> None:
        with self._lock:
            self._reserved -= need

    # ---- one request ---------------------------------------------------------------------------
    def chat(self, req: ChatRequest, on_token=None, *, owner: str | None = None,
             cancel: threading.Event | None = None) -> ChatResult:
        """Serve one request (see the module docstring); `on_token` gets each generated token id of the
        reply as it is chosen (streaming, n = 1); `cancel` set: stop, commit nothing (Cancelled)."""
        self.expire()
        self._admit()
        try:
            return self._chat(req, on_token, owner, cancel)
        finally:
            self._leave()

    def _chat(self, req: ChatRequest, on_token, owner, cancel) -> ChatResult:
        conv, named = self._candidate(req, owner)
        if conv is not None and named:
            if not conv.lock.acquire(timeout=self.busy_timeout):
                raise APIError(409, f"session {conv.id!r} is busy with another request (waited {self.busy_timeout:g} s)",
                               type="conflict", code="session_busy")
            try:
                with self._lock:
                    alive = self._convs.get(conv.id) is conv
                k = matched_prefix(conv.session, req.messages, req.tools) if alive else -1
                if k >= 0:
                    need = self.estimate_bytes(req, conv.session)
                    self._reserve(need, keep={conv.id})
                    try:
                        work = conv.session.fork()  # commit: the fork replaces the session only on success
                        result = self._advance(work, req.messages[k:], req, on_token=on_token, cancel=cancel,
                                               reseed=False)
                        conv.session = work
                        with self._lock:
                            conv.nbytes, conv.last_used = session_bytes(work), time.monotonic()
                            if conv.id in self._convs:
                                self._convs.move_to_end(conv.id)
                        extra = self._insert_choices(result, req, owner)
                    finally:
                        self._release(need)
                    return self._result(conv, result, extra, req)
            finally:
                conv.lock.release()
        elif conv is not None:
            # copy-on-write: a committed session is never modified (a request replaces it by its fork), so
            # it is copied without its lock, and the stored conversation is neither waited for nor touched
            base = conv.session
            k = matched_prefix(base, req.messages, req.tools)
            need = self.estimate_bytes(req, base)
            self._reserve(need, keep={conv.id})
            try:
                work = base.fork()
                result = self._advance(work, req.messages[k:], req, on_token=on_token, cancel=cancel, reseed=True)
                new = self._insert(work, req.ttt, owner)
                extra = self._insert_choices(result, req, owner)
            finally:
                self._release(need)
            return self._result(new, result, extra, req)
        need = self.estimate_bytes(req, None)
        self._reserve(need, keep=set())
        try:
            self._check_room()
            work = self._new_session(req)
            result = self._advance(work, req.messages, req, fresh=True, on_token=on_token, cancel=cancel, reseed=False,
                                   owner=owner)
            new = self._insert(work, req.ttt, owner)
            extra = self._insert_choices(result, req, owner)
        finally:
            self._release(need)
        return self._result(new, result, extra, req)

    def _new_session(self, req: ChatRequest) -> AgentSession:
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        return AgentSession(self.agent, max_new_tokens=self.max_new_tokens, max_context=self.max_context,
                            update=req.ttt, seed=seed, prefix_cache=self.prefix_cache)

    def decode_options(self, req: ChatRequest) -> DecodeOptions:
        tok = self.agent.tokenizer
        ban, force, end = (), (), ()
        if req.tool_choice == "none":
            ban = (tok.convert_tokens_to_ids("<tool_call>"),)
        elif req.tool_choice == "required":
            force = tuple(tok.encode('\n\n<tool_call>\n{"name":', add_special_tokens=False))
        elif req.tool_choice == "function":
            force = tuple(tok.encode('\n\n<tool_call>\n{"name": "' + req.tool_name + '", "arguments":',
                                     add_special_tokens=False))
        if not req.parallel_tool_calls:
            end = (tok.convert_tokens_to_ids("</tool_call>"),)
        return DecodeOptions(temperature=req.temperature, top_p=req.top_p, stop=req.stop, ban_ids=ban,
                             force_after_think=force, end_ids=end, logprobs=req.logprobs,
                             top_logprobs=req.top_logprobs)

    def _advance(self, work: AgentSession, rest: list[dict], req: ChatRequest, *, fresh: bool = False,
                 on_token=None, cancel=None, reseed: bool, owner: str | None = None) -> dict:
        """Feed `rest` (after the matched prefix; with `fresh`, the whole conversation, its round-0
        messages starting the episode, its system block from `owner`'s prompt cache), then generate
        the next assistant turn (n choices)."""
        observed = 0
        eng = self.engine
        cached = 0 if fresh else len(work.input_ids)
        try:
            if fresh:
                prompt = next(i for i, m in enumerate(rest + [{"role": "assistant"}]) if m["role"] == "assistant")
                reset = eng.reset(work, rest[:prompt], tools=req.tools, cache_salt=owner, cancel=cancel)
                cached = reset["cached_tokens"]
                rest = rest[prompt:]
            i = 0
            while i < len(rest):
                if rest[i]["role"] == "assistant":
                    msg = rest[i]
                    eng.run(lambda: work.act(force=msg), cancel)
                    i += 1
                    continue
                j = i
                while j < len(rest) and rest[j]["role"] in ("tool", "user"):
                    j += 1
                part = rest[i:j]
                eng.run(lambda: work.observe_messages(part), cancel)
                observed += 1
                i = j
            sessions = [work] + [work.fork() for _ in range(req.n - 1)]
            for c, s in enumerate(sessions):
                if req.seed is not None:
                    s.generator.manual_seed(req.seed + c)
                elif reseed or c > 0:  # a copy or another choice must not repeat the original's samples
                    s.generator.manual_seed(secrets.randbits(63))
            prompt_tokens = len(work.input_ids) + len(self.agent.prompt_ids)
            opts = self.decode_options(req)
            budget = req.max_tokens or self.max_new_tokens
            decodes = [s.begin_decode(max_new_tokens=budget, options=opts, on_token=on_token if c == 0 else None)
                       for c, s in enumerate(sessions)]
            eng.generate(decodes, cancel)
            messages = [s.end_decode(d) for s, d in zip(sessions, decodes)]
        except ContextFullError as e:
            raise APIError(400, f"This model's maximum context length is {e.capacity} tokens; the conversation needs "
                           f"at least {e.needed} (shorten it or start a new conversation)", param="messages",
                           code="context_length_exceeded") from None
        except SessionError as e:
            raise bad(str(e), "messages") from None
        choices = []
        for s, message in zip(sessions, messages):
            # tool-call ids unique across the conversation (the parser numbers them per message)
            stored = s.messages[-1]
            for call in stored.get("tool_calls") or []:
                call["id"] = "call_" + secrets.token_hex(12)
            logprobs = message.pop("logprobs", None)
            message.pop("stopped", None)
            if stored.get("tool_calls"):
                message = dict(message, tool_calls=stored["tool_calls"])
            choices.append({"session": s, "message": message, "truncated": bool(message.get("truncated")),
                            "completion_tokens": len(s.history[-1].action_token_nll),  # generated, not the appended end
                            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}})
        return {"choices": choices, "observed": observed, "prompt_tokens": prompt_tokens, "cached_tokens": cached}

    def _check_room(self) -> None:
        with self._lock:
            if len(self._convs) < self.max_sessions or any(not c.lock.locked() for c in self._convs.values()):
                return
        raise self._too_many(f"all {self.max_sessions} sessions are busy (--max-sessions)", "sessions_exhausted")

    def _insert(self, work: AgentSession, ttt: bool, owner: str | None) -> Conversation:
        conv = Conversation(id="sess-" + secrets.token_hex(12), session=work, ttt=ttt, owner=owner,
                            lock=threading.Lock(), last_used=time.monotonic(), nbytes=session_bytes(work))
        with self._lock:
            while len(self._convs) >= self.max_sessions:
                victim = next((c for c in self._convs.values() if c.lock.acquire(blocking=False)), None)
                if victim is None:
                    raise self._too_many(f"all {self.max_sessions} sessions are busy (--max-sessions)",
                                         "sessions_exhausted")
                del self._convs[victim.id]  # least recently used idle conversation
                victim.lock.release()
            self._convs[conv.id] = conv
        return conv

    def _insert_choices(self, result: dict, req: ChatRequest, owner) -> list[Conversation]:
        """Choices 1..n-1 become conversations of their own."""
        return [self._insert(c["session"], req.ttt, owner) for c in result["choices"][1:]]

    def _result(self, conv: Conversation, result: dict, extra: list[Conversation], req: ChatRequest) -> ChatResult:
        choices = []
        for c, owner_conv in zip(result["choices"], [conv] + extra):
            choices.append({k: v for k, v in c.items() if k != "session"}
                           | {"ttt": self.ttt_info(owner_conv, c["session"], observed=result["observed"])})
        return ChatResult(conversation_id=conv.id, choices=choices, prompt_tokens=result["prompt_tokens"],
                          cached_tokens=result["cached_tokens"], ttt=choices[0]["ttt"])

    def ttt_info(self, conv: Conversation, work: AgentSession | None = None, observed: int | None = None) -> dict:
        work = work or conv.session
        info = {"session_id": conv.id, "updates": work.num_updates, "skipped": work.num_skipped,
                "policy": self.agent.model.ttt.context_policy, "enabled": conv.ttt, "round": work.round,
                "num_tokens": len(work.input_ids)}
        if observed is not None:
            info["observed"] = observed
        return info
