"""Pipeline layers in one process (no distributed): spec structure and partition, the chained pipe
layers equal the single-device model (loss + meta-gradients), padding invariance, frozen-stage
anchors, and single-process reassembly of a pipeline checkpoint (`load_model_from_checkpoint`).

    python -m pytest tests/unit/test_train_pipeline_layers.py
"""

from __future__ import annotations

import json

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.train import checkpoint as ckpt_mod
from ds_ttt.train.data_loader import collate
from ds_ttt.train.pipeline import (ANCHOR, DecoderPipe, EmbedPipe, LastStagePipe, build_specs, layer_name_map,
                                   reduce_outer_loss)
from ds_ttt.train.run_config import RunConfig, resolve_layout, resolved_config

ROUND = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]


def traj(num_rounds, prompt=5, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    kinds = [0] * prompt + ROUND * num_rounds
    rounds = [0] * prompt + [r for r in range(1, num_rounds + 1) for _ in ROUND]
    return torch.randint(0, vocab, (len(kinds),), generator=g).tolist(), kinds, rounds


def make_model(cfg, **ttt):
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**ttt))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    model.set_trainable_scope()
    return model


def build_layers(model, layout):
    layers = [spec.build() for spec in build_specs(model.config, model.ttt, layout)]
    full = model.state_dict()
    for idx, layer in enumerate(layers):
        names = layer_name_map(layout, idx)
        layer.load_state_dict({k: (v if k == ANCHOR else full[names(k)]) for k, v in layer.state_dict().items()})
    return layers


def run_chain(layers, batch):
    x = batch
    for layer in layers[:-1]:
        x = layer(x)
    return reduce_outer_loss(layers[-1](x), None)


def test_layout_and_specs(tiny_qwen3_config):
    ttt = TTTConfig(adaptive_layers=2)
    layout = resolve_layout(4, 8, ttt)
    assert layout.prefix_per_stage == (2, 2, 2) and layout.spec_parts() == [0, 3, 5, 7, 8]
    specs = build_specs(tiny_qwen3_config, ttt, layout)
    assert [s.typename for s in specs] == [EmbedPipe] + [DecoderPipe] * 6 + [LastStagePipe]
    # Qwen3-8B: 27 prefix layers over 3 stages, the 9 adaptive ones on the last.
    big = resolve_layout(4, 36, TTTConfig())
    assert big.prefix_per_stage == (9, 9, 9) and big.spec_parts() == [0, 10, 19, 28, 29]
    assert resolve_layout(1, 8, ttt).spec_parts() == [0, 8]
    assert resolve_layout(2, 8, TTTConfig(adaptive_layers=0)).spec_parts() == [0, 9, 10]


@pytest.mark.parametrize("scope,adaptive", [("prime", 2), ("all", 2), ("suffix", 0)])
def test_chained_pipe_layers_equal_model(tiny_qwen3_config, scope, adaptive):
    model = make_model(tiny_qwen3_config, adaptive_layers=adaptive, trainable_scope=scope)
    layout = resolve_layout(4, 8, model.ttt)
    layers = build_layers(model, layout)
    anchors = [hasattr(layer, ANCHOR) for layer in layers]
    # frozen stages get one anchor at their first layer ("all": none; SFT "suffix": stages 0..2 frozen)
    want = {"prime": [True, False, False, True, False, True, False, False], "all": [False] * 8,
            "suffix": [True, False, False, False, True, False, False, True, False, False]}[scope]
    assert anchors == want
    ids, kinds, rounds = collate([traj(2, seed=1), traj(3, seed=2)], bucket=1, capacity=10_000)
    ref = model.trajectory_loss(ids, kinds, rounds)
    ref.loss.backward()
    loss = run_chain(layers, (ids, kinds, rounds))
    loss.backward()
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    got = {}
    for idx, layer in enumerate(layers):
        names = layer_name_map(layout, idx)
        for local, p in layer.named_parameters():
            if local != ANCHOR and p.requires_grad:
                got[names(local)] = p.grad
            elif local == ANCHOR:
                assert p.grad is not None and float(p.grad.abs().sum()) == 0.0
    assert set(got) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(got[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_padding_changes_no_loss_and_no_gradient(tiny_qwen3_config):
    model = make_model(tiny_qwen3_config, adaptive_layers=2, trainable_scope="all", context_policy="current_round")
    layout = resolve_layout(2, 8, model.ttt)
    a, b = traj(2, seed=3), traj(3, seed=4)

    def sums(bucket):
        for p in model.parameters():
            p.grad = None
        layers = build_layers(model, layout)
        ids, kinds, rounds = collate([a, b], bucket=bucket, capacity=10_000)
        x = (ids, kinds, rounds)
        for layer in layers[:-1]:
            x = layer(x)
        last = layers[-1]
        last(x).sum().backward()
        grads = torch.cat([p.grad.flatten() for layer in layers for p in layer.parameters() if p.grad is not None])
        return ids.shape[1], last.stats, grads

    t1, s1, g1 = sums(bucket=1)
    t2, s2, g2 = sums(bucket=64)
    assert t2 % 64 == 0 and t2 > t1  # really padded
    for k in ("action_nll_sum", "obs_nll_sum", "num_action_tokens", "num_obs_tokens", "num_updates", "num_tokens"):
        assert s1[k] == pytest.approx(s2[k], rel=1e-6, abs=1e-6), k
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def write_fake_checkpoint(model, layout, run_dir, step=7):
    """The files a DeepSpeed pipeline save writes for our layers, plus our metadata."""
    tag = ckpt_mod.tag_for(step)
    d = run_dir / tag
    d.mkdir(parents=True)
    for idx, layer in enumerate(build_layers(model, layout)):
        torch.save(layer.state_dict(), d / f"layer_{idx:02d}-model_states.pt")
    run = RunConfig(data="x/manifest.json", output=str(run_dir), ttt=model.ttt)
    res = resolved_config(run=run, backbone=model.config, ds={"pipeline": {"stages": layout.num_stages}}, plan=None,
                          layout=layout, manifest_path="x/manifest.json", manifest_sha256="abc")
    (d / ckpt_mod.RUN_CONFIG).write_text(json.dumps({**res, "step": step}))
    (d / ckpt_mod.COMPLETE).write_text(tag)
    (run_dir / ckpt_mod.LATEST).write_text(tag)
    return d


def test_load_model_from_checkpoint_reassembles(tiny_qwen3_config, tmp_path):
    model = make_model(tiny_qwen3_config, adaptive_layers=2, trainable_scope="prime", inner_lr=0.05)
    layout = resolve_layout(4, 8, model.ttt)
    d = write_fake_checkpoint(model, layout, tmp_path)
    assert ckpt_mod.resolve_checkpoint(tmp_path) == d
    assert ckpt_mod.resolve_checkpoint(d) == d
    loaded, info = ckpt_mod.load_model_from_checkpoint(tmp_path)
    assert info.step == 7 and info.ttt["inner_lr"] == 0.05 and info.manifest_sha256 == "abc"
    assert info.model_source == {"preset": "tiny"} and info.backbone_config().num_hidden_layers == 8
    ref_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert set(ref_sd) == set(got_sd)
    for k in ref_sd:
        torch.testing.assert_close(got_sd[k], ref_sd[k], rtol=0, atol=0)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))


def test_load_hf_weights_per_stage(tiny_qwen3_config, tmp_path):
    """--model: each stage reads its own tensors from a Hugging Face directory; prime weights stay fresh."""
    from transformers import Qwen3ForCausalLM

    from ds_ttt.model.hf_adapter import load_hf_qwen3
    from ds_ttt.train.engine import load_hf_weights

    torch.manual_seed(1)
    Qwen3ForCausalLM(tiny_qwen3_config).save_pretrained(tmp_path / "hf")
    ref = load_hf_qwen3(tmp_path / "hf", TTTConfig(adaptive_layers=2))
    layout = resolve_layout(4, 8, ref.ttt)
    torch.manual_seed(2)
    layers = [spec.build() for spec in build_specs(ref.config, ref.ttt, layout)]
    for stage in range(4):
        parts = layout.spec_parts()
        wanted = {layer_name_map(layout, i)(n): p for i in range(parts[stage], parts[stage + 1])
                  for n, p in layers[i].named_parameters() if n != ANCHOR}
        load_hf_weights(wanted, tmp_path / "hf")
    full = ref.state_dict()
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            hf = layer_name_map(layout, i)(n)
            if n != ANCHOR and ".prime_" not in hf:
                torch.testing.assert_close(p, full[hf], rtol=0, atol=0)
    assert float(layers[-1].layers[0].prime_mlp.down_proj.weight.detach().abs().sum()) == 0.0


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="latest"):
        ckpt_mod.resolve_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step_00000003")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt_mod.resolve_checkpoint(tmp_path)
