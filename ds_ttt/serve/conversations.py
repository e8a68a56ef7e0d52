"""The OpenAI-compatible server's conversations: each one is a TTT session (AgentSession) with its own W.

    store = ConversationStore(agent, max_sessions=64)
    result = store.chat(parse_chat_request(body, served_model=name))     # thread-safe; raises APIError

Finding the session of a request:
  * `session_id` in the body names it (404 if unknown or evicted);
  * otherwise the stored conversation (same `ttt` mode, same tools) whose messages are the longest
    prefix of the request's messages;
  * a named conversation whose history is not a prefix of the request (the client edited or
    regenerated a turn) is left unchanged, and the request starts a new conversation, as does a
    request that matches none.
A message matches the stored one by role and content; an assistant message by its content and its
tool calls (name, arguments as JSON), and by reasoning_content when the client sends it (clients
usually drop it; the session keeps the tokens it really generated). Tool-call ids are not compared.

Advancing a session: the request's messages after the matched prefix are fed as the session would
have seen them: each run of tool results / user turns after an assistant turn is one observation
(`AgentSession.observe_messages`: one inner update, exactly the training event), an assistant turn the
client supplies is fed as given (`act(force=...)`), then the next assistant turn is generated. A new
conversation replays the whole request this way from its round-0 messages, which reproduces the
fast weights a live session would have (same tokens, same updates).

Isolation: each conversation has a lock, held for the whole request, so concurrent requests to one
conversation run one after the other (a request that waits longer than `busy_timeout` gets 409). The
request works on a fork of the session and the fork replaces the stored session only when everything
succeeded, so a failed request changes nothing. Beyond `max_sessions`, the least recently used idle
conversation is evicted; when every conversation is busy, a new one gets 429.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ds_ttt.serve.openai_api import APIError, ChatRequest, bad
from ds_ttt.serve.session import AgentModel, AgentSession, ContextFullError, SessionError


@dataclass
class Conversation:
    id: str
    session: AgentSession
    ttt: bool
    lock: threading.Lock


@dataclass
class ChatResult:
    conversation_id: str
    message: dict
    truncated: bool
    prompt_tokens: int
    completion_tokens: int
    ttt: dict


def _args_key(arguments) -> str:
    try:
        return json.dumps(json.loads(arguments) if isinstance(arguments, str) else arguments, sort_keys=True)
    except ValueError:
        return str(arguments)


def same_message(stored: dict, sent: dict) -> bool:
    """Does the client's message `sent` stand for the session's message `stored`? (module docstring)"""
    if stored["role"] != sent["role"]:
        return False
    if stored["role"] != "assistant":
        return (stored.get("content") or "") == (sent.get("content") or "")
    calls = [(c["function"]["name"], _args_key(c["function"]["arguments"])) for c in stored.get("tool_calls") or []]
    sent_calls = [(c["function"]["name"], _args_key(c["function"]["arguments"])) for c in sent.get("tool_calls") or []]
    if (stored.get("content") or "").strip() != (sent.get("content") or "").strip() or calls != sent_calls:
        return False
    return sent.get("reasoning_content") is None or \
        (sent["reasoning_content"] or "").strip("\n") == (stored.get("reasoning_content") or "").strip("\n")


def _tools_key(tools) -> str:
    return json.dumps(tools or None, sort_keys=True)


def matched_prefix(session: AgentSession, messages: list[dict], tools) -> int:
    """len(session.messages) when they are a prefix of `messages` (and the tools agree), else -1."""
    mine = session.messages
    if _tools_key(session.tools) != _tools_key(tools) or len(mine) > len(messages):
        return -1
    return len(mine) if all(same_message(a, b) for a, b in zip(mine, messages)) else -1


class ConversationStore:
    def __init__(self, agent: AgentModel, *, max_sessions: int = 64, busy_timeout: float = 60.0,
                 max_new_tokens: int = 1024, max_context: int | None = None):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.agent = agent
        self.max_sessions = max_sessions
        self.busy_timeout = busy_timeout
        self.max_new_tokens = max_new_tokens
        self.max_context = max_context or agent.model.config.max_position_embeddings
        self._convs: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    # ---- lookup --------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._convs)

    def get(self, conversation_id: str) -> Conversation:
        with self._lock:
            conv = self._convs.get(conversation_id)
        if conv is None:
            raise APIError(404, f"no session {conversation_id!r} (unknown, closed or evicted; resend the conversation "
                           "without session_id to start a new one)", param="session_id", code="session_not_found")
        return conv

    def close(self, conversation_id: str) -> None:
        conv = self.get(conversation_id)
        if not conv.lock.acquire(timeout=self.busy_timeout):
            raise APIError(409, f"session {conversation_id!r} is busy", type="conflict", code="session_busy")
        try:
            with self._lock:
                self._convs.pop(conversation_id, None)
        finally:
            conv.lock.release()

    def _candidate(self, req: ChatRequest) -> Conversation | None:
        if req.session_id is not None:
            conv = self.get(req.session_id)
            if conv.ttt != req.ttt:
                raise bad(f"session {req.session_id!r} is a {'ttt' if conv.ttt else 'frozen'} session; "
                          f"\"ttt\": {str(req.ttt).lower()} needs a conversation of its own (send it without session_id)",
                          "ttt")
            return conv
        with self._lock:
            convs = list(self._convs.values())
        best, best_len = None, -1
        for conv in reversed(convs):  # most recently used first: it wins ties
            if conv.ttt != req.ttt:
                continue
            k = matched_prefix(conv.session, req.messages, req.tools)
            if k > best_len:
                best, best_len = conv, k
        return best

    # ---- one request ---------------------------------------------------------------------------
    def chat(self, req: ChatRequest, on_token=None) -> ChatResult:
        """Serve one request (see the module docstring); `on_token` gets each generated token id of the
        reply as it is chosen (streaming)."""
        conv = self._candidate(req)
        if conv is not None:
            if not conv.lock.acquire(timeout=self.busy_timeout):
                raise APIError(409, f"session {conv.id!r} is busy with another request (waited {self.busy_timeout:g} s)",
                               type="conflict", code="session_busy")
            try:
                with self._lock:
                    alive = self._convs.get(conv.id) is conv
                k = matched_prefix(conv.session, req.messages, req.tools) if alive else -1
                if k >= 0:
                    work = conv.session.fork()
                    result = self._advance(work, req.messages[k:], req, on_token=on_token)
                    conv.session = work  # commit: the fork replaces the session only on success
                    with self._lock:
                        if conv.id in self._convs:
                            self._convs.move_to_end(conv.id)
                    return self._result(conv, work, result, req)
            finally:
                conv.lock.release()
        self._check_room()
        work = self._new_session(req)
        result = self._advance(work, req.messages, req, fresh=True, on_token=on_token)
        conv = self._insert(work, req.ttt)
        return self._result(conv, work, result, req)

    def _new_session(self, req: ChatRequest) -> AgentSession:
        return AgentSession(self.agent, max_new_tokens=self.max_new_tokens, max_context=self.max_context,
                            update=req.ttt)

    def _advance(self, work: AgentSession, rest: list[dict], req: ChatRequest, *, fresh: bool = False,
                 on_token=None) -> dict:
        """Feed `rest` (after the matched prefix; with `fresh`, the whole conversation, its round-0
        messages starting the episode), then generate the next assistant turn."""
        observed = 0
        try:
            if fresh:
                prompt = next(i for i, m in enumerate(rest + [{"role": "assistant"}]) if m["role"] == "assistant")
                work.reset_messages(rest[:prompt], tools=req.tools)
                rest = rest[prompt:]
            i = 0
            while i < len(rest):
                if rest[i]["role"] == "assistant":
                    work.act(force=rest[i])
                    i += 1
                    continue
                j = i
                while j < len(rest) and rest[j]["role"] in ("tool", "user"):
                    j += 1
                work.observe_messages(rest[i:j])
                observed += 1
                i = j
            if req.seed is not None:
                work.generator.manual_seed(req.seed)
            prompt_tokens = len(work.input_ids) + len(self.agent.prompt_ids)
            message = work.act(max_new_tokens=req.max_tokens or self.max_new_tokens, temperature=req.temperature,
                               top_p=req.top_p, on_token=on_token)
        except ContextFullError as e:
            raise APIError(400, f"This model's maximum context length is {e.capacity} tokens; the conversation needs "
                           f"at least {e.needed} (shorten it or start a new conversation)", param="messages",
                           code="context_length_exceeded") from None
        except SessionError as e:
            raise bad(str(e), "messages") from None
        # tool-call ids unique across the conversation (the parser numbers them per message)
        stored = work.messages[-1]
        for call in stored.get("tool_calls") or []:
            call["id"] = "call_" + secrets.token_hex(12)
        message = dict(message, tool_calls=stored["tool_calls"]) if stored.get("tool_calls") else message
        return {"message": message, "observed": observed, "prompt_tokens": prompt_tokens,
                "completion_tokens": len(work.history[-1].action_token_nll),  # generated, not the appended end
                "truncated": bool(message.get("truncated"))}

    def _check_room(self) -> None:
        with self._lock:
            if len(self._convs) < self.max_sessions or any(not c.lock.locked() for c in self._convs.values()):
                return
        raise APIError(429, f"all {self.max_sessions} sessions are busy (--max-sessions); retry later",
                       type="rate_limit_error", code="sessions_exhausted")

    def _insert(self, work: AgentSession, ttt: bool) -> Conversation:
        conv = Conversation(id="sess-" + secrets.token_hex(12), session=work, ttt=ttt, lock=threading.Lock())
        with self._lock:
            while len(self._convs) >= self.max_sessions:
                victim = next((c for c in self._convs.values() if c.lock.acquire(blocking=False)), None)
                if victim is None:
                    raise APIError(429, f"all {self.max_sessions} sessions are busy (--max-sessions); retry later",
                                   type="rate_limit_error", code="sessions_exhausted")
                del self._convs[victim.id]  # least recently used idle conversation
                victim.lock.release()
            self._convs[conv.id] = conv
        return conv

    def _result(self, conv: Conversation, work: AgentSession, result: dict, req: ChatRequest) -> ChatResult:
        return ChatResult(conversation_id=conv.id, message=result["message"], truncated=result["truncated"],
                          prompt_tokens=result["prompt_tokens"], completion_tokens=result["completion_tokens"],
                          ttt=self.ttt_info(conv, work, observed=result["observed"]))

    def ttt_info(self, conv: Conversation, work: AgentSession | None = None, observed: int | None = None) -> dict:
        work = work or conv.session
        info = {"session_id": conv.id, "updates": work.num_updates, "skipped": work.num_skipped,
                "policy": self.agent.model.ttt.context_policy, "enabled": conv.ttt, "round": work.round,
                "num_tokens": len(work.input_ids)}
        if observed is not None:
            info["observed"] = observed
        return info
