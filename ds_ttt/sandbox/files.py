"""The host side of a sandbox's directory: removing it whatever a command did to it, and the safe export filter.

    remove_tree(sb.base)                                   # also what a command made unreadable (chmod 000)
    tar.extractall(target, filter=export_filter)           # keep=True: the mounts' tar, extracted on the host

Used by `shell.py` (close, a failed start, `keep=True` exports) and by tests that clean up after a
sandbox. The host never reads or writes inside a live sandbox directly: `Shell.write` / `read` /
`get_tree` run cat and tar inside, so a link made by a command cannot redirect them.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from pathlib import Path


def remove_tree(path: Path) -> None:
    """rmtree that also removes what a command made unreadable or read-only (chmod 000 dirs). It changes
    modes only inside the tree: a missing tree is nothing to do, and the tree's own parent (e.g. the shared
    /tmp) is never touched."""
    root = os.path.abspath(path)
    if not os.path.lexists(root):
        return

    def inside(p: str) -> bool:
        return p == root or p.startswith(root + os.sep)

    def fix(func, p, _exc):
        try:
            parent = os.path.dirname(os.path.abspath(p))
            if inside(parent):
                os.chmod(parent, stat.S_IRWXU)
            if inside(os.path.abspath(p)) and os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=fix)


def export_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "tar" filter (nothing lands outside dest, even through links extracted before; no setuid
    bits) that also drops device nodes; links are kept as links, never followed."""
    if member.ischr() or member.isblk():
        return None
    return tarfile.tar_filter(member, dest)
