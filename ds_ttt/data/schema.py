"""The canonical trajectory: OpenAI-style messages, one trajectory per JSONL line, and its validator.

    {"id": str, "source": str, "tools"?: [OpenAI tool schemas],
     "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str,
                   "reasoning_content"?: str,
                   "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": JSON str}}],
                   "tool_call_id"?: str}],
     "meta": {"task": str, "group": str, "reward"?, "success"?, ...}}

`normalize_trajectory` returns a cleaned copy or raises `TrajectoryError` with the reason and the
message index (`step`). Normalization: content parts lists are joined, `None` content becomes "",
tool-call arguments are re-serialized as `json.dumps(obj, ensure_ascii=False)` (what Qwen3's template
writes for a dict), `<think>…</think>` inside assistant content moves to `reasoning_content`,
`meta.group` defaults to the id (the split keeps a group on one side: continuation parts of one
session share a group) and `meta.task` to the first user message.
"""

from __future__ import annotations

import json

from .render import THINK_TAGS, contains_control_tokens

ROLES = ("system", "user", "assistant", "tool")


class TrajectoryError(ValueError):
    def __init__(self, reason: str, step: int | None = None):
        super().__init__(reason if step is None else f"message {step}: {reason}")
        self.reason = reason
        self.step = step


def _text(content, step: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise TrajectoryError(f"unsupported content part {str(p)[:60]!r} (only text parts)", step)
        return "".join(parts)
    raise TrajectoryError(f"content must be a string, got {type(content).__name__}", step)


def normalize_arguments(arguments, step: int):
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise TrajectoryError(f"tool call arguments are not valid JSON ({e.msg})", step) from None
    if not isinstance(arguments, dict):
        raise TrajectoryError("tool call arguments must be a JSON object", step)
    return json.dumps(arguments, ensure_ascii=False)


def normalize_trajectory(traj) -> dict:
    """A cleaned copy of one canonical trajectory (see the module docstring), or TrajectoryError."""
    if not isinstance(traj, dict):
        raise TrajectoryError(f"trajectory must be a JSON object, got {type(traj).__name__}")
    tid = traj.get("id")
    if not isinstance(tid, (str, int)) or str(tid) == "":
        raise TrajectoryError("missing id")
    messages = traj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TrajectoryError("messages must be a non-empty list")
    tools = traj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TrajectoryError("tools must be a list of objects")
    out = []
    open_calls: set[str] = set()  # the tool-call ids of the latest assistant turn: what a tool result may name
    seen_user = False
    num_actions = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TrajectoryError("message is not an object", i)
        role = m.get("role")
        if role not in ROLES:
            raise TrajectoryError(f"unknown role {role!r}", i)
        content = _text(m.get("content"), i)
        msg = {"role": role, "content": content}
        if role == "user":
            seen_user = True
        if role == "assistant":
            if not seen_user:
                raise TrajectoryError("assistant turn before any user task", i)
            num_actions += 1
            open_calls = _normalize_assistant(m, msg, i)
        elif role == "tool":
            _normalize_tool_result(m, msg, out, open_calls, i)
        _check_control_tokens(msg, i)
        out.append(msg)
    if num_actions == 0:
        raise TrajectoryError("no assistant turn")
    meta = traj.get("meta") or {}
    if not isinstance(meta, dict):
        raise TrajectoryError("meta must be an object")
    meta = dict(meta)
    meta.setdefault("group", str(tid))
    if "task" not in meta:
        meta["task"] = next((m["content"] for m in out if m["role"] == "user"), "")
    result = {"id": str(tid), "source": str(traj.get("source") or "unknown"), "messages": out, "meta": meta}
    if tools:
        result["tools"] = tools
    return result


def _normalize_assistant(m: dict, msg: dict, i: int) -> set[str]:
    """Fill `msg` (the normalized assistant message `i`) with its reasoning and tool calls; returns the
    ids of its tool calls."""
    content = msg["content"]
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise TrajectoryError("reasoning_content must be a string", i)
    if reasoning is None and "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        msg["content"] = content.split("</think>")[-1].lstrip("\n")
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise TrajectoryError("tool_calls must be a list", i)
    norm_calls = []
    open_calls = set()
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise TrajectoryError(f"tool call {k} has no function name", i)
        if "arguments" not in fn:
            raise TrajectoryError(f"tool call {k} has no arguments", i)
        cid = str(c.get("id") or f"call_{i}_{k}")
        norm_calls.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": normalize_arguments(fn["arguments"], i)}})
        open_calls.add(cid)
    if norm_calls:
        msg["tool_calls"] = norm_calls
    return open_calls


def _normalize_tool_result(m: dict, msg: dict, out: list[dict], open_calls: set[str], i: int) -> None:
    """Check tool result `i` against the messages before it (`out`) and fill in its tool_call_id."""
    prev = out[-1]["role"] if out else None
    if prev not in ("assistant", "tool") or (prev == "assistant" and not out[-1].get("tool_calls")):
        raise TrajectoryError("tool result without a preceding assistant tool call", i)
    cid = m.get("tool_call_id")
    if cid is not None:
        if str(cid) not in open_calls:
            raise TrajectoryError(f"tool_call_id {cid!r} names no tool call of the preceding assistant turn", i)
        msg["tool_call_id"] = str(cid)


def _check_control_tokens(msg: dict, i: int) -> None:
    """Refuse text that would encode as a chat-control token (or a think tag) and break the turn structure."""
    for key in ("content", "reasoning_content"):
        text = msg.get(key) or ""
        bad = contains_control_tokens(text) or next((t for t in THINK_TAGS if t in text), None)
        if bad:
            raise TrajectoryError(f"{key} contains the chat-control token {bad} (it would encode as that token "
                                  f"and break the turn structure)", i)
