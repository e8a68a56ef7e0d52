"""The OpenAI chat-completions wire format: validate a request, shape a reply, an error, or SSE chunks.

    req = parse_chat_request(body, served_model="tiny-export", capacity=16384)   # raises APIError
    reply = completion(reply_id, model, message, finish_reason, usage, ttt)     # the JSON object
    chunks = stream_chunks(reply)                                               # "data: {...}\n\n" ...

Pure functions over JSON values; no model and no web framework here (ds_ttt/serve/frontends/http.py serves
them, ds_ttt/serve/conversations.py runs the sessions). What is accepted:

  messages      system / developer (as system), user, assistant (content, tool_calls, optional
                reasoning_content), tool (tool_call_id naming a call of the assistant message before
                it, content). Content is a string, null (assistant with tool calls) or a list of text
                parts. The conversation starts with system/user turns (the task, round 0); an assistant
                turn is followed by its tool results and/or user turns (observations); the last
                message is user or tool (the server writes the next assistant turn).
  tools         [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
  sampling      temperature (0 = greedy; omitted: greedy, the export's generation_config), top_p (0 keeps
                the most likely token), max_tokens / max_completion_tokens (capped by the server's
                --max-tokens-cap: above it a 400), seed, stop (string, list of up to 4, or null),
                n (choices; each one a fork of the conversation), logprobs + top_logprobs (0..20)
  tools         tool_choice "auto" | "none" (no tool call is generated) | "required" (a tool call follows
                the think block) | {"type": "function", "function": {"name"}} (a call of that tool);
                parallel_tool_calls false: the reply ends after its first tool call
  stream        stream (+ stream_options.include_usage)
  token ids     return_token_ids (vLLM's field; not with stream): the reply carries prompt_token_ids (what
                the model had seen, then the assistant header) and each choice its token_ids (the reply,
                its closing <|im_end|> included; null, with token_ids_error saying why, when the session
                was evicted before they were read), and the ttt object the observation's inner loss
                (obs_loss: its mean NLL before the update; null when the request fed no observation)
  ds_ttt        session_id (the `openai` client's extra_body), "ttt": false (frozen weights)
  accepted, no effect  user, metadata, store, frequency/presence penalty 0, response_format {"type": "text"},
                logit_bias {}; an unknown field is ignored and logged (ChatRequest.ignored)
A known field with a value the server cannot honour is a 400 naming the field (`param`).
Errors are OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the HTTP status.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ds_ttt.data.render import contains_control_tokens

ROLES = ("system", "developer", "user", "assistant", "tool")
_NO_EFFECT = {"user", "metadata", "store", "service_tier"}
_MUST_BE = {"frequency_penalty": 0, "presence_penalty": 0}
_KNOWN = {"model", "messages", "tools", "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed",
          "stream", "stream_options", "session_id", "ttt", "response_format", "top_logprobs", "logprobs", "n",
          "stop", "tool_choice", "parallel_tool_calls", "logit_bias", "return_token_ids"} | _NO_EFFECT | set(_MUST_BE)
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20
# Tool-call markup is the model's own output: a reply cut inside a tool call carries it in its content,
# and the client sends that reply back verbatim. Every other chat-control token stays refused.
_ASSISTANT_MARKUP = ("<tool_call>", "</tool_call>")


class APIError(Exception):
    """An error reply: HTTP status + OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # canonical: role in system/user/assistant/tool, content str
    tools: list | None
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None
    stream: bool
    include_usage: bool
    session_id: str | None
    ttt: bool
    stop: tuple[str, ...] = ()
    tool_choice: str = "auto"  # auto | none | required | function (then tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    return_token_ids: bool = False
    ignored: list[str] = field(default_factory=list)  # unknown fields (logged by the server)


def _without_markup(text: str) -> str:
    for tag in _ASSISTANT_MARKUP:
        text = text.replace(tag, "")
    return text


def _text(content, param: str, *, allow_null: bool) -> str:
    if content is None:
        if allow_null:
            return ""
        raise bad(f"{param} is required", param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}[{i}]: only text content parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                          f"{param}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{param} must be a string, null or a list of text parts, got {type(content).__name__}", param)


def _number(body: dict, key: str, default, lo: float, hi: float, *, integer: bool = False):
    if body.get(key) is None:
        return default
    val = body[key]
    ok = isinstance(val, int) if integer else isinstance(val, (int, float))
    if isinstance(val, bool) or not ok or not (lo <= val <= hi):
        kind = "an integer" if integer else "a number"
        raise bad(f"{key} must be {kind} in [{lo}, {hi}], got {val!r}", key)
    return val


def _tool_calls(calls, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str):
            raise bad(f"{p} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", p)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError as e:
                raise bad(f"{p}.function.arguments is not JSON: {e}", f"{p}.function.arguments") from None
        elif not isinstance(args, dict):
            raise bad(f"{p}.function.arguments must be a JSON string", f"{p}.function.arguments")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_messages(messages) -> list[dict]:
    """Canonical messages (see the module docstring); 400 on anything the renderer cannot take."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out: list[dict] = []
    open_calls: set[str] = set()
    seen_assistant = False
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object", p)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{p}.role {role!r} is not one of {', '.join(ROLES)}", f"{p}.role")
        role = "system" if role == "developer" else role
        content = _text(m.get("content"), f"{p}.content", allow_null=role == "assistant")
        bad_token = contains_control_tokens(_without_markup(content) if role == "assistant" else content)
        if bad_token:
            raise bad(f"{p}.content contains the chat-control token {bad_token}", f"{p}.content")
        msg: dict = {"role": role, "content": content}
        if role == "system" and seen_assistant:
            raise bad(f"{p}: a system message after the first assistant turn is not supported", f"{p}.role")
        if role == "assistant":
            seen_assistant = True
            calls = _tool_calls(m["tool_calls"], f"{p}.tool_calls") if m.get("tool_calls") else []
            if calls:
                msg["tool_calls"] = calls
            reasoning = m.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning_content"] = _text(reasoning, f"{p}.reasoning_content", allow_null=True)
            open_calls = {c["id"] for c in calls}
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in open_calls:
                raise bad(f"{p}: tool message without its call (tool_call_id {call_id!r} is not a tool call of the "
                          "assistant message before it)", f"{p}.tool_call_id")
            open_calls.discard(call_id)
            msg["tool_call_id"] = call_id
        out.append(msg)
    first = next(i for i, m in enumerate(out + [{"role": "assistant"}]) if m["role"] != "system")
    if first >= len(out) or out[first]["role"] != "user":
        raise bad("the conversation must start with system messages and a user message (the task)", "messages")
    if out[-1]["role"] not in ("user", "tool"):
        raise bad(f"messages[{len(out) - 1}]: the last message must be user or tool (the server writes the next "
                  "assistant turn)", f"messages[{len(out) - 1}].role")
    return out


def parse_tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) \
                or not isinstance(t["function"].get("name"), str):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", f"tools[{i}]")
    return tools or None


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(x, str) and x for x in stops):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, got {value!r}",
                  "stop")
    return tuple(stops)


def _tool_choice(value, tools) -> tuple[str, str | None]:
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        if value == "required" and not tools:
            raise bad('tool_choice "required" needs tools', "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
                  f"got {value!r}", "tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in names:
        raise bad(f"tool_choice names the function {fn['name']!r}, which is not in tools ({names})", "tool_choice")
    return "function", fn["name"]


def _bool(body: dict, key: str, default: bool) -> bool:
    val = body.get(key)
    if val is None:
        return default
    if not isinstance(val, bool):
        raise bad(f"{key} must be a boolean, got {val!r}", key)
    return val


def parse_chat_request(body, *, served_model: str, max_tokens_cap: int | None = None, max_n: int = 8) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    ignored = sorted(set(body) - _KNOWN)
    for key, want in _MUST_BE.items():
        if body.get(key) is not None and body[key] != want:
            raise bad(f"{key}={body[key]!r} is not supported (only {want!r})", key)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported (only {} or null)", "logit_bias")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model is required (GET /v1/models lists it)", "model")
    if model != served_model:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    max_tokens = _number(body, "max_completion_tokens", None, 1, 1 << 30, integer=True)
    max_tokens = _number(body, "max_tokens", max_tokens, 1, 1 << 30, integer=True)
    if max_tokens is not None and max_tokens_cap is not None and max_tokens > max_tokens_cap:
        key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
        raise bad(f"{key}={max_tokens} exceeds this server's cap of {max_tokens_cap} (--max-tokens-cap)", key)
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    sid = body.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise bad("session_id must be a string", "session_id")
    ttt = _bool(body, "ttt", True)
    tools = parse_tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    logprobs = _bool(body, "logprobs", False)
    top = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    n = _number(body, "n", 1, 1, max_n, integer=True)
    if n > 1 and stream:
        raise bad("n > 1 is not supported with stream: true (send n requests, or stream: false)", "n")
    token_ids = _bool(body, "return_token_ids", False)
    if token_ids and stream:
        raise bad("return_token_ids is not supported with stream: true (use stream: false)", "return_token_ids")
    return ChatRequest(
        model=model, messages=parse_messages(body.get("messages")), tools=tools,
        temperature=float(_number(body, "temperature", 0.0, 0.0, 2.0)), top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        max_tokens=max_tokens, seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        stream=stream, include_usage=bool(opts.get("include_usage")), session_id=sid, ttt=ttt,
        stop=_stop(body.get("stop")), tool_choice=choice, tool_name=name,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True), logprobs=logprobs, top_logprobs=top,
        n=n, return_token_ids=token_ids, ignored=ignored)


# ---- replies ------------------------------------------------------------------------------------
def reply_message(message: dict) -> dict:
    """The assistant message as OpenAI returns it (content null when there is only a tool call)."""
    out = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content") is not None:
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [dict(c) for c in message["tool_calls"]]
    if message.get("invalid_tool_calls"):
        out["invalid_tool_calls"] = message["invalid_tool_calls"]
    return out


def finish_reason(message: dict, truncated: bool) -> str:
    if truncated:
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def completion(reply_id: str, model: str, choices: list[dict], usage: dict, ttt: dict,
               created: int | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """choices: [{"message", "finish_reason", "logprobs" (None or {"content": [...]}), "ttt", "token_ids"?}]
    in order; with token_ids in the choices (return_token_ids) the reply carries prompt_token_ids too."""
    with_ids = any("token_ids" in c for c in choices)
    reply = {"id": reply_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
             "system_fingerprint": None,
             "choices": [{"index": i, "message": reply_message(c["message"]), "finish_reason": c["finish_reason"],
                          "logprobs": c.get("logprobs")} | ({"ttt": c["ttt"]} if len(choices) > 1 else {})
                         | ({k: c[k] for k in ("token_ids", "token_ids_error") if k in c} if with_ids else {})
                         for i, c in enumerate(choices)],
             "usage": usage, "ttt": ttt}
    if with_ids:
        reply["prompt_token_ids"] = prompt_token_ids
    return reply


_MARKERS = ("<think>", "</think>", "<tool_call>", "<|im_end|>")


def _held_back(text: str) -> str:
    """`text` without a trailing partial marker or an incomplete UTF-8 character (more tokens may
    complete them)."""
    text = text.rstrip("\ufffd")
    for k in range(max(map(len, _MARKERS)) - 1, 0, -1):
        if any(m.startswith(text[-k:]) for m in _MARKERS if len(m) > k):
            return text[:-k]
    return text


def provisional_message(text: str) -> dict:
    """What the reply's reasoning_content / content are so far, from a prefix of the generated text:
    the parts `parse_assistant_message` will keep whatever follows (tool-call blocks are sent whole at
    the end; whitespace the final parse may strip is held back)."""
    text = _held_back(text.split("<|im_end|>")[0])
    out: dict = {}
    head = text.lstrip()
    if "</think>" in text:
        reasoning, rest = text.split("</think>", 1)
        out["reasoning_content"] = reasoning.lstrip().removeprefix("<think>").strip("\n")
        rest = rest.lstrip()
    elif head.startswith("<think>"):
        out["reasoning_content"] = head.removeprefix("<think>").strip("\n")
        return out
    elif "<think>".startswith(head):
        return out
    else:
        rest = text
    out["content"] = rest.split("<tool_call>")[0].strip()
    return out


class ChatStream:
    """One reply as OpenAI's SSE stream, sent while it is generated: a role chunk, reasoning_content and
    content deltas as tokens arrive, then one chunk per tool call (index, id, name, arguments), a
    finish chunk carrying `ttt`, optionally a usage chunk, and `data: [DONE]`."""

    def __init__(self, reply_id: str, model: str, created: int | None = None):
        self.base = {"id": reply_id, "object": "chat.completion.chunk", "created": created or int(time.time()),
                     "model": model, "system_fingerprint": None}
        self.sent = {"reasoning_content": "", "content": ""}

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> str:
        body = dict(self.base, choices=[{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
                    **extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _deltas(self, target: dict) -> list[str]:
        out = []
        for key in ("reasoning_content", "content"):
            new = target.get(key) or ""
            if len(new) > len(self.sent[key]) and new.startswith(self.sent[key]):
                out.append(self._chunk({key: new[len(self.sent[key]):]}))
                self.sent[key] = new
        return out

    def text(self, generated: str) -> list[str]:
        """Deltas for the text generated so far."""
        return self._deltas(provisional_message(generated))

    def end(self, reply: dict, *, include_usage: bool) -> list[str]:
        choice = reply["choices"][0]
        msg = choice["message"]
        out = self._deltas(msg)
        for k, call in enumerate(msg.get("tool_calls") or []):
            out.append(self._chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                    "function": {"name": call["function"]["name"],
                                                                 "arguments": call["function"]["arguments"]}}]}))
        # logprobs (when asked for) come whole with the finish chunk
        out.append(self._chunk({}, choice["finish_reason"], choice.get("logprobs"), ttt=reply["ttt"]))
        if include_usage:
            out.append(f"data: {json.dumps(dict(self.base, choices=[], usage=reply['usage']))}\n\n")
        return out + ["data: [DONE]\n\n"]

    def error(self, e: APIError) -> list[str]:
        """A failure after the stream started (OpenAI sends the error object as an event)."""
        return [f"data: {json.dumps(e.body())}\n\n", "data: [DONE]\n\n"]


def stream_chunks(reply: dict, *, include_usage: bool) -> list[str]:
    """A finished reply as the SSE stream ChatStream sends (all text in one delta each)."""
    stream = ChatStream(reply["id"], reply["model"], reply["created"])
    return stream.start() + stream.end(reply, include_usage=include_usage)
