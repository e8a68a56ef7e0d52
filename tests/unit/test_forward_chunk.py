"""One layer loop for training, evaluation and serving: ds_ttt/model/forward.py `forward_chunk`.

Checks that the loop exists once (no other module of ds_ttt calls a decoder layer), and that its
caches compose: a sequence run chunk by chunk through EventCache (the training event's cache) and the
key state carried between chunks equals the whole sequence at once through WholeSequence, with fast
weights, a key shift and the round address.

    python -m pytest tests/unit/test_forward_chunk.py -q
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.context import ContextPolicy, LayerCache
from ds_ttt.model.forward import EventCache, WholeSequence, forward_chunk, uses_key_state
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM, frozen_path_attend

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_only_forward_py_calls_decoder_layers():
    """Every pass through decoder layers goes through forward_chunk: no other module calls a layer
    (fails on the code before it: qwen3.run_decoder_layers, event_loop.forward_event, session._forward and
    batch.batched_decode_logits each had their own loop)."""
    callers = []
    for path in sorted((ROOT / "ds_ttt").rglob("*.py")):
        if path.name == "forward.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "layer" \
                    and len(node.args) >= 3:
                callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not callers, f"decoder layers called outside ds_ttt/model/forward.py: {callers}"


@pytest.mark.parametrize("ttt", [
    TTTConfig(context_policy="full", key_shift=2),
    TTTConfig(context_policy="current_round", round_address=True),
    TTTConfig(context_policy="window", window=5),
], ids=["full+shift", "current_round+address", "window"])
def test_event_chunks_compose_to_the_whole_sequence(ttt):
    cfg = tiny_qwen3_config(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, ttt.validate(3)).double()
    with torch.no_grad():  # non-zero slow weights of the key, so the state between chunks matters
        for layer in model.model.layers:
            if layer.is_adaptive:
                for name in ("key_shift", "address_query", "address_proj"):
                    p = getattr(layer.prime_mlp, name, None)
                    if isinstance(p, torch.nn.Parameter):
                        p.normal_(0, 0.3)
    layers, policy = list(model.model.layers), ContextPolicy.from_ttt(model.ttt)
    rounds = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    t = rounds.shape[1]
    h = torch.randn(1, t, 32, dtype=torch.float64)
    pos_emb = model.model.rotary_emb(h, torch.arange(t)[None])
    fast = tuple(w + 0.05 * torch.randn_like(w) for layer in layers if layer.is_adaptive
                 for w in (layer.prime_mlp.gate_proj.weight, layer.prime_mlp.up_proj.weight,
                           layer.prime_mlp.down_proj.weight))
    segments = rounds if policy.rounds_are_segments else None
    attend = frozen_path_attend(policy, h, rounds, layers[0].self_attn.scaling)
    whole = forward_chunk(layers, h, pos_emb, WholeSequence(attend), fast_weights=fast, segments_BT=segments)

    caches = [LayerCache.empty(torch.zeros(1, 2, 0, 8, dtype=torch.float64)) for _ in layers]
    key_prev, parts = None, []
    for r in range(3):
        idx = (rounds[0] == r).nonzero().squeeze(1)
        start, end = int(idx[0]), int(idx[-1]) + 1
        cache = EventCache([policy.select_chunks([c], start, r) for c in caches], "reference")
        out = forward_chunk(layers, h[:, start:end], (pos_emb[0][:, start:end], pos_emb[1][:, start:end]), cache,
                            fast_weights=fast, key_prev=None if policy.rounds_are_segments else key_prev)
        parts.append(out.hidden_BTC)
        key_prev = out.key_last
        assert len(out.key_last) == sum(uses_key_state(layer) for layer in layers)
        pos, rid = torch.arange(start, end), torch.full((end - start,), r)
        caches = [LayerCache(c.k_1HSD, c.v_1HSD, c.positions_S, c.rounds_S).append(k, v, pos, rid)
                  for c, (_, k, v) in zip(caches, cache.outs)]
    torch.testing.assert_close(torch.cat(parts, 1), whole.hidden_BTC, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("policy", [ContextPolicy("full"), ContextPolicy("window", 5), ContextPolicy("current_round")])
def test_event_cache_over_chunks_equals_one_merged_cache(policy):
    """The event loop hands EventCache each layer's cache as per-event chunks (no re-copy per event);
    attention over them (whole chunks as they are, the kept rows of a chunk the window cuts) equals
    attention over the one merged, pruned cache, bit for bit."""
    from ds_ttt.ops.flashbob import attention  # noqa: F401  (the backend EventCache calls)

    gen = torch.Generator().manual_seed(0)
    sizes, rounds = [4, 3, 5], [0, 1, 2]
    chunks, pos = [], 0
    for n, r in zip(sizes, rounds):
        kv = [torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
        chunks.append(LayerCache(kv[0], kv[1], torch.arange(pos, pos + n), torch.full((n,), r)))
        pos += n
    merged = LayerCache(torch.cat([c.k_1HSD for c in chunks], 2), torch.cat([c.v_1HSD for c in chunks], 2),
                        torch.arange(pos), torch.cat([c.rounds_S for c in chunks]))
    q, k, v = (torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    outs = [EventCache([policy.select_chunks(c, pos, 3)], "reference").attend(0)(q, k, v) for c in (chunks, [merged])]
    assert torch.equal(outs[0], outs[1])
    if policy.attention_window:  # a chunk the window cuts is kept as a view of its rows, not a copy
        kept, _ = policy.select_chunks(chunks[:2], 9, 2)  # window 5 from position 9: positions 5, 6 of chunk 1
        assert len(kept) == 1 and kept[0].positions_S.tolist() == [5, 6]
        assert kept[0].k_1HSD.untyped_storage().data_ptr() == chunks[1].k_1HSD.untyped_storage().data_ptr()
        assert torch.equal(kept[0].k_1HSD, chunks[1].k_1HSD[:, :, 1:])


@pytest.mark.parametrize("ttt", [
    TTTConfig(context_policy="window", window=5, inner_steps=2),
    TTTConfig(context_policy="current_round", inner_steps=2),
], ids=["window", "current_round"])
@pytest.mark.parametrize("how", ["record", "checkpointed"])
def test_the_event_loop_selects_each_event_once(ttt, how, monkeypatch):
    """The event loop selects the rows an event sees once per event and layer (ContextPolicy.select_chunks)
    and hands EventCache the pairs: scoring an event again (a second inner step, the record's rescoring,
    the checkpointed backward's recompute) selects nothing again (each scoring pass re-selected before)."""
    cfg = tiny_qwen3_config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    ttt = TTTConfig(**{**{f: getattr(ttt, f) for f in ("context_policy", "window", "inner_steps")},
                       "checkpoint_events": how == "checkpointed", "adaptive_layers": 1})
    model = TTTQwen3ForCausalLM(cfg, ttt.validate(2)).double()
    calls = []
    select = ContextPolicy.keep_rows
    monkeypatch.setattr(ContextPolicy, "keep_rows", lambda self, *a: calls.append(a[2:]) or select(self, *a))
    ids = torch.randint(0, 64, (1, 12))
    kinds = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 0, 1, 2, 2]])  # context, action, observation
    rounds = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]])
    if how == "record":
        with torch.no_grad():
            out = model.trajectory_loss(ids, kinds, rounds, create_graph=False, record=True)
    else:
        out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
        out.loss.backward()
    assert out.num_update_attempts == 2  # rounds 1 and 2 update (twice each: inner_steps=2)
    assert sorted(calls) == sorted((start, r) for start, r in ((0, 0), (4, 1), (8, 2)) for _ in model.adaptive_layers)
