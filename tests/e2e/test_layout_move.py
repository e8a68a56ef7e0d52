"""Moving a run to another machine shape (`--resume RUN --deepspeed_config OTHER --output NEW`) on CPU ranks:

  PP4 x DP1 -> PP1 x DP2      (trainable_scope 'prime': frozen layers and stage anchors move too)
  PP4 x DP1 -> PP1 x DP2      the main recipe itself: ds_configs/run_cpu_tiny.json (preset tiny-mem: 3
                              non-adaptive decoder layer files for 4 stages) from ds_configs/cpu_tiny.json
                              to ds_configs/cpu_tiny_pp1_dp2.json
  PP1 x DP2 -> PP1 x DP4      (trainable_scope 'suffix': the LM head's AdamW moments re-sliced for 4 ranks)
  PP1 x DP2 -> PP2 x DP1      (micro-batch 1 x accumulation 2 x dp 2 -> micro 2 x accumulation 2 x dp 1)

Each baseline runs once, uninterrupted, in the old layout (3 steps, a checkpoint every step). Each move
continues its step-1 checkpoint in the new layout for steps 2-3; its losses equal the baseline's within
LOSS_RTOL, its learning rates exactly. Then the moved run is resumed once more in its own new layout
from its step-2 checkpoint: step 3 equals the moved run's step 3 bit for bit. The source run is never
modified (every file byte for byte). On the code before the layout move every move is refused (--resume
refused any change of layout), so every test here fails there; the main recipe's move also failed after
it, until the conversion stopped reading the layer files (DeepSpeed's universal conversion raised
ZeroDivisionError for a source with fewer decoder layer files than stages; every preset and stage count:
tests/unit/test_layout_move_parts.py).

Tolerance. A move changes which rank and which accumulation slot computes each trajectory, never what
is computed for it: with one trajectory per micro-batch (every layout here but PP2 x DP1) each
trajectory's loss and gradient are bit-identical in both layouts, and only the order in which the
N = train_batch_size / micro terms are summed (accumulation, then the data-parallel all-reduce) differs.
Reordering a sum of N fp32 terms of one sign moves it by at most (N - 1) u relative (u = 2**-24, the
unit roundoff), so the first step after the move agrees to 3 u = 1.8e-7. The next step starts from
weights that moved by an AdamW step whose gradient differs by that much; AdamW normalises the step
(m / sqrt(v)), so the weights differ by about lr x (N - 1) u and the loss by far less than another
(N - 1) u. PP2 x DP1 pads two trajectories to one length: padding changes no loss in exact arithmetic
(tests/unit/test_train_pipeline_layers.py) but lengthens the masked reductions, another reordering of
fp32 sums. LOSS_RTOL = 2 N eps = 16 u (eps = 2**-23) covers both with margin; the measured differences are
printed (pytest -s) and were <= 8.0e-8 relative (see docs/training.md).

    python -m pytest tests/e2e/test_layout_move.py     (eleven launches on 2 or 4 CPU ranks, ~4.5 CPU-minutes)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("pipeline_train_e2e", ROOT / "tests" / "e2e" / "test_pipeline_train.py")
_train_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_train_e2e)
free_port, metrics = _train_e2e.free_port, _train_e2e.metrics

GLOBAL_BATCH = 4
N_TERMS = GLOBAL_BATCH  # micro-batch terms summed per step in the layouts with micro-batch 1
LOSS_RTOL = 2 * N_TERMS * 2.0 ** -23  # 2 N eps: see the module docstring
BASE_DS = {"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupCosineLR", "params": {}}, "steps_per_print": 10**6}


def ds_config(stages: int, micro: int, gas: int) -> dict:
    return {**BASE_DS, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "pipeline": {"stages": stages, "activation_checkpoint_interval": 1, "use_reentrant": False}}


LAYOUTS = {"pp4_dp1": (4, ds_config(4, 1, 4)), "pp1_dp2": (2, ds_config(1, 1, 2)),
           "pp1_dp4": (4, ds_config(1, 1, 1)), "pp2_dp1": (2, ds_config(2, 2, 2))}
SCOPES = {"pp4_dp1": "prime", "pp1_dp2": "suffix"}  # the baselines' ttt.trainable_scope
RECIPE_RUN = ROOT / "ds_configs" / "run_cpu_tiny.json"  # the main recipe: tiny-mem, trainable_scope 'all'
RECIPE_PP4, RECIPE_PP1_DP2 = ROOT / "ds_configs" / "cpu_tiny.json", ROOT / "ds_configs" / "cpu_tiny_pp1_dp2.json"


def launch(nproc: int, ds: pathlib.Path, args: list[str], *, want_rc: int = 0) -> str:
    """launch/train.py on `nproc` CPU ranks (torchrun, its own session); returns stdout + stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "launch/train.py", "--deepspeed_config", str(ds)] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == want_rc, " ".join(cmd) + f"\nrc {proc.returncode}\n" + out[-4000:] + err[-4000:]
    return out + err


def make_data(out: pathlib.Path, seed: int) -> pathlib.Path:
    """12 generated shell trajectories with a trimmed vocabulary (the tiny preset adopts it: small
    embedding and LM head, so saves and conversions stay fast)."""
    from ds_ttt.data.generator import generate, write_outputs
    from ds_ttt.data.manifest import prepare

    write_outputs(generate(12, seed, workers=1), out / "raw")
    res = prepare([out / "raw" / "trajectories.jsonl"], out / "data", capacity=384, test_fraction=0.2, seed=seed,
                  trim_vocab=True)
    assert res.exit_code == 0, res.message
    return out / "data" / "manifest.json"


def tree_digest(path: pathlib.Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("move")
    for name, (_, ds) in LAYOUTS.items():
        (tmp / f"{name}.json").write_text(json.dumps(ds))
    return {"tmp": tmp, "manifest": make_data(tmp / "data", seed=1), "baselines": {}}


def baseline(work, layout: str) -> pathlib.Path:
    """The uninterrupted 3-step run in `layout` (once per module), a checkpoint every step."""
    if layout not in work["baselines"]:
        tmp = work["tmp"]
        run = {"preset": "tiny", "seed": 0, "save_interval": 1, "min_lr_ratio": 0.1,
               "ttt": {"adaptive_layers": 2, "trainable_scope": SCOPES[layout]}}
        (tmp / f"run_{layout}.json").write_text(json.dumps(run))
        out = tmp / f"base_{layout}"
        launch(LAYOUTS[layout][0], tmp / f"{layout}.json",
               ["--run_config", str(tmp / f"run_{layout}.json"), "--data", str(work["manifest"]),
                "--output", str(out), "--max_steps", "3"])
        work["baselines"][layout] = out
    return work["baselines"][layout]


def recipe_baseline(work) -> pathlib.Path:
    """The main recipe (run_cpu_tiny.json on cpu_tiny.json: 4 stages x 1 dp) uninterrupted for 3 steps,
    a checkpoint every step."""
    if "recipe" not in work["baselines"]:
        out = work["tmp"] / "base_recipe_pp4"
        launch(4, RECIPE_PP4, ["--run_config", str(RECIPE_RUN), "--data", str(work["manifest"]), "--output", str(out),
                               "--max_steps", "3", "--save_interval", "1"])
        work["baselines"]["recipe"] = out
    return work["baselines"]["recipe"]


STATE_RTOL = 1e-5  # norm-wise, for the optimizer state one step after the move: see `check_state_carried`


def universal_state(ckpt: pathlib.Path, out: pathlib.Path) -> dict[str, dict]:
    """Every optimizer-held parameter of a checkpoint, in DeepSpeed's universal form (layout-free
    names): {name: {"fp32" | "exp_avg" | "exp_avg_sq": tensor, "step": step}}."""
    import torch

    from ds_ttt.train.layout_move import ANCHOR, UNIVERSAL_DIR, run_ds_to_universal

    run_ds_to_universal(ckpt, out)
    state = {}
    for folder in sorted((out / UNIVERSAL_DIR).iterdir()):
        if folder.is_dir() and folder.name != ANCHOR:
            entry = {k: torch.load(folder / f"{k}.pt", weights_only=True)["param"].detach()
                     for k in ("fp32", "exp_avg", "exp_avg_sq")}
            entry["step"] = torch.load(folder / "step.pt", weights_only=True)
            state[folder.name] = entry
    return state


def layer_tensors(ckpt: pathlib.Path) -> dict[tuple[str, str], "torch.Tensor"]:
    import torch
    return {(f.name, k): v for f in sorted(ckpt.glob("layer_*-model_states.pt"))
            for k, v in torch.load(f, weights_only=True).items()}


def check_state_carried(base: pathlib.Path, moved: pathlib.Path, tmp: pathlib.Path) -> None:
    """One step after the move (step 2), the moved run's weights and AdamW state are the old layout's:
    parameters no step changed (frozen) bit for bit, in every layer file; the optimizer-held ones with
    the same AdamW step and, norm-wise, within STATE_RTOL. Step 2's gradient is the same sum in
    another order (relative error (N - 1) u per term magnitude, module docstring); STATE_RTOL = 1e-5 is
    ~170 times that, and far below what a lost state would cause: zeroed moments or weights would
    differ by 10% and more (exp_avg = 0.9 m + 0.1 g). Measured: <= 1.0e-7."""
    import torch

    frozen_before, want, got = layer_tensors(base / "step_00000001"), layer_tensors(base / "step_00000002"), \
        layer_tensors(moved / "step_00000002")
    assert set(want) == set(got)
    num_frozen = 0
    for key, tensor in want.items():
        if torch.equal(tensor, frozen_before[key]):
            num_frozen += 1
            assert torch.equal(got[key], tensor), key
    # 'prime' / 'suffix' freeze the embedding and the non-adaptive layers; the main recipe trains all, but its
    # round-address queries (zero-initialised, no gradient yet) have not moved either
    assert num_frozen > 0
    a = universal_state(base / "step_00000002", tmp / "u_base")
    b = universal_state(moved / "step_00000002", tmp / "u_moved")
    assert set(a) == set(b) and a
    for name in a:
        assert float(b[name]["step"]) == float(a[name]["step"]) == 2.0, name
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            diff, ref = float((b[name][key] - a[name][key]).norm()), float(a[name][key].norm())
            assert diff <= STATE_RTOL * ref, (name, key, diff, ref)


def move_and_check(work, old: str, new: str) -> None:
    check_move(work, baseline(work, old), LAYOUTS[new][0], work["tmp"] / f"{new}.json", f"{old}_to_{new}")


def check_move(work, base: pathlib.Path, nproc: int, ds: pathlib.Path, name: str) -> None:
    """Move base's step-1 checkpoint to config `ds` on `nproc` ranks; compare with base's steps 2-3."""
    source = base / "step_00000001"
    before = tree_digest(base)
    moved = work["tmp"] / f"moved_{name}"
    log = launch(nproc, ds, ["--resume", str(source), "--output", str(moved)])
    from ds_ttt.train.layout_move import MOVED_PREFIX, TMP_MOVED_PREFIX  # after the launch the old code refuses

    assert "DeepSpeed universal checkpoint" in log and "ds_ttt reassembly of the layer files" in log, log[-3000:]
    assert tree_digest(base) == before  # the source run is only read
    assert not list(moved.glob(MOVED_PREFIX + "*")) and not list(moved.glob(TMP_MOVED_PREFIX + "*"))

    want, got = metrics(base)[1:], metrics(moved)
    assert [r["step"] for r in got] == [2, 3]
    diffs = []
    for a, b in zip(want, got):
        assert b["lr"] == a["lr"]  # the schedule continues, never restarts
        assert b["tokens"] == a["tokens"]  # the same trajectories
        diffs.append(abs(b["loss"] - a["loss"]) / abs(a["loss"]))
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL, abs=0), (name, a["loss"], b["loss"])
    print(f"\n{name}: relative loss differences {['%.2e' % d for d in diffs]} (tolerance {LOSS_RTOL:.2e})")
    check_state_carried(base, moved, work["tmp"] / f"universal_{name}")

    # once more in the new layout, from the moved run's own step-2 checkpoint: exact (losses and weights)
    step3 = {k: v for k, v in tree_digest(moved / "step_00000003").items() if k.endswith("model_states.pt")
             and k.startswith("layer_")}
    launch(nproc, ds, ["--resume", str(moved / "step_00000002")])
    resumed = metrics(moved)
    assert [r["step"] for r in resumed] == [2, 3]
    for key in ("loss", "action_loss", "lr", "tokens"):
        assert resumed[1][key] == got[1][key], key
    resaved = tree_digest(moved / "step_00000003-resave1")
    assert {k: resaved[k] for k in step3} == step3  # every layer file bit for bit


def test_pp4_dp1_moves_to_pp1_dp2(work):
    move_and_check(work, "pp4_dp1", "pp1_dp2")


def test_the_main_recipe_moves_from_pp4_to_pp1_dp2(work):
    """run_cpu_tiny.json (tiny-mem: on cpu_tiny.json's 4 stages, stages 0-2 hold one non-adaptive decoder
    layer each, stage 3 the adaptive ones) continues on cpu_tiny_pp1_dp2.json, as docs/training.md shows;
    DeepSpeed's universal conversion raised ZeroDivisionError on this source (3 decoder layer files for 4
    stages) before."""
    check_move(work, recipe_baseline(work), 2, RECIPE_PP1_DP2, "recipe_pp4_to_pp1_dp2")


def test_pp1_dp2_moves_to_pp1_dp4(work):
    move_and_check(work, "pp1_dp2", "pp1_dp4")


def test_pp1_dp2_moves_to_pp2_dp1(work):
    move_and_check(work, "pp1_dp2", "pp2_dp1")


def test_a_kill_during_the_conversion_leaves_the_source_loadable(work):
    """The conversion, SIGKILLed after DeepSpeed's converter has written part of its files: the source
    checkpoint is byte for byte what it was and still resolves as the run's checkpoint; the half-written
    conversion is a `.tmp-moved-*` folder in the new RUN_DIR only, and the next attempt (the same
    command again) removes it and converts completely."""
    from ds_ttt.train.checkpoint import resolve_checkpoint
    from ds_ttt.train.layout_move import MOVED_PREFIX, TMP_MOVED_PREFIX, Move, convert_for_move
    from ds_ttt.train.run_record import RunInfo

    base = baseline(work, "pp4_dp1")
    source = base / "step_00000001"
    before = tree_digest(base)
    target = work["tmp"] / "killed_move"
    target.mkdir()
    move = Move(source=source, source_world=4, old="pp4", new="pp1")

    pid = os.fork()
    if pid == 0:  # the child dies by SIGKILL at its 6th torch.save inside the conversion
        try:
            import torch
            real_save, calls = torch.save, []

            def save_then_die(*args, **kwargs):
                calls.append(1)
                if len(calls) == 6:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_save(*args, **kwargs)
            torch.save = save_then_die
            convert_for_move(move, target, rank=0)
        finally:
            os._exit(0)  # reached only when no kill happened
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    assert tree_digest(base) == before
    assert resolve_checkpoint(base).name == "step_00000003" and RunInfo.read(source).step == 1
    assert [p.name for p in target.iterdir()] == [TMP_MOVED_PREFIX + source.name]
    moved = convert_for_move(move, target, rank=0)
    assert sorted(p.name for p in target.iterdir()) == [MOVED_PREFIX + source.name]
    assert (moved / "zero" / "optimizer_state.pt").is_file() and (moved / "layer_07-model_states.pt").is_file()
    assert tree_digest(base) == before
