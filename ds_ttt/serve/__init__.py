"""Serving a TTT agent: AgentSession (reset → act → observe …), the JSONL service, a sandboxed bash runner.

  session.py   AgentModel (frozen weights + tokenizer, shared) and AgentSession (per-episode W + KV cache)
  service.py   `python -m ds_ttt.serve --model EXPORT`: JSONL requests on stdin, responses on stdout
  runner.py    `python -m ds_ttt.serve.runner --model EXPORT --task TEXT`: the agent's bash tool calls
               executed in a throwaway sandbox directory with timeouts
See docs/serving.md.
"""

from ds_ttt.serve.session import AgentModel, AgentSession, SessionError

__all__ = ["AgentModel", "AgentSession", "SessionError"]
