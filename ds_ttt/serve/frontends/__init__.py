"""The front ends of the serving engine: the ways a model served by ds_ttt/serve/ is reached.

  jsonl.py         `python -m ds_ttt.serve --model EXPORT`: JSONL requests on stdin, responses on stdout
                   (the protocol: ds_ttt/serve/service.py)
  http.py          `python -m ds_ttt.serve.frontends.http --model EXPORT`: an OpenAI-compatible
                   chat-completions server (FastAPI + uvicorn) whose conversations are TTT sessions
                   (wire format: ds_ttt/serve/openai_api.py; sessions: ds_ttt/serve/conversations.py)
  task_cli.py      `python -m ds_ttt.serve.frontends.task_cli --model EXPORT --task TEXT`: one episode of
                   the episode loop with its bash tool calls in a throwaway sandbox
  harbor_agent.py  the Harbor agent (`ds_ttt.serve.frontends.harbor_agent:TTTAgent`) that talks to http.py
  harbor_env.py    its sandbox-backed Harbor environment (`ds_ttt.serve.frontends.harbor_env:SandboxEnvironment`)

The Harbor modules run in the Harbor venv, which has no torch: nothing here imports torch at import time
but jsonl.py, http.py and task_cli.py, which the Harbor modules never import. See docs/serving.md.
"""
