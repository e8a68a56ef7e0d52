"""One reply being generated, one token per step: the token choice (greedy, sampled, forced, banned), its NLL and logprobs.

    decode = session.begin_decode(options=DecodeOptions(temperature=0.0))   # session.py
    with torch.inference_mode():
        logits_V = decode.first_logits()          # the generation prompt in one chunk
        while decode.step(logits_V):              # choose a token; True while another is wanted
            logits_V = decode.forward_next()      # or one row of batch.batched_decode_logits
    message = session.end_decode(decode)          # closes the turn and commits it

The unbatched loop (`AgentSession.act`, scheduler.DirectEngine) and the batched scheduler
(scheduler.BatchScheduler) run the same steps; only the forward that turns the last token into the
next logits differs. Everything a Decode touches is the session's own: its SessionState (W, cache
slots at or after the new round's, which no committed state needs), its RNG; nothing is committed
until `AgentSession.end_decode`. Its forwards are `session_chunk.run_chunk`, i.e. `model.step`.
`row_stats` gives the logsumexp / argmax of a whole batch's rows at once (the scheduler's per-row cost).

Shape letters: B rows, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_ttt.serve.agent_model import AgentModel
from ds_ttt.serve.session_chunk import run_chunk
from ds_ttt.serve.session_state import SessionState


@dataclass(frozen=True)
class RowStats:
    """What choosing a row's most likely token needs of its logits, as Python numbers: logsumexp, the
    argmax and its NLL (lse - max, subtracted in the logits' dtype as Decode.step does per row)."""

    lse: float
    argmax: int
    argmax_nll: float


def row_stats(logits_BV: torch.Tensor) -> list[RowStats]:
    """RowStats of every row of a batch's logits in a few batched ops and host copies, instead of a few
    per row (the batched decode's per-row overhead); the values equal the per-row ones."""
    mx, am = logits_BV.max(-1)
    lse = torch.logsumexp(logits_BV, -1)
    return [RowStats(a, b, c) for a, b, c in zip(lse.tolist(), am.tolist(), (lse - mx).tolist())]


@dataclass(frozen=True)
class DecodeOptions:
    """How one reply is generated (the OpenAI fields of ds_ttt/serve/openai_api.py map onto it)."""

    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # the reply ends where one of these first appears (cut before it)
    ban_ids: tuple[int, ...] = ()  # never generated (tool_choice "none": the <tool_call> token)
    force_after_think: tuple[int, ...] = ()  # fed once </think> is generated (tool_choice required / named)
    end_ids: tuple[int, ...] = ()  # a generated id that ends the action (parallel_tool_calls false: </tool_call>)
    logprobs: bool = False
    top_logprobs: int = 0


def choose_token(logits_V: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else a sample from softmax(logits / T) restricted to the smallest
    top-p prefix (top_p = 0 keeps the most likely token; masked -inf logits are never drawn)."""
    if temperature <= 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.double() / temperature, -1).cpu()
    if not torch.isfinite(probs).all() or probs.sum() <= 0:  # overflow at a tiny temperature: greedy
        return int(logits_V.argmax())
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # smallest prefix with mass >= top_p
        keep[0] = True  # top_p = 0: the most likely token
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class Decode:
    """One reply being generated (module docstring).

    first_logits()  the generation prompt in one chunk -> logits of the first token [V]
    step(logits_V)  choose the next token (forced, banned, sampled), record its NLL / logprobs, call
                    on_token; True while another token is wanted: its forward is token `action[-1]` at
                    position pos - 1, slot slot - 1
    close()         the turn's end (<|im_end|>, `\\n`) into the cache"""

    def __init__(self, agent: AgentModel, state: SessionState, start: int, slot0: int, budget: int,
                 opts: DecodeOptions, on_token, generator: torch.Generator):
        self.agent, self.state, self.start, self.slot0, self.budget, self.opts = agent, state, start, slot0, budget, opts
        self.w = state.weights
        self.on_token = on_token
        self.generator = generator
        self.stop_ids = agent.stop_ids | set(opts.end_ids)
        self.pos = start + len(agent.prompt_ids)
        self.slot = slot0 + len(agent.prompt_ids)
        self.action: list[int] = []
        self.nll: list[float] = []
        self.logprobs: list[dict] = []
        self.forced: list[int] = []
        self.think_end = agent.tokenizer.convert_tokens_to_ids("</think>") if opts.force_after_think else None
        self.truncated = False
        self.stopped: str | None = None  # the stop string that ended the reply
        self.text = ""
        self._ban = torch.tensor(list(opts.ban_ids), dtype=torch.long) if opts.ban_ids else None
        self.closed = False

    def _forward(self, token_ids: list[int], pos: int, slot: int, want: list[int]) -> torch.Tensor:
        logits, _ = run_chunk(self.agent.model, token_ids, pos, slot, self.state.cache, self.w, want,
                              prompt_slots=self.state.prompt_slots)
        return logits

    def first_logits(self) -> torch.Tensor:
        prompt = self.agent.prompt_ids
        return self._forward(prompt, self.start, self.slot0, [len(prompt) - 1])[-1]

    def step(self, logits_V: torch.Tensor, stats: "RowStats | None" = None) -> bool:
        """stats: the row's logsumexp / max / argmax, computed for a whole batch at once (row_stats);
        without it they are computed here. The same token and NLL either way."""
        opts = self.opts
        greedy = opts.temperature <= 0 and self._ban is None
        if self.forced:
            tok = self.forced.pop(0)
        elif greedy and stats is not None:
            tok = stats.argmax
        else:
            masked = logits_V
            if self._ban is not None:
                masked = logits_V.clone()
                masked[self._ban.to(masked.device)] = float("-inf")
            tok = choose_token(masked, opts.temperature, opts.top_p, self.generator)
        if self.on_token is not None:
            self.on_token(tok)
        if stats is not None and tok == stats.argmax:
            lse = stats.lse
            self.nll.append(stats.argmax_nll)
        else:
            lse = torch.logsumexp(logits_V, -1)
            self.nll.append(float(lse - logits_V[tok]))
        self.action.append(tok)
        if opts.logprobs and tok not in self.agent.stop_ids:
            self.logprobs.append(self._logprob_entry(tok, logits_V - lse))
        if tok == self.think_end and opts.force_after_think and not self.forced and len(self.action) < self.budget:
            self.forced = list(opts.force_after_think)
            self.think_end = None
        if opts.stop:
            text = self.agent.tokenizer.decode(self.action, skip_special_tokens=False).split("<|im_end|>")[0]
            hits = [(text.find(x), x) for x in opts.stop if x in text]
            if hits:
                at, self.stopped = min(hits)
                self.text = text[:at]
                return False
        if tok in self.stop_ids or len(self.action) >= self.budget:
            return False
        self.pos, self.slot = self.pos + 1, self.slot + 1
        return True

    def forward_next(self) -> torch.Tensor:
        """The unbatched forward of the last chosen token -> the next token's logits [V]."""
        return self._forward([self.action[-1]], self.pos - 1, self.slot - 1, [0])[-1]

    def _logprob_entry(self, tok: int, logp_V: torch.Tensor) -> dict:
        tokenizer = self.agent.tokenizer

        def item(i: int, lp: float) -> dict:
            text = tokenizer.decode([i], skip_special_tokens=False)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        entry = item(tok, float(logp_V[tok]))
        k = self.opts.top_logprobs
        if k:
            vals, idx = logp_V.topk(min(k, logp_V.shape[-1]))
            entry["top_logprobs"] = [item(int(i), float(v)) for v, i in zip(vals, idx)]
        else:
            entry["top_logprobs"] = []
        return entry

    def close(self) -> None:
        """Close the turn: <|im_end|> after a cut or a stop string, <|endoftext|> closed as <|im_end|>,
        then the action end, written into the cache."""
        ag = self.agent
        action = self.action
        # the last chosen token has not been through the model yet
        pos, slot = self.pos, self.slot
        if self.stopped is None and action[-1] not in self.stop_ids and len(action) < self.budget:
            raise AssertionError("close() before the decode ended")
        tail = [action[-1]]
        ended = action[-1] in ag.stop_ids
        self.truncated = self.stopped is None and not ended and action[-1] not in self.opts.end_ids
        if not ended:
            action.append(ag.im_end_id)
            tail.append(ag.im_end_id)
        elif action[-1] != ag.im_end_id:  # <|endoftext|>: close the turn as the renderer does
            action[-1] = tail[-1] = ag.im_end_id
        if self.stopped is None:
            self.text = ag.tokenizer.decode(action, skip_special_tokens=False)
        self._forward(tail + ag.action_end_ids, pos, slot, [])
        self.state.cache.leave_pool()  # a batched reply's row back to the pool (ds_ttt/serve/kv_pool.py)
        self.closed = True
