"""AgentSession: one agent episode with test-time training — reset → act → (caller runs tools) → observe → act …

    from ds_ttt.serve import AgentSession
    s = AgentSession("EXPORT")                      # or AgentSession(AgentModel.load("EXPORT")) to share weights
    s.reset("Find the port of the api service and write it to PORT.")
    msg = s.act()                                   # {"role": "assistant", "reasoning_content", "content", "tool_calls"}
    loss = s.observe(["<the command's output>"])    # one inner SGD step on the fast weights; returns L_obs (pre-update)
    msg = s.act() ...

Exactly the training computation (ds_ttt/model/event_loop.py), incrementally:
  * tokens are rendered with the training renderer (`render_trajectory` for the prompt,
    `render_generation_prompt` / `render_action_end` / `render_observation` per turn); a replayed
    conversation has the same token ids, kinds and round ids as `render_trajectory` of it;
  * every layer runs event-wise with a per-layer key/value cache pruned by the model's context policy
    (`forward_event`; the frozen prefix layers use the same function without fast weights), which is
    mathematically what training computes with a whole-sequence mask for the prefix;
  * round r (`<|im_start|>assistant\\n`, the action, `\\n`, then the tool results) is processed with the
    fast weights W_{r-1}. `observe` re-runs the whole round in one chunk from the cache as it was before
    the round — as the training event does — so the inner gradient also flows through the action
    tokens' keys/values, scores the observation tokens (L_obs) and takes one clipped SGD step
    W_r = W_{r-1} - lr * clip(grad L_obs). The backbone is frozen; W lives in this session only.
Generation is greedy (temperature 0) or sampled (temperature, top-p, seeded) until `<|im_end|>`.
`act(force=message)` feeds a given action instead (replay / teacher forcing) and records its NLL.

Shape letters: T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ds_ttt.data.render import (
    parse_assistant_message, render_action, render_action_end, render_generation_prompt, render_observation,
    render_trajectory)
from ds_ttt.model.context import LayerCache
from ds_ttt.model.event_loop import forward_event, observation_labels
from ds_ttt.model.fast_weights import inner_sgd_step

CONTEXT, ACTION, OBSERVATION = 0, 1, 2


def default_system_prompt() -> str:
    from ds_ttt.data.generator import SYSTEM_PROMPT

    return SYSTEM_PROMPT


def default_tools() -> list[dict]:
    from ds_ttt.data.generator import BASH_TOOL

    return [BASH_TOOL]


class SessionError(RuntimeError):
    """A request that does not fit the session's state (the session itself is unchanged)."""


class AgentModel:
    """A frozen TTT model + tokenizer, shared by any number of sessions (each keeps its own W and cache)."""

    def __init__(self, model, tokenizer, provenance: dict | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.provenance = provenance or {}
        self.device = next(model.parameters()).device
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = {self.im_end_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        self.prompt_ids = render_generation_prompt(tokenizer)
        self.action_end_ids = render_action_end(tokenizer)

    @classmethod
    def load(cls, path: str | pathlib.Path, *, device: str = "cpu", attention_backend: str | None = "reference") -> "AgentModel":
        """From an export directory (or a training checkpoint)."""
        from ds_ttt.export import load_for_inference

        loaded = load_for_inference(path, device=device, attention_backend=attention_backend, hash_files=False)
        tok = loaded.tokenizer
        if tok is None:
            from ds_ttt.data.tokenizer import load_tokenizer

            tok = load_tokenizer()
        return cls(loaded.model, tok, loaded.provenance)


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
    caches: list[LayerCache]
    weights: tuple
    round: int
    phase: str  # "act" (expects act) | "acted" (expects observe or act)
    round_start: int
    caches_before_round: list[LayerCache]
    messages: list[dict]
    history: list[RoundLog]


class AgentSession:
    def __init__(self, model: "str | pathlib.Path | AgentModel", *, device: str = "cpu", max_new_tokens: int = 1024,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, track_after: bool = False,
                 max_context: int | None = None):
        self.agent = model if isinstance(model, AgentModel) else AgentModel.load(model, device=device)
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.track_after = track_after
        self.max_context = max_context or self.agent.model.config.max_position_embeddings
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._s: _State | None = None

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

    def _state(self) -> _State:
        if self._s is None:
            raise SessionError("no episode: call reset(task) first")
        return self._s

    # ---- model plumbing ------------------------------------------------------------------------
    def _forward(self, chunk_ids: list[int], start: int, round_id: int, caches, weights, want: list[int]):
        """Run new tokens (positions start..) through every layer against `caches`.

        Returns (float logits [len(want), V] at chunk indices `want`, caches with the chunk appended)."""
        if start + len(chunk_ids) > self.max_context:
            raise SessionError(f"context full: {start + len(chunk_ids)} tokens > max_context={self.max_context}")
        m, dev = self.model, self.agent.device
        ids = torch.tensor([chunk_ids], device=dev)
        h = m.model.embed_tokens(ids)
        positions = torch.arange(start, start + len(chunk_ids), device=dev)
        pos_emb = m.model.rotary_emb(h, positions[None])
        h, outs = forward_event(m.model.layers, caches, h, pos_emb, start, round_id, m.policy, m.ttt.attention_backend,
                                weights)
        logits = m.lm_head(m.model.norm(h[0, torch.tensor(want, dtype=torch.long, device=dev)]))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        rounds = torch.full((len(chunk_ids),), round_id, dtype=torch.long, device=dev)
        new = [kept.append(k.detach(), v.detach(), positions, rounds) for kept, k, v in outs]
        return logits, new

    def _empty_caches(self) -> list[LayerCache]:
        like = []
        for layer in self.model.model.layers:
            attn = layer.self_attn
            p = attn.k_proj.weight
            like.append(LayerCache.empty(p.new_zeros(1, attn.config.num_key_value_heads, 0, attn.head_dim)))
        return like

    def _choose(self, logits_V: torch.Tensor, temperature: float, top_p: float) -> int:
        if temperature <= 0:
            return int(logits_V.argmax())
        probs = torch.softmax(logits_V.double() / temperature, -1).cpu()
        if top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p  # smallest prefix with mass >= top_p
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
        r = render_trajectory({"id": "session", "messages": messages, "tools": tools or None}, self.tokenizer)
        caches0 = self._empty_caches()
        weights = tuple(w.detach().clone() for w in self.model.initial_fast_weights())
        with torch.no_grad():
            _, caches = self._forward(r.input_ids, 0, 0, caches0, weights, want=[])
        self._s = _State(ids=list(r.input_ids), kinds=list(r.kinds), rounds=list(r.rounds), caches=caches,
                         weights=weights, round=0, phase="act", round_start=0, caches_before_round=caches0,
                         messages=messages, history=[])
        return {"round": 0, "num_tokens": len(r.input_ids)}

    def act(self, *, force: dict | str | None = None, max_new_tokens: int | None = None,
            temperature: float | None = None, top_p: float | None = None) -> dict:
        """The next assistant message (parsed: reasoning_content, content, tool_calls, invalid_tool_calls).

        force: an assistant message (or its raw generated text) to feed instead of generating."""
        s = self._state()
        ag = self.agent
        temperature = self.temperature if temperature is None else temperature
        top_p = self.top_p if top_p is None else top_p
        r, start, before, w = s.round + 1, len(s.ids), s.caches, s.weights
        prompt, end = ag.prompt_ids, ag.action_end_ids
        log = RoundLog(round=r, forced=force is not None)
        with torch.no_grad():
            if force is not None:
                if isinstance(force, dict):
                    action = render_action(force, self.tokenizer)
                else:
                    action = self.tokenizer.encode(str(force), add_special_tokens=False)
                    if not action or action[-1] != ag.im_end_id:
                        action.append(ag.im_end_id)
                chunk = prompt + action + end
                want = list(range(len(prompt) - 1, len(prompt) + len(action) - 1))
                logits, caches = self._forward(chunk, start, r, before, w, want)
                log.action_token_nll = F.cross_entropy(logits, torch.tensor(action, device=logits.device),
                                                       reduction="none").tolist()
            else:
                budget = min(max_new_tokens or self.max_new_tokens, self.max_context - start - len(prompt) - len(end) - 1)
                if budget <= 0:
                    raise SessionError(f"context full: {start} tokens, max_context={self.max_context}")
                logits, caches = self._forward(prompt, start, r, before, w, [len(prompt) - 1])
                pos, action = start + len(prompt), []
                while True:
                    tok = self._choose(logits[-1], temperature, top_p)
                    log.action_token_nll.append(float(-torch.log_softmax(logits[-1], -1)[tok]))
                    action.append(tok)
                    if tok in ag.stop_ids or len(action) >= budget:
                        break
                    logits, caches = self._forward([tok], pos, r, caches, w, [0])
                    pos += 1
                tail = [action[-1]]
                if action[-1] not in ag.stop_ids:
                    log.truncated = True
                    action.append(ag.im_end_id)
                    tail.append(ag.im_end_id)
                elif action[-1] != ag.im_end_id:  # <|endoftext|>: close the turn as the renderer does
                    action[-1] = tail[-1] = ag.im_end_id
                _, caches = self._forward(tail + end, pos, r, caches, w, [])
        text = self.tokenizer.decode(action, skip_special_tokens=False)
        message = parse_assistant_message(text)
        if log.truncated:
            message["truncated"] = True
        log.action_ids = action
        # commit (nothing above mutated the session, so a failure leaves it as it was)
        s.ids += prompt + action + end
        s.kinds += [CONTEXT] * len(prompt) + [ACTION] * len(action) + [CONTEXT] * len(end)
        s.rounds += [r] * (len(prompt) + len(action) + len(end))
        s.caches, s.caches_before_round, s.round_start = caches, before, start
        s.round, s.phase = r, "acted"
        s.messages.append({k: v for k, v in message.items() if k != "truncated"})
        s.history.append(log)
        return message

    def observe(self, outputs: str | list[str]) -> float | None:
        """Feed the tool output(s) of the last action; one inner step on W. Returns the observation's
        mean NLL under the pre-update W (None when the outputs render to no observation tokens)."""
        s = self._state()
        if s.phase != "acted":
            raise SessionError("observe() must follow act(): pass every tool output of the last action in one call")
        outputs = [outputs] if isinstance(outputs, str) else outputs
        if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs):
            raise SessionError("observe needs a string or a non-empty list of strings (one per tool call)")
        obs_ids, obs_kinds = render_observation(outputs, self.tokenizer)
        round_ids = s.ids[s.round_start:] + obs_ids
        round_kinds = s.kinds[s.round_start:] + obs_kinds
        ttt = self.model.ttt
        # the labels of the training loop's observation loss (label j predicts token j + 1)
        want = observation_labels(torch.tensor(round_kinds[1:]), with_end=ttt.obs_loss_with_end).nonzero().flatten().tolist()
        labels = torch.tensor([round_ids[j + 1] for j in want], dtype=torch.long, device=self.agent.device)
        can_update = bool(want) and len(s.weights) > 0 and ttt.inner_lr > 0
        new_w, obs_nll, updated, skipped, after = s.weights, None, False, False, None
        with torch.enable_grad() if can_update else torch.no_grad():
            w = tuple(x.detach().requires_grad_(True) for x in s.weights) if can_update else s.weights
            logits, caches = self._forward(round_ids, s.round_start, s.round, s.caches_before_round, w, want)
            if want:
                loss = F.cross_entropy(logits, labels)
                obs_nll = float(loss.detach())
            if can_update:
                res = inner_sgd_step(loss, w, lr=ttt.inner_lr, max_norm=ttt.inner_max_norm, create_graph=False)
                new_w = tuple(x.detach() for x in res.weights)
                updated, skipped = not res.skipped, res.skipped
        if self.track_after and updated:
            with torch.no_grad():
                logits_after, _ = self._forward(round_ids, s.round_start, s.round, s.caches_before_round, new_w, want)
                after = float(F.cross_entropy(logits_after, labels))
        # commit (nothing above mutated the session)
        log = s.history[-1]
        log.obs_tokens, log.obs_nll, log.obs_nll_after, log.updated, log.skipped = len(want), obs_nll, after, updated, skipped
        s.ids += obs_ids
        s.kinds += obs_kinds
        s.rounds += [s.round] * len(obs_ids)
        s.caches, s.weights, s.phase = caches, new_w, "act"
        calls = (s.messages[-1].get("tool_calls") or []) if s.messages else []
        for i, out in enumerate(outputs):
            call_id = calls[i]["id"] if i < len(calls) else f"call_{i}"
            s.messages.append({"role": "tool", "tool_call_id": call_id, "content": out})
        return obs_nll

    def snapshot(self) -> dict:
        """A JSON-friendly view of the episode so far."""
        s = self._state()
        return {"round": s.round, "num_tokens": len(s.ids), "phase": s.phase,
                "history": [dataclasses.asdict(h) | {"action_nll": h.action_nll} for h in s.history]}
