"""An OpenAI-compatible chat-completions server whose conversations learn at test time.

    .venv/bin/python -m ds_ttt.serve.frontends.http --model EXPORT [--host 127.0.0.1] [--port 8000] [--device cpu] \
        [--attention-backend {auto,reference,cpu,cuda}] [--max-sessions 64] [--max-new-tokens 1024] \
        [--served-model-name NAME] [--busy-timeout 60] [--api-key KEY (or $DS_TTT_API_KEY)] \
        [--max-model-len N] [--max-tokens-cap N] [--max-body-bytes 8MiB] [--max-active 16] [--max-queue 64] \
        [--memory-budget BYTES] [--idle-timeout 1800] [--max-n 8] [--prefix-cache-entries 4] [--no-batching]

Endpoints (FastAPI on uvicorn):
  GET  /health                    {"status": "ok", "model", "sessions", "policy", "attention_backend", "memory",
                                  "scheduler" (batched: steps, decoded tokens, mean batch, decode/chunk seconds), ...}
  GET  /v1/models                 the served model (its name: the export directory's, or --served-model-name),
                                  with its context length ("context_length", "max_model_len")
  GET  /v1/models/{model}
  POST /v1/chat/completions       OpenAI's request and reply (stream: SSE chunks as tokens arrive), plus a top-level
                                  "ttt": {"session_id", "updates", "skipped", "policy", "enabled", ...}
  GET  /v1/sessions/{id}          a conversation's ttt state;  DELETE /v1/sessions/{id} closes it

With --api-key (or $DS_TTT_API_KEY; several keys comma-separated) every /v1 request needs
`Authorization: Bearer KEY` (else 401, an OpenAI error object), and a conversation belongs to the key
that made it: another key can neither find, continue, read nor delete it. Replies are decoded in one
batch across sessions (ds_ttt/serve/scheduler.py; --no-batching: every request decodes alone).
Bounds: --max-body-bytes (413), --max-tokens-cap (400), --max-active running + --max-queue waiting
requests (beyond: 429 with Retry-After), --memory-budget for every session's KV cache and fast weights
(counting those being built), --idle-timeout; a client that disconnects cancels its request, and
nothing of it is committed. New conversations take their system prompt's keys/values from a per-key
cache (--prefix-cache-entries; exact, reported as usage.prompt_tokens_details.cached_tokens). Conversations: ds_ttt/serve/conversations.py; wire format:
ds_ttt/serve/openai_api.py. With --port 0 the server binds a free port and prints it. Logs go to
stderr. docs/serving.md.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything without --api-key")
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=[...], tools=[...])
    r.ttt["updates"]            # (the openai client keeps unknown fields: r.model_extra["ttt"])
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import pathlib
import secrets
import threading
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
from ds_ttt.serve.scheduler import Cancelled

API_KEY_ENV = "DS_TTT_API_KEY"
DISCONNECT_POLL_SEC = 0.25


def key_id(key: str) -> str:
    """What a conversation records of its owner: a hash of the API key, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def log(message: str) -> None:
    print(f"[ds_ttt.serve.frontends.http] {message}", file=sys.stderr, flush=True)


class ChatServer:
    """The handlers of the app (create_app registers them): authentication, bounded bodies, the chat
    endpoint with cancellation and streaming, the model and session endpoints."""

    def __init__(self, store: ConversationStore, model_name: str, *, api_keys: list[str] | None = None,
                 max_body_bytes: int = 8 << 20, max_tokens_cap: int | None = None, max_n: int = 8):
        self.store, self.model_name = store, model_name
        self.keys = [k for k in (api_keys or []) if k]
        self.max_body_bytes, self.max_tokens_cap, self.max_n = max_body_bytes, max_tokens_cap, max_n
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "ds_ttt",
                           "context_length": store.max_context, "max_model_len": store.max_context}

    # ---- access and input ------------------------------------------------------------------------
    def owner_of(self, request: Request) -> str | None:
        """The caller's key id (None without --api-key); 401 for a missing or wrong key. Every /v1
        handler calls it first (a plain call, not an HTTP middleware: Starlette's BaseHTTPMiddleware
        hides the client's disconnect from the handler, which cancellation needs)."""
        if not self.keys:
            return None
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "You didn't provide an API key (Authorization: Bearer KEY)", type="invalid_request_error",
                           code="invalid_api_key")
        token = token.strip()
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in self.keys):
            raise APIError(401, "Incorrect API key provided", type="invalid_request_error", code="invalid_api_key")
        return key_id(token)

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"the request body exceeds {self.max_body_bytes} bytes (--max-body-bytes)",
                           code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise too_big
            parts.append(part)
        return b"".join(parts)

    # ---- small endpoints -------------------------------------------------------------------------
    async def health(self):
        store = self.store
        return {"status": "ok", "model": self.model_name, "sessions": len(store), "max_sessions": store.max_sessions,
                "policy": store.agent.model.ttt.context_policy, "attention_backend": store.agent.attention_backend,
                "max_model_len": store.max_context, "batched": store.engine.batched, "memory": store.memory(),
                "scheduler": store.engine.stats() if store.engine.batched else None}

    async def models(self, request: Request):
        self.owner_of(request)
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model: str, request: Request):
        self.owner_of(request)
        if model != self.model_name:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return self.model_card

    async def session(self, session_id: str, request: Request):
        return self.store.ttt_info(self.store.get(session_id, self.owner_of(request)))

    async def close(self, session_id: str, request: Request):
        await anyio.to_thread.run_sync(self.store.close, session_id, self.owner_of(request))
        return {"id": session_id, "object": "session", "deleted": True}

    # ---- chat completions ------------------------------------------------------------------------
    async def chat(self, request: Request):
        owner = self.owner_of(request)  # before the body is read
        # request threads wait on the scheduler (or run the model): one per admitted or queued request
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, self.store.max_active + self.store.max_queue + 8)
        raw = await self.read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
        req = parse_chat_request(body, served_model=self.model_name, max_tokens_cap=self.max_tokens_cap,
                                 max_n=self.max_n)
        if req.ignored:
            log(f"ignored unknown request field(s): {', '.join(req.ignored)}")
        reply_id, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        if not req.stream:
            result = await self.run_cancellable(request, req, owner)  # the model runs off the event loop
            if req.return_token_ids:
                return self.reply_of(result, reply_id, created, tokens=self.token_ids_of(result, owner))
            return self.reply_of(result, reply_id, created)
        return await self.stream(req, reply_id, created, owner)

    async def run_cancellable(self, request: Request, req, owner):
        """store.chat in a worker thread; a client that goes away cancels it (nothing is committed)."""
        cancel = threading.Event()
        task = asyncio.ensure_future(anyio.to_thread.run_sync(
            lambda: self.store.chat(req, owner=owner, cancel=cancel)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SEC)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    cancel.set()
                    log("client disconnected: request cancelled")
                    try:
                        await task
                    except Cancelled:
                        pass
                    raise APIError(499, "the client disconnected; the request was cancelled", code="cancelled")
        except asyncio.CancelledError:
            cancel.set()
            raise

    def reply_of(self, result, reply_id: str, created: int, tokens: tuple | None = None) -> dict:
        choices = [{"message": c["message"], "finish_reason": finish_reason(c["message"], c["truncated"]),
                    "logprobs": c["logprobs"], "ttt": c["ttt"]} for c in result.choices]
        ttt = result.ttt
        if tokens is not None:  # return_token_ids: token ids per choice, the observation's inner loss in ttt
            prompt_ids, per_choice = tokens
            choices = [c | {"token_ids": ids, "ttt": c["ttt"] | {"obs_loss": loss}}
                       | ({"token_ids_error": error} if error else {}) for c, (ids, loss, error) in zip(choices, per_choice)]
            ttt = choices[0]["ttt"]
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                 "total_tokens": result.prompt_tokens + result.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
        return completion(reply_id, self.model_name, choices, usage, ttt, created,
                          prompt_token_ids=None if tokens is None else tokens[0])

    def token_ids_of(self, result, owner) -> tuple[list[int] | None, list[tuple]]:
        """(prompt ids, [(reply ids, inner loss of the observation this request fed, error)] per choice), read
        from each choice's session right after its reply was committed. A session evicted meanwhile has no
        ids to give: its choice says so (token_ids null, token_ids_error naming why), the reply stands. One
        that moved on (a second request on the conversation) is a 409 rather than another reply's ids."""
        prompt, per_choice = None, []
        end = len(self.store.agent.action_end_ids)
        for c in result.choices:
            ttt = c["ttt"]
            try:
                session = self.store.get(ttt["session_id"], owner).session
            except APIError as e:
                if e.status != 404:
                    raise
                per_choice.append((None, None, f"session {ttt['session_id']} was evicted before its token ids were "
                                   "read"))
                continue
            ids, history = list(session.input_ids), session.history
            if len(ids) != ttt["num_tokens"]:
                raise APIError(409, f"session {ttt['session_id']} moved on before its token ids were read (another "
                               "request on it); send one request per conversation at a time", param="return_token_ids",
                               code="session_busy")
            action = list(history[-1].action_ids)
            prompt = ids[:len(ids) - len(action) - end]
            if len(prompt) != result.prompt_tokens:
                raise AssertionError(f"prompt ids {len(prompt)} != usage.prompt_tokens {result.prompt_tokens}")
            loss = history[-2].obs_nll if ttt.get("observed") and len(history) > 1 else None
            per_choice.append((action, loss, None))
        return prompt, per_choice

    async def stream(self, req, reply_id: str, created: int, owner):
        """SSE while generating: the request runs in a worker thread whose on_token callback feeds a
        queue; an error before the first token is a plain error reply (status and error object)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(event):
            loop.call_soon_threadsafe(events.put_nowait, event)

        def work():
            try:
                put(("done", self.store.chat(req, on_token=lambda tok: put(("token", tok)), owner=owner,
                                             cancel=cancel)))
            except Cancelled:
                log("client disconnected mid-stream: request cancelled, nothing committed")
            except Exception as e:  # noqa: BLE001 - delivered to the stream
                put(("error", e))
        asyncio.ensure_future(anyio.to_thread.run_sync(work))
        try:
            first = await events.get()
        except asyncio.CancelledError:
            cancel.set()
            raise
        if first[0] == "error":
            raise first[1]

        async def body():
            try:
                async for chunk in self._sse(req, reply_id, created, first, events):
                    yield chunk
            finally:  # the client went away (the generator is closed) or the reply ended
                cancel.set()
        return StreamingResponse(body(), media_type="text/event-stream")

    async def _sse(self, req, reply_id: str, created: int, event, events: asyncio.Queue):
        """The SSE chunks of a streamed reply, from its first event on."""
        out = ChatStream(reply_id, self.model_name, created)
        tokenizer = self.store.agent.tokenizer
        yield "".join(out.start())
        ids = []
        while True:
            kind, value = event
            if kind == "token":
                ids.append(value)
                for chunk in out.text(tokenizer.decode(ids, skip_special_tokens=False)):
                    yield chunk
            elif kind == "done":
                yield "".join(out.end(self.reply_of(value, reply_id, created), include_usage=req.include_usage))
                return
            else:
                if not isinstance(value, APIError):
                    traceback.print_exception(value, file=sys.stderr)
                    value = APIError(500, f"internal error: {type(value).__name__}: {value}", type="server_error")
                yield "".join(out.error(value))
                return
            event = await events.get()


def error_response(e: APIError) -> JSONResponse:
    """An OpenAI error object with the error's status (and Retry-After for a 429)."""
    headers = {"Retry-After": f"{max(1, round(e.retry_after))}"} if getattr(e, "retry_after", None) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(store: ConversationStore, model_name: str, **options):
    """The ASGI app serving `store` under the model id `model_name`; options: ChatServer's (api_keys,
    max_body_bytes, max_tokens_cap, max_n; the module docstring). Every error is an OpenAI error object."""
    server = ChatServer(store, model_name, **options)
    app = FastAPI(title="ds_ttt", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        traceback.print_exc(file=sys.stderr)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model:path}")(server.model)
    app.get("/v1/sessions/{session_id}")(server.session)
    app.delete("/v1/sessions/{session_id}")(server.close)
    app.post("/v1/chat/completions")(server.chat)
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
    p.add_argument("--api-key", default=None, help=f"required Bearer key(s), comma-separated (default: ${API_KEY_ENV}; "
                   "unset: no authentication, every conversation has the same owner)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length served (default: the model's)")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens a request may ask (else 400)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body (else 413)")
    p.add_argument("--max-active", type=int, default=16, help="requests served at once (the decode batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond --max-active (else 429)")
    p.add_argument("--memory-budget", type=int, default=None,
                   help="bytes for every session's KV cache + fast weights, sessions being built included "
                        "(default: unbounded; idle sessions are evicted to make room, else 429)")
    p.add_argument("--idle-timeout", type=float, default=1800.0, help="seconds before an idle conversation is dropped")
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices) of one request")
    p.add_argument("--prefix-cache-entries", type=int, default=4,
                   help="system prompts (+ tool schemas) whose keys/values are kept for new conversations of the "
                        "same API key (0: none); counted in --memory-budget")
    p.add_argument("--no-batching", action="store_true", help="decode every request alone (the unbatched path)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    from ds_ttt.serve.scheduler import BatchScheduler, DirectEngine
    from ds_ttt.serve.session import AgentModel

    agent = AgentModel.load(args.model, device=args.device, attention_backend=args.attention_backend)
    name = args.served_model_name or pathlib.Path(args.model).resolve().name
    engine = DirectEngine() if args.no_batching else BatchScheduler(agent, max_batch=args.max_active)
    store = ConversationStore(agent, max_sessions=args.max_sessions, max_new_tokens=args.max_new_tokens,
                              busy_timeout=args.busy_timeout, max_context=args.max_model_len,
                              memory_budget=args.memory_budget, idle_timeout=args.idle_timeout,
                              max_active=args.max_active, max_queue=args.max_queue, engine=engine,
                              prefix_cache_entries=args.prefix_cache_entries)
    store.start_reaper()
    raw_keys = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    keys = [k.strip() for k in raw_keys.split(",") if k.strip()]
    sock = bind(args.host, args.port)
    server = make_server(create_app(store, name, api_keys=keys, max_body_bytes=args.max_body_bytes,
                                    max_tokens_cap=args.max_tokens_cap, max_n=args.max_n), sock,
                         log_level=args.log_level)
    host, port = sock.getsockname()[:2]
    log(f"serving {name!r} ({args.model}) on http://{host}:{port}/v1 — device {args.device}, attention "
        f"{agent.attention_backend}, policy {agent.model.ttt.context_policy}, max model len {store.max_context}, "
        f"{'batched' if engine.batched else 'unbatched'} decode, auth {'on' if keys else 'off'}")
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
