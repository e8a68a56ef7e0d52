"""ATIF (Harbor's Agent Trajectory Interchange Format) <-> canonical trajectories.

ATIF root: `schema_version` ("ATIF-v1.x"), `session_id`, `agent {name, version, model_name?,
tool_definitions?}`, `steps[]`, optional `final_metrics`, `continued_trajectory_ref`, `notes`, `extra`.
A step: `step_id` (1, 2, 3 … in order), `source` in {system, user, agent}, `message`; agent steps may
carry `reasoning_content`, `tool_calls[{tool_call_id, function_name, arguments}]` and
`observation.results[{source_call_id?, content}]` (a source_call_id must name a tool call of the same
step).

Mapping: system step -> system message; user step -> user message; agent step -> assistant message
(+ one tool message per observation result when the step made tool calls, or one user message
carrying the results when it made none, as Terminus-style agents do). A summarization continues in
`trajectory.cont-N.json`; each file becomes its own trajectory (the model's context restarts there)
with id `<session>.cont-N` and the parent's session as `meta.group`, so a split never separates them.

For RL (ATIF >= 1.7): an agent step's `metrics` may carry `prompt_token_ids` (everything the model had
seen, then the assistant header), `completion_token_ids` (the reply, its closing <|im_end|> included)
and `logprobs` (the log-probability of each completion id under the model at temperature 1 but the
closing <|im_end|>, as OpenAI's and vLLM's logprobs leave it out), and its `extra.inner_loss` the
loss of the test-time update its observation made (the observation's mean NLL under the fast weights
before the update; null when the observation was never fed back). `rl_steps_atif` writes them
(ds_ttt/evaluation/closed_loop.py; the Harbor agent writes the same fields from the server's
`return_token_ids` reply); `atif_to_canonical` keeps them as `meta.rl_steps` (one entry per agent step),
which `ds_ttt.data.importers.check_token_ids` compares with a re-tokenisation of the messages.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from .render import contains_control_tokens
from .schema import TrajectoryError, normalize_arguments

ATIF_VERSION = "ATIF-v1.4"
ATIF_RL_VERSION = "ATIF-v1.7"  # the first version whose step metrics hold token ids and logprobs
RL_METRICS = ("prompt_token_ids", "completion_token_ids", "logprobs")


class ATIFError(TrajectoryError):
    """A malformed ATIF document; `step` is the ATIF step_id (or None for root-level problems)."""


def is_atif(doc) -> bool:
    return isinstance(doc, dict) and str(doc.get("schema_version", "")).startswith("ATIF")


def _tool_defs(defs) -> list | None:
    if not defs:
        return None
    if not isinstance(defs, list):
        raise ATIFError("agent.tool_definitions must be a list")
    return [d if isinstance(d, dict) and "function" in d else {"type": "function", "function": d} for d in defs]


def atif_to_canonical(doc: dict, *, traj_id: str | None = None, group: str | None = None, source: str = "atif") -> dict:
    """Convert one ATIF document (validated step by step) into a canonical trajectory dict."""
    session, agent, steps = _check_document(doc)
    messages = []
    for idx, step in enumerate(steps):
        messages += _step_messages(step, idx)
    extra = doc.get("extra") or {}
    meta = dict(extra.get("meta") or {}) if isinstance(extra, dict) else {}
    meta.setdefault("session_id", session)
    meta.setdefault("agent", agent.get("name"))
    if agent.get("model_name"):
        meta.setdefault("model", agent["model_name"])
    if group:
        meta["group"] = group
    rl_steps = [_rl_step(s) for s in steps if isinstance(s, dict) and s.get("source") == "agent"]
    if any(r is not None for r in rl_steps):
        meta["rl_steps"] = rl_steps
    traj = {"id": traj_id or session, "source": (extra.get("source") if isinstance(extra, dict) else None) or source, "messages": messages, "meta": meta}
    tools = _tool_defs(agent.get("tool_definitions"))
    if tools:
        traj["tools"] = tools
    return traj


def _rl_step(step: dict) -> dict | None:
    """An agent step's RL fields (module docstring), None when it has none; malformed ones raise."""
    metrics = step.get("metrics") or {}
    extra = step.get("extra") or {}
    if not isinstance(metrics, dict) or not isinstance(extra, dict):
        raise ATIFError("metrics and extra must be objects", step.get("step_id"))
    out = {k: metrics[k] for k in RL_METRICS if metrics.get(k) is not None}
    if "inner_loss" in extra:
        out["inner_loss"] = extra["inner_loss"]
    for k in ("prompt_token_ids", "completion_token_ids"):
        if k in out and not (isinstance(out[k], list) and all(isinstance(t, int) for t in out[k])):
            raise ATIFError(f"metrics.{k} must be a list of token ids (integers)", step.get("step_id"))
    return out or None


def rl_steps_atif(traj: dict, turns: list[dict], inner_losses: list, **atif_options) -> dict:
    """`canonical_to_atif(traj)` at ATIF_RL_VERSION with each agent step's RL fields: `turns[k]` (its
    prompt_token_ids, completion_token_ids, logprobs) in its metrics, `inner_losses[k]` in extra."""
    doc = canonical_to_atif(traj, **atif_options)
    doc["schema_version"] = ATIF_RL_VERSION
    agent_steps = [s for s in doc["steps"] if s["source"] == "agent"]
    if not len(agent_steps) == len(turns) == len(inner_losses):
        raise ValueError(f"{len(agent_steps)} agent steps but {len(turns)} turns and {len(inner_losses)} inner "
                         "losses: pass one of each per assistant message")
    for step, turn, loss in zip(agent_steps, turns, inner_losses):
        # the result of a call that did not parse (the session's `[error: invalid tool call: …]`) names no
        # tool call of the step: it stays a result without source_call_id, as ATIF allows
        calls = {c["tool_call_id"] for c in step.get("tool_calls") or []}
        for r in (step.get("observation") or {}).get("results") or []:
            if r.get("source_call_id") not in calls:
                r.pop("source_call_id", None)
        step["metrics"] = {"prompt_tokens": len(turn["prompt_token_ids"]),
                           "completion_tokens": len(turn["completion_token_ids"])} | {k: turn[k] for k in RL_METRICS}
        step["extra"] = {"inner_loss": loss}
    return doc


def _check_document(doc) -> tuple[str, dict, list]:
    """The document-level fields every ATIF trajectory needs: (session_id, agent, steps)."""
    if not is_atif(doc):
        raise ATIFError("not an ATIF document (schema_version must start with 'ATIF')")
    session = doc.get("session_id")
    if not isinstance(session, str) or not session:
        raise ATIFError("missing session_id")
    agent = doc.get("agent")
    if not isinstance(agent, dict) or not agent.get("name"):
        raise ATIFError("missing agent.name")
    steps = doc.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ATIFError("steps must be a non-empty list")
    return session, agent, steps


def _step_messages(step, idx: int) -> list[dict]:
    """The canonical messages of step `idx` (0-based): a system or user message, or an agent's assistant
    turn followed by its observation (tool results, or one user message without tool calls)."""
    if not isinstance(step, dict):
        raise ATIFError("step is not an object", idx + 1)
    sid = step.get("step_id")
    if sid != idx + 1:
        raise ATIFError(f"step_id {sid!r} out of order (expected {idx + 1})", idx + 1)
    src = step.get("source")
    msg_text = step.get("message")
    if not isinstance(msg_text, str):
        raise ATIFError("message must be a string", sid)
    obs = step.get("observation") or {}
    results = obs.get("results") or [] if isinstance(obs, dict) else None
    if results is None or not isinstance(results, list):
        raise ATIFError("observation.results must be a list", sid)
    texts = [("message", msg_text), ("reasoning_content", step.get("reasoning_content") or "")]
    texts += [(f"observation result {k}", r.get("content") or "") for k, r in enumerate(results) if isinstance(r, dict)]
    for where, text in texts:
        bad = contains_control_tokens(text) if isinstance(text, str) else None
        if bad:
            raise ATIFError(f"{where} contains the chat-control token {bad} (it would encode as that token and "
                            f"break the turn structure)", sid)
    if src == "system":
        extra = "".join("\n\n" + str(r.get("content", "")) for r in results if isinstance(r, dict))
        return [{"role": "system", "content": msg_text + extra}]
    if src == "user":
        return [{"role": "user", "content": msg_text}]
    if src == "agent":
        return _agent_messages(step, sid, msg_text, results)
    raise ATIFError(f"unknown step source {src!r}", sid)


def _agent_messages(step: dict, sid: int, msg_text: str, results: list) -> list[dict]:
    """An agent step: the assistant message (reasoning, tool calls) and its observation results."""
    messages = []
    msg = {"role": "assistant", "content": msg_text}
    if step.get("reasoning_content") is not None:
        if not isinstance(step["reasoning_content"], str):
            raise ATIFError("reasoning_content must be a string", sid)
        msg["reasoning_content"] = step["reasoning_content"]
    calls = step.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ATIFError("tool_calls must be a list", sid)
    ids = set()
    oa_calls = []
    for k, c in enumerate(calls):
        if not isinstance(c, dict) or not c.get("tool_call_id") or not c.get("function_name"):
            raise ATIFError(f"tool call {k} needs tool_call_id and function_name", sid)
        if "arguments" not in c:
            raise ATIFError(f"tool call {c['tool_call_id']} has no arguments", sid)
        try:
            args = normalize_arguments(c["arguments"], sid)
        except TrajectoryError as e:
            raise ATIFError(f"tool call {c['tool_call_id']}: {e.reason}", sid) from None
        ids.add(c["tool_call_id"])
        oa_calls.append({"id": c["tool_call_id"], "type": "function", "function": {"name": c["function_name"], "arguments": args}})
    if oa_calls:
        msg["tool_calls"] = oa_calls
    messages.append(msg)
    texts = []
    for r in results:
        if not isinstance(r, dict) or not isinstance(r.get("content", ""), str):
            raise ATIFError("observation result must be an object with string content", sid)
        ref = r.get("source_call_id")
        if ref is not None and ref not in ids:
            raise ATIFError(f"observation source_call_id {ref!r} names no tool call of this step", sid)
        if oa_calls:
            tm = {"role": "tool", "content": r.get("content") or ""}
            if ref is not None:
                tm["tool_call_id"] = ref
            messages.append(tm)
        else:
            texts.append(r.get("content") or "")
    if texts:
        messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def canonical_to_atif(traj: dict, *, agent_name: str = "ds_ttt-generator", agent_version: str = "0.1.0",
                      model_name: str = "scripted-expert", start: str = "2025-01-01T00:00:00+00:00") -> dict:
    """Write a canonical trajectory as ATIF (deterministic timestamps: `start` + one second per step)."""
    t0 = datetime.fromisoformat(start).astimezone(timezone.utc)
    steps: list[dict] = []

    def ts(i):
        return (t0 + timedelta(seconds=i)).strftime("%Y-%m-%dT%H:%M:%SZ")

    for m in traj["messages"]:
        role = m["role"]
        if role == "tool":
            step = steps[-1]
            res = {"content": m.get("content", "")}
            if m.get("tool_call_id"):
                res["source_call_id"] = m["tool_call_id"]
            step.setdefault("observation", {"results": []})["results"].append(res)
            continue
        step = {"step_id": len(steps) + 1, "timestamp": ts(len(steps)), "source": {"system": "system", "user": "user", "assistant": "agent"}[role], "message": m.get("content", "")}
        if role == "assistant":
            step["model_name"] = model_name
            if m.get("reasoning_content") is not None:
                step["reasoning_content"] = m["reasoning_content"]
            if m.get("tool_calls"):
                step["tool_calls"] = [
                    {"tool_call_id": c["id"], "function_name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                    for c in m["tool_calls"]
                ]
        steps.append(step)
    agent = {"name": agent_name, "version": agent_version, "model_name": model_name}
    if traj.get("tools"):
        agent["tool_definitions"] = traj["tools"]
    return {
        "schema_version": ATIF_VERSION,
        "session_id": traj["id"],
        "agent": agent,
        "steps": steps,
        "final_metrics": {"total_steps": len(steps)},
        "extra": {"source": traj.get("source"), "meta": traj.get("meta", {})},
    }
