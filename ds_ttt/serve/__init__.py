"""Serving a TTT agent: the engine (sessions, batched decode, caches), the episode loop, and its front ends.

The engine (every path builds a cache and calls the model's one incremental entry, model.step):
  session.py       AgentSession (per-episode W + KV cache: reset, reply, observe, fork)
  agent_model.py   AgentModel (frozen weights + tokenizer, shared; its decode pool)
  session_state.py the episode's state, RoundLog and the session errors
  round0.py        round 0 (system block + the rest) rendered once at reset
  decode.py        Decode (one reply token by token), DecodeOptions, token choice and per-row stats
  session_chunk.py one session's chunk through model.step; pooled_chunk.py many sessions' rows in one
  batch.py, prefill.py  batched decode and batched prefill over the KV pool (kv_pool.py, prefix_cache.py)
  kv_cache.py      the session's preallocated key/value cache, owning its key state (key_prev, commit_keys)
  scheduler.py     BatchScheduler: many sessions' replies decoded in one forward (DirectEngine: one alone)
  conversations.py the HTTP server's sessions: lookup by session_id or message prefix (conversation_match.py),
                   fork-and-commit, per-session locks, LRU eviction
  service.py       the JSONL protocol over named sessions
  openai_api.py    the OpenAI wire format (request validation, replies, SSE chunks, error objects)
The episode:
  tools.py         the `bash` tool: parse a call, run it in an episode's sandboxed shell (BashToolRunner)
  episode.py       the one loop act -> run tools -> observe (inner step), used by every harness
The front ends (frontends/): JSONL (`python -m ds_ttt.serve`), OpenAI-compatible HTTP
(`python -m ds_ttt.serve.frontends.http`), the task CLI (`python -m ds_ttt.serve.frontends.task_cli`), and
the Harbor agent + environment. The Harbor modules run in the Harbor venv, which has no torch: this
package therefore imports session.py (and torch) lazily, on first use of its names.
See docs/serving.md and docs/harbor.md.
"""

_SESSION_NAMES = ("AgentModel", "AgentSession", "ContextFullError", "SessionError")
__all__ = list(_SESSION_NAMES)


def __getattr__(name):
    if name in _SESSION_NAMES:
        from ds_ttt.serve import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
