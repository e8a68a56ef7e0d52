"""The bubblewrap command line that builds a sandbox: namespaces, the read-only system, private tmpfs mounts.

    argv = bwrap_argv(bwrap_path(), base, {"/app": 1 << 30, "/tmp": 256 << 20}, "/app") + shell_argv(...)

What `bwrap` (bubblewrap) builds:

  bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL
        --as-pid-1 --uid 1000 --gid 1000 --ro-bind /usr /usr (+ /bin /lib /lib64 /sbin as on the host)
        --ro-bind /etc /etc (/etc/passwd, /etc/group: the sandbox's own) --proc /proc --dev /dev
        --tmpfs /dev/shm --tmpfs /run --tmpfs WORKDIR --tmpfs /tmp --tmpfs /var/tmp [--tmpfs HOME, dirs]
        --remount-ro / -- bash SUPERVISOR

No network (a fresh network namespace with only its own loopback; abstract Unix sockets belong to it
too), an unprivileged uid 1000 without capabilities or further user namespaces, NO_NEW_PRIVS (setuid
bits do nothing), a private PID namespace (no host process is visible), and no host path except the
read-only system directories and BASE/xfer (read-only at /run/ds_ttt: the host's uploads): host homes,
the project checkout, host sockets and other sandboxes do not exist inside. The writable places are
size-capped tmpfs mounts private to the sandbox (`mounts`: the working directory, HOME, /tmp, /var/tmp
and the caller's `dirs`, plus /dev/shm and /run); everything else is read-only. So "disk" is memory,
bounded by the mounts' sizes. When the caller is root, bwrap itself runs as uid HOST_UID_FOR_ROOT,
because the kernel never enforces the process limit for the host's root (`check_reachable`).

`shell.py` writes BASE/passwd and BASE/group (`passwd_text`, GROUP_TEXT) and BASE/xfer, then starts
this argv followed by the supervisor's (supervisor.py).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from .refusal import SandboxError

SANDBOX_UID = 1000  # the uid inside; it has no capabilities
HOST_UID_FOR_ROOT = 65534  # bwrap runs as this uid when the caller is root (the kernel exempts root from RLIMIT_NPROC)
SYSTEM_TMPFS_BYTES = 64 << 20  # /dev/shm and /run
SYSTEM_DIRS = ("usr", "etc")  # bound read-only
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr links, or read-only binds
XFER_INSIDE = "/run/ds_ttt"  # where BASE/xfer (uploads, the driver's RUN_FUNCTION) is bound read-only
GROUP_TEXT = f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def passwd_text(home: str) -> str:
    """The sandbox's /etc/passwd: root, agent (SANDBOX_UID, HOME `home`) and nobody."""
    return (f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:{home}:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")


def bwrap_argv(bwrap: str, base: Path, mounts: dict[str, int], workdir: str) -> list[str]:
    """bwrap's options up to and including "--" (the command follows): `mounts` maps each writable tmpfs
    to its size; BASE holds passwd, group and xfer."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--as-pid-1", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--hostname", "sandbox"]
    for name in SYSTEM_DIRS:
        argv += ["--ro-bind", f"/{name}", f"/{name}"]
    for name in SYSTEM_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), f"/{name}"]
    argv += ["--ro-bind", str(base / "passwd"), "/etc/passwd", "--ro-bind", str(base / "group"), "/etc/group",
             "--proc", "/proc", "--dev", "/dev", "--size", str(SYSTEM_TMPFS_BYTES), "--tmpfs", "/dev/shm",
             "--size", str(SYSTEM_TMPFS_BYTES), "--tmpfs", "/run", "--ro-bind", str(base / "xfer"), XFER_INSIDE]
    for path, size in sorted(mounts.items(), key=lambda kv: len(PurePosixPath(kv[0]).parts)):
        argv += (["--perms", "1777"] if path in ("/tmp", "/var/tmp") else []) + ["--size", str(size), "--tmpfs", path]
    return argv + ["--remount-ro", "/", "--chdir", workdir, "--"]


def check_reachable(base: Path) -> None:
    """bwrap runs as HOST_UID_FOR_ROOT when the caller is root: every parent of BASE must be searchable by it."""
    for parent in base.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            shutil.rmtree(base, ignore_errors=True)
            raise SandboxError(f"{parent} is not searchable by other users (mode {stat.filemode(os.stat(parent).st_mode)}), "
                               f"but the sandbox runs as uid {HOST_UID_FOR_ROOT} because the caller is root: put the "
                               f"sandbox elsewhere (parent=, e.g. under /tmp), `chmod o+x {parent}`, or run as a non-root user")
