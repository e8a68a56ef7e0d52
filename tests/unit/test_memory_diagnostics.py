"""The memory diagnostics of every memory report: readback sites on real worlds, first-token hits from
event records, worlds by number of keys and the passed ids, the addressing margin's sign, and the
comparison rows carrying them (a row scored before them is refused by name).
Run: python -m pytest tests/unit/test_memory_diagnostics.py
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.evaluation import comparison, memory_diagnostics
from ds_ttt.evaluation.memory import MEMORY_SPLITS
from ds_ttt.evaluation.memory_diagnostics import (ReadbackSite, addressing_margins, first_token_hits, readback_sites,
                                                  world_diagnostics)
from ds_ttt.model.event_loop import EventRecord

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def worlds():
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    ws = [generate_memory_world(MEMORY_SPLITS["dev"] + i, pool="train") for i in range(6)]
    return tok, ws, [render_trajectory(w, tok) for w in ws]


def test_sites_point_at_the_value_in_the_readback_and_in_its_write(worlds):
    tok, ws, rendered = worlds
    seen_multi = False
    for w, r in zip(ws, rendered):
        sites = readback_sites(w, r, tok)
        assert len(sites) == len(w["meta"]["readbacks"]) and all(s is not None for s in sites)
        for s, rb in zip(sites, w["meta"]["readbacks"]):
            assert r.rounds[s.read + 1] == rb["round"] and r.rounds[s.write + 1] == rb["source_round"]
            assert r.input_ids[s.read + 1] == r.input_ids[s.write + 1] == s.first_token
            assert rb["value"].startswith(tok.decode([s.first_token]).strip()[:1])
            assert len(s.other_writes) == len(w["meta"]["values"]) - 1 and s.write not in s.other_writes
            seen_multi |= bool(s.other_writes)
    assert seen_multi


def _record(positions, argmax):
    t = torch.tensor(positions)
    return EventRecord(round=1, label_positions=t, labels=t, label_kinds=t, token_nll=t.float(),
                       argmax=torch.tensor(argmax), obs_nll_after=None, updated=False, skipped=False)


def test_first_token_hits_and_the_counts_by_number_of_keys():
    sites = [ReadbackSite(round=3, read=10, first_token=7, write=4, other_writes=()),
             ReadbackSite(round=4, read=20, first_token=9, write=6, other_writes=()), None]
    records = [_record([9, 10, 11], [1, 7, 2]), _record([20], [8])]
    assert first_token_hits(sites, records) == [True, False, False]
    ws = [{"id": f"w{i}", "meta": {"values": dict.fromkeys("abcde"[:k])}} for i, k in enumerate((1, 2, 2, 3, 5))]
    d = world_diagnostics(ws, [sites[:1]] * 5, [records] * 5, [True, True, False, False, True])
    assert d["first_token_count"] == [5, 5]
    assert d["by_num_keys"] == {"1": [1, 1], "2": [1, 2], "3": [0, 1], "4": [1, 1]}  # 5 keys counted as 4+
    assert d["multi_key_passed"] == [2, 4] and d["passed_ids"] == ["w0", "w1", "w4"]


def test_addressing_margin_is_own_minus_the_closest_other_write(monkeypatch):
    class Layer:
        layer_idx = 7

    class Model:
        adaptive_layers = [Layer()]
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.6, 0.8]])
    monkeypatch.setattr(memory_diagnostics, "prime_inputs", lambda model, rendered: [keys])
    good = ReadbackSite(round=2, read=2, first_token=0, write=0, other_writes=(1,))  # read ~ own write
    bad = ReadbackSite(round=2, read=3, first_token=0, write=0, other_writes=(1,))  # read ~ the other write
    m = addressing_margins(Model(), [None], [[good, bad, None]])["7"]
    unit = torch.nn.functional.normalize(keys, dim=-1)
    want = [float(unit[2] @ unit[0] - unit[2] @ unit[1]), float(unit[3] @ unit[0] - unit[3] @ unit[1])]
    assert m["readbacks"] == 2 and m["above_zero"] == [1, 2]
    assert m["margin"] == pytest.approx(sum(want) / 2)


def test_real_prime_inputs_have_one_row_per_token_and_layer(worlds):
    from tests.unit.test_comparison import _tiny_ttt

    tok, ws, rendered = worlds
    model = _tiny_ttt("current_round")
    keys = memory_diagnostics.prime_inputs(model, rendered[0])
    assert len(keys) == model.num_adaptive and keys[0].shape == (len(rendered[0].input_ids), model.config.hidden_size)
    m = addressing_margins(model, rendered[:3], [readback_sites(w, r, tok) for w, r in zip(ws[:3], rendered[:3])])
    (layer,) = m
    assert m[layer]["readbacks"] > 0 and -2.0 <= m[layer]["margin"] <= 2.0


def test_rows_without_the_diagnostics_are_refused_by_name():
    row = {"worlds_128": 0.1}
    res = {k: 0.1 for k in comparison.ROW_METRICS} | {f"{k}_{s}": 0.0 for k in comparison.ROW_METRICS for s in ("lo", "hi")}
    res["recovery_rounds"] = 1
    model = {"label": "old", "train_policy": "current_round", "sets": {"files": {}}, "modes": {"ttt": res}}
    with pytest.raises(ValueError, match="memory_diagnostics.*score it again"):
        comparison.compare_rows([model], command="c", seeds={}, load={})
    del row
