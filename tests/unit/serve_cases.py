"""Serving test fixtures: the main job's kind of export (compact vocabulary), with a model that calls tools.

    root = build_trimmed_export(tmp_dir)     # root/data (manifest, trimmed tokenizer), root/export
    SYSTEM, TOOLS, TASKS, TOOL_COMMAND       # the prompts it was taught on, the bash call it makes

The export is written exactly as the main job writes it (launch/main.sh): `prepare(..., trim_vocab=True)`
builds a manifest with a compact tokenizer (tokenizer.json + qwen3_ids.json, special tokens at new
ids), a model whose embedding is that vocabulary padded to 64 rows is "trained", and
`export_checkpoint` exports it from a training checkpoint through the trainer's RunInfo (the
checkpoint's weights come through the test seam `ds_ttt.loading.load_training_checkpoint`, as in
test_export.py; the tokenizer comes from the manifest, hash-checked). Only DeepSpeed's reassembly is
skipped.

"Trained" here means a few hundred Adam steps of next-action loss on one rendered conversation, so
that greedy decoding emits the same bash tool call after every generation prompt of a conversation
with SYSTEM, TOOLS and one of TASKS: enough for a real multi-round tool-calling loop (the content of
the calls is not the point; other prompts may get no tool call).
"""

from __future__ import annotations

import json
import pathlib

import torch

TOOL_COMMAND = "echo ok"
ACTION = {"role": "assistant", "content": "",
          "tool_calls": [{"id": "call_0", "type": "function",
                          "function": {"name": "bash", "arguments": json.dumps({"command": TOOL_COMMAND})}}]}
TTT = {"adaptive_layers": 1, "prime_intermediate_size": 64, "inner_lr": 0.01, "inner_max_norm": 1.0,
       "context_policy": "current_round", "obs_loss_with_end": True, "checkpoint_events": False}


def _worlds(num: int, seed: int = 40) -> list[dict]:
    from ds_ttt.data.generator import generate_memory_world

    return [generate_memory_world(seed + i, num_distractors=1) for i in range(num)]


SYSTEM = "You are a terminal agent."
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]
TASKS = ("List the files.", "Show the date.", "Count the lines of notes.txt.", "Find the port of the api service.")


def tool_loop_trajectory(index: int, rounds: int = 4) -> dict:
    """A short conversation: system prompt, the bash tool, a task, then `rounds` x (ACTION, "ok")."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[index % len(TASKS)]}]
    for _ in range(rounds):
        msgs = msgs + [ACTION, {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
    return {"id": f"loop-{index}", "messages": msgs, "tools": TOOLS,
            "meta": {"group": f"loop-{index}", "family": "tool_loop"}}


def _train_tool_caller(model, tokenizer, trajectories, steps: int = 300) -> None:
    """Next-action loss (W_0, no inner updates) until greedy decoding repeats ACTION for the TASKS
    (300 Adam steps at lr 3e-3 for this model: 150 left two of the four tasks with broken calls once the
    generator's memory worlds, and so the compact vocabulary, changed in 537bb19)."""
    from ds_ttt.data.render import render_trajectory

    batch = [render_trajectory(t, tokenizer) for t in trajectories]
    n = min(len(r.input_ids) for r in batch)  # one [B, n] batch (the conversations differ only in the task)
    ids = torch.tensor([r.input_ids[:n] for r in batch])
    rounds = torch.tensor([r.rounds[:n] for r in batch])
    act = torch.tensor([r.kinds[1:n] for r in batch]) == 1
    opt = torch.optim.Adam(list(model.parameters()), lr=3e-3)
    model.train()
    for _ in range(steps):
        logits = model(ids, rounds)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[act], ids[:, 1:][act])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_trimmed_export(root: pathlib.Path) -> pathlib.Path:
    """root/raw (trajectories), root/data (trimmed manifest), root/run (fake checkpoint dir), root/export."""
    from pytest import MonkeyPatch

    from ds_ttt import loading
    from ds_ttt.config import TTTConfig
    from ds_ttt.export import export_checkpoint
    from ds_ttt.data.manifest import load_manifest, prepare
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
    from ds_ttt.train.run_record import RunInfo

    worlds = _worlds(3)
    loops = [tool_loop_trajectory(i) for i in range(len(TASKS))]
    (root / "raw").mkdir(parents=True)
    with open(root / "raw" / "trajectories.jsonl", "w") as f:
        for t in worlds + loops:
            f.write(json.dumps(t) + "\n")
    res = prepare([root / "raw" / "trajectories.jsonl"], root / "data", test_fraction=0.3, seed=0, trim_vocab=True)
    assert res.exit_code == 0, res.message
    man = load_manifest(root / "data")
    assert man.data["tokenizer"]["trimmed"]
    tok = man.tokenizer()
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=-(-len(tok) // 64) * 64)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**TTT))
    _train_tool_caller(model, tok, loops)
    model.requires_grad_(False)

    ckpt = root / "run" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "layer_00-model_states.pt").write_bytes(b"weights (reassembled by the seam below)")
    (ckpt / "run_config.json").write_text("{}")
    info = RunInfo(checkpoint=ckpt, step=10, backbone=cfg.to_dict(), ttt=model.ttt.to_dict(), run={}, deepspeed={},
                   plan={}, manifest_path=str(man.path), manifest_sha256=man.sha256, model_source={"preset": "tiny"},
                   layout={})
    with MonkeyPatch.context() as mp:
        mp.setattr(loading, "load_training_checkpoint", lambda path, device="cpu": (model, info))
        export_checkpoint(root / "run", root / "export")
    return root / "export"
