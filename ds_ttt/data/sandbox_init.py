"""The first process inside a sandbox: set up the namespaces' filesystem and limits, then exec bash.

Not imported by the package. `ds_ttt.data.sandbox.Sandbox.run` starts it as

    unshare --user --map-root-user --net --mount --pid --fork --kill-child --mount-proc \
        PYTHON -S -I sandbox_init.py unshare BASE WORKDIR MAX_PROCESSES MAX_FILE_BYTES ERROR_FD -- bash ... -c CMD

(or without `unshare` and with mode `none`). It is PID 1 of a fresh PID namespace, root of a fresh
user namespace (mapped to the caller's uid), with a private mount namespace and a network namespace
that holds only a downed loopback. Mode `unshare` then:

  1. sets the namespace's pid_max to MAX_PROCESSES + 1 (per-PID-namespace since Linux 6.14), so the
     command and everything it starts can hold at most MAX_PROCESSES PIDs at once; RLIMIT_NPROC is set
     too (it counts per user namespace and is what limits a non-root caller on older kernels). Root
     outside on a kernel without a per-namespace pid_max has no working limit: that is an error;
  2. bind-mounts BASE/tmp over /tmp (and /var/tmp), then BASE back at its own path (hidden by that
     mount when BASE lies under /tmp), so `touch /tmp/x` lands in the throwaway directory;
  3. makes every mount read-only, recursively (mount_setattr, Linux >= 5.12), and only BASE and the
     temporary directories writable again;
  4. moves into a nested user + mount namespace. Root of the first user namespace could simply
     remount / read-write or unmount the /tmp binding; copied into a less privileged namespace the
     mounts are locked (the kernel's MNT_LOCKED / MNT_LOCK_READONLY), so the command cannot. This PID
     namespace's /proc stays writable except /proc/sys: the kernel lets any process whose uid maps
     to the namespace's root write its pid_max, so a read-only /proc/sys is what keeps step 1.

Both modes set RLIMIT_FSIZE (one file at most MAX_FILE_BYTES), chdir to WORKDIR and exec the command.
Any failure before the exec is written to ERROR_FD (which the command never inherits) and exits 125,
so the host can tell a broken sandbox from a failing command. Standard library only: it runs with
`-S -I`, outside the package's environment.
"""

import ctypes
import os
import resource
import sys

MS_BIND = 0x1000
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (asm-generic table, Linux 5.12)
TEMP_DIRS = ("/tmp", "/var/tmp")
INIT_FAILED = 125


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def bind(source: str, target: str) -> None:
    _check(_libc.mount(source.encode(), target.encode(), None, ctypes.c_ulong(MS_BIND), None), f"bind-mount {source} on {target}")


def set_readonly(path: str, readonly: bool, recursive: bool) -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    ret = _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(), ctypes.c_uint(flags),
                        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(ret, f"make {path} {'read-only' if readonly else 'writable'} (mount_setattr, Linux >= 5.12)")


def outer_uid() -> int:
    """The uid outside the user namespace that root inside maps to (/proc/self/uid_map: `0 OUTER 1`)."""
    with open("/proc/self/uid_map") as f:
        inside, outside, _ = f.readline().split()
    assert inside == "0", inside
    return int(outside)


def limit_processes(max_processes: int) -> None:
    resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(max_processes + 1))
        return
    except OSError as e:
        why = e
    if outer_uid() == 0:
        # fork() ignores RLIMIT_NPROC for the real root user, inside a user namespace too
        raise RuntimeError(f"no process limit: the sandbox runs as root, where RLIMIT_NPROC is not enforced, and this "
                           f"kernel refuses a per-namespace pid_max ({why}; needs Linux >= 6.14)")


def confine_filesystem(base: str) -> None:
    # Directory descriptors keep BASE and BASE/tmp reachable once a mount over /tmp hides their paths.
    base_fd = os.open(base, os.O_PATH | os.O_DIRECTORY)
    tmp_fd = os.open(os.path.join(base, "tmp"), os.O_PATH | os.O_DIRECTORY)
    temp_dirs = [d for d in TEMP_DIRS if os.path.isdir(d)]
    for d in temp_dirs:
        bind(f"/proc/self/fd/{tmp_fd}", d)
    os.makedirs(base, exist_ok=True)  # under /tmp the path now resolves inside BASE/tmp: recreate the mount point
    bind(f"/proc/self/fd/{base_fd}", base)
    os.close(base_fd)
    os.close(tmp_fd)
    bind("/proc/sys", "/proc/sys")  # its own mount, so it stays read-only while /proc is made writable
    set_readonly("/", True, recursive=True)
    for d in [base, "/proc"] + temp_dirs:  # /proc: this PID namespace's own, for lock_mounts' uid_map
        set_readonly(d, False, recursive=False)


def lock_mounts() -> None:
    """A nested user + mount namespace (uid/gid 0 mapped to 0): the mounts above become locked."""
    _check(_libc.unshare(ctypes.c_int(CLONE_NEWUSER | CLONE_NEWNS)), "unshare a nested user and mount namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def main(argv: list[str]) -> None:
    mode, base, workdir, max_processes, max_file_bytes, error_fd, sep, *command = argv
    assert sep == "--" and command, argv
    error_fd = int(error_fd)
    try:
        if mode == "unshare":
            limit_processes(int(max_processes))
            confine_filesystem(base)
            lock_mounts()
        elif mode != "none":
            raise ValueError(f"unknown sandbox mode {mode!r}")
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(max_file_bytes), int(max_file_bytes)))
        os.chdir(workdir)
    except Exception as e:  # noqa: BLE001 - every setup failure is reported to the host, never to the command
        os.write(error_fd, f"{type(e).__name__}: {e}".encode())
        os._exit(INIT_FAILED)
    os.close(error_fd)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
