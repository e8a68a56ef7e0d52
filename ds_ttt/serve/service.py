"""JSONL service over AgentSession: one request per stdin line, one response per stdout line.

    .venv/bin/python -m ds_ttt.serve --model EXPORT [--device cpu] [--max-sessions 64]

Requests (any request may carry an "id", echoed back):
  {"op": "reset",   "session": "s1", "task": "...", "system"?: str, "tools"?: [...],
                    "temperature"?: 0.0, "top_p"?: 1.0, "max_new_tokens"?: 1024, "seed"?: 0}
  {"op": "act",     "session": "s1", "force"?: {assistant message} | "raw text", "max_new_tokens"?, "temperature"?, "top_p"?}
  {"op": "observe", "session": "s1", "outputs": ["tool output", ...]}      ("output": "..." also accepted)
  {"op": "state",   "session": "s1"}       {"op": "close", "session": "s1"}       {"op": "list"}      {"op": "ping"}
Responses: {"id", "ok": true, "result": {...}} or {"id", "ok": false, "error": {"type", "message"}} with
type one of parse_error, invalid_request, unknown_session, session_error, internal_error.
A malformed or failing request changes no session (every session operation commits only at its end),
so all sessions survive it.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import IO, Callable

from ds_ttt.serve.session import AgentModel, AgentSession, SessionError

OPS = ("reset", "act", "observe", "state", "close", "list", "ping")
_SESSION_OPTS = {"temperature": (int, float), "top_p": (int, float), "max_new_tokens": int, "seed": int}


class RequestError(ValueError):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _get(req: dict, key: str, types, required: bool = True):
    if key not in req or req[key] is None:
        if required:
            raise RequestError("invalid_request", f"missing field {key!r}")
        return None
    val = req[key]
    tt = types if isinstance(types, tuple) else (types,)
    if not isinstance(val, tt) or (isinstance(val, bool) and bool not in tt):
        names = "/".join(t.__name__ for t in tt)
        raise RequestError("invalid_request", f"field {key!r} must be {names}, got {type(val).__name__}")
    return val


class Service:
    def __init__(self, agent: AgentModel, *, max_sessions: int = 64,
                 session_factory: Callable[..., AgentSession] | None = None):
        self.agent = agent
        self.max_sessions = max_sessions
        self.sessions: dict[str, AgentSession] = {}
        self.session_factory = session_factory or (lambda **kw: AgentSession(agent, **kw))

    def _session(self, req: dict) -> AgentSession:
        sid = _get(req, "session", str)
        if sid not in self.sessions:
            raise RequestError("unknown_session", f"no session {sid!r} (start it with op=reset)")
        return self.sessions[sid]

    def dispatch(self, req: dict) -> dict:
        op = _get(req, "op", str)
        if op not in OPS:
            raise RequestError("invalid_request", f"unknown op {op!r}; ops: {', '.join(OPS)}")
        if op == "ping":
            return {"pong": True, "sessions": len(self.sessions)}
        if op == "list":
            return {"sessions": sorted(self.sessions)}
        if op == "reset":
            sid = _get(req, "session", str)
            task = _get(req, "task", str)
            system = _get(req, "system", str, required=False)
            tools = _get(req, "tools", list, required=False)
            opts = {k: _get(req, k, t, required=False) for k, t in _SESSION_OPTS.items()}
            if sid not in self.sessions and len(self.sessions) >= self.max_sessions:
                raise RequestError("invalid_request", f"too many sessions ({self.max_sessions}); close one first")
            session = self.session_factory(**{k: v for k, v in opts.items() if v is not None})
            info = session.reset(task, system=system, tools=tools)
            self.sessions[sid] = session  # replaces an existing session only after a successful reset
            return {"session": sid, **info}
        session = self._session(req)
        if op == "act":
            force = req.get("force")
            if force is not None and not isinstance(force, (dict, str)):
                raise RequestError("invalid_request", "field 'force' must be an assistant message object or a string")
            kw = {k: _get(req, k, t, required=False) for k, t in _SESSION_OPTS.items() if k != "seed"}
            message = session.act(force=force, **kw)
            log = session.history[-1]
            return {"message": message, "round": session.round, "action_nll": log.action_nll,
                    "num_action_tokens": len(log.action_ids), "truncated": log.truncated}
        if op == "observe":
            outputs = req.get("outputs", req.get("output"))
            if isinstance(outputs, str):
                outputs = [outputs]
            if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs):
                raise RequestError("invalid_request", "observe needs 'outputs': a non-empty list of strings")
            loss = session.observe(outputs)
            log = session.history[-1]
            return {"obs_loss": loss, "updated": log.updated, "skipped": log.skipped, "round": session.round,
                    "num_obs_tokens": log.obs_tokens}
        if op == "state":
            return {"messages": session.messages, **session.snapshot()}
        del self.sessions[req["session"]]  # close
        return {"closed": True}

    def handle(self, line: str) -> dict:
        rid = None
        try:
            try:
                req = json.loads(line)
            except json.JSONDecodeError as e:
                raise RequestError("parse_error", f"not JSON: {e}") from None
            if not isinstance(req, dict):
                raise RequestError("invalid_request", f"a request is a JSON object, got {type(req).__name__}")
            rid = req.get("id")
            return {"id": rid, "ok": True, "result": self.dispatch(req)}
        except RequestError as e:
            return {"id": rid, "ok": False, "error": {"type": e.kind, "message": str(e)}}
        except SessionError as e:
            return {"id": rid, "ok": False, "error": {"type": "session_error", "message": str(e)}}
        except Exception as e:  # noqa: BLE001 - one bad request must not take the service down
            traceback.print_exc(file=sys.stderr)
            return {"id": rid, "ok": False, "error": {"type": "internal_error", "message": f"{type(e).__name__}: {e}"}}

    def serve(self, fin: IO[str], fout: IO[str]) -> None:
        for line in fin:
            if not line.strip():
                continue
            fout.write(json.dumps(self.handle(line), ensure_ascii=False, default=str) + "\n")
            fout.flush()
