"""An OpenAI-compatible chat-completions server whose conversations learn at test time.

    .venv/bin/python -m ds_ttt.serve.http --model EXPORT [--host 127.0.0.1] [--port 8000] [--device cpu] \
        [--attention-backend {auto,reference,cpu,cuda}] [--max-sessions 64] [--max-new-tokens 1024] \
        [--served-model-name NAME] [--busy-timeout 60]

Endpoints (FastAPI on uvicorn):
  GET  /health                    {"status": "ok", "model", "sessions", "policy", "attention_backend"}
  GET  /v1/models                 the served model (its name: the export directory's, or --served-model-name)
  GET  /v1/models/{model}
  POST /v1/chat/completions       OpenAI's request and reply (stream: SSE chunks as tokens arrive), plus a top-level
                                  "ttt": {"session_id", "updates", "skipped", "policy", "enabled", ...}
  GET  /v1/sessions/{id}          a conversation's ttt state;  DELETE /v1/sessions/{id} closes it

Every conversation is a TTT session (ds_ttt/serve/conversations.py): tool results that arrived since
its last reply are observed first, one inner update each round exactly as `AgentSession.observe`;
`session_id` in the body (the openai client's `extra_body`) names it, else its message prefix finds it;
`"ttt": false` answers with frozen weights. Request format and errors: ds_ttt/serve/openai_api.py.
With --port 0 the server binds a free port and prints it. Logs go to stderr. docs/serving.md.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=[...], tools=[...])
    r.ttt["updates"]            # (the openai client keeps unknown fields: r.model_extra["ttt"])
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import secrets
import socket
import sys
import time
import traceback

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ds_ttt.serve.conversations import ConversationStore
from ds_ttt.serve.openai_api import APIError, ChatStream, completion, finish_reason, parse_chat_request


def create_app(store: ConversationStore, model_name: str):
    """The ASGI app serving `store` under the model id `model_name`."""
    app = FastAPI(title="ds_ttt", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "ds_ttt"}

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        traceback.print_exc(file=sys.stderr)
        return error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "sessions": len(store), "max_sessions": store.max_sessions,
                "policy": store.agent.model.ttt.context_policy, "attention_backend": store.agent.attention_backend}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return model_card

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str):
        return store.ttt_info(store.get(session_id))

    @app.delete("/v1/sessions/{session_id}")
    async def close(session_id: str):
        await anyio.to_thread.run_sync(store.close, session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
        req = parse_chat_request(body, served_model=model_name)
        reply_id, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if not req.stream:
            result = await anyio.to_thread.run_sync(store.chat, req)  # the model runs off the event loop
            return reply_of(result, reply_id, created)
        return await stream(req, reply_id, created)

    def reply_of(result, reply_id: str, created: int) -> dict:
        return completion(reply_id, model_name, result.message, finish_reason(result.message, result.truncated),
                          {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                           "total_tokens": result.prompt_tokens + result.completion_tokens}, result.ttt, created)

    async def stream(req, reply_id: str, created: int):
        """SSE while generating: the request runs in a worker thread whose on_token callback feeds a
        queue; an error before the first token is a plain error reply (status and error object)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(event):
            loop.call_soon_threadsafe(events.put_nowait, event)

        def work():
            try:
                put(("done", store.chat(req, on_token=lambda tok: put(("token", tok)))))
            except Exception as e:  # noqa: BLE001 - delivered to the stream
                put(("error", e))
        loop.run_in_executor(None, work)
        first = await events.get()
        if first[0] == "error":
            raise first[1]
        out = ChatStream(reply_id, model_name, created)
        tokenizer = store.agent.tokenizer

        async def body():
            yield "".join(out.start())
            ids, event = [], first
            while True:
                kind, value = event
                if kind == "token":
                    ids.append(value)
                    for chunk in out.text(tokenizer.decode(ids, skip_special_tokens=False)):
                        yield chunk
                elif kind == "done":
                    yield "".join(out.end(reply_of(value, reply_id, created), include_usage=req.include_usage))
                    return
                else:
                    if not isinstance(value, APIError):
                        traceback.print_exception(value, file=sys.stderr)
                        value = APIError(500, f"internal error: {type(value).__name__}: {value}", type="server_error")
                    yield "".join(out.error(value))
                    return
                event = await events.get()
        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free port, read it back with sock.getsockname())."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def make_server(app, sock: socket.socket, *, log_level: str = "warning"):
    """A uvicorn Server for `app` on `sock`; run with server.run(sockets=[sock]), stop with
    server.should_exit = True."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))


def main(argv=None) -> int:
    from ds_ttt.config import ATTENTION_BACKENDS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="export directory (launch/export.py) or training checkpoint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention kernel: reference (default), auto (cuda on a GPU, cpu kernel on a CPU), cpu, cuda")
    p.add_argument("--max-sessions", type=int, default=64, help="conversations kept; the least recently used idle "
                   "one is evicted beyond it")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="reply length when a request sets no max_tokens")
    p.add_argument("--served-model-name", default=None, help="model id (default: the export directory's name)")
    p.add_argument("--busy-timeout", type=float, default=60.0,
                   help="seconds a request waits for its busy session before a 409")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    from ds_ttt.serve.session import AgentModel

    agent = AgentModel.load(args.model, device=args.device, attention_backend=args.attention_backend)
    name = args.served_model_name or pathlib.Path(args.model).resolve().name
    store = ConversationStore(agent, max_sessions=args.max_sessions, max_new_tokens=args.max_new_tokens,
                              busy_timeout=args.busy_timeout)
    sock = bind(args.host, args.port)
    server = make_server(create_app(store, name), sock, log_level=args.log_level)
    host, port = sock.getsockname()[:2]
    print(f"[ds_ttt.serve.http] serving {name!r} ({args.model}) on http://{host}:{port}/v1 — device {args.device}, "
          f"attention {agent.attention_backend}, policy {agent.model.ttt.context_policy}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
