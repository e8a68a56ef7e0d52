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
    what training computes with a whole-sequence mask for the frozen prefix. The layer loop is the
    model's own (ds_ttt/model/forward.py `forward_chunk`, the one training's events run); this session
    only supplies its cache (session_chunk.py);
  * round r (`<|im_start|>assistant\n`, the action, `\n`, then the tool results) is processed with the
    fast weights W_{r-1}. `observe` re-runs the whole round in one chunk from the cache as it was before
    the round — as the training event does — so the inner gradient also flows through the action
    tokens' keys/values, scores the observation tokens (L_obs) and takes one clipped SGD step
    W_r = W_{r-1} - lr * clip(grad L_obs). The backbone is frozen; W lives in this session only
    (`update=False`: a frozen session, W_0 throughout).
Generation is greedy (temperature 0) or sampled (temperature, top-p, seeded) until `<|im_end|>`,
one token per step into the preallocated cache (no re-concatenation per token). Attention outside
the inner step uses PyTorch's fused SDPA, the inner step (observe) the configured FlashBoB backend
(session_chunk.py says which mask each chunk gets).
Round 0 is prefilled in two chunks, its system block (system prompt + tool schemas) and the rest, so
that a shared system-prompt cache (`prefix_cache=`, ds_ttt/serve/prefix_cache.py) can supply the first
exactly. Every session starts from one shared fp32 copy of W_0 (`AgentModel.initial_weights`).
`act(force=message)` feeds a given action instead (replay / teacher forcing) and records its NLL.
`fork()` copies a session (W, cache, history) so a caller can try a sequence of operations and keep
the copy only if all of them succeed.
The attention kernel is the model's `ttt.attention_backend` (`AgentModel.load(..., attention_backend=)`).

Shape letters: T tokens, V vocab.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ds_ttt.data.render import (
    parse_assistant_message, render_action, render_action_end, render_generation_prompt, render_message,
    render_trajectory)
from ds_ttt.data.token_kind import TokenKind
from ds_ttt.model.event_loop import observation_labels
from ds_ttt.model.fast_weights import fast_weight_dtype
from ds_ttt.model.inner_step import inner_update
from ds_ttt.model.forward import forward_chunk, uses_key_state
from ds_ttt.serve.kv_cache import KVCache
from ds_ttt.serve.session_chunk import SessionChunk



def default_system_prompt() -> str:
    from ds_ttt.data.generator import SYSTEM_PROMPT

    return SYSTEM_PROMPT


def default_tools() -> list[dict]:
    from ds_ttt.data.generator import BASH_TOOL

    return [BASH_TOOL]


class SessionError(RuntimeError):
    """A request that does not fit the session's state (the session itself is unchanged)."""


class ContextFullError(SessionError):
    """The conversation does not fit the model's context (`max_context` tokens)."""

    def __init__(self, needed: int, capacity: int):
        super().__init__(f"context full: {needed} tokens > max_context={capacity}")
        self.needed, self.capacity = needed, capacity


class AgentModel:
    """A frozen TTT model + tokenizer, shared by any number of sessions (each keeps its own W and cache)."""

    def __init__(self, model, tokenizer, provenance: dict | None = None):
        from ds_ttt.loading import check_tokenizer_fits

        check_tokenizer_fits(tokenizer, model.config, where="AgentModel")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.provenance = provenance or {}
        self.device = next(model.parameters()).device
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = {self.im_end_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        self.prompt_ids = render_generation_prompt(tokenizer)
        self.action_end_ids = render_action_end(tokenizer)
        self._w0: tuple | None = None
        self._w0_version: tuple | None = None
        self._w0_lock = threading.Lock()

    def initial_weights(self) -> tuple:
        """W_0 as every session starts from it: fp32 (at least) copies of the prime weights, made once and
        shared by all sessions (weights are never written in place: an inner step returns new tensors,
        so sessions diverge only in the matrices they update; `fast_matrices="down"` keeps gate/up
        shared for good). Shared storage is what lets the batched decode (batch.py) run one product
        for the rows that hold the same matrix. Rebuilt if a parameter is changed in place."""
        params = self.model.initial_fast_weights()
        version = tuple((w.data_ptr(), w._version) for w in params)
        with self._w0_lock:  # request threads of the unbatched server reset sessions concurrently
            if self._w0 is None or version != self._w0_version:
                if torch.is_inference_mode_enabled():
                    raise RuntimeError("AgentModel.initial_weights: call outside torch.inference_mode (the copies "
                                       "must be usable by the inner step's autograd)")
                self._w0 = tuple(w.detach().to(fast_weight_dtype(w.dtype), copy=True) for w in params)
                self._w0_version = version
            return self._w0

    @classmethod
    def load(cls, path: str | pathlib.Path, *, device: str = "cpu", attention_backend: str | None = "reference") -> "AgentModel":
        """From an export directory (or a training checkpoint), with its own tokenizer (a compact
        vocabulary's included; see ds_ttt.loading.load_for_inference). attention_backend: "reference",
        "auto" (cuda on a GPU, the cpu kernel on a CPU), "cpu", "cuda"; the concrete one is
        `provenance["attention_backend"]`."""
        from ds_ttt.loading import load_for_inference

        loaded = load_for_inference(path, device=device, attention_backend=attention_backend, hash_files=False)
        return cls(loaded.model, loaded.tokenizer, loaded.provenance)

    @property
    def attention_backend(self) -> str:
        return self.model.ttt.attention_backend


@dataclass
class RoundLog:
    round: int
    action_ids: list[int] = field(default_factory=list)
    action_token_nll: list[float] = field(default_factory=list)  # model NLL of each action token (temperature 1)
    forced: bool = False
    truncated: bool = False
    obs_tokens: int = 0
    obs_nll: float | None = None  # mean observation NLL with W_{r-1} (what observe() returns)
    obs_nll_after: float | None = None  # with W_r (only with track_after=True)
    updated: bool = False
    skipped: bool = False

    @property
    def action_nll(self) -> float | None:
        return sum(self.action_token_nll) / len(self.action_token_nll) if self.action_token_nll else None


@dataclass
class _State:
    ids: list[int]
    kinds: list[int]
    rounds: list[int]
    cache: KVCache
    num_slots: int  # valid cache slots (see kv_cache.py for the layout)
    prompt_slots: int  # slots of round 0 (system prompt + task)
    weights: tuple
    round: int
    phase: str  # "act" (expects act) | "acted" (expects observe or act)
    round_start: int  # position of the current round's first token
    round_slot: int  # its cache slot
    messages: list[dict]
    history: list[RoundLog]
    tools: list | None
    num_updates: int = 0
    num_skipped: int = 0


@dataclass
class Round0:
    """A session's round 0 between `begin_reset` and `end_reset`: rendered, its cache holding the system
    block (slots 0..block-1); the rest, ids[block:], still to be prefilled at slots (= positions) block.."""

    session: "AgentSession"
    messages: list[dict]
    tools: list | None
    ids: list[int]
    kinds: list[int]
    rounds: list[int]
    cache: KVCache
    weights: tuple
    block: int  # tokens of the system block (0: none)
    cached: int  # of them, taken from the prefix cache

    @property
    def rest(self) -> list[int]:
        return self.ids[self.block:]


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
        self._s: _State | None = None

    def fork(self) -> "AgentSession":
        """An independent copy (same shared model): its W, cache, history and RNG evolve separately."""
        s = self._state()
        twin = copy.copy(self)
        twin.generator = torch.Generator(device="cpu")
        twin.generator.set_state(self.generator.get_state())
        twin._s = dataclasses.replace(
            s, ids=list(s.ids), kinds=list(s.kinds), rounds=list(s.rounds), cache=s.cache.clone(s.num_slots),
            messages=copy.deepcopy(s.messages), history=copy.deepcopy(s.history), tools=copy.deepcopy(s.tools))
        return twin

    # ---- public state --------------------------------------------------------------------------
    @property
    def model(self):
        return self.agent.model

    @property
    def tokenizer(self):
        return self.agent.tokenizer

    @property
    def round(self) -> int:
        return self._state().round

    @property
    def input_ids(self) -> list[int]:
        return list(self._state().ids)

    @property
    def kinds(self) -> list[int]:
        return list(self._state().kinds)

    @property
    def rounds(self) -> list[int]:
        return list(self._state().rounds)

    @property
    def history(self) -> list[RoundLog]:
        return self._state().history

    @property
    def messages(self) -> list[dict]:
        return self._state().messages

    @property
    def fast_weights(self) -> tuple:
        return self._state().weights

    @property
    def tools(self) -> list | None:
        return self._state().tools

    @property
    def phase(self) -> str:
        return self._state().phase

    @property
    def num_updates(self) -> int:
        """Inner updates taken so far (one per observed round with observation tokens)."""
        return self._state().num_updates

    @property
    def num_skipped(self) -> int:
        """Inner updates skipped for a non-finite gradient."""
        return self._state().num_skipped

    def _state(self) -> _State:
        if self._s is None:
            raise SessionError("no episode: call reset(task) first")
        return self._s

    # ---- model plumbing ------------------------------------------------------------------------
    def _forward(self, chunk_ids: list[int], start: int, slot: int, cache: KVCache, weights, want: list[int], *,
                 keep_graph: bool = False, write_rates: list | None = None, round0: bool = False):
        """Run new tokens (positions start.., cache slots slot..) through every layer.

        Default: the new keys/values are written into `cache` at their slots and attention reads the
        visible slice in place. keep_graph=True (the inner step): the cache is only read (its slice
        concatenated with the new keys/values once per layer, so the inner gradient flows through
        them) and the new keys/values are returned for the caller to commit.
        Returns (float logits [len(want), V] at chunk indices `want`, [(k, v) per layer] or None).
        The key shift's history (kv_cache.py) is read from the cache; a default run stores the chunk's
        as `cache.key_tail`, a keep_graph run returns it through `cache.key_pending` for the caller.
        With `write_rates` (a list) and a model with a write rate, the rate at `want` is appended to it.
        round0: a chunk of a new episode's round 0 (reset), which is one segment whatever the session's
        previous episode was."""
        if start + len(chunk_ids) > self.max_context:
            raise ContextFullError(start + len(chunk_ids), self.max_context)
        m, dev = self.model, self.agent.device
        n = len(chunk_ids)
        cache.ensure(slot + n)
        ids = torch.tensor([chunk_ids], device=dev)
        h = m.model.embed_tokens(ids)
        pos_emb = m.model.rotary_emb(h, torch.arange(start, start + n, device=dev)[None])
        chunk = SessionChunk(cache, slot, n, policy=m.policy, backend=m.ttt.attention_backend, keep_graph=keep_graph,
                             device=dev)
        prompt_slots = self._s.prompt_slots if self._s is not None and not round0 else None
        new_round = m.policy.segment_starts_at(slot, prompt_slots)
        has_key_state = any(uses_key_state(layer) for layer in m.model.layers)
        key_prev = None if new_round or not has_key_state else cache.key_history_at(slot)
        out = forward_chunk(m.model.layers, h, pos_emb, chunk, fast_weights=weights, key_prev=key_prev)
        h, key_last, new_kv = out.hidden_BTC, out.key_last, chunk.new_kv
        if out.write_rate_BT is not None and write_rates is not None:
            write_rates.append(out.write_rate_BT[0, torch.tensor(want, dtype=torch.long, device=dev)])
        if keep_graph:
            cache.key_pending = (slot + n, [t.detach() for t in key_last])
        else:
            cache.key_tail = (slot + n, key_last)
        rows = h[0, -1:] if want == [n - 1] else h[0, torch.tensor(want, dtype=torch.long, device=dev)]
        logits = m.lm_head(m.model.norm(rows))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return logits, new_kv

    def _choose(self, logits_V: torch.Tensor, temperature: float, top_p: float) -> int:
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
        return int(torch.multinomial(probs, 1, generator=self.generator))

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
        r = render_trajectory({"id": "session", "messages": messages, "tools": tools or None}, self.tokenizer)
        n = len(r.input_ids)
        if n > self.max_context:
            raise ContextFullError(n, self.max_context)
        cache = KVCache.for_model(self.model, capacity=n + 2 * min(self.max_new_tokens, 1024) + 64,
                                  max_capacity=self.max_context)
        # fp32 (at least) copies of W_0, shared by every session (a bf16 model's inner steps are below
        # half a bf16 ulp); observe() takes its own leaves for the inner gradient
        weights = self.agent.initial_weights()
        # round 0 in two chunks, the system block and the rest, whether the block is cached or not, so
        # a cache hit is bit-identical to a miss (prefix_cache.py); the block is always computed alone
        block = self._system_block_length(messages, tools, r.input_ids)
        prefix = self.prefix_cache
        with torch.inference_mode():  # the cache already has room: only in-place writes below
            cached = prefix.restore(r.input_ids[:block], cache, salt=cache_salt) if block and prefix else 0
            if block and not cached:
                self._forward(r.input_ids[:block], 0, 0, cache, weights, want=[], round0=True)
                if prefix is not None:
                    prefix.store(r.input_ids[:block], cache, salt=cache_salt)
        return Round0(self, copy.deepcopy(messages), copy.deepcopy(tools), r.input_ids, r.kinds, r.rounds, cache,
                      weights, block, cached)

    def end_reset(self, r0: "Round0") -> dict:
        """The episode starts from a Round0 whose rest has been prefilled (begin_reset)."""
        n = len(r0.ids)
        r0.cache.start_round()
        self._s = _State(ids=list(r0.ids), kinds=list(r0.kinds), rounds=list(r0.rounds), cache=r0.cache,
                         num_slots=n, prompt_slots=n, weights=r0.weights, round=0, phase="act", round_start=0,
                         round_slot=0, messages=r0.messages, history=[], tools=r0.tools)
        return {"round": 0, "num_tokens": n, "cached_tokens": r0.cached}

    def _system_block_length(self, messages: list[dict], tools: list | None, ids: list[int]) -> int:
        """Tokens of round 0's system block (system message and tool schemas, rendered on their own),
        or 0 when there is none (or it is the whole of round 0)."""
        head = messages[:1] if messages[0]["role"] == "system" else []
        if not head and not tools:
            return 0
        block = render_trajectory({"id": "session", "messages": head, "tools": tools or None}, self.tokenizer).input_ids
        b = len(block)
        return b if 0 < b < len(ids) and ids[:b] == block else 0

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

    def _commit_action(self, s: _State, log: RoundLog, action: list[int], slot0: int, start: int,
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
        return Decode(self, s, start, slot0, budget, opts, on_token)

    def end_decode(self, decode: "Decode") -> dict:
        """Close the generated turn in the cache and commit it (the message, parsed)."""
        if not decode.closed:
            with torch.inference_mode():
                decode.close()
        d = decode
        log = RoundLog(round=d.s.round + 1, truncated=d.truncated, action_token_nll=d.nll)
        message = parse_assistant_message(d.text)
        if d.opts.logprobs:
            message["logprobs"] = d.logprobs
        if d.stopped is not None:
            message["stopped"] = d.stopped
        return self._commit_action(d.s, log, d.action, d.slot0, d.start, message)

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
            rates: list = []  # the write rate at the observation labels (a model with one)
            logits, new_kv = self._forward(round_ids, s.round_start, s.round_slot, s.cache, w, want, keep_graph=True,
                                           write_rates=rates)
            key_tail = s.cache.key_pending  # the round's key history with W_{r-1}, as training carries it
            if want:
                nll = F.cross_entropy(logits, labels, reduction="none")
                obs_nll = float(nll.detach().mean())
            if can_update:  # the event loop's step (ds_ttt/model/event_loop.py), inner_steps included
                res = inner_update(nll.sum() if not rates else (nll * rates[0]).sum(), len(want), w, ttt,
                                   create_graph=False)
                skipped = bool(res.skipped)
                for _ in range(1, ttt.inner_steps):
                    again, _ = self._forward(round_ids, s.round_start, s.round_slot, s.cache, res.weights, want,
                                             keep_graph=True)
                    again_nll = F.cross_entropy(again, labels, reduction="none")
                    res = inner_update(again_nll.sum() if not rates else (again_nll * rates[0]).sum(), len(want),
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
        s.cache.key_tail = key_tail
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


class Decode:
    """One reply being generated, one token per `step`: the unbatched loop (`AgentSession.act`) and the
    batched scheduler (ds_ttt/serve/scheduler.py) run the same steps; only the forward that turns the
    last token into the next logits differs. Everything here is the session's own: its fork, its W, its
    RNG, its cache slots; nothing is committed until `AgentSession.end_decode`.

    first_logits()  the generation prompt in one chunk -> logits of the first token [V]
    step(logits_V)  choose the next token (forced, banned, sampled), record its NLL / logprobs, call
                    on_token; True while another token is wanted: its forward is token `action[-1]` at
                    position pos - 1, slot slot - 1
    close()         the turn's end (<|im_end|>, `\n`) into the cache"""

    def __init__(self, session: AgentSession, s: _State, start: int, slot0: int, budget: int, opts: DecodeOptions,
                 on_token):
        self.session, self.s, self.start, self.slot0, self.budget, self.opts = session, s, start, slot0, budget, opts
        self.w = s.weights
        self.on_token = on_token
        ag = session.agent
        self.stop_ids = ag.stop_ids | set(opts.end_ids)
        self.pos = start + len(ag.prompt_ids)
        self.slot = slot0 + len(ag.prompt_ids)
        self.action: list[int] = []
        self.nll: list[float] = []
        self.logprobs: list[dict] = []
        self.forced: list[int] = []
        self.think_end = ag.tokenizer.convert_tokens_to_ids("</think>") if opts.force_after_think else None
        self.truncated = False
        self.stopped: str | None = None  # the stop string that ended the reply
        self.text = ""
        self._ban = torch.tensor(list(opts.ban_ids), dtype=torch.long) if opts.ban_ids else None
        self.closed = False

    def first_logits(self) -> torch.Tensor:
        ses = self.session
        logits, _ = ses._forward(ses.agent.prompt_ids, self.start, self.slot0, self.s.cache, self.w,
                                 [len(ses.agent.prompt_ids) - 1])
        return logits[-1]

    def step(self, logits_V: torch.Tensor, stats: "RowStats | None" = None) -> bool:
        """stats: the row's logsumexp / max / argmax, computed for a whole batch at once (row_stats);
        without it they are computed here. The same token and NLL either way."""
        ses, opts = self.session, self.opts
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
            tok = ses._choose(masked, opts.temperature, opts.top_p)
        if self.on_token is not None:
            self.on_token(tok)
        if stats is not None and tok == stats.argmax:
            lse = stats.lse
            self.nll.append(stats.argmax_nll)
        else:
            lse = torch.logsumexp(logits_V, -1)
            self.nll.append(float(lse - logits_V[tok]))
        self.action.append(tok)
        if opts.logprobs and tok not in ses.agent.stop_ids:
            self.logprobs.append(self._logprob_entry(tok, logits_V - lse))
        if tok == self.think_end and opts.force_after_think and not self.forced and len(self.action) < self.budget:
            self.forced = list(opts.force_after_think)
            self.think_end = None
        if opts.stop:
            text = ses.tokenizer.decode(self.action, skip_special_tokens=False).split("<|im_end|>")[0]
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
        logits, _ = self.session._forward([self.action[-1]], self.pos - 1, self.slot - 1, self.s.cache, self.w, [0])
        return logits[-1]

    def _logprob_entry(self, tok: int, logp_V: torch.Tensor) -> dict:
        tokenizer = self.session.tokenizer

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
        """Close the turn (the session's `_generate` tail): <|im_end|> after a cut or a stop string,
        <|endoftext|> closed as <|im_end|>, then the action end, written into the cache."""
        ses, ag = self.session, self.session.agent
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
            self.text = ses.tokenizer.decode(action, skip_special_tokens=False)
        ses._forward(tail + ag.action_end_ids, pos, slot, self.s.cache, self.w, [])
        self.s.cache.leave_pool()  # a batched reply's row back to the pool (ds_ttt/serve/kv_pool.py)
        self.closed = True
