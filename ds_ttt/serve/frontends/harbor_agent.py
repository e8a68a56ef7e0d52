"""TTTAgent: a Harbor agent that runs a trained ds_ttt model, served with test-time updates over HTTP.

    python -m ds_ttt.serve.frontends.http --model EXPORT --port 8000 &          # the project's venv (torch)
    .venv-harbor/bin/harbor run -d terminal-bench@2.0 \
        --agent ds_ttt.serve.frontends.harbor_agent:TTTAgent --ak server_url=http://127.0.0.1:8000/v1 ...

Runs in the Harbor venv (Python >= 3.12, `bash setup_harbor.sh`) and imports no torch: the model lives
in the server (`ds_ttt.serve.frontends.http`, OpenAI chat-completions + a `session_id` per conversation, one
inner update per tool result). See docs/harbor.md.

The loop is the one episode loop (ds_ttt/serve/episode.py), the closed-loop evaluation's and the task
CLI's, with this agent's act and tools (`ServerAgent`, `EnvironmentTools`):
  * messages = the generator's system prompt + the task instruction, tools = its `bash` tool;
  * every reply's tool calls run in the task's environment (stderr merged into stdout, stdin closed):
    in ds_ttt's SandboxEnvironment through its persistent shell, as the generator's episodes run
    (`cd`, exports and background jobs carry over, as in a terminal); elsewhere through
    `environment.exec` at the task's workdir, a fresh shell per command. The tool result is the
    sandbox's `format_observation` of it (exit code / timeout notes, long output cut), what the model
    saw in training; a malformed call gets `parse_bash_call`'s error text (ds_ttt/serve/tools.py);
  * the conversation goes back to the server with the `session_id` its first reply named, so that TTT
    session observes each tool result (one inner step on the fast weights) before it generates the
    next action (a reply from another session — the server found the history diverged — is an error);
  * it ends at a reply without tool calls, or after `max_rounds` replies. That final reply's answer is
    written to ANSWER_PATH (/logs/agent/answer.txt) in the environment, where the tests of ds_ttt's
    held-out tasks that check the agent's answer read it (ds_ttt/tasks/checks.py), and kept as
    logs_dir/answer.txt. The file is always written: empty when the episode gave no answer (max_rounds)
    or an unfinished one (a reply cut at max_tokens, an unclosed `<think>` or `<tool_call>`: stop
    "truncated"; ds_ttt/data/render.py `final_answer`), so neither half a command nor a file the agent
    wrote there itself is taken for its answer. A reply whose only tool calls did not parse (the
    server's `invalid_tool_calls`) also ends it (stop "invalid_tool_calls"): the OpenAI format has no
    tool result for a call without an id, whereas the in-process harnesses report such calls back as
    `[error: invalid tool call: …]` observations.
Serving a fleet (`harbor run -n 8` on one server):
  * a 409 (session busy), 429 (queue or memory full; its Retry-After is honoured), 5xx or a refused
    connection (a restarting server) is retried with exponential backoff (`max_retries`,
    `retry_backoff_sec` doubling up to `retry_backoff_max_sec`, with jitter);
  * a 404 for the session (evicted, expired, or the server restarted) is survived by replaying: the
    whole history goes back without `session_id`, and the server rebuilds the session from it — a
    prefill of the conversation plus one inner step per tool-result round so far (about the cost of
    one training event per round; a stored copy of a prefix is reused when the server still has one).
    The new session id is adopted and the replay counted (`replays` in the metadata);
  * the session is deleted on the server when the episode ends (also on an error);
  * without `seed` every attempt draws a fresh seed (recorded in the metadata), so pass@k attempts
    sample independently; with one, every attempt uses it.
The trajectory is written as ATIF (`logs_dir/trajectory.json`, Harbor's own pydantic model, ATIF-v1.8,
rewritten after every round) with the server's `ttt` object ({"session_id", "updates", "skipped",
"policy", ...}) and usage on each agent step, and for RL (the server's `return_token_ids` and logprobs)
the step's `prompt_token_ids`, `completion_token_ids` and `logprobs` in its metrics and, in its extra,
`inner_loss`: the loss of the inner step the server took on its tool results (reported with the next
reply; null when no reply followed). It imports with `data_prep/prepare.py` (ds_ttt/data/atif.py).

Options (`--ak key=value`; `server_url` also from $DS_TTT_SERVER_URL, `api_key` from $DS_TTT_API_KEY):
server_url, api_key, max_rounds, command_timeout_sec, temperature, top_p, max_tokens, seed, ttt (false:
frozen weights), max_output_chars, request_timeout_sec, max_retries, retry_backoff_sec,
retry_backoff_max_sec. The model is `-m NAME`, or the server's only model.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any

import openai
from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.agents.options import AgentOptions, Env
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.trajectories import Agent, FinalMetrics, Metrics, Observation, ObservationResult, Step, ToolCall
from harbor.models.trajectories import Trajectory
from pydantic import Field

import ds_ttt
from ds_ttt.data.generator import BASH_TOOL, SYSTEM_PROMPT
from ds_ttt.sandbox import CommandResult, format_observation
from ds_ttt.serve.episode import play_episode
from ds_ttt.serve.tools import parse_bash_call
from ds_ttt.tasks.checks import ANSWER_PATH

AGENT_NAME = "ds-ttt"
SERVER_URL_ENV = "DS_TTT_SERVER_URL"
API_KEY_ENV = "DS_TTT_API_KEY"
RETRY_STATUSES = (409, 429, 500, 502, 503, 504)
TIMEOUT_EXIT_CODE = 124  # the sandbox's code for a timed-out command


class TTTAgentOptions(AgentOptions):
    server_url: Annotated[str, Env(SERVER_URL_ENV, fallback=SERVER_URL_ENV)] = Field(
        default="http://127.0.0.1:8000/v1", description="OpenAI-compatible base URL of `python -m ds_ttt.serve.frontends.http`")
    max_rounds: int = Field(default=30, ge=1, description="at most this many model replies")
    command_timeout_sec: float = Field(default=60.0, gt=0, description="timeout of one bash tool call")
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=1024, ge=1, description="generation budget of one reply")
    seed: int | None = None
    ttt: bool = Field(default=True, description="false: the server answers with frozen weights")
    max_output_chars: int = Field(default=2000, ge=1, description="tool output kept (the generator's default)")
    request_timeout_sec: float = Field(default=600.0, gt=0, description="HTTP timeout of one completion")
    api_key: Annotated[str, Env(API_KEY_ENV, fallback=API_KEY_ENV)] = Field(
        default="ds-ttt", description="the server's --api-key (any value when it has none)")
    max_retries: int = Field(default=6, ge=0, description="retries of one request on 409/429/5xx/connection errors")
    retry_backoff_sec: float = Field(default=1.0, gt=0, description="first retry delay (doubles per retry)")
    retry_backoff_max_sec: float = Field(default=30.0, gt=0, description="longest retry delay")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _arguments_dict(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"raw_arguments": arguments}


class TTTAgent(BaseAgent):
    """Harbor agent: bash tool calls in the task environment, actions from the ds_ttt HTTP server."""

    capabilities = AgentCapabilities(atif=True)
    options_model = TTTAgentOptions

    @staticmethod
    def name() -> str:
        return AGENT_NAME

    def version(self) -> str | None:
        return ds_ttt.__version__

    @property
    def settings(self) -> TTTAgentOptions:
        assert isinstance(self.options, TTTAgentOptions)
        return self.options

    def _client(self) -> openai.AsyncOpenAI:
        # retries are ours (below): the client's would not replay an evicted session
        return openai.AsyncOpenAI(base_url=self.settings.server_url, api_key=self.settings.api_key,
                                  timeout=self.settings.request_timeout_sec, max_retries=0)

    async def _delete_session(self, session_id: str) -> bool:
        """DELETE /v1/sessions/{id}: the server frees its KV cache and fast weights now (True if deleted)."""
        import httpx

        url = f"{self.settings.server_url.rstrip('/')}/sessions/{session_id}"
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.delete(url, headers={"Authorization": f"Bearer {self.settings.api_key}"})
            return r.status_code == 200
        except httpx.HTTPError as e:
            self.logger.warning(f"ds_ttt server: could not delete session {session_id}: {e}")
            return False

    async def _model(self, client: openai.AsyncOpenAI) -> str:
        served = [m.id for m in (await client.models.list()).data]
        if self.model_name:
            if self.model_name not in served:
                raise ValueError(f"model {self.model_name!r} (-m) is not served at {self.settings.server_url}; "
                                 f"it serves {served}")
            return self.model_name
        if len(served) != 1:
            raise ValueError(f"{self.settings.server_url} serves {served}; pick one with -m NAME")
        return served[0]

    async def setup(self, environment: BaseEnvironment) -> None:
        """Nothing to install in the environment (the agent runs here); check the server answers."""
        async with self._client() as client:
            try:
                self._served_model = await self._model(client)
            except openai.APIConnectionError as e:
                raise RuntimeError(f"the ds_ttt server at {self.settings.server_url} is not reachable ({e}); start "
                                   "it with `python -m ds_ttt.serve.frontends.http --model EXPORT` or pass --ak server_url=...") from e

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        opts = self.settings
        session = f"harbor-{self.session_id or uuid.uuid4().hex}"  # the trajectory's; the server names its own
        steps = [Step(step_id=1, timestamp=_now(), source="system", message=SYSTEM_PROMPT),
                 Step(step_id=2, timestamp=_now(), source="user", message=instruction)]
        # a fresh seed per attempt unless one is set (pass@k attempts must not sample alike)
        seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1 << 31)
        stats = {"retries": 0, "replays": 0, "seed": seed, "deleted": False}
        async with self._client() as client:
            model = getattr(self, "_served_model", None) or await self._model(client)
            agent = ServerAgent(client, opts, self.logger, model, instruction, seed, stats)
            record = TrajectoryRecord(self, context, session, model, steps, agent)
            try:
                episode = await play_episode(agent, EnvironmentTools(environment, opts), max_rounds=opts.max_rounds,
                                             on_round=record.add_round)
            finally:
                if stats.get("server_session"):
                    stats["deleted"] = await self._delete_session(stats["server_session"])
        await self._write_answer(environment, episode.answer)
        record.write(stop=episode.stop)

    async def _write_answer(self, environment: BaseEnvironment, answer: str) -> None:
        """The reply that ended the episode, for tests that check the final answer (ds_ttt/tasks/checks.py):
        kept in the agent's logs and copied to ANSWER_PATH in the environment."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        path = self.logs_dir / "answer.txt"
        path.write_text(answer)
        await environment.upload_file(path, ANSWER_PATH)


class ServerAgent:
    """The episode loop's agent (ds_ttt/serve/episode.py): each action is a chat completion of the ds_ttt
    server, on the conversation so far, with the server's `session_id` once it named one; the tool results
    go back with the next request, and the server's session takes its inner step on them there."""

    reports_invalid_calls = False  # OpenAI's format has no tool result for a call without an id

    def __init__(self, client: openai.AsyncOpenAI, opts: TTTAgentOptions, logger, model: str, instruction: str,
                 seed: int, stats: dict):
        self.client, self.opts, self.logger, self.model, self.seed, self.stats = client, opts, logger, model, seed, stats
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
        self.server_session: str | None = None
        self.reply = None  # the last chat completion
        self.ttt: dict | None = None  # its `ttt` object

    def delay(self, attempt: int, error: Exception) -> float:
        """Retry-After when the server sent one, else exponential backoff with jitter."""
        opts = self.opts
        response = getattr(error, "response", None)
        after = response.headers.get("retry-after") if response is not None else None
        if after is not None:
            try:
                return min(float(after), opts.retry_backoff_max_sec)
            except ValueError:
                pass
        base = min(opts.retry_backoff_sec * 2 ** attempt, opts.retry_backoff_max_sec)
        return base * (0.5 + random.random() / 2)

    async def complete(self, **kwargs):
        """One chat completion, retried on 409/429/5xx and connection errors (module docstring)."""
        for attempt in range(self.opts.max_retries + 1):
            try:
                return await self.client.chat.completions.create(**kwargs)
            except openai.APIStatusError as e:
                if e.status_code not in RETRY_STATUSES or attempt == self.opts.max_retries:
                    raise
                error: Exception = e
            except openai.APIConnectionError as e:
                if attempt == self.opts.max_retries:
                    raise
                error = e
            self.stats["retries"] += 1
            delay = self.delay(attempt, error)
            self.logger.warning(f"ds_ttt server: {type(error).__name__} ({getattr(error, 'status_code', '')}); "
                                f"retry {attempt + 1}/{self.opts.max_retries} in {delay:.1f} s")
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def request(self):
        """The next reply; an evicted session (404) is rebuilt by replaying the whole history."""
        opts = self.opts
        while True:
            try:
                return await self.complete(
                    model=self.model, messages=self.messages, tools=[BASH_TOOL], temperature=opts.temperature,
                    top_p=opts.top_p, max_tokens=opts.max_tokens, seed=self.seed, logprobs=True,
                    extra_body={"ttt": opts.ttt, "return_token_ids": True}
                    | ({"session_id": self.server_session} if self.server_session else {}))
            except openai.NotFoundError as e:
                code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
                if self.server_session is None or code != "session_not_found":
                    raise
                # evicted, expired or a restarted server: replay the history into a new session
                self.logger.warning(f"ds_ttt server: session {self.server_session} is gone; replaying "
                                    f"{len(self.messages)} messages")
                self.stats["replays"] += 1
                self.server_session = self.stats["server_session"] = None

    async def act(self) -> dict:
        reply = self.reply = await self.request()
        ttt = self.ttt = (reply.model_extra or {}).get("ttt")
        if not isinstance(ttt, dict):
            raise RuntimeError(f"{self.opts.server_url} is not a ds_ttt server: its reply has no `ttt` object")
        if ttt["session_id"] != self.server_session:
            if self.server_session is not None:  # the server found our history diverged from its own
                self.logger.warning(f"ds_ttt server answered from session {ttt['session_id']}, not "
                                    f"{self.server_session}")
            self.server_session = self.stats["server_session"] = ttt["session_id"]
        choice = reply.choices[0]
        extra = choice.message.model_extra or {}
        assistant: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
        if extra.get("reasoning_content") is not None:
            assistant["reasoning_content"] = extra["reasoning_content"]
        calls = [c for c in (choice.message.tool_calls or []) if c.type == "function"]
        if calls:
            assistant["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in calls]
        self.messages.append(assistant)
        # the server's parse failures of <tool_call>; a reply cut at max_tokens is truncated
        return assistant | {"invalid_tool_calls": extra.get("invalid_tool_calls") or [],
                            "truncated": choice.finish_reason == "length"}

    def observe(self, outputs: list[str]) -> None:
        """The tool results join the conversation; the server observes them with the next request."""
        calls = self.messages[-1]["tool_calls"]
        self.messages += [{"role": "tool", "tool_call_id": c["id"], "content": o} for c, o in zip(calls, outputs)]


class EnvironmentTools:
    """The episode loop's tools: bash calls run in the task's Harbor environment (module docstring)."""

    def __init__(self, environment: BaseEnvironment, opts: TTTAgentOptions):
        self.environment, self.opts = environment, opts

    async def execute(self, call: dict) -> str:
        fn = call["function"]
        command, error = parse_bash_call(fn["name"], fn["arguments"])
        return error if command is None else await self.run_command(command)

    async def run_command(self, command: str) -> str:
        env, timeout, max_chars = self.environment, self.opts.command_timeout_sec, self.opts.max_output_chars
        if hasattr(env, "shell"):  # ds_ttt's SandboxEnvironment: one persistent shell per episode
            return format_observation(await env.shell(command, timeout_sec=timeout), max_chars=max_chars)
        try:  # other environments (docker, ...): a fresh shell per command through Harbor's exec
            # stderr into stdout in order, as the training sandbox captured it
            result = await env.exec(f"exec 2>&1\n{command}", timeout_sec=timeout)
        except RuntimeError as e:
            if not str(e).startswith("Command timed out"):
                raise
            return format_observation(CommandResult(command, "", TIMEOUT_EXIT_CODE, timed_out=True), max_chars=max_chars)
        output = (result.stdout or "") + (result.stderr or "")
        return format_observation(CommandResult(command, output, result.return_code), max_chars=max_chars)


class TrajectoryRecord:
    """The episode as ATIF (`logs_dir/trajectory.json`, Harbor's pydantic model) and Harbor's context,
    rewritten after every round."""

    def __init__(self, harbor_agent: TTTAgent, context: AgentContext, session: str, model: str, steps: list[Step],
                 agent: ServerAgent):
        self.logs_dir, self.server_url = harbor_agent.logs_dir, harbor_agent.settings.server_url
        self.context, self.session, self.model, self.steps, self.agent = context, session, model, steps, agent
        self.totals = {"prompt": 0, "completion": 0}

    def add_round(self, r) -> None:
        """One agent step per round of the episode loop (its message, tool calls and their results)."""
        reply, ttt, message = self.agent.reply, self.agent.ttt, r.message
        calls = message.get("tool_calls") or []
        usage = reply.usage
        if usage is not None:
            self.totals["prompt"] += usage.prompt_tokens
            self.totals["completion"] += usage.completion_tokens
        invalid = message["invalid_tool_calls"]
        if (ttt or {}).get("observed") and self.steps[-1].source == "agent":  # the inner step on the last results
            self.steps[-1].extra["inner_loss"] = ttt.get("obs_loss")
        self.steps.append(Step(
            step_id=len(self.steps) + 1, timestamp=_now(), source="agent", model_name=self.model,
            message=message["content"], reasoning_content=message.get("reasoning_content"),
            tool_calls=[ToolCall(tool_call_id=c["id"], function_name=c["function"]["name"],
                                 arguments=_arguments_dict(c["function"]["arguments"])) for c in calls] or None,
            observation=Observation(results=[ObservationResult(source_call_id=c["id"], content=o)
                                             for c, o in zip(calls, r.outputs)]) if calls else None,
            metrics=self.metrics(reply),
            extra={"ttt": ttt, "finish_reason": reply.choices[0].finish_reason, "inner_loss": None}
            | ({"invalid_tool_calls": invalid} if invalid else {})
            | {k: v for k, v in (reply.choices[0].model_extra or {}).items() if k == "token_ids_error"}))
        self.write(stop=None)

    @staticmethod
    def metrics(reply) -> Metrics:
        """Usage and, for RL, the reply's token ids and logprobs (the server's return_token_ids, vLLM's
        fields); a server that sent none of them leaves them out."""
        choice, usage = reply.choices[0], reply.usage
        logprobs = choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else None
        return Metrics(prompt_tokens=usage.prompt_tokens if usage else None,
                       completion_tokens=usage.completion_tokens if usage else None,
                       prompt_token_ids=(reply.model_extra or {}).get("prompt_token_ids"),
                       completion_token_ids=(choice.model_extra or {}).get("token_ids"),
                       logprobs=[lp.logprob for lp in logprobs] if logprobs is not None else None)

    def write(self, stop: str | None) -> None:
        ttt, totals = self.agent.ttt, self.totals
        self.context.n_input_tokens = totals["prompt"]
        self.context.n_output_tokens = totals["completion"]
        self.context.metadata = {"session_id": self.session, "rounds": len(self.steps) - 2, "stop": stop, "ttt": ttt,
                                 **{k: v for k, v in self.agent.stats.items() if k != "server_session"}}
        trajectory = Trajectory(
            session_id=self.session,
            agent=Agent(name=AGENT_NAME, version=ds_ttt.__version__, model_name=self.model, tool_definitions=[BASH_TOOL]),
            steps=self.steps,
            final_metrics=FinalMetrics(total_prompt_tokens=totals["prompt"],
                                       total_completion_tokens=totals["completion"], total_steps=len(self.steps),
                                       extra={"ttt": ttt, "stop": stop}),
            extra={"source": "harbor/ds-ttt", "meta": {"server_url": self.server_url, "stop": stop}})
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        path = self.logs_dir / "trajectory.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(trajectory.to_json_dict(), indent=2, ensure_ascii=False))
        tmp.replace(path)
