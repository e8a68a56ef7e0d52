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
    """rmtree that also removes what a command made unreadable or read-only (chmod 000 dirs)."""
    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
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
