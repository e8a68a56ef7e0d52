"""The pipeline engine on 4 CPU ranks equals one process computing the token-weighted outer loss over
the whole global batch (sum of action NLL / number of action tokens, + obs_loss_weight x the same for
observation tokens): loss and gradients, for
  - 4 stages x 1 dp (no clipping);
  - 2 stages x 2 dp with ZeRO-1 gradient clipping and a weighted observation loss (the clipped update
    equals torch's clip_grad_norm_ on the reference; DeepSpeed 0.19.8 gets fp32 pipeline clipping
    without ZeRO wrong, which the trainer rejects at startup);
  - no adaptive layers (adaptive_layers=0, the trainable norm + head of 'suffix') on 4 stages;
  - trainable_scope 'prime' (frozen stages send gradient-free boundaries) on 4 stages and on 2 x 2 dp;
  - tied embeddings (TiedLayerSpec) on 4 stages with ZeRO-1 clipping (cpu_tiny's engine layout);
    it and the 4 x 1 layout load their backbone from tied / untied checkpoints that transformers'
    Qwen3ForCausalLM.save_pretrained wrote (the trainer's per-stage --model loading);
  - the Qwen3-8B recipe's engine settings (bf16, ZeRO-1, clipping, 'prime') on 4 stages, within the
    single-process bf16 reference's own error of the fp32 loss, its update along the fp32 gradient.
The trajectories differ 30-fold in action tokens, so a mean of micro-batch means fails these tests.

    python -m pytest tests/e2e/test_pipeline_equivalence.py        (one 4-rank launch, ~1.5 min on 2 cores)
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pipeline_worker", ROOT / "tests/e2e/pipeline_worker.py")
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)

pytestmark = pytest.mark.slow
HF_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="pipe_hf_"))  # the reference's copies of the HF checkpoints


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(ROOT / "tests/e2e/pipeline_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = {}
    for name in [*worker.LAYOUTS, *worker.BF16_LAYOUTS]:
        files = sorted((out / name).glob("rank*.pt"))
        parts = [torch.load(f, weights_only=True) for f in files]
        res[name] = {"loss": parts[0]["loss"], "losses": [p["loss"] for p in parts],
                     "delta": {k: v for p in parts for k, v in p["delta"].items()}}
    return res


def reference(name: str, token_weighted: bool = True, dtype: torch.dtype = torch.float32):
    """(loss, {name: grad}, pre-clip norm) of one process over the whole global batch. The token-
    weighted loss uses the event loop's own sums and counts; `token_weighted=False` is the old
    objective (the mean of the micro-batch means), to check the data tells the two apart."""
    stages, _, clip, micro, gas, ttt, _ = worker.layout_of(name)
    model = worker.make_reference(name, HF_ROOT).to_dtype(dtype)
    data = worker.batches(stages, micro, gas)
    from ds_ttt.train.data_loader import collate
    outs = [model.trajectory_loss(*collate(rows, bucket=data.bucket, capacity=data.capacity))
            for rows in data.step_micro_batches(0)]  # every dp rank's micro-batches
    if token_weighted:
        loss = sum(o.action_loss_sum for o in outs) / sum(o.num_action_tokens for o in outs)
        w = ttt.get("obs_loss_weight", 0.0)
        if w > 0:
            loss = loss + w * sum(o.obs_loss_sum for o in outs) / sum(o.num_obs_tokens for o in outs)
    else:
        loss = torch.stack([o.loss for o in outs]).mean()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if clip > 0 else None
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, norm


def test_token_weighting_matters_for_this_data():
    """The old objective (mean of micro-batch means) gives a clearly different gradient on this batch,
    so test_pipeline_equals_single_process fails on it."""
    for name in ("pp4", "pp2dp2"):
        _, new, _ = reference(name)
        _, old, _ = reference(name, token_weighted=False)
        flat_new = torch.cat([g.flatten() for g in new.values()])
        flat_old = torch.cat([old[n].flatten() for n in new])
        assert float((flat_new - flat_old).norm() / flat_new.norm()) > 0.05, name


def test_deepspeed_fp32_pipeline_clipping_without_zero_is_wrong(results):
    """The reason validate_deepspeed refuses gradient_clipping with ZeRO-0 in fp32 pipelines: the
    update is off by a uniform factor (the norm counts stage 0's gradients only). If this starts to
    pass as equal, DeepSpeed fixed it and the refusal can go."""
    got = results["bug_pp4_zero0_clip"]
    _, ref_grads, _ = reference("bug_pp4_zero0_clip")
    flat_got = torch.cat([got["delta"][n].flatten() for n in ref_grads])
    flat_ref = torch.cat([g.flatten() for g in ref_grads.values()])
    ratio = float(flat_got.norm() / flat_ref.norm())
    assert ratio > 1.05, ratio  # larger steps than the correctly clipped reference
    cos = float(flat_got @ flat_ref / (flat_got.norm() * flat_ref.norm()))
    assert cos > 0.999999  # same direction: a uniform wrong factor


@pytest.mark.parametrize("name", [n for n in worker.LAYOUTS if not n.startswith("bug_")])
def test_pipeline_equals_single_process(results, name):
    got = results[name]
    ref_loss, ref_grads, norm = reference(name)
    if worker.LAYOUTS[name][2] > 0:
        assert norm > 2 * worker.LAYOUTS[name][2], "clipping must be active for this test to mean anything"
    if worker.LAYOUTS[name][6]:  # tied: both stages' copies of the shared matrix took the same step
        torch.testing.assert_close(got["delta"].pop("lm_head.weight"), got["delta"]["model.embed_tokens.weight"],
                                   rtol=0, atol=0)
        assert "model.embed_tokens.weight" in ref_grads
    assert all(abs(v - got["loss"]) < 1e-7 for v in got["losses"])  # every stage reports the same loss
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert set(ref_grads) <= set(got["delta"])
    for n, d in got["delta"].items():  # parameters outside the trainable scope never move
        if n not in ref_grads:
            assert float(d.abs().max()) == 0.0, n
    if name.startswith("sft"):
        assert not any(".prime_" in n for n in ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got["delta"][n], g, rtol=2e-4, atol=2e-7, msg=n)
    # overall: the update vector matches the (clipped) reference gradient to fp32 precision
    flat_got = torch.cat([got["delta"][n].flatten() for n in ref_grads])
    flat_ref = torch.cat([g.flatten() for g in ref_grads.values()])
    assert float((flat_got - flat_ref).norm() / flat_ref.norm()) < 1e-4


def test_bf16_prime_pipeline_matches_within_bf16_error(results):
    name = "prime_pp4_bf16"
    got = results[name]
    loss32, grads32, _ = reference(name)
    loss16, _, _ = reference(name, dtype=torch.bfloat16)
    err16 = abs(loss16 - loss32)
    assert abs(got["loss"] - loss32) <= 2 * err16 + 2 ** -8 * abs(loss32), (got["loss"], loss16, loss32)
    for n, d in got["delta"].items():  # the frozen backbone never moves
        if n not in grads32:
            assert float(d.abs().max()) == 0.0, n
    assert set(grads32) == {n for n in got["delta"] if ".prime_" in n}
    flat_got = torch.cat([got["delta"][n].float().flatten() for n in grads32])
    flat_ref = torch.cat([g.flatten() for g in grads32.values()])
    cos = float(flat_got @ flat_ref / (flat_got.norm() * flat_ref.norm()))
    assert cos > 0.98, cos  # bf16 rounding of the weights after the step (~1% per element) and of the compute
