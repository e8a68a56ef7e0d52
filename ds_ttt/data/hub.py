"""Download a pinned dataset revision from a model hub (or a mirror of one) with hash verification.

A pin is a JSON spec: `{"repo_id": "org/name", "revision": "<40-hex commit>", "files": {"path": "<sha256>"}}`.
Only full commit hashes are accepted (a branch name is not a pin). Every file is checked against its
sha256 after download; a mismatch deletes the file and raises naming it.

Sources, all with Hugging Face's URL layout `<base>/datasets/<repo_id>/resolve/<revision>/<path>`:
  mirror=None           huggingface_hub from `HF_ENDPOINT` (default https://huggingface.co), after a
                        short reachability probe so an offline machine fails in seconds, not minutes;
  mirror="/dir" or "file:///dir"   a local mirror directory;
  mirror="http(s)://host/..."      a plain HTTP mirror (urllib, short timeout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .manifest import sha256_file

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubError(RuntimeError):
    pass


def load_pin(path: str | Path) -> dict:
    spec = json.loads(Path(path).read_text())
    for key in ("repo_id", "revision", "files"):
        if key not in spec:
            raise HubError(f"{path}: pin needs {key!r}")
    return spec


def _check_pin(repo_id: str, revision: str, files: dict[str, str]) -> None:
    if not _COMMIT.match(revision):
        raise HubError(f"revision {revision!r} of {repo_id} is not a pinned 40-hex commit")
    if not files:
        raise HubError(f"pin of {repo_id}@{revision[:8]} lists no files")
    for p, h in files.items():
        if not re.match(r"^[0-9a-f]{64}$", h):
            raise HubError(f"{p}: expected a sha256 hex digest, got {h!r}")
        if p.startswith("/") or ".." in Path(p).parts:
            raise HubError(f"{p}: file paths must be relative to the repository")


def _probe(url: str, timeout: float) -> None:
    u = urllib.parse.urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise HubError(f"cannot reach {u.scheme}://{u.hostname}:{port} ({e}); offline? Use a local mirror "
                       "(--hub-mirror DIR) or copy the files and pass them with --inputs") from None


def _verify(dest: Path, rel: str, digest: str) -> None:
    got = sha256_file(dest)
    if got != digest:
        dest.unlink()
        raise HubError(f"{rel}: sha256 mismatch (pinned {digest[:12]}…, downloaded {got[:12]}…)")


def download_pinned(repo_id: str, revision: str, files: dict[str, str], dest: str | Path, *,
                    mirror: str | None = None, timeout: float = 5.0) -> list[Path]:
    """Fetch `files` of dataset `repo_id` at commit `revision` into `dest`, verifying each sha256."""
    _check_pin(repo_id, revision, files)
    dest = Path(dest)
    out = []
    if mirror is None:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise HubError("HF_HUB_OFFLINE is set: cannot download; use a local mirror (--hub-mirror DIR)")
        _probe(endpoint, timeout)
        from huggingface_hub import hf_hub_download

        for rel, digest in sorted(files.items()):
            try:
                p = Path(hf_hub_download(repo_id, rel, revision=revision, repo_type="dataset", local_dir=str(dest),
                                         etag_timeout=timeout))
            except Exception as e:  # noqa: BLE001 - surface any hub failure as one clear error
                raise HubError(f"{rel}: download from {endpoint} failed: {type(e).__name__}: {e}") from None
            _verify(p, rel, digest)
            out.append(p)
        return out
    for rel, digest in sorted(files.items()):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if mirror.startswith(("http://", "https://")):
            url = f"{mirror.rstrip('/')}/datasets/{repo_id}/resolve/{revision}/{urllib.parse.quote(rel)}"
            _probe(url, timeout)
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r, open(target, "wb") as f:
                    shutil.copyfileobj(r, f)
            except (urllib.error.URLError, OSError) as e:
                raise HubError(f"{rel}: download from {url} failed: {e}") from None
        else:
            base = Path(urllib.parse.urlparse(mirror).path if mirror.startswith("file://") else mirror)
            src = base / "datasets" / repo_id / "resolve" / revision / rel
            if not src.is_file():
                raise HubError(f"{rel}: not in mirror ({src} missing)")
            shutil.copyfile(src, target)
        _verify(target, rel, digest)
        out.append(target)
    return out
