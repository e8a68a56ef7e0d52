"""When a client's conversation continues a stored session: message by message, as the server compares them.

    k = matched_prefix(session, request_messages, tools)    # len(session.messages), or -1 when not a prefix
    same_message(stored, sent)                               # one message

The OpenAI-compatible server (conversations.py) continues a stored session when its messages are a
prefix of the request's. A message matches the stored one by role and content; an assistant message
by its content and its tool calls (name, arguments as JSON), and by reasoning_content when the client
sends it (clients usually drop it; the session keeps the tokens it really generated). Tool-call ids are
not compared. Whatever the server replied matches itself when sent back verbatim (a reply cut inside a
tool call included: its content holds the `<tool_call>` markup). The tools must agree as JSON.
Tests: python -m pytest tests/unit/test_serve_fleet.py
"""

from __future__ import annotations

import json


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


def matched_prefix(session, messages: list[dict], tools) -> int:
    """len(session.messages) (an AgentSession's) when they are a prefix of `messages` (and the tools
    agree), else -1."""
    mine = session.messages
    if _tools_key(session.tools) != _tools_key(tools) or len(mine) > len(messages):
        return -1
    return len(mine) if all(same_message(a, b) for a, b in zip(mine, messages)) else -1
