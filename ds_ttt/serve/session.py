"""AgentSession: one agent episode with test-time training — reset → act → (caller runs tools) → observe → act …

    from ds_ttt.serve import AgentSession
    s = AgentSession("EXPORT")                      # or AgentSession(AgentModel.load("EXPORT")) to share weights
    s.reset("Find the port of the api service and write it to PORT.")
    msg = s.act()                                   # {"role": "assistant", "reasoning_content", "content", "tool_calls"}
    loss = s.observe(["<the command's output>"])    # one inner SGD step on the fast weights; returns L_obs (pre-update)
    msg = s.act() ...

Exactly the training computation (ds_ttt/model/event_loop.py), incrementally:
  * tokens are rendered with the training renderer (`render_trajectory` for the prompt,
    `render_generation_prompt` / `render_action_end` / `render_message` per turn); a replayed
    conversation has the same token ids, kinds and round ids as `render_trajectory` of it;
  * every layer runs event-wise against this session's preallocated key/value cache (kv_cache.py),
    laid out so that the model's context policy is one contiguous slice of it; that is mathematically
    what training computes with a whole-sequence mask for the frozen prefix. Every forward is the
    model's one incremental entry, `model.step` (ds_ttt/model/qwen3.py, over the layer loop training's
    events run); this session only builds its cache (session_chunk.py `run_chunk`);
  * round r (`<|im_start|>assistant\n`, the action, `\n`, then the tool results) is processed with the
    fast weights W_{r-1}. `observe` re-runs the whole round in one chunk from the cache as it was before
    the round — as the training event does — so the inner gradient also flows through the action
    tokens' keys/values, scores the observation tokens (L_obs) and takes one clipped SGD step
    W_r = W_{r-1} - lr * clip(grad L_obs). The backbone is frozen; W lives in this session only
    (`update=False`: a frozen session, W_0 throughout).
Generation (decode.py `Decode`) is greedy (temperature 0) or sampled (temperature, top-p, seeded) until
`<|im_end|>`, one token per step into the preallocated cache (no re-concatenation per token). Attention outside
the inner step uses PyTorch's fused SDPA, the inner step (observe) the configured FlashBoB backend
(session_chunk.py says which mask each chunk gets).
Round 0 is rendered once and prefilled in two chunks, its system block (system prompt + tool schemas)
and the rest (round0.py), so that a shared system-prompt cache (`prefix_cache=`, prefix_cache.py) can
supply the first exactly. Every session starts from one shared fp32 copy of W_0 (`AgentModel.initial_weights`).
`act(force=message)` feeds a given action instead (replay / teacher forcing) and records its NLL.
`fork()` copies a session (W, cache, history) so a caller can try a sequence of operations and keep
the copy only if all of them succeed.
The attention kernel is the model's `ttt.attention_backend` (`AgentModel.load(..., attention_backend=)`).
The episode's state is a SessionState (session_state.py), replaced or changed only when a request
succeeds. This module also offers the names callers import from it: AgentModel (agent_model.py),
DecodeOptions (decode.py), SessionError and ContextFullError (session_state.py).

Shape letters: T tokens, V vocab.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib

import torch
import torch.nn.functional as F

from ds_ttt.data.render import parse_assistant_message, render_action, render_message
from ds_ttt.data.token_kind import TokenKind
from ds_ttt.model.event_loop import observation_labels
from ds_ttt.model.inner_step import inner_update
from ds_ttt.serve.agent_model import AgentModel
from ds_ttt.serve.decode import Decode, DecodeOptions
from ds_ttt.serve.kv_cache import KVCache
from ds_ttt.serve.round0 import Round0, default_system_prompt, default_tools, render_round0
from ds_ttt.serve.session_chunk import run_chunk
from ds_ttt.serve.session_state import ContextFullError, RoundLog, SessionError, SessionState

__all__ = ["AgentModel", "AgentSession", "ContextFullError", "DecodeOptions", "RoundLog", "SessionError"]


class _EpisodeField:
    """A read-only AgentSession attribute that reads one field of its current episode's SessionState."""

    def __init__(self, field: str, doc: str, *, copy: bool = False):
        self.field, self.copy, self.__doc__ = field, copy, doc

    def __get__(self, session, owner=None):
        if session is None:
            return self
        value = getattr(session._state(), self.field)
        return list(value) if self.copy else value


class AgentSession:
    def __init__(self, model: "str | pathlib.Path | AgentModel", *, device: str = "cpu", max_new_tokens: int = 1024,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, track_after: bool = False,
                 max_context: int | None = None, update: bool = True, attention_backend: str = "reference",
                 prefix_cache=None):
        self.agent = (model if isinstance(model, AgentModel)
                      else AgentModel.load(model, device=device, attention_backend=attention_backend))
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.track_after = track_after
        self.update = update
        self.max_context = max_context or self.agent.model.config.max_position_embeddings
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.prefix_cache = prefix_cache  # a PrefixCache (ds_ttt/serve/prefix_cache.py) shared with other sessions
        self._s: SessionState | None = None

    def fork(self) -> "AgentSession":
        """An independent copy (same shared model): its W, cache, history and RNG evolve separately."""
        twin = copy.copy(self)
        twin._continue(self._state().copy(), self.generator.get_state())
        return twin

    def _continue(self, state: SessionState, rng_state: torch.Tensor) -> None:
        """Continue the episode `state` with a generator of its own from `rng_state` (fork's twin)."""
        self.generator = torch.Generator(device="cpu")
        self.generator.set_state(rng_state)
        self._s = state

    # ---- public state --------------------------------------------------------------------------
    @property
    def model(self):
        return self.agent.model

    @property
    def tokenizer(self):
        return self.agent.tokenizer

    # the current episode's state, read-only (SessionError before reset); lists are copies
    round = _EpisodeField("round", "the current round (SessionState.round)")
    input_ids = _EpisodeField("ids", "every token id of the episode so far", copy=True)
    kinds = _EpisodeField("kinds", "each token's TokenKind", copy=True)
    rounds = _EpisodeField("rounds", "each token's round", copy=True)
    history = _EpisodeField("history", "one RoundLog per finished round")
    messages = _EpisodeField("messages", "the chat so far, in Qwen3's message format")
    fast_weights = _EpisodeField("weights", "the episode's fast weights W (W_0 until the first update)")
    tools = _EpisodeField("tools", "the tool schemas the episode was reset with (None: the default bash tool)")
    phase = _EpisodeField("phase", 'what the session expects next: "act", or "acted" (observe or act)')
    num_updates = _EpisodeField("num_updates", "inner updates taken so far (one per observed round with observation tokens)")
    num_skipped = _EpisodeField("num_skipped", "inner updates skipped for a non-finite gradient")
    kv_cache = _EpisodeField("cache", "the episode's key/value cache (read it; the session writes it)")

    def _state(self) -> SessionState:
        if self._s is None:
            raise SessionError("no episode: call reset(task) first")
        return self._s

    # ---- model plumbing ------------------------------------------------------------------------
    def _forward(self, chunk_ids: list[int], start: int, slot: int, cache: KVCache, weights, want: list[int], *,
                 keep_graph: bool = False, round0: bool = False):
        """Run new tokens (positions start.., cache slots slot..) through the model: session_chunk.run_chunk,
        i.e. `model.step` over this session's cache. Returns (float logits [len(want), V] at chunk indices
        `want`, the SessionChunk). keep_graph=True (the inner step): the cache is only read, the chunk
        keeps the new keys/values and the key state for the caller to commit. round0: a chunk of a new
        episode's round 0 (reset), which is one segment whatever the session's previous episode was."""
        if start + len(chunk_ids) > self.max_context:
            raise ContextFullError(start + len(chunk_ids), self.max_context)
        prompt_slots = self._s.prompt_slots if self._s is not None and not round0 else None
        return run_chunk(self.model, chunk_ids, start, slot, cache, weights, want, keep_graph=keep_graph,
                         prompt_slots=prompt_slots)

    # ---- the episode -----------------------------------------------------------------------------
    def reset(self, task: str, *, system: str | None = None, tools: list | None = None) -> dict:
        """Start an episode: render system prompt (+ tool schemas) + task as round 0, prefill, W = W_0.

        system/tools default to the generator's (the training distribution); pass system="" for none."""
        if not isinstance(task, str) or not task:
            raise SessionError("reset needs a non-empty task string")
        system = default_system_prompt() if system is None else system
        tools = default_tools() if tools is None else tools
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task}]
        return self.reset_messages(messages, tools=tools)

    def reset_messages(self, messages: list[dict], *, tools: list | None = None, cache_salt: str | None = None) -> dict:
        """Start an episode from its round-0 messages (system and user turns, no assistant yet).
        cache_salt: the system-prompt cache's scope (prefix_cache.py; the server passes the API key's id).
        The same as `end_reset(begin_reset(...))` with the rest of round 0 prefilled alone in between
        (the batched scheduler prefills several sessions' rests in one forward: ds_ttt/serve/prefill.py)."""
        r0 = self.begin_reset(messages, tools=tools, cache_salt=cache_salt)
        self.prefill_rest(r0)
        return self.end_reset(r0)

    def prefill_rest(self, r0: "Round0") -> None:
        """Prefill the rest of round 0 alone (slots block..; the batched scheduler batches it instead)."""
        if r0.rest:
            with torch.inference_mode():  # the cache already has room: only in-place writes
                self._forward(r0.rest, r0.block, r0.block, r0.cache, r0.weights, want=[], round0=True)

    def begin_reset(self, messages: list[dict], *, tools: list | None = None, cache_salt: str | None = None
                    ) -> "Round0":
        """Round 0 rendered, its cache allocated and its system block in the cache (from the prefix cache,
        or prefilled here, alone); the rest of round 0 (`Round0.rest`) is left for the caller to prefill
        at slots block.. before `end_reset`. The session is unchanged until `end_reset`."""
        if not messages or any(m.get("role") not in ("system", "user") for m in messages):
            raise SessionError("an episode starts with system/user messages only (the task), before any assistant turn")
        r = render_round0(messages, tools, self.tokenizer)
        n = len(r.ids)
        if n > self.max_context:
            raise ContextFullError(n, self.max_context)
        cache = KVCache.for_model(self.model, capacity=n + 2 * min(self.max_new_tokens, 1024) + 64,
                                  max_capacity=self.max_context)
        # fp32 (at least) copies of W_0, shared by every session (a bf16 model's inner steps are below
        # half a bf16 ulp); observe() takes its own leaves for the inner gradient
        weights = self.agent.initial_weights()
        # round 0 in two chunks, the system block and the rest, whether the block is cached or not, so
        # a cache hit is bit-identical to a miss (prefix_cache.py); the block is always computed alone
        block = r.block
        prefix = self.prefix_cache
        with torch.inference_mode():  # the cache already has room: only in-place writes below
            cached = prefix.restore(r.ids[:block], cache, salt=cache_salt) if block and prefix else 0
            if block and not cached:
                self._forward(r.ids[:block], 0, 0, cache, weights, want=[], round0=True)
                if prefix is not None:
                    prefix.store(r.ids[:block], cache, salt=cache_salt)
        return Round0(self, copy.deepcopy(messages), copy.deepcopy(tools), r.ids, r.kinds, r.rounds, cache,
                      weights, block, cached)

    def end_reset(self, r0: "Round0") -> dict:
        """The episode starts from a Round0 whose rest has been prefilled (begin_reset)."""
        n = len(r0.ids)
        r0.cache.start_round()
        self._s = SessionState(ids=list(r0.ids), kinds=list(r0.kinds), rounds=list(r0.rounds), cache=r0.cache,
                         num_slots=n, prompt_slots=n, weights=r0.weights, round=0, phase="act", round_start=0,
                         round_slot=0, messages=r0.messages, history=[], tools=r0.tools)
        return {"round": 0, "num_tokens": n, "cached_tokens": r0.cached}

    def act(self, *, force: dict | str | None = None, max_new_tokens: int | None = None,
            temperature: float | None = None, top_p: float | None = None, on_token=None,
            options: "DecodeOptions | None" = None) -> dict:
        """The next assistant message (parsed: reasoning_content, content, tool_calls, invalid_tool_calls).

        force: an assistant message (or its raw generated text) to feed instead of generating.
        on_token: called with each generated token id as soon as it is chosen (streaming, latency); an
        exception it raises aborts the act and leaves the session as it was.
        options: stop strings, banned / forced tokens, logprobs (DecodeOptions; temperature/top_p
        arguments override its sampling fields)."""
        if force is not None:
            return self._act_forced(force)
        decode = self.begin_decode(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   on_token=on_token, options=options)
        with torch.inference_mode():
            logits_V = decode.first_logits()
            while decode.step(logits_V):
                logits_V = decode.forward_next()
        return self.end_decode(decode)

    def _act_forced(self, force: dict | str) -> dict:
        s = self._state()
        ag = self.agent
        r, start, w = s.round + 1, len(s.ids), s.weights
        slot0 = self.model.policy.new_round_slot(start, s.prompt_slots)
        prompt, end = ag.prompt_ids, ag.action_end_ids
        log = RoundLog(round=r, forced=True)
        # Cache writes go to slots at or after slot0, which no committed state still needs: full/window
        # write past the last valid slot; current_round overwrites the finished round, which `observe`
        # never reads (it re-runs its round from round 0's slots). So a failure leaves the session usable.
        # The cache is grown first, so everything below runs under inference_mode.
        if isinstance(force, dict):
            action = render_action(force, self.tokenizer)
        else:
            action = self.tokenizer.encode(str(force), add_special_tokens=False)
            if not action or action[-1] != ag.im_end_id:
                action.append(ag.im_end_id)
        s.cache.ensure(min(slot0 + len(prompt) + len(action) + len(end), self.max_context))
        with torch.inference_mode():
            chunk = prompt + action + end
            want = list(range(len(prompt) - 1, len(prompt) + len(action) - 1))
            logits, _ = self._forward(chunk, start, slot0, s.cache, w, want)
            log.action_token_nll = F.cross_entropy(logits, torch.tensor(action, device=logits.device),
                                                   reduction="none").tolist()
        message = parse_assistant_message(self.tokenizer.decode(action, skip_special_tokens=False))
        return self._commit_action(s, log, action, slot0, start, message)

    def _commit_action(self, s: SessionState, log: RoundLog, action: list[int], slot0: int, start: int,
                       message: dict) -> dict:
        ag = self.agent
        prompt, end = ag.prompt_ids, ag.action_end_ids
        if log.truncated:
            message["truncated"] = True
        log.action_ids = action
        n = len(prompt) + len(action) + len(end)
        s.ids += prompt + action + end
        s.kinds += [TokenKind.CONTEXT] * len(prompt) + [TokenKind.ACTION] * len(action) + [TokenKind.CONTEXT] * len(end)
        s.rounds += [log.round] * n
        s.num_slots, s.round_start, s.round_slot = slot0 + n, start, slot0
        s.round, s.phase = log.round, "acted"
        s.messages.append({k: v for k, v in message.items() if k not in ("truncated", "logprobs", "stopped")})
        s.history.append(log)
        return message

    def _budget(self, start: int, max_new_tokens: int) -> int:
        """Tokens a reply starting at position `start` may generate (its turn must still close)."""
        ag = self.agent
        budget = min(max_new_tokens, self.max_context - start - len(ag.prompt_ids) - len(ag.action_end_ids) - 1)
        if budget <= 0:
            raise ContextFullError(start + len(ag.prompt_ids) + len(ag.action_end_ids) + 1, self.max_context)
        return budget

    def begin_decode(self, *, max_new_tokens: int | None = None, temperature: float | None = None,
                     top_p: float | None = None, on_token=None, options: "DecodeOptions | None" = None) -> "Decode":
        """A generation in progress (see Decode): the cache is grown here, outside inference_mode; the
        caller runs `first_logits` / `step` / forwards under inference_mode, then `end_decode`."""
        s = self._state()
        opts = options or DecodeOptions(temperature=self.temperature, top_p=self.top_p)
        if temperature is not None or top_p is not None:
            opts = dataclasses.replace(opts, temperature=opts.temperature if temperature is None else temperature,
                                       top_p=opts.top_p if top_p is None else top_p)
        start = len(s.ids)
        slot0 = self.model.policy.new_round_slot(start, s.prompt_slots)
        budget = self._budget(start, max_new_tokens or self.max_new_tokens)
        s.cache.ensure(slot0 + len(self.agent.prompt_ids) + budget + len(self.agent.action_end_ids) + 1)
        return Decode(self.agent, s, start, slot0, budget, opts, on_token, self.generator)

    def end_decode(self, decode: "Decode") -> dict:
        """Close the generated turn in the cache and commit it (the message, parsed)."""
        if not decode.closed:
            with torch.inference_mode():
                decode.close()
        d = decode
        log = RoundLog(round=d.state.round + 1, truncated=d.truncated, action_token_nll=d.nll)
        message = parse_assistant_message(d.text)
        if d.opts.logprobs:
            message["logprobs"] = d.logprobs
        if d.stopped is not None:
            message["stopped"] = d.stopped
        return self._commit_action(d.state, log, d.action, d.slot0, d.start, message)

    def observe(self, outputs: str | list[str]) -> float | None:
        """Feed the tool output(s) of the last action; one inner step on W. Returns the observation's
        mean NLL under the pre-update W (None when the outputs render to no observation tokens)."""
        outputs = [outputs] if isinstance(outputs, str) else outputs
        if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs):
            raise SessionError("observe needs a string or a non-empty list of strings (one per tool call)")
        s = self._state()
        calls = (s.messages[-1].get("tool_calls") or []) if s.messages and s.phase == "acted" else []
        return self.observe_messages([{"role": "tool", "tool_call_id": calls[i]["id"] if i < len(calls) else f"call_{i}",
                                       "content": out} for i, out in enumerate(outputs)])

    def observe_messages(self, messages: list[dict]) -> float | None:
        """Feed what followed the last action: tool results and/or user turns (a user turn after the
        first action is an observation, e.g. Terminus' "New Terminal Output:"), rendered exactly as
        `render_trajectory` renders them; one inner step on W for all of them (one training event)."""
        s = self._state()
        if s.phase != "acted":
            raise SessionError("observe() must follow act(): pass every tool output of the last action in one call")
        if not messages or any(m.get("role") not in ("tool", "user") or not isinstance(m.get("content"), str)
                               for m in messages):
            raise SessionError("an observation is a non-empty list of tool/user messages with string content")
        obs_ids, obs_kinds = [], []
        for i, msg in enumerate(messages):
            a, b = render_message(msg, self.tokenizer, prev_role=messages[i - 1]["role"] if i else "assistant",
                                  next_role=messages[i + 1]["role"] if i + 1 < len(messages) else None,
                                  as_observation=True)
            obs_ids += a
            obs_kinds += b
        round_ids = s.ids[s.round_start:] + obs_ids
        round_kinds = s.kinds[s.round_start:] + obs_kinds
        ttt = self.model.ttt
        # the labels of the training loop's observation loss (label j predicts token j + 1)
        want = observation_labels(torch.tensor(round_kinds[1:]), with_end=ttt.obs_loss_with_end).nonzero().flatten().tolist()
        labels = torch.tensor([round_ids[j + 1] for j in want], dtype=torch.long, device=self.agent.device)
        can_update = self.update and bool(want) and len(s.weights) > 0 and ttt.inner_lr > 0
        new_w, obs_nll, updated, skipped, after = s.weights, None, False, False, None
        with torch.enable_grad() if can_update else torch.no_grad():
            w = tuple(x.detach().requires_grad_(True) for x in s.weights) if can_update else s.weights
            logits, chunk = self._forward(round_ids, s.round_start, s.round_slot, s.cache, w, want, keep_graph=True)
            new_kv = chunk.new_kv
            key_state = chunk.key_last  # the round's key state with W_{r-1}, as training carries it
            # the write rate at the observation labels (a model with one)
            rate = (None if chunk.write_rate_BT is None
                    else chunk.write_rate_BT[0, torch.tensor(want, dtype=torch.long, device=self.agent.device)])
            if want:
                nll = F.cross_entropy(logits, labels, reduction="none")
                obs_nll = float(nll.detach().mean())
            if can_update:  # the event loop's step (ds_ttt/model/event_loop.py), inner_steps included
                res = inner_update(nll.sum() if rate is None else (nll * rate).sum(), len(want), w, ttt,
                                   create_graph=False)
                skipped = bool(res.skipped)
                for _ in range(1, ttt.inner_steps):
                    again, _ = self._forward(round_ids, s.round_start, s.round_slot, s.cache, res.weights, want,
                                             keep_graph=True)
                    again_nll = F.cross_entropy(again, labels, reduction="none")
                    res = inner_update(again_nll.sum() if rate is None else (again_nll * rate).sum(), len(want),
                                       res.weights, ttt, create_graph=False)
                    skipped = skipped or bool(res.skipped)
                new_w = tuple(x.detach() for x in res.weights)  # a skipped step left W as it was
                updated = not skipped
        if self.track_after and updated:
            with torch.no_grad():
                logits_after, _ = self._forward(round_ids, s.round_start, s.round_slot, s.cache, new_w, want,
                                                keep_graph=True)
                after = float(F.cross_entropy(logits_after, labels))
        # commit: the round's keys/values (computed in one chunk with W_{r-1}, as training) replace the
        # ones written while acting, and the observation's follow them
        for i, (k, v) in enumerate(new_kv):
            s.cache.write(i, s.round_slot, k.detach(), v.detach())
        s.cache.commit_keys(s.round_slot + len(round_ids), key_state)
        s.cache.start_round()
        log = s.history[-1]
        log.obs_tokens, log.obs_nll, log.obs_nll_after, log.updated, log.skipped = len(want), obs_nll, after, updated, skipped
        s.ids += obs_ids
        s.kinds += obs_kinds
        s.rounds += [s.round] * len(obs_ids)
        s.num_slots = s.round_slot + len(round_ids)
        s.weights, s.phase = new_w, "act"
        s.num_updates += int(updated)
        s.num_skipped += int(skipped)
        s.messages.extend(copy.deepcopy(messages))
        return obs_nll

    def snapshot(self) -> dict:
        """A JSON-friendly view of the episode so far."""
        s = self._state()
        return {"round": s.round, "num_tokens": len(s.ids), "phase": s.phase,
                "history": [dataclasses.asdict(h) | {"action_nll": h.action_nll} for h in s.history]}
