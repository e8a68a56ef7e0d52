"""Serving a TTT agent: AgentSession (reset → act → observe …), the JSONL service, a sandboxed bash runner.

  session.py   AgentModel (frozen weights + tokenizer, shared) and AgentSession (per-episode W + KV cache)
  service.py   `python -m ds_ttt.serve --model EXPORT`: JSONL requests on stdin, responses on stdout
  kv_cache.py  the session's preallocated key/value cache (decoding writes in place)
  runner.py    `python -m ds_ttt.serve.runner --model EXPORT --task TEXT`: the agent's bash tool calls
               executed in a throwaway sandbox directory with timeouts
  http.py      `python -m ds_ttt.serve.http --model EXPORT`: an OpenAI-compatible chat-completions
               server (FastAPI + uvicorn) whose conversations are TTT sessions
  openai_api.py    the OpenAI wire format (request validation, replies, SSE chunks, error objects)
  conversations.py the server's sessions: lookup by session_id or message prefix, fork-and-commit,
                   per-session locks, LRU eviction
  harbor_agent.py  the Harbor agent (TTTAgent) that talks to http.py; harbor_env.py its sandbox-backed
                   Harbor environment. Both run in the Harbor venv, which has no torch: this package
                   therefore imports session.py (and torch) lazily, on first use of its names.
See docs/serving.md and docs/harbor.md.
"""

_SESSION_NAMES = ("AgentModel", "AgentSession", "ContextFullError", "SessionError")
__all__ = list(_SESSION_NAMES)


def __getattr__(name):
    if name in _SESSION_NAMES:
        from ds_ttt.serve import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
