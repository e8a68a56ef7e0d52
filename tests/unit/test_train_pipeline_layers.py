"""Pipeline layers in one process (no distributed): spec structure and partition, the chained pipe
layers equal the single-device model (loss + meta-gradients, the token-weighted objective), padding
invariance, gradient-free boundaries out of frozen layers, tied embeddings, and single-process
reassembly of a pipeline checkpoint (`load_model_from_checkpoint`).

    python -m pytest tests/unit/test_train_pipeline_layers.py
"""

from __future__ import annotations

import json

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.train import checkpoint as ckpt_mod
from ds_ttt.train.reassembly import load_model_from_checkpoint
from ds_ttt.train.data_loader import collate
from ds_ttt.train.layout import resolve_layout
from ds_ttt.train.objective import StepObjective
from ds_ttt.train.pipeline import DecoderPipe, EmbedPipe, LastStagePipe, build_specs, reduce_outer_loss
from ds_ttt.train.run_config import RunConfig
from ds_ttt.train.run_record import RUN_CONFIG, resolved_config

ROUND = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]


def traj(num_rounds, prompt=5, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    kinds = [0] * prompt + ROUND * num_rounds
    rounds = [0] * prompt + [r for r in range(1, num_rounds + 1) for _ in ROUND]
    return torch.randint(0, vocab, (len(kinds),), generator=g).tolist(), kinds, rounds


def tied(cfg):
    """The backbone with Qwen3-0.6B..4B's tied embeddings."""
    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.tie_word_embeddings = True
    return cfg


def make_model(cfg, **ttt):
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**ttt))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    model.set_trainable_scope()
    return model


def build_layers(model, layout):
    """The layers of every spec in one process (a tied head reference is wired like TTTPipelineModule
    does: the last stage's LM head is the embedding's Parameter)."""
    layers = [spec.build() for spec in build_specs(model.config, model.ttt, layout)[:layout.last_spec + 1]]
    if layout.tied_embeddings:
        layers[-1].tie_lm_head(layers[0].embed_tokens.weight)
    full = model.state_dict()
    for idx, layer in enumerate(layers):
        layer.load_state_dict({k: full[layout.hf_name(idx, k)] for k in layer.state_dict()})
    return layers


def set_whole_batch_objective(last, model, batch):
    """The token-weighted objective of one micro-batch that is the whole global batch (scale 1)."""
    last.set_objective(StepObjective.for_step([batch], model.ttt, loss_scale=1.0))


def run_chain(layers, batch, model):
    set_whole_batch_objective(layers[-1], model, batch)
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
    ids, kinds, rounds = collate([traj(2, seed=1), traj(3, seed=2)], bucket=1, capacity=10_000)
    ref = model.trajectory_loss(ids, kinds, rounds)
    ref.loss.backward()
    loss = run_chain(layers, (ids, kinds, rounds), model)
    loss.backward()
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    got = {}
    for idx, layer in enumerate(layers):
        for local, p in layer.named_parameters():
            if p.requires_grad:
                got[layout.hf_name(idx, local)] = p.grad
    assert set(got) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(got[n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("scope", ["all", "suffix", "prime"])
def test_tied_embeddings_chain_equals_model(tiny_qwen3_config, scope):
    """Tied embeddings: the last stage's LM head is the embedding's Parameter; its gradient is the
    sum of both uses (what DeepSpeed's tied all-reduce forms across stages), equal to the model's."""
    model = make_model(tied(tiny_qwen3_config), adaptive_layers=2, trainable_scope=scope)
    layout = resolve_layout(4, 8, model.ttt, tied_embeddings=True)
    assert layout.spec_parts() == [0, 3, 5, 7, 9]  # the last stage also holds the tied reference
    layers = build_layers(model, layout)
    assert layers[-1].lm_head.weight is layers[0].embed_tokens.weight
    batch = collate([traj(2, seed=1), traj(3, seed=2)], bucket=1, capacity=10_000)
    ref = model.trajectory_loss(*batch)
    ref.loss.backward()
    loss = run_chain(layers, batch, model)
    loss.backward()
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    embed = layers[0].embed_tokens.weight
    assert embed.requires_grad == (scope != "prime")
    if scope != "prime":
        torch.testing.assert_close(embed.grad, model.model.embed_tokens.weight.grad, rtol=1e-5, atol=1e-7)
    for local, p in layers[-1].named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, dict(model.named_parameters(remove_duplicate=False))[
                layout.hf_name(layout.last_spec, local)].grad, rtol=1e-5, atol=1e-7)


def test_tied_layout_must_match_the_backbone(tiny_qwen3_config):
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        build_specs(tied(tiny_qwen3_config), TTTConfig(adaptive_layers=2), resolve_layout(4, 8, TTTConfig(adaptive_layers=2)))


@pytest.mark.parametrize("scope,adaptive,frozen_specs", [("prime", 2, 7), ("suffix", 0, 9), ("suffix", 2, 7),
                                                         ("all", 2, 0)])
def test_frozen_layers_send_hidden_states_without_gradient(tiny_qwen3_config, scope, adaptive, frozen_specs):
    """Layers with nothing trainable at or before them hand on byte views of the hidden states
    (no gradient crosses, so DeepSpeed runs no backward there); the last stage still gets exact
    gradients (test_chained_pipe_layers_equal_model) and the values arrive bit-exact."""
    model = make_model(tiny_qwen3_config, adaptive_layers=adaptive, trainable_scope=scope)
    layout = resolve_layout(4, 8, model.ttt)
    layers = build_layers(model, layout)
    batch = collate([traj(2, seed=1)], bucket=1, capacity=10_000)
    set_whole_batch_objective(layers[-1], model, batch)
    x, kinds_of_boundaries = batch, []
    for layer in layers[:-1]:
        x = layer(x)
        kinds_of_boundaries.append(x[0].is_floating_point())
        assert x[0].is_floating_point() == x[0].requires_grad  # float iff a gradient flows back
    assert kinds_of_boundaries == [False] * frozen_specs + [True] * (len(layers) - 1 - frozen_specs)
    with torch.no_grad():
        ref = model.run_layers(model.prefix_layers, model.model.embed_tokens(batch[0]), batch[2])
    from ds_ttt.train.pipeline import as_hidden
    assert torch.equal(as_hidden(x[0], torch.float32).detach(), ref)
    if frozen_specs:
        assert x[0].dtype == torch.uint8  # NCCL sends uint8 (it has no int16 for bf16 views)


def test_last_stage_refuses_to_run_without_the_step_objective(tiny_qwen3_config):
    model = make_model(tiny_qwen3_config, adaptive_layers=2)
    layers = build_layers(model, resolve_layout(1, 8, model.ttt))
    with pytest.raises(RuntimeError, match="set_objective"):
        layers[-1](layers[0](collate([traj(1)], bucket=1, capacity=10_000)))


def test_micro_batches_add_up_to_the_token_weighted_loss(tiny_qwen3_config):
    """Each micro-batch's loss is its share of one token-weighted loss over the whole batch (loss and
    gradient): a trajectory with 8 action rounds weighs 8 times one with 1 (a mean of micro-batch
    means, the old objective, does not; the test checks the data tells the two apart)."""
    model = make_model(tiny_qwen3_config, adaptive_layers=2, trainable_scope="all", obs_loss_weight=0.5)
    layers = build_layers(model, resolve_layout(1, 8, model.ttt))
    mbs = [collate([traj(1, seed=5)], bucket=1, capacity=10_000), collate([traj(8, seed=6)], bucket=1, capacity=10_000)]
    objective = StepObjective.for_step(mbs, model.ttt, loss_scale=1.0)
    layers[-1].set_objective(objective)
    total = 0
    for mb in mbs:
        x = mb
        for layer in layers:
            x = layer(x)
        total = total + reduce_outer_loss(x, None)
    total.backward()
    got = torch.cat([p.grad.flatten() for layer in layers for p in layer.parameters()])

    def model_grads(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    whole = collate([traj(1, seed=5), traj(8, seed=6)], bucket=1, capacity=10_000)
    ref = model.trajectory_loss(*whole)  # one event loop over the whole batch: its own token means
    assert (objective.num_action_tokens, objective.num_obs_tokens) == (ref.num_action_tokens, ref.num_obs_tokens)
    torch.testing.assert_close(total, ref.loss, rtol=1e-5, atol=1e-6)
    ref_grad = model_grads(ref.loss)
    assert float((got - ref_grad).norm() / ref_grad.norm()) < 1e-5
    mean_of_means = model_grads(sum(model.trajectory_loss(*mb).loss for mb in mbs) / 2)
    assert float((mean_of_means - ref_grad).norm() / ref_grad.norm()) > 0.05


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
        set_whole_batch_objective(last, model, (ids, kinds, rounds))
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
    for idx, layer in enumerate(build_layers(model, layout)):  # the tied head reference saves no file
        torch.save(layer.state_dict(), d / f"layer_{idx:02d}-model_states.pt")
    run = RunConfig(data="x/manifest.json", output=str(run_dir), ttt=model.ttt)
    res = resolved_config(run=run, backbone=model.config, ds={"pipeline": {"stages": layout.num_stages}}, plan=None,
                          layout=layout, manifest_path="x/manifest.json", manifest_sha256="abc")
    (d / RUN_CONFIG).write_text(json.dumps({**res, "step": step}))
    (d / ckpt_mod.COMPLETE).write_text(tag)
    (run_dir / ckpt_mod.LATEST).write_text(tag)
    return d


@pytest.mark.parametrize("tie", [False, True])
def test_load_model_from_checkpoint_reassembles(tiny_qwen3_config, tmp_path, tie):
    model = make_model(tied(tiny_qwen3_config) if tie else tiny_qwen3_config, adaptive_layers=2,
                       trainable_scope="prime", inner_lr=0.05)
    layout = resolve_layout(4, 8, model.ttt, tied_embeddings=tie)
    d = write_fake_checkpoint(model, layout, tmp_path)
    assert ckpt_mod.resolve_checkpoint(tmp_path) == d
    assert ckpt_mod.resolve_checkpoint(d) == d
    loaded, info = load_model_from_checkpoint(tmp_path)
    assert info.step == 7 and info.ttt["inner_lr"] == 0.05 and info.manifest_sha256 == "abc"
    assert info.model_source == {"preset": "tiny"} and info.backbone_config().num_hidden_layers == 8
    ref_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert set(ref_sd) == set(got_sd)
    for k in ref_sd:
        torch.testing.assert_close(got_sd[k], ref_sd[k], rtol=0, atol=0)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))


def test_tied_checkpoint_with_diverged_copies_is_refused(tiny_qwen3_config, tmp_path):
    model = make_model(tied(tiny_qwen3_config), adaptive_layers=2)
    layout = resolve_layout(4, 8, model.ttt, tied_embeddings=True)
    d = write_fake_checkpoint(model, layout, tmp_path)
    last = torch.load(d / f"layer_{layout.last_spec:02d}-model_states.pt", weights_only=True)
    last["lm_head.weight"] = last["lm_head.weight"] + 1e-3
    torch.save(last, d / f"layer_{layout.last_spec:02d}-model_states.pt")
    with pytest.raises(ValueError, match="tied"):
        load_model_from_checkpoint(tmp_path)


@pytest.mark.parametrize("tie", [False, True])
def test_load_hf_weights_per_stage(tiny_qwen3_config, tmp_path, tie):
    """--model: each stage reads its own tensors from a Hugging Face directory (a tied checkpoint has
    no lm_head.weight: the last stage reads the embedding); prime weights stay fresh."""
    from transformers import Qwen3ForCausalLM

    from ds_ttt.model.hf_adapter import load_hf_qwen3, load_hf_weights

    torch.manual_seed(1)
    Qwen3ForCausalLM(tied(tiny_qwen3_config) if tie else tiny_qwen3_config).save_pretrained(tmp_path / "hf")
    ref = load_hf_qwen3(tmp_path / "hf", TTTConfig(adaptive_layers=2))
    layout = resolve_layout(4, 8, ref.ttt, tied_embeddings=tie)
    torch.manual_seed(2)
    layers = [spec.build() for spec in build_specs(ref.config, ref.ttt, layout)[:layout.last_spec + 1]]
    if tie:  # separate processes in the pipeline: the last stage's head is its own copy here
        layers[-1].tie_lm_head(torch.nn.Parameter(torch.empty_like(layers[0].embed_tokens.weight)))
    for stage in range(4):
        parts = layout.spec_parts()
        wanted = {layout.hf_name(i, n): p for i in range(parts[stage], min(parts[stage + 1], len(layers)))
                  for n, p in layers[i].named_parameters()}
        load_hf_weights(wanted, tmp_path / "hf", ref.config)
    full = ref.state_dict()
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            hf = layout.hf_name(i, n)
            if ".prime_" not in hf:
                torch.testing.assert_close(p, full[hf], rtol=0, atol=0)
    assert float(layers[-1].layers[0].prime_mlp.down_proj.weight.detach().abs().sum()) == 0.0


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="latest"):
        ckpt_mod.resolve_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step_00000003")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt_mod.resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_free_boundary_is_bit_exact(dtype):
    from ds_ttt.train.pipeline import as_hidden, grad_free
    h = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True) * 3
    sent = grad_free(h)
    assert sent.dtype == torch.uint8 and not sent.requires_grad and sent.shape == (2, 5, 8 * h.element_size())
    assert torch.equal(as_hidden(sent.clone(), dtype), h.detach())
    with pytest.raises(TypeError, match="uint8"):
        as_hidden(torch.zeros(2, 5, 8, dtype=torch.int32), dtype)


def test_module_is_built_on_the_rank_device(monkeypatch):
    """The trainer builds its pipeline module under the rank's device, so a GPU rank's parameters are born
    there (an 8B random init on the CPU outlasted the H200 trainer phase); the CPU accelerator's device is
    the CPU, so CPU runs build exactly what they built before."""
    from ds_ttt.train import engine

    seen = []

    class Spy:
        def __init__(self, *args, **kwargs):
            seen.append((torch.get_default_device().type, kwargs))
    monkeypatch.setattr(engine, "TTTPipelineModule", Spy)
    engine.build_module("backbone", "ttt", "layout", seed=7, device="meta")
    assert seen == [("meta", {"seed": 7})]
    assert torch.get_default_device().type == "cpu"  # the context ends with the build
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert engine.rank_device() == "cpu"
