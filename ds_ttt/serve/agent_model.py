"""AgentModel: a frozen TTT model and its tokenizer, shared by any number of sessions (each keeps its own W and cache).

    from ds_ttt.serve.agent_model import AgentModel
    agent = AgentModel.load("EXPORT", device="cpu", attention_backend="reference")
    w0 = agent.initial_weights()        # the one fp32 copy of W_0 every session starts from
    pool = agent.decode_pool()          # its own KV pool, for batched decodes that bring none

What the sessions (session.py), their replies (decode.py) and the batched paths (batch.py, prefill.py)
share: the model (eval mode, no parameter requires grad), the tokenizer with the ids of the turn
markers, and W_0's fp32 copies. The weights must not change after the AgentModel is built (it takes
W_0's copies once; a replaced parameter is noticed, an edit in place is not): build a new AgentModel
for new weights.
"""

from __future__ import annotations

import pathlib
import threading

import torch

from ds_ttt.data.render import render_action_end, render_generation_prompt
from ds_ttt.model.fast_weights import fast_weight_dtype
from ds_ttt.serve.kv_pool import KVPool


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
        self._w0_of: tuple | None = None  # the parameters (their storages) the copies were taken from
        self._w0_lock = threading.Lock()
        self._decode_pool: KVPool | None = None

    def initial_weights(self) -> tuple:
        """W_0 as every session starts from it: fp32 (at least) copies of the prime weights, made once and
        shared by all sessions (weights are never written in place: an inner step returns new tensors,
        so sessions diverge only in the matrices they update; `fast_matrices="down"` keeps gate/up
        shared for good). Shared storage is what lets the batched decode (batch.py) run one product
        for the rows that hold the same matrix. Rebuilt if a parameter is replaced."""
        params = self.model.initial_fast_weights()
        source = tuple(w.data_ptr() for w in params)
        with self._w0_lock:  # request threads of the unbatched server reset sessions concurrently
            if self._w0 is None or source != self._w0_of:
                if torch.is_inference_mode_enabled():
                    raise RuntimeError("AgentModel.initial_weights: call outside torch.inference_mode (the copies "
                                       "must be usable by the inner step's autograd)")
                self._w0 = tuple(w.detach().to(fast_weight_dtype(w.dtype), copy=True) for w in params)
                self._w0_of = source
            return self._w0

    def decode_pool(self) -> KVPool:
        """This agent's own decode pool (made on first use), for batched decodes that bring none (the
        batched scheduler has its own)."""
        if self._decode_pool is None:
            self._decode_pool = KVPool.for_model(self.model)
        return self._decode_pool

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
