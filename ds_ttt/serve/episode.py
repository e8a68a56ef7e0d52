"""The episode loop, the one every harness runs: act -> run the tool calls -> observe (one inner step).

    from ds_ttt.serve.episode import SessionAgent, run_episode
    session.reset(task)                                          # round 0: system prompt, tool, task
    episode = run_episode(SessionAgent(session), tools, max_rounds=20, on_round=print)
    episode.stop, episode.answer, episode.rounds                 # "answer" | "truncated" | ...

    episode = await play_episode(agent, tools, max_rounds=30)    # the same loop inside an event loop

Used by the closed-loop evaluation (ds_ttt/evaluation/closed_loop.py: in-process sessions on a batched
scheduler), the task CLI (ds_ttt/serve/frontends/task_cli.py) and the Harbor agent
(ds_ttt/serve/frontends/harbor_agent.py: replies from the HTTP server, commands in Harbor's environment).
Each round:
  1. `agent.act()` returns the assistant message: content, tool_calls [{"id"?, "function": {"name",
     "arguments"}}], invalid_tool_calls [{"error", ...}] (a `<tool_call>` that did not parse), truncated;
  2. a reply without tool calls is the final one: stop "truncated" when it was cut at its token budget
     or is unfinished (an unclosed `<think>` or `<tool_call>`, ds_ttt/data/render.py `reply_is_unfinished`),
     else "answer" with `answer` = its content (`final_answer`);
  3. otherwise every tool call runs (`tools.execute(call)`, in order) and each invalid call is reported
     as `[error: invalid tool call: …]`; an agent whose wire format has no tool result for a call without
     an id (`reports_invalid_calls = False`, the Harbor agent) ends the episode instead (stop
     "invalid_tool_calls") when no valid call is left;
  4. `agent.observe(outputs)` feeds the results back: the session's inner step on its fast weights (the
     Harbor agent sends them with its next request, and the server takes the step there). Its return
     value, the observation's loss under the weights before the update, is kept in the round.
The loop stops at the final reply or after `max_rounds` replies (stop "max_rounds"). An agent ends the
episode early by raising `EpisodeEnd(stop)` (an in-process session whose context is full: "context_full");
the rounds so far are kept. Agents, tools and `on_round` may be plain or async: a returned awaitable is
awaited, so one loop serves threads (`run_episode`) and an event loop (`play_episode`).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

from ds_ttt.data.render import final_answer, reply_is_unfinished

STOPS = ("answer", "truncated", "max_rounds", "invalid_tool_calls", "context_full")


def invalid_call_observation(invalid: dict) -> str:
    """What the model reads for a `<tool_call>` that did not parse (the generator's wording)."""
    return f"[error: invalid tool call: {invalid['error']}]"


class EpisodeEnd(Exception):
    """Raised by an agent's act/observe to end the episode with `stop`; the rounds so far are kept."""

    def __init__(self, stop: str):
        if stop not in STOPS:
            raise ValueError(f"EpisodeEnd stop={stop!r}: choose one of {STOPS}")
        super().__init__(stop)
        self.stop = stop


@dataclass
class Round:
    round: int  # 1, 2, ... (the session's round after acting)
    message: dict  # the assistant message act() returned
    outputs: list[str] | None = None  # tool results, in call order then invalid calls (None: final reply)
    obs_loss: float | None = None  # what observe() returned: the observation's loss before the update

    def to_dict(self) -> dict:
        out = {"round": self.round, "message": self.message}
        if self.outputs is not None:
            out |= {"outputs": self.outputs, "obs_loss": self.obs_loss}
        return out


@dataclass
class Episode:
    stop: str = "max_rounds"  # one of STOPS
    answer: str = ""  # the final reply's answer ("" unless stop == "answer")
    rounds: list[Round] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.stop == "answer"


async def _value(x):
    return await x if inspect.isawaitable(x) else x


async def play_episode(agent, tools, *, max_rounds: int, on_round=None) -> Episode:
    """The loop (module docstring) on an agent whose episode has been reset."""
    episode = Episode()
    report_invalid = getattr(agent, "reports_invalid_calls", True)
    try:
        for num in range(1, max_rounds + 1):
            message = await _value(agent.act())
            calls = message.get("tool_calls") or []
            invalid = message.get("invalid_tool_calls") or []
            if not calls and (not invalid or not report_invalid):
                content, truncated = message.get("content") or "", bool(message.get("truncated"))
                if reply_is_unfinished(content, truncated=truncated):
                    episode.stop = "truncated"
                elif invalid:  # nothing to send back: the wire format has no result for a call without an id
                    episode.stop = "invalid_tool_calls"
                else:
                    episode.stop, episode.answer = "answer", final_answer(content, truncated=False)
                episode.rounds.append(Round(num, message))
                await _value(on_round and on_round(episode.rounds[-1]))
                break
            outputs = [await _value(tools.execute(c)) for c in calls]
            if report_invalid:
                outputs += [invalid_call_observation(b) for b in invalid]
            episode.rounds.append(Round(num, message, outputs))
            episode.rounds[-1].obs_loss = await _value(agent.observe(outputs))
            await _value(on_round and on_round(episode.rounds[-1]))
    except EpisodeEnd as end:
        episode.stop = end.stop
    return episode


def run_episode(agent, tools, *, max_rounds: int, on_round=None) -> Episode:
    """`play_episode` from plain (threaded) code: its own event loop, run to the end."""
    return asyncio.run(play_episode(agent, tools, max_rounds=max_rounds, on_round=on_round))


class SessionAgent:
    """An in-process AgentSession (ds_ttt/serve/session.py) as the loop's agent, its model work run by
    `engine` (a BatchScheduler, or DirectEngine: the calling thread decodes alone).

    Per act it records what an RL trainer reads (`turns`): the prompt's token ids (everything the model
    had seen, then the assistant header), the reply's token ids (its closing <|im_end|> last) and the
    log-probability of each of them under the model (temperature 1) but that closing token, as OpenAI's
    and vLLM's logprobs leave it out (a reply cut at its budget was closed by one the model did not
    generate). A full context ends the episode ("context_full")."""

    def __init__(self, session, engine=None):
        if engine is None:
            from ds_ttt.serve.scheduler import DirectEngine

            engine = DirectEngine()
        self.session, self.engine = session, engine
        self.turns: list[dict] = []

    def act(self) -> dict:
        from ds_ttt.serve.session import ContextFullError

        ses = self.session
        try:
            prompt = list(ses.input_ids) + list(ses.agent.prompt_ids)
            decode = ses.begin_decode()
            self.engine.generate([decode])
            message = ses.end_decode(decode)
        except ContextFullError:
            raise EpisodeEnd("context_full") from None
        action = list(decode.action)
        nll = list(ses.history[-1].action_token_nll)
        self.turns.append({"prompt_token_ids": prompt, "completion_token_ids": action,
                           "logprobs": [-x for x in nll[:len(action) - 1]]})
        return message

    def observe(self, outputs: list[str]) -> float | None:
        from ds_ttt.serve.session import ContextFullError

        try:
            return self.engine.run(lambda: self.session.observe(outputs))
        except ContextFullError:
            raise EpisodeEnd("context_full") from None

    @property
    def num_generated(self) -> int:
        return sum(len(t["completion_token_ids"]) for t in self.turns)
