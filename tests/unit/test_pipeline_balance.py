"""benchmarks/pipeline_balance/: the TrainSchedule simulation, the memory arithmetic, the CPU allocator
probe, and a tiny smoke run of the per-stage probes (real PipelineModule stages, in a subprocess so its
single-rank process group never meets another test's).

    .venv/bin/python -m pytest tests/unit/test_pipeline_balance.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from pipeline_balance import estimate, memory, simulate  # noqa: E402


def _uniform(num_stages, num_micro, f, b):
    return [[f] * num_micro for _ in range(num_stages)], [[b] * num_micro for _ in range(num_stages)]


@pytest.mark.parametrize("num_micro,num_stages", [(1, 1), (4, 4), (8, 4), (32, 4), (2, 2), (3, 4), (16, 2)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_equal_stages_reproduce_the_1f1b_bubble(num_micro, num_stages, f, b):
    fwd, bwd = _uniform(num_stages, num_micro, f, b)
    for blocking in (True, False):
        sim = simulate.simulate_train_schedule(fwd, bwd, blocking_send=blocking)
        assert sim["step_s"] == pytest.approx((num_micro + num_stages - 1) * (f + b))
        assert sim["bubble"] == pytest.approx(simulate.uniform_bubble(num_micro, num_stages))
        assert all(u == pytest.approx(num_micro / (num_micro + num_stages - 1)) for u in sim["utilisation"].values())


def test_one_slow_stage_dominates():
    m = 8
    fwd = [[0.1] * m, [0.1] * m, [0.1] * m, [3.0] * m]
    bwd = [[0.2] * m, [0.2] * m, [0.2] * m, [7.0] * m]
    sim = simulate.simulate_train_schedule(fwd, bwd)
    # the slow stage never waits after its first input: M x its work + the others' fill and drain
    assert sim["step_s"] == pytest.approx(m * 10.0 + 3 * 0.3)
    assert sim["utilisation"]["0/3"] == pytest.approx(m * 10.0 / sim["step_s"])
    assert sim["utilisation"]["0/0"] == pytest.approx(m * 0.3 / sim["step_s"])
    # far from what the equal-stage formula would claim
    assert sim["bubble"] > 0.7 > simulate.uniform_bubble(m, 4)


def test_slow_first_stage_also_dominates():
    m = 6
    fwd = [[2.0] * m, [0.1] * m, [0.1] * m]
    bwd = [[4.0] * m, [0.1] * m, [0.1] * m]
    sim = simulate.simulate_train_schedule(fwd, bwd)
    # stage 0 starts at once and 1F1B's warm-up forwards keep it busy until the fast stages' gradients
    # return: it never waits, and the fast stages' work hides inside its own
    assert sim["step_s"] == pytest.approx(m * 6.0)
    assert sim["utilisation"]["0/0"] == pytest.approx(1.0)


def test_schedule_ops_follow_deepspeed():
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    for stages, micro in ((4, 8), (2, 3), (1, 5)):
        for s in range(stages):
            ops = simulate.train_schedule_ops(micro, stages, s)
            ds = [type(c) for cmds in TrainSchedule(micro_batches=micro, stages=stages, stage_id=s).steps() for c in cmds
                  if isinstance(c, (ForwardPass, BackwardPass))]
            assert [o.kind for o in ops if o.kind in "FB"] == ["F" if c is ForwardPass else "B" for c in ds]
            assert [o.micro for o in ops if o.kind == "F"] == list(range(micro))
            assert sum(o.kind == "send_act" for o in ops) == (micro if s < stages - 1 else 0)
            assert sum(o.kind == "recv_grad" for o in ops) == (micro if s < stages - 1 else 0)


def test_replicas_and_shared_cores():
    fwd, bwd = _uniform(2, 4, 1.0, 2.0)
    one = simulate.simulate_train_schedule(fwd, bwd)["step_s"]
    assert simulate.simulate_train_schedule([fwd, fwd], [bwd, bwd])["step_s"] == pytest.approx(one)
    slow_f, slow_b = _uniform(2, 4, 2.0, 4.0)
    assert simulate.simulate_train_schedule([fwd, slow_f], [bwd, slow_b])["step_s"] == pytest.approx(2 * one)
    # 4 single-stage replicas of equal work on 2 cores take twice as long as on 4 devices
    f1, b1 = [[1.0, 1.0]], [[1.0, 1.0]]
    assert simulate.simulate_train_schedule([f1] * 4, [b1] * 4)["step_s"] == pytest.approx(4.0)
    assert simulate.simulate_train_schedule([f1] * 4, [b1] * 4, cores=2)["step_s"] == pytest.approx(8.0)
    # a pipeline whose stages never overlap loses nothing to 1 core
    fwd, bwd = [[1.0], [1.0]], [[1.0], [1.0]]
    assert simulate.simulate_train_schedule(fwd, bwd, cores=1)["step_s"] == pytest.approx(4.0)


def test_background_load_slows_concurrent_ranks_only():
    f1, b1 = [[1.0]], [[1.0]]
    # one busy rank runs as fast as the process that measured it, whatever the background
    assert simulate.simulate_train_schedule([f1], [b1], cores=2, background=10)["step_s"] == pytest.approx(2.0)
    # four: each gets 2/14 of the cores instead of the 2/11 the measuring process had
    four = simulate.simulate_train_schedule([f1] * 4, [b1] * 4, cores=2, background=10)["step_s"]
    assert four == pytest.approx(2.0 * 14 / 11)


def test_deadlock_is_reported(monkeypatch):
    def only_receives(num_micro, num_stages, stage):
        return [simulate.Op("recv_act", -1)] if stage == 1 else [simulate.Op("recv_grad", -1)]

    monkeypatch.setattr(simulate, "train_schedule_ops", only_receives)
    with pytest.raises(RuntimeError, match="deadlocked"):
        simulate.simulate_train_schedule([[1.0], [1.0]], [[1.0], [1.0]])


def test_stage_memory_arithmetic():
    params = {"params": 1000, "weight_bytes": 2000, "trainable_params": 100, "grad_bytes": 200}
    act = {"held_after_forward_bytes": 50, "peak_bytes": 300, "peak_includes_grad_bytes": 200}
    m = memory.stage_memory(params, act, stage=0, num_stages=4, num_micro=8, dp=2, mixed_bf16=True)
    assert m["optimizer"] == 12 * 100 / 2 and m["fp32_grad_partition_at_step"] == 4 * 100 / 2
    assert m["in_flight"] == 4  # 1F1B: stage 0 of 4 keeps 4 micro-batches' activations
    assert m["activations"] == 3 * 50 + (300 - 200)
    assert m["total"] == 2000 + 200 + 600 + 250
    assert memory.stage_memory(params, act, stage=3, num_stages=4, num_micro=8, dp=1, mixed_bf16=True)["in_flight"] == 1


def test_cpu_allocator_profile_counts_what_the_step_allocates():
    import torch

    keep = []

    def step():
        with torch.profiler.record_function("stage_forward"):
            keep.append(torch.ones(1 << 18))  # 1 MiB, held past the forward
        tmp = torch.ones(1 << 20)  # 4 MiB, freed before the end
        del tmp

    res = memory.cpu_allocator_profile(step)
    assert 1 << 20 <= res["held_after_forward_bytes"] < 2 << 20
    assert res["peak_bytes"] >= 5 << 20


def test_frozen_layer_flops():
    from ds_ttt.model.presets import backbone_config

    cfg = backbone_config("qwen3-8b")
    fl = estimate.decoder_layer_flops(cfg, 8192)
    # q, o: 4096 x 4096; k, v: 4096 x 1024; SwiGLU: 3 x 4096 x 12288
    assert fl["linear_params"] == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288
    assert fl["attention"] == pytest.approx(2 * 8192 * 8192 * 128 * 32)  # QK^T + PV, causal half, 32 heads


SMOKE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from pipeline_balance import estimate, memory, timing
    import torch
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config
    timing.init_single_process_group()
    cfg = tiny_qwen3_config(num_hidden_layers=4, vocab_size=256)
    ttt = TTTConfig(adaptive_layers=1).validate(4)
    layouts = timing.resolve_layouts(cfg, ttt, ((4, 1), (1, 4)))
    built = {n: [timing.build_stage(cfg, ttt, lay, s, dtype=torch.float32, device="cpu") for s in range(st)]
             for n, (st, dp, lay) in layouts.items()}
    mb = timing.synthetic_micro_batch(cfg, 96, device="cpu", prompt=8, action=8, observation=16)
    inputs = timing.layout_inputs(built, [mb])
    times = timing.time_stages(built, inputs, 2, "cpu", warmup=0)
    losses = {}
    for n, stages in built.items():
        timing.set_step_objective(stages[-1], inputs[n][0])
        with torch.no_grad():
            losses[n] = float(stages[-1](timing.stage_inputs(inputs[n][0], len(stages) - 1)).reshape(()))
    mem = memory.measure_stage_memory(built["PP1xDP4"][0], 0, True, inputs["PP1xDP4"][0], "cpu")
    print(json.dumps({"times": {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in times["times"].items()},
                      "ran": {f"{k[0]}/{k[1]}": v for k, v in times["backward_ran"].items()},
                      "losses": losses, "mem": mem, "updates": estimate.count_updates(mb),
                      "params": {n: [timing.stage_params(m) for m in s] for n, s in built.items()}}))
""")


def test_stage_probe_smoke_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SMOKE, str(BENCHMARKS)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(res["times"]) == sorted([f"PP4xDP1/{s}/0" for s in range(4)] + ["PP1xDP4/0/0"])
    for fwd, bwd in res["times"].values():
        assert len(fwd) == len(bwd) == 2 and all(t > 0 for t in fwd + bwd)
    # the last stage always backpropagates (its prime MLPs train)
    assert res["ran"]["PP4xDP1/3"] and res["ran"]["PP1xDP4/0"]
    # the probes are the real pipeline: PP4's four stages chained compute PP1's loss (same seeded layers)
    assert res["losses"]["PP4xDP1"] == pytest.approx(res["losses"]["PP1xDP4"], rel=1e-5)
    # one model, two partitions: the same parameters in total (the frozen stages' anchors aside)
    pp4 = [p["params"] for p in res["params"]["PP4xDP1"]]
    pp4_anchors = sum(p["trainable_params"] == 1 for p in res["params"]["PP4xDP1"])
    assert sum(pp4) - pp4_anchors == res["params"]["PP1xDP4"][0]["params"]
    m = res["mem"]
    assert 0 < m["held_after_forward_bytes"] <= m["peak_bytes"]
    assert res["updates"] >= 2


def test_fp32_fast_weights_are_added_only_to_a_recording_made_without_them(tmp_path):
    """The committed H200 recording (made after the fp32 fast weights) is used as it is; the same files
    stamped with the older recording's commit get the fp32 copies added (failed on the code before: the
    estimate added them to every recording, counting them twice in the new one)."""
    assert not estimate.recorded_with_fp32_fast_weights("7c57737")  # the 2026-11-30 recording
    assert estimate.recorded_with_fp32_fast_weights(estimate.FP32_FAST_WEIGHTS_COMMIT)
    with pytest.raises(ValueError, match="not in this clone's history"):
        estimate.recorded_with_fp32_fast_weights("0123456789abcdef0123456789abcdef01234567")
    est = estimate.qwen3_8b_estimate(last_stage_fwd_fraction=0.45, frozen_backward=False, fast_weight_factor=1.0)
    assert est["fast_weight_factor"] is None and all("fp32_fast_weights" not in r["busiest_rank_bytes"] for r in est["rows"])
    for name in ("last_stage.json", "flashbob_cuda.json"):
        (tmp_path / name).write_text((estimate.GPU_RESULTS / name).read_text())
    env = json.loads((estimate.GPU_RESULTS / "environment.json").read_text())
    (tmp_path / "environment.json").write_text(json.dumps({**env, "git_commit": "7c57737"}))
    old = estimate.qwen3_8b_estimate(last_stage_fwd_fraction=0.45, frozen_backward=False, fast_weight_factor=1.0,
                                     gpu_dir=tmp_path)
    assert old["fast_weight_factor"] == 1.0 and old["rows"]
    for r in old["rows"]:
        m = r["busiest_rank_bytes"]
        extra = r["updates"] * old["prime_mlp_params"] * 2 + old["prime_mlp_params"] * 4
        assert m["fp32_fast_weights"] - m["recorded_inner_loop"] == pytest.approx(extra)


def test_qwen3_8b_estimate_from_the_recorded_h200_files():
    est = estimate.qwen3_8b_estimate(last_stage_fwd_fraction=0.45, frozen_backward=False, fast_weight_factor=1.0)
    rows = {(r["tokens"], r["backend"], r["layout"]): r for r in est["rows"]}
    assert est["prime_mlp_params"] == 9 * 3 * 4096 * 12288
    pp4, pp1 = rows[(8192, "cuda", "PP4xDP1")], rows[(8192, "cuda", "PP1xDP4")]
    rate = min(pp4["by_rate"])
    # the last stage dominates: 4 replicas of it give ~4x one pipeline's throughput
    assert 3.5 < pp1["by_rate"][rate]["tokens_per_s"] / pp4["by_rate"][rate]["tokens_per_s"] <= 4.0
    assert pp4["by_rate"][rate]["utilisation_last"] > 0.99
    # PP1 trades the frozen weights for 3/4 of the optimizer state
    diff = pp1["busiest_rank_bytes"]["recorded_inner_loop"] - pp4["busiest_rank_bytes"]["recorded_inner_loop"]
    assert diff == pytest.approx(est["weight_bytes_all"] - est["weight_bytes_last_stage"] - 0.75 * est["optimizer_bytes_dp1"])
    # with a wasted frozen backward the PP4 step can only grow
    slow = estimate.qwen3_8b_estimate(last_stage_fwd_fraction=0.45, frozen_backward=True, fast_weight_factor=None)
    slow_pp4 = next(r for r in slow["rows"] if (r["tokens"], r["backend"], r["layout"]) == (8192, "cuda", "PP4xDP1"))
    assert slow_pp4["by_rate"][rate]["step_s"] >= pp4["by_rate"][rate]["step_s"]


def test_longest_fitting_context_interpolates_and_never_extrapolates():
    gib = 2**30
    est = {"usable_bytes": {"g": 50 * gib}, "rows": [
        {"backend": "b", "layout": "L", "tokens": t, "busiest_rank_bytes": {"k": m * gib}}
        for t, m in ((2048, 40), (8192, 60), (16384, 80))] + [
        {"backend": "b", "layout": "small", "tokens": t, "busiest_rank_bytes": {"k": 10 * gib}} for t in (2048, 8192)] + [
        {"backend": "b", "layout": "big", "tokens": 2048, "busiest_rank_bytes": {"k": 70 * gib}}]}
    fit = estimate.longest_fitting_context(est, "g", "k")
    assert fit[("b", "L")] == "5K"  # 2048 + (50 - 40) / (60 - 40) * 6144 = 5120
    assert fit[("b", "small")] == "8K+"
    assert fit[("b", "big")] is None


BUILT_ON = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from pipeline_balance import timing
    import torch
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.train.pipeline import TTTPipelineModule
    timing.init_single_process_group()
    devices = []
    class Built(Exception):
        pass
    def spy(self, *a, **k):  # record where the stage's parameters would be created, then stop
        devices.append(torch.get_default_device().type)
        raise Built
    TTTPipelineModule.__init__ = spy
    cfg = tiny_qwen3_config(num_hidden_layers=4, vocab_size=256)
    ttt = TTTConfig(adaptive_layers=1).validate(4)
    (stages, _, lay), = timing.resolve_layouts(cfg, ttt, ((4, 1),)).values()
    try:
        timing.build_stage(cfg, ttt, lay, 0, dtype=torch.float32, device="meta")
    except Built:
        pass
    print(devices)
""")


def test_stages_are_built_on_the_device_they_run_on():
    """build_stage initialises a stage's parameters on its device, not on the CPU first (a Qwen3-8B stage's
    fp32 random init on the CPU outlasted the H200 balance phase's whole limit; failed on the code before:
    the module was built under the CPU default device and moved afterwards)."""
    r = subprocess.run([sys.executable, "-c", BUILT_ON, str(BENCHMARKS)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "['meta']", r.stdout[-2000:]
