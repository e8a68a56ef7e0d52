"""The real-shell generator: deterministic, real observations, family metadata, sandbox limits.

    .venv/bin/python -m pytest tests/unit/test_data_generator.py -q
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_ttt.data.families import MEMORY_POOLS
from ds_ttt.data.generator import FAMILY_NAMES, generate, generate_memory_world, generate_one, write_outputs
from ds_ttt.sandbox import Sandbox, network_isolation_available
from ds_ttt.data.schema import normalize_trajectory

ROOT = Path(__file__).resolve().parents[2]


def commands(t):
    out = []
    for i, m in enumerate(t["messages"]):
        for c in m.get("tool_calls") or []:
            obs = t["messages"][i + 1]["content"]
            out.append((json.loads(c["function"]["arguments"])["command"], obs))
    return out


def test_deterministic_across_runs_and_workers(tmp_path):
    a = generate(10, 123, workers=1)
    b = generate(10, 123, workers=2)
    assert a == b
    pa, pb = write_outputs(a, tmp_path / "a"), write_outputs(b, tmp_path / "b")
    assert pa["jsonl"].read_bytes() == pb["jsonl"].read_bytes()
    for f in sorted(pa["atif"].iterdir()):
        assert f.read_bytes() == (pb["atif"] / f.name).read_bytes()
    assert generate(10, 124, workers=1) != a
    assert generate_one(123, 7) == a[7]  # any trajectory can be regenerated alone


def test_all_trajectories_are_valid_and_families_covered():
    trajs = generate(40, 9)
    assert {t["meta"]["family"] for t in trajs} == set(FAMILY_NAMES)
    for t in trajs:
        assert normalize_trajectory(t)["messages"] == t["messages"]
        for m in t["messages"]:
            if m["role"] == "assistant":
                assert m["reasoning_content"]
                for c in m.get("tool_calls", []):
                    assert c["function"]["name"] == "bash" and set(json.loads(c["function"]["arguments"])) == {"command"}


@pytest.fixture
def keep_dir():
    """A kept-sandbox parent that uid 65534 can traverse (a root caller's sandbox runs as it; pytest's
    tmp_path is 0700)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ds_ttt_keep_")
    os.chmod(d, 0o711)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_observations_are_real_sandbox_output(keep_dir):
    tmp_path = keep_dir
    checked = 0
    for i in range(12):
        t = generate_one(77, i, keep_dir=str(tmp_path))
        if t["meta"]["variant"] == "shell_cd":
            continue  # its paths are relative to a directory it changed into
        root = Path(t["meta"]["sandbox"])
        cmds = commands(t)
        for k, (cmd, obs) in enumerate(cmds):
            m = re.fullmatch(r"(cat|ls) (\S+)", cmd)
            if not m or any(m.group(2) in later for later, _ in cmds[k + 1:] if not later.startswith(("cat ", "ls "))):
                continue  # only paths no later command modifies
            path = root / m.group(2)
            if m.group(1) == "cat":
                assert obs == path.read_text().rstrip("\n")
            else:
                assert obs.splitlines() == sorted(os.listdir(path))
            checked += 1
    assert checked >= 8


def test_memory_world_values_are_real_and_meta_consistent(keep_dir):
    tmp_path = keep_dir
    w = generate_memory_world(31, keep_dir=str(tmp_path))
    root = Path(w["meta"]["sandbox"])
    salt = re.search(r"\$1-([0-9a-f]+)", (root / "bin" / "keygen").read_text()).group(1)
    fmt = w["meta"]["memory_format"]
    assert w["meta"]["memory_pool"] == "heldout" and fmt["format"] in MEMORY_POOLS["heldout"]["formats"]
    assert set(w["meta"]["values"]) <= set(MEMORY_POOLS["heldout"]["names"])
    mapped = {"hexdash": lambda h: h[:4] + "-" + h[4:], "hexupper": str.upper}[fmt["format"]]
    for name, value in w["meta"]["values"].items():
        assert value == mapped(hashlib.sha256(f"{name}-{salt}".encode()).hexdigest()[:fmt["length"]])
    for rb in w["meta"]["readbacks"]:
        assert rb["value"] in (root / rb["path"]).read_text()
    rounds = per_round(w)
    for rb in w["meta"]["readbacks"]:
        assert rounds[rb["round"]]["obs"] == rb["value"]  # the readback observation reproduces the fact
        assert rb["value"] in rounds[rb["source_round"]]["obs"]
        assert rb["value"] not in rounds[rb["source_round"]]["cmd"]  # the fact came from the shell, not the action
    for mc in w["meta"]["memory_checks"]:
        assert mc["fact"] in rounds[mc["round"]]["cmd"]
    assert generate_memory_world(31) == {**w, "meta": {k: v for k, v in w["meta"].items() if k != "sandbox"}}
    assert generate_memory_world(32)["meta"]["values"] != w["meta"]["values"]


def test_memory_world_pools_are_disjoint_and_training_varies_the_world():
    """Training worlds vary keys (1-4), formats and stores; the held-out pool shares no name, format or
    readback with them, and every held-out value still uses characters training values use."""
    train, held = MEMORY_POOLS["train"], MEMORY_POOLS["heldout"]
    for field in ("names", "formats", "stores"):
        assert not set(train[field]) & set(held[field]), field
    seen = {"num_keys": set(), "format": set(), "store": set()}
    for seed in range(40):
        w = generate_memory_world(500 + seed, pool="train")
        f = w["meta"]["memory_format"]
        seen["num_keys"].add(f["num_keys"]), seen["format"].add(f["format"]), seen["store"].add(f["store"])
        assert len(w["meta"]["readbacks"]) == f["num_keys"] == len(w["meta"]["values"])
    assert seen == {"num_keys": {1, 2, 3, 4}, "format": set(train["formats"]), "store": set(train["stores"])}
    train_chars = set("0123456789abcdef") | set("ABCDEFGHIJKLMNOP")
    for seed in range(10):
        for v in generate_memory_world(seed)["meta"]["values"].values():
            assert set(v) <= train_chars | {"-"}


def test_find_fact_tokens_in_memory_world():
    from ds_ttt.data.render import TokenKind, find_fact_tokens, render_trajectory
    from ds_ttt.data.tokenizer import build_qwen3_tokenizer

    tok = build_qwen3_tokenizer()
    w = generate_memory_world(8)
    rt = render_trajectory(w, tok)
    for rb in w["meta"]["readbacks"]:
        pos = find_fact_tokens(rt, tok, rb["value"], rb["round"], TokenKind.OBSERVATION)
        assert pos and tok.decode([rt.input_ids[i] for i in pos]).strip() == rb["value"]
        assert all(rt.kinds[i] == TokenKind.OBSERVATION and rt.rounds[i] == rb["round"] for i in pos)
        src = find_fact_tokens(rt, tok, rb["value"], rb["source_round"], TokenKind.OBSERVATION)
        assert src and src[0] < pos[0]
    for mc in w["meta"]["memory_checks"]:
        pos = find_fact_tokens(rt, tok, mc["fact"], mc["round"], TokenKind.ACTION)
        assert mc["fact"] in tok.decode([rt.input_ids[i] for i in pos])
    assert find_fact_tokens(rt, tok, "not-a-fact", 1, TokenKind.OBSERVATION) == []


def per_round(t):
    rounds, r = {}, 0
    for m in t["messages"]:
        if m["role"] == "assistant":
            r += 1
            cmd = json.loads(m["tool_calls"][0]["function"]["arguments"])["command"] if m.get("tool_calls") else ""
            rounds[r] = {"cmd": cmd, "obs": None}
        elif m["role"] == "tool":
            rounds[r]["obs"] = m["content"]
    return rounds


def test_family_metadata():
    trajs = generate(60, 4)
    seen_fail = False
    for t in trajs:
        rounds = per_round(t)
        meta = t["meta"]
        if meta["family"] == "memory":
            for mc in meta["memory_checks"]:
                assert mc["fact"] in rounds[mc["round"]]["cmd"]
                assert mc["fact"] in rounds[mc["source_round"]]["obs"] and mc["source_round"] < mc["round"]
        if meta["family"] == "error_recovery":
            for r in meta["recovery_rounds"]:
                assert re.search(r"\[exit code: \d+\]", rounds[r - 1]["obs"])
            seen_fail |= not meta["success"]
    assert any(not t["meta"]["success"] for t in generate(80, 1, family="error_recovery")) or seen_fail


def test_shell_state_families_need_the_persistent_shell(monkeypatch):
    """The cd / export / background-job families pass in the episode's one shell and fail where every
    command gets a fresh shell (`Sandbox.run_fresh`)."""
    from ds_ttt.data import shell_families

    trajs = generate(9, 5, workers=1, family="shell_state")
    assert {t["meta"]["variant"] for t in trajs} == {"shell_cd", "shell_export", "shell_background"}
    assert all(t["meta"]["success"] and t["meta"]["isolation"] == "bwrap" for t in trajs)
    fresh_run = lambda self, command, timeout=None: self.run_fresh(f"exec 2>&1\n{command}", timeout=timeout)
    monkeypatch.setattr(Sandbox, "run", fresh_run)
    for policy in shell_families.SHELL_FAMILIES["shell_state"]:
        with pytest.raises((AssertionError, RuntimeError)):
            _play(policy)


def test_background_job_episode_is_deterministic_on_a_stalled_shell(monkeypatch):
    """`touch go && wait %1` finds the job still running even when the shell stalls between the two (a
    loaded machine): the episode records "exit 0", never bash's "wait: %1: no such job" (which 2 of 300
    generated trajectories once recorded)."""
    from ds_ttt.data import shell_families

    run, seen = Sandbox.run, []

    def stalled(self, command, timeout=None):
        if "wait %1" in command:  # 0.3 s between the flag and the wait, as a busy scheduler may leave
            result = run(self, command.replace("touch go && ", "touch go && sleep 0.3 && "), timeout=timeout)
            seen.append(result.output.strip())
            return result
        return run(self, command, timeout=timeout)
    monkeypatch.setattr(Sandbox, "run", stalled)
    _play(shell_families.shell_background)
    assert seen == ["exit 0"]


def _play(policy):
    import random

    from ds_ttt.data.generator import _run_episode

    _run_episode("t", "shell_state", policy.__name__, lambda ep: policy(ep, random.Random(0)), 0, None, "required")


def test_sandbox_timeout_and_no_network():
    with Sandbox(timeout=0.5) as sb:
        r = sb.run("sleep 5")
        assert r.timed_out and r.exit_code == 124
        if network_isolation_available():
            r = sb.run("exec 3<>/dev/tcp/1.1.1.1/80")
            assert r.exit_code != 0 and "unreachable" in r.output.lower()
        root = sb.root
    assert not root.exists()


def test_generate_cli(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "data_prep" / "generate.py"), "--out", str(tmp_path), "--num", "6", "--seed", "0",
                          "--workers", "1", "--no-token-stats"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| family" in out.stdout and "generated 6 trajectories" in out.stdout
    assert len((tmp_path / "trajectories.jsonl").read_text().splitlines()) == 6
    assert len(list((tmp_path / "atif").glob("*.json"))) == 6
