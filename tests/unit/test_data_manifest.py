"""Manifest: prepare writes hashes/counts/splits; load verifies every hash; rejects; hub download.

    .venv/bin/python -m pytest tests/unit/test_data_manifest.py -q
"""

import hashlib
import json
import random
import shutil
import time
from pathlib import Path

import pytest

from ds_ttt.data.cli import prepare_main
from ds_ttt.data.generator import generate
from ds_ttt.data.hub import HubError, download_pinned
from ds_ttt.data.manifest import ManifestError, assign_splits, load_manifest, prepare
from ds_ttt.data.render import TokenKind

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets" / "data"


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    with open(d / "gen.jsonl", "w") as f:
        for t in generate(24, 5, workers=1):
            f.write(json.dumps(t) + "\n")
    shutil.copytree(ASSETS / "atif" / "good", d / "atif")
    shutil.copytree(ASSETS / "terminus" / "trial_good", d / "trial_good")
    return d


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep")
    res = prepare([raw], out, capacity=700, test_fraction=0.25, seed=3)
    assert res.exit_code == 0, res.message
    return out


def test_manifest_contents(prepared):
    m = json.loads((prepared / "manifest.json").read_text())
    assert m["capacity"] == 700 and m["seed"] == 3
    assert set(m["files"]) >= {"train.jsonl", "test.jsonl", "rejects.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"}
    for rel, digest in m["files"].items():
        assert hashlib.sha256((prepared / rel).read_bytes()).hexdigest() == digest
    assert m["tokenizer"]["hash"] == m["files"]["tokenizer/tokenizer.json"]
    assert any(k.endswith("gen.jsonl") for k in m["input_files"]) and len(m["input_files"]) >= 10
    total = sum(s["num_trajectories"] for s in m["splits"].values()) + len(m["excluded_by_capacity"])
    assert total == 24 + 2 + 1  # generated + ATIF main/continuation + Terminus trial
    assert m["split_check"] == {"overlap_ids": 0, "overlap_groups": 0}
    assert m["splits"]["test"]["num_trajectories"] > 0 and m["splits"]["train"]["num_trajectories"] > 0


def test_load_verifies_and_renders(prepared):
    man = load_manifest(prepared)
    assert man.sha256 == hashlib.sha256((prepared / "manifest.json").read_bytes()).hexdigest()
    assert man.capacity == 700 and man.splits == ["train", "test"]
    assert not man.ids("train") & man.ids("test")
    for split in man.splits:
        rendered = man.rendered(split)
        info = man.data["splits"][split]
        assert [r.id for r in rendered] == sorted(r.id for r in rendered)
        assert all(len(r) <= 700 for r in rendered)
        assert sum(r.count(TokenKind.ACTION) for r in rendered) == info["tokens"]["action"]
        assert sum(r.count(TokenKind.OBSERVATION) for r in rendered) == info["tokens"]["observation"]
        assert {r.id: r.num_rounds for r in rendered} == info["retained_rounds"]
        assert {t["id"] for t in man.trajectories(split)} == man.ids(split)
    # capacity 700 truncates some generated trajectories to a prefix
    full = {t["id"]: t["meta"].get("num_rounds") for s in man.splits for t in man.trajectories(s)}
    kept = {**man.retained_rounds("train"), **man.retained_rounds("test")}
    assert any(full[i] and kept[i] < full[i] for i in kept)
    # continuation parts share a group and therefore a split
    split_of = {i: s for s in man.splits for i in man.ids(s)}
    if "sess-good-1" in split_of and "sess-good-1.cont-1" in split_of:
        assert split_of["sess-good-1"] == split_of["sess-good-1.cont-1"]


@pytest.mark.parametrize("victim", ["train.jsonl", "tokenizer/tokenizer.json", "rejects.jsonl"])
def test_tamper_detection_names_the_file(prepared, tmp_path, victim):
    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    with open(d / victim, "a") as f:
        f.write(" ")
    with pytest.raises(ManifestError, match=victim.replace("/", ".")):
        load_manifest(d)


def test_missing_file_is_refused(prepared, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    (d / "test.jsonl").unlink()
    with pytest.raises(ManifestError, match="test.jsonl.*missing"):
        load_manifest(d)


def test_prepare_is_deterministic(raw, prepared, tmp_path):
    res = prepare([raw], tmp_path / "again", capacity=700, test_fraction=0.25, seed=3)
    a = json.loads((prepared / "manifest.json").read_text())
    b = res.manifest
    assert a["files"] == b["files"] and a["splits"] == b["splits"]


def test_split_determinism_and_disjointness():
    trajs = [{"id": f"t{i}", "meta": {"group": f"g{i // 2}"}} for i in range(200)]
    a = assign_splits(trajs, 0.2, seed=1)
    shuffled = trajs[:]
    random.Random(0).shuffle(shuffled)
    b = assign_splits(shuffled, 0.2, seed=1)
    assert a == b
    ids = {s: {t["id"] for t in a[s]} for s in a}
    groups = {s: {t["meta"]["group"] for t in a[s]} for s in a}
    assert not ids["train"] & ids["test"] and not groups["train"] & groups["test"]
    assert ids["train"] | ids["test"] == {t["id"] for t in trajs}
    assert 20 <= len(ids["test"]) <= 60
    # adding data never moves an existing trajectory
    c = assign_splits(trajs + [{"id": "new", "meta": {"group": "new"}}], 0.2, seed=1)
    assert {t["id"] for t in c["test"]} - {"new"} == ids["test"]
    assert assign_splits(trajs, 0.2, seed=2) != a


def test_rejects_fail_the_run_unless_allowed(tmp_path, capsys):
    out = tmp_path / "p"
    rc = prepare_main(["--inputs", str(ASSETS / "openai"), "--out", str(out)])
    assert rc == 1 and not (out / "manifest.json").exists()
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    # 8 malformed lines, and both versions of the id "ok-1" (lines 1 and 10 differ)
    assert len(rejects) == 10 and all(r["file"].endswith("bad.jsonl") and r["line"] for r in rejects)
    assert sorted(r["line"] for r in rejects if "duplicate id 'ok-1'" in r["reason"]) == [1, 10]
    assert "--allow-rejects" in capsys.readouterr().err
    rc = prepare_main(["--inputs", str(ASSETS / "openai"), "--out", str(out), "--allow-rejects", "--test-fraction", "0.5"])
    assert rc == 0
    man = load_manifest(out)
    assert man.data["num_rejects"] == 10
    assert man.ids("train") | man.ids("test") == {"oa-1", "good:2"}
    assert "| train" in capsys.readouterr().out  # the summary table


# ---------------------------------------------------------------- hub
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def mirror(tmp_path):
    base = tmp_path / "mirror"
    f = base / "datasets" / "org" / "traj" / "resolve" / REV / "data" / "train.jsonl"
    f.parent.mkdir(parents=True)
    shutil.copyfile(ASSETS / "openai" / "good.jsonl", f)
    return base, {"data/train.jsonl": hashlib.sha256(f.read_bytes()).hexdigest()}


def test_hub_local_mirror_download_verified(mirror, tmp_path):
    base, files = mirror
    for m in (str(base), f"file://{base}"):
        (p,) = download_pinned("org/traj", REV, files, tmp_path / "dl", mirror=m)
        assert p.read_bytes() == (ASSETS / "openai" / "good.jsonl").read_bytes()


def test_hub_http_mirror_download_verified(mirror, tmp_path):
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    base, files = mirror
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(base))
    handler.log_message = lambda *a, **k: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (p,) = download_pinned("org/traj", REV, files, tmp_path / "dl", mirror=url, timeout=5.0)
        assert hashlib.sha256(p.read_bytes()).hexdigest() == files["data/train.jsonl"]
        with pytest.raises(HubError, match="data/missing.jsonl"):
            download_pinned("org/traj", REV, {"data/missing.jsonl": "1" * 64}, tmp_path / "dl2", mirror=url, timeout=5.0)
    finally:
        server.shutdown()
        server.server_close()


def test_hub_hash_mismatch_names_file(mirror, tmp_path):
    base, files = mirror
    with pytest.raises(HubError, match="data/train.jsonl: sha256 mismatch"):
        download_pinned("org/traj", REV, {"data/train.jsonl": "0" * 64}, tmp_path / "dl", mirror=str(base))
    assert not (tmp_path / "dl" / "data" / "train.jsonl").exists()


def test_hub_requires_pinned_commit(mirror, tmp_path):
    base, files = mirror
    with pytest.raises(HubError, match="not a pinned"):
        download_pinned("org/traj", "main", files, tmp_path / "dl", mirror=str(base))


def test_hub_offline_fails_fast(monkeypatch, tmp_path, mirror):
    _, files = mirror
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t0 = time.time()
    with pytest.raises(HubError, match="cannot reach"):
        download_pinned("org/traj", REV, files, tmp_path / "dl", timeout=2.0)
    with pytest.raises(HubError, match="cannot reach"):
        download_pinned("org/traj", REV, files, tmp_path / "dl", mirror="http://127.0.0.1:9", timeout=2.0)
    assert time.time() - t0 < 6.0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        download_pinned("org/traj", REV, files, tmp_path / "dl")


def test_prepare_cli_with_hub_pin(mirror, tmp_path):
    base, files = mirror
    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps({"repo_id": "org/traj", "revision": REV, "files": files}))
    out = tmp_path / "p"
    assert prepare_main(["--hub-pin", str(pin), "--hub-mirror", str(base), "--out", str(out), "--test-fraction", "0.5"]) == 0
    man = load_manifest(out)
    assert man.data["hub"]["revision"] == REV and man.ids("train") | man.ids("test") == {"oa-1", "train:2"}
    assert man.data["files"]["raw/data/train.jsonl"] == files["data/train.jsonl"]  # pinned data re-verified on load
    with open(out / "raw" / "data" / "train.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(ManifestError, match="raw/data/train.jsonl"):
        load_manifest(out)
    assert prepare_main(["--hub-pin", str(pin), "--hub-mirror", "http://127.0.0.1:9", "--hub-timeout", "1", "--out", str(out)]) == 2


def test_train_only_inputs_join_train_and_leave_the_test_split_alone(raw, prepared, tmp_path):
    extra = tmp_path / "extra.jsonl"
    with open(extra, "w") as f:
        for t in generate(6, 77, workers=1, family="memory"):
            f.write(json.dumps(t) + "\n")
    out = tmp_path / "aug"
    res = prepare([raw], out, capacity=700, test_fraction=0.25, seed=3, train_only=[extra])
    assert res.exit_code == 0, res.message
    base, aug = load_manifest(prepared), load_manifest(out)
    assert aug.ids("test") == base.ids("test")  # the held-out split does not move
    extra_ids = {json.loads(line)["id"] for line in extra.read_text().splitlines()}
    assert aug.ids("train") == base.ids("train") | extra_ids
    assert aug.data["num_train_only"] == 6 and aug.data["train_only_inputs"] == [str(extra)]
    assert str(extra) in aug.data["input_files"]


def test_train_only_ids_may_not_collide_with_the_inputs(raw, tmp_path):
    clash = tmp_path / "clash.jsonl"
    with open(clash, "w") as f:
        for t in generate(2, 5, workers=1):  # the same seed as `raw`: the same ids
            f.write(json.dumps(t) + "\n")
    with pytest.raises(ValueError, match=r"reuse 2 trajectory id\(s\) or group\(s\).*another seed"):
        prepare([raw], tmp_path / "out", capacity=700, test_fraction=0.25, seed=3, train_only=[clash])


# ---------------------------------------------------------------- the generator's folder is valid input
@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    from ds_ttt.data.generator import write_outputs

    d = tmp_path_factory.mktemp("gen")
    write_outputs(generate(6, 11, workers=1), d)
    return d


def test_prepare_takes_one_canonical_copy_from_the_generator_folder(gen_dir, tmp_path):
    res = prepare([gen_dir], tmp_path / "out", capacity=4096, test_fraction=0.3, seed=1)
    assert res.exit_code == 0 and res.num_rejects == 0, res.message
    m = res.manifest
    ids = {json.loads(line)["id"] for line in (gen_dir / "trajectories.jsonl").read_text().splitlines()}
    man = load_manifest(tmp_path / "out")
    assert man.ids("train") | man.ids("test") == ids and m["imported_by_format"] == {"openai_jsonl": 6}
    copies = {c["id"]: c for c in m["duplicate_copies"]}
    assert set(copies) == ids  # every ATIF copy is listed, none dropped silently
    for tid, c in copies.items():
        assert c["kept"].startswith(str(gen_dir / "trajectories.jsonl") + ":")  # the canonical JSONL copy is kept
        assert c["dropped"] == str(gen_dir / "atif" / f"{tid}.json")
    kept = {t["id"]: t for s in man.splits for t in man.trajectories(s)}
    assert all("session_id" not in t["meta"] and t["meta"]["isolation"] in ("bwrap", "none") for t in kept.values())
    # either copy alone gives the same trajectories
    alone = prepare([gen_dir / "atif"], tmp_path / "atif_only", capacity=4096, test_fraction=0.3, seed=1)
    assert alone.exit_code == 0 and alone.manifest["splits"]["train"]["retained_rounds"] == m["splits"]["train"]["retained_rounds"]


def test_a_real_duplicate_in_the_generator_folder_is_refused_by_name(gen_dir, tmp_path):
    d = tmp_path / "gen"
    shutil.copytree(gen_dir, d)
    victim = sorted((d / "atif").glob("*.json"))[2]
    doc = json.loads(victim.read_text())
    step = next(s for s in doc["steps"] if s.get("observation"))
    step["observation"]["results"][0]["content"] += " (edited)"
    victim.write_text(json.dumps(doc))
    res = prepare([d], tmp_path / "out")
    assert res.exit_code == 1
    tid = doc["session_id"]
    # both versions are refused, each naming the other: neither is known to be the right one
    assert f"{victim}: duplicate id {tid!r} with different content (also in {d / 'trajectories.jsonl'}:" in res.message
    assert f"{d / 'trajectories.jsonl'}:3: duplicate id {tid!r} with different content (also in {victim})" in res.message
    res = prepare([d], tmp_path / "out2", allow_rejects=True)
    assert res.exit_code == 0 and res.num_rejects == 2 and len(res.manifest["duplicate_copies"]) == 5
    assert tid not in load_manifest(tmp_path / "out2").ids("train") | load_manifest(tmp_path / "out2").ids("test")
