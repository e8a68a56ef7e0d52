"""Bad input is refused with a message naming the file and the line, step or key — one test per kind.

    .venv/bin/python -m pytest tests/unit/test_bad_input.py -q

Data (through `prepare`, the way `data_prep/prepare.py` sees it): malformed ATIF (no steps, step ids
out of order, a tool call without an id, an observation naming no call), a JSONL line that is not
JSON, a tool result without its call, chat-control tokens in message text, empty input, a changed
byte in a prepared dataset. Configs: unknown keys, ZeRO-3 with a pipeline. Exports: a truncated
safetensors shard. And `--allow-rejects` keeps every good trajectory that sits next to a bad one.
"""

import copy
import json
from pathlib import Path

import pytest

from ds_ttt.data.cli import prepare_main
from ds_ttt.data.manifest import ManifestError, load_manifest, prepare

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "data"
GOOD_ATIF = json.loads((ASSETS / "atif" / "good" / "trajectory.json").read_text())
GOOD_LINE = {"id": "good-1", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}


def refusal(tmp_path: Path, files: dict[str, str]) -> str:
    """Write `files` (name -> text) into a fresh input folder; prepare must refuse it; its message."""
    src = tmp_path / "in"
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    res = prepare([src], tmp_path / "out")
    assert res.manifest is None and res.exit_code == 1, res.message
    assert not (tmp_path / "out" / "manifest.json").exists()
    return res.message


def atif(mutate) -> str:
    doc = copy.deepcopy(GOOD_ATIF)
    mutate(doc)
    return json.dumps(doc)


def line(obj) -> str:
    return json.dumps(obj) + "\n"


# ---------------------------------------------------------------- malformed ATIF
def test_atif_without_steps(tmp_path):
    msg = refusal(tmp_path, {"run/trajectory.json": atif(lambda d: d.pop("steps"))})
    assert f"{tmp_path}/in/run/trajectory.json: steps must be a non-empty list" in msg


def test_atif_step_ids_out_of_order(tmp_path):
    msg = refusal(tmp_path, {"trajectory.json": atif(lambda d: d["steps"][3].update(step_id=7))})
    assert "in/trajectory.json: step 4: step_id 7 out of order (expected 4)" in msg


def test_atif_tool_call_without_an_id(tmp_path):
    msg = refusal(tmp_path, {"trajectory.json": atif(lambda d: d["steps"][2]["tool_calls"][0].pop("tool_call_id"))})
    assert "in/trajectory.json: step 3: tool call 0 needs tool_call_id and function_name" in msg


def test_atif_observation_naming_no_call(tmp_path):
    msg = refusal(tmp_path, {"trajectory.json": atif(
        lambda d: d["steps"][3]["observation"]["results"][0].update(source_call_id="call_404"))})
    assert "in/trajectory.json: step 4: observation source_call_id 'call_404' names no tool call of this step" in msg


# ---------------------------------------------------------------- JSONL and canonical messages
def test_jsonl_line_that_is_not_json(tmp_path):
    msg = refusal(tmp_path, {"data.jsonl": line(GOOD_LINE) + '{"id": "cut", "messages": [\n'})
    assert "in/data.jsonl:2: invalid JSON (" in msg


def test_tool_result_without_its_call(tmp_path):
    bad = {"id": "orphan", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok"},
                                        {"role": "tool", "content": "out"}, {"role": "assistant", "content": "y"}]}
    msg = refusal(tmp_path, {"data.jsonl": line(GOOD_LINE) + line(bad)})
    assert "in/data.jsonl:2: message 2: tool result without a preceding assistant tool call" in msg
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    wrong = {"id": "wrong-id", "messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "tool_call_id": "c9", "content": "out"}]}
    msg = refusal(tmp_path / "b", {"data.jsonl": line(wrong)})
    assert "in/data.jsonl:1: message 2: tool_call_id 'c9' names no tool call of the preceding assistant turn" in msg


@pytest.mark.parametrize("token,role,index", [("<|im_start|>", "user", 0), ("<|im_end|>", "assistant", 1),
                                              ("<tool_call>", "assistant", 1), ("</tool_response>", "user", 0),
                                              ("<think>", "user", 0), ("<|endoftext|>", "assistant", 1)])
def test_chat_control_tokens_in_message_text(tmp_path, token, role, index):
    messages = copy.deepcopy(GOOD_LINE["messages"])
    messages[index]["content"] = f"before {token} after"
    msg = refusal(tmp_path, {"data.jsonl": line({"id": "ctl", "messages": messages})})
    assert f"in/data.jsonl:1: message {index}: content contains the chat-control token {token}" in msg


def test_chat_control_token_in_an_atif_observation(tmp_path):
    msg = refusal(tmp_path, {"trajectory.json": atif(
        lambda d: d["steps"][2]["observation"]["results"][0].update(content="<tool_call>{}</tool_call>"))})
    assert "in/trajectory.json: step 3: observation result 0 contains the chat-control token <tool_call>" in msg


# ---------------------------------------------------------------- empty input
def test_empty_files(tmp_path):
    msg = refusal(tmp_path, {"empty.jsonl": "", "blank.jsonl": "\n\n", "trajectory.json": ""})
    assert "in/empty.jsonl: empty file: no trajectory records" in msg
    assert "in/blank.jsonl: empty file: no trajectory records" in msg
    assert "in/trajectory.json: empty file: no JSON document" in msg


def test_empty_folder_and_missing_path(tmp_path):
    (tmp_path / "nothing").mkdir()
    res = prepare([tmp_path / "nothing"], tmp_path / "out")
    assert res.manifest is None and res.exit_code == 1
    assert f"no trajectories imported from ['{tmp_path / 'nothing'}']" in res.message
    res = prepare([tmp_path / "typo.jsonl"], tmp_path / "out2")
    assert res.exit_code == 1 and f"{tmp_path / 'typo.jsonl'}: input path does not exist" in res.message


def test_cli_prints_every_reject_with_its_place(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(line(GOOD_LINE) + "not json\n" + line({"id": "no-messages"}))
    assert prepare_main(["--inputs", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{src}:2: invalid JSON" in err and f"{src}:3: messages must be a non-empty list" in err
    assert "--allow-rejects" in err


# ---------------------------------------------------------------- --allow-rejects keeps every good neighbour
def test_allow_rejects_keeps_every_good_trajectory_next_to_a_bad_one(tmp_path):
    src = tmp_path / "in"
    (src / "atif").mkdir(parents=True)
    goods = [dict(GOOD_LINE, id=f"good-{i}") for i in range(4)]
    lines = [line(goods[0]), "{broken\n", line(goods[1]),
             line({"id": "bad-ctl", "messages": [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "x"}]}),
             line(goods[2]), line({"id": "no-action", "messages": [{"role": "user", "content": "x"}]}), line(goods[3])]
    (src / "mixed.jsonl").write_text("".join(lines))
    (src / "atif" / "good.json").write_text(atif(lambda d: d.update(session_id="atif-good")))
    (src / "atif" / "bad.json").write_text(atif(lambda d: (d.update(session_id="atif-bad"), d["steps"][1].update(step_id=9))))
    assert prepare([src], tmp_path / "strict").exit_code == 1
    res = prepare([src], tmp_path / "out", allow_rejects=True, test_fraction=0.0)
    assert res.exit_code == 0, res.message
    man = load_manifest(tmp_path / "out")
    assert man.ids("train") | man.ids("test") == {"good-0", "good-1", "good-2", "good-3", "atif-good"}
    rejects = [json.loads(r) for r in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((Path(r["file"]).name, r["line"], r["step"]) for r in rejects) == [
        ("bad.json", None, 2), ("mixed.jsonl", 2, None), ("mixed.jsonl", 4, 0), ("mixed.jsonl", 6, None)]


# ---------------------------------------------------------------- prepared datasets
def test_a_changed_byte_in_a_manifest_file_is_named(tmp_path):
    res = prepare([ASSETS / "openai" / "good.jsonl"], tmp_path / "data", test_fraction=0.0)
    assert res.exit_code == 0, res.message
    load_manifest(tmp_path / "data")
    victim = tmp_path / "data" / "train.jsonl"
    data = bytearray(victim.read_bytes())
    i = data.index(b"Where am I?")
    data[i] = ord("w")  # same length, one byte different
    victim.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"data/train\.jsonl: sha256 mismatch .*the file changed after prepare"):
        load_manifest(tmp_path / "data")


# ---------------------------------------------------------------- configs
def test_unknown_config_keys_are_named(tmp_path):
    from ds_ttt.config import TTTConfig
    from ds_ttt.train.run_config import load_run_config

    with pytest.raises(ValueError, match=r"ttt: unknown key\(s\) \['inner_lr_typo'\]"):
        TTTConfig.from_dict({"inner_lr_typo": 0.1})
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"preset": "tiny", "data": "d", "output": "o", "save_intervall": 5}))
    with pytest.raises(ValueError, match=rf"{run}: unknown key\(s\) \['save_intervall'\]"):
        load_run_config(str(run), {}, {})
    run.write_text(json.dumps({"preset": "tiny", "data": "d", "output": "o", "ttt": {"adaptive_layer": 2}}))
    with pytest.raises(ValueError, match=rf"{run}: ttt: unknown key\(s\) \['adaptive_layer'\]"):
        load_run_config(str(run), {}, {})


def test_zero3_with_a_pipeline_is_refused():
    from ds_ttt.model.presets import backbone_config
    from ds_ttt.train.deepspeed_config import validate_deepspeed
    from ds_ttt.train.run_config import load_run_config

    configs = Path(__file__).resolve().parents[2] / "ds_configs"
    run = load_run_config(str(configs / "run_cpu_tiny.json"), {"data": "d", "output": "o"}, {})
    ds = json.loads((configs / "cpu_tiny.json").read_text())  # the shipped 4-stage pipeline, ZeRO-1
    layers = backbone_config(run.preset).num_hidden_layers
    validate_deepspeed(run, ds, 4, layers)
    ds["zero_optimization"]["stage"] = 3
    with pytest.raises(ValueError, match=r"zero_optimization\.stage=3: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1"):
        validate_deepspeed(run, ds, 4, layers)


# ---------------------------------------------------------------- exports
def test_a_truncated_safetensors_shard_is_named(tmp_path, tiny_qwen3_config):
    from ds_ttt.config import TTTConfig
    from ds_ttt.export import export_model
    from ds_ttt.loading import load_export
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    export_model(TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig()), tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shard = shards[len(shards) // 2]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(Exception) as e:
        load_export(tmp_path)
    assert shard.name in str(e.value)
