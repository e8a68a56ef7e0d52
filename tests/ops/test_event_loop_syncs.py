"""The event loop's hot path never waits for the GPU: host syncs per batch do not grow with events.

Counts synchronizing CUDA calls with `torch.cuda.set_sync_debug_mode("warn")` for the same model on
trajectories of 2 and 8 events; only the batch's one host copy of token kinds and round ids may sync.
Skipped without CUDA.

    python -m pytest tests/ops/test_event_loop_syncs.py
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronizations; needs a CUDA GPU")]

ROUND = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]


def batch(num_rounds: int, device: str):
    kinds = [0] * 6 + ROUND * num_rounds
    rounds = [0] * 6 + [r for r in range(1, num_rounds + 1) for _ in ROUND]
    ids = torch.randint(0, 256, (1, len(kinds)), generator=torch.Generator().manual_seed(0))
    return ids.to(device), torch.tensor([kinds], device=device), torch.tensor([rounds], device=device)


def count_syncs(model, num_rounds: int, create_graph: bool) -> int:
    ids, kinds, rounds = batch(num_rounds, "cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.set_grad_enabled(create_graph):
                out = model.trajectory_loss(ids, kinds, rounds, create_graph=create_graph)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.num_update_attempts == num_rounds
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("create_graph", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_syncs_do_not_grow_with_events(create_graph, dtype):
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=256)
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(context_policy="current_round")).to("cuda").to(dtype)
    count_syncs(model, 2, create_graph)  # warm-up: the first call's one-time CUDA setup (cuBLAS handle, context) syncs
    few, many = count_syncs(model, 2, create_graph), count_syncs(model, 8, create_graph)
    assert many == few, f"{few} syncs for 2 events but {many} for 8: a sync runs per event"
    assert few <= 2, f"{few} syncs per batch; expected only the host copy of kinds and round ids"
