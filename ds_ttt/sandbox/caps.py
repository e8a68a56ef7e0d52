"""Per-episode cgroup caps: memory (swap included), processes and CPU for a sandbox's whole process tree.

    caps = CgroupCaps(memory_bytes=4 << 30, processes=272, cpus=1.0)
    group = create_episode_cgroup("ds_ttt_sbx_x1", caps)   # CgroupError (why, and the fix) when none can be made
    argv = group.wrap(argv)                                # systemd: runs argv inside a new transient scope
    group.adopt([pid, ...])                                # cgroupfs: moves them in before they run any command
    group.oom_kills(); group.cpu_seconds(); group.memory_bytes(); group.pids()
    group.remove()                                         # kills what is left in it, then removes it

Used by `shell.py` (one cgroup per sandbox, made when the sandbox is made, removed at `close`) and
`probe.py` (can one be made here?); docs/sandbox.md says what is capped on which kernel. Three ways,
the first that works here:

  cgroup-v2   a unified hierarchy (/sys/fs/cgroup, or /sys/fs/cgroup/unified beside v1) whose current
              cgroup (the "0::" line of /proc/self/cgroup) has memory, pids and cpu available: a child
              cgroup with memory.max, memory.swap.max = 0, pids.max and cpu.max.
  cgroup-v1   the memory, pids and cpu hierarchies (and cpuacct for accounting, if mounted): a child of
              the current process's cgroup in each, with memory.limit_in_bytes (+ memory.memsw.limit_in_bytes
              equal to it, so no swap, where swap accounting exists), pids.max and cpu.cfs_quota_us.
  systemd     where the cgroups are systemd's to hand out (cgroup v2 without a writable current cgroup,
              systemd running): the sandbox starts as `systemd-run [--user] --scope -p MemoryMax=...
              -p MemorySwapMax=0 -p TasksMax=... -p CPUQuota=...`, a transient scope that ends with it.

The cgroupfs ways make the sandbox's first processes (bwrap, or the shell without bwrap) members before
the sandbox reads its first command; their children inherit the membership, and a process inside
bubblewrap cannot leave (no cgroup filesystem is mounted there, and uid 1000 could not write one).
Without bubblewrap (isolation="none") commands run as the caller: a root caller's commands could
move themselves out, as they could do anything else on the host.
CGROUP_ROOT is where the hierarchies are looked for (tests point it elsewhere).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
CPU_PERIOD_US = 100_000  # the CFS period the quota is a share of
REMOVE_WAIT_SEC = 5.0  # how long remove() keeps killing and retrying rmdir before it gives up loudly
V2_CONTROLLERS = ("memory", "pids", "cpu")
V1_CAPPING = ("memory", "pids", "cpu")  # hierarchies that must exist for cgroup-v1 caps
FIX_HINT = ("run as root, or where cgroup v2 is delegated to you (systemd: `systemd-run --user --scope "
            "-p Delegate=yes ...`, or a user session with user@.service delegation), or accept running "
            "without per-episode caps with --no-cgroup-caps (data_prep/generate.py, the serve runner), "
            "Sandbox(cgroup_caps='none'), or Harbor's --ek cgroup_caps=none; the choice is recorded "
            "(meta.cgroup_caps, the runner's summary)")


class CgroupError(RuntimeError):
    """No cgroup could be made or configured here; the message says why."""


@dataclass(frozen=True, slots=True)
class CgroupCaps:
    memory_bytes: int  # RAM of the whole tree, tmpfs pages written inside included; swap capped at 0 beyond it
    processes: int  # tasks (threads count) of the whole tree at once
    cpus: float  # CPU time per wall second (1.0 = one core)

    def validate(self) -> None:
        if self.memory_bytes < 16 << 20:
            raise ValueError(f"max_episode_memory_bytes={self.memory_bytes}: give at least 16 MiB (16 << 20)")
        if self.processes < 8:
            raise ValueError(f"max_episode_processes={self.processes}: give at least 8 (the sandbox itself uses 3)")
        if not 0.01 <= self.cpus <= 1024:
            raise ValueError(f"max_episode_cpus={self.cpus}: give a number of cores between 0.01 and 1024")


def own_cgroups(proc_file: str | None = None) -> dict[str, str]:
    """{controller: path of this process's cgroup} from /proc/self/cgroup; the v2 line is under ""."""
    out = {}
    for line in Path(proc_file or PROC_SELF_CGROUP).read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_int_field(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _kill_pids(read_pids, deadline: float) -> None:
    """SIGSTOP then SIGKILL every pid `read_pids()` lists, round after round, until it lists none (a fork
    loop cannot outrun a stopped process) or the deadline passes."""
    while time.monotonic() < deadline:
        pids = read_pids()
        if not pids:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        time.sleep(0.005)


class EpisodeCgroup:
    """One sandbox's cgroup (a directory per hierarchy on v1, one directory on v2 / systemd)."""

    backend = ""

    def __init__(self, name: str, caps: CgroupCaps):
        self.name, self.caps = name, caps

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    def adopt(self, pids) -> None:
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this cgroup so far."""
        raise NotImplementedError

    def cpu_seconds(self) -> float | None:
        """CPU time used by the tree so far (None where no accounting hierarchy is mounted)."""
        raise NotImplementedError

    def memory_bytes(self) -> int:
        raise NotImplementedError

    def _dirs(self) -> list[Path]:
        raise NotImplementedError

    def kill(self, wait_sec: float = REMOVE_WAIT_SEC) -> None:
        _kill_pids(self.pids, time.monotonic() + wait_sec)

    def remove(self) -> None:
        """Kill every process still in the cgroup, then remove its directories (retrying while the kernel
        finishes the exits). CgroupError if one is still there after REMOVE_WAIT_SEC."""
        deadline = time.monotonic() + REMOVE_WAIT_SEC
        left = []
        while True:
            self.kill(wait_sec=max(0.0, deadline - time.monotonic()))
            left = []
            for d in self._dirs():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise CgroupError(f"could not remove the sandbox's cgroup {d}: {e}") from e
                    left.append(d)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if left:
            raise CgroupError(f"the sandbox's cgroup {left[0]} still holds processes after {REMOVE_WAIT_SEC} s: "
                              f"{self.pids()[:20]}")


class V1Cgroup(EpisodeCgroup):
    backend = "cgroup-v1"

    def __init__(self, name: str, caps: CgroupCaps, dirs: dict[str, Path]):
        super().__init__(name, caps)
        self.dirs = dirs  # controller -> the sandbox's directory in that hierarchy (cpuacct may share cpu's)

    def _dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))

    def adopt(self, pids) -> None:
        for d in self._dirs():
            for pid in pids:
                try:
                    _write(d / "cgroup.procs", str(pid))
                except ProcessLookupError:
                    pass

    def pids(self) -> list[int]:
        seen = set()
        for d in self._dirs():
            try:
                seen.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(seen)

    def oom_kills(self) -> int:
        return _read_int_field(self.dirs["memory"] / "memory.oom_control", "oom_kill")  # kernels >= 4.13

    def cpu_seconds(self) -> float | None:
        d = self.dirs.get("cpuacct")
        if d is None:
            return None
        return int((d / "cpuacct.usage").read_text()) / 1e9

    def memory_bytes(self) -> int:
        return int((self.dirs["memory"] / "memory.usage_in_bytes").read_text())


class V2Cgroup(EpisodeCgroup):
    backend = "cgroup-v2"

    def __init__(self, name: str, caps: CgroupCaps, path: Path | None):
        super().__init__(name, caps)
        self.path = path

    def _dirs(self) -> list[Path]:
        return [self.path] if self.path is not None else []

    def adopt(self, pids) -> None:
        for pid in pids:
            try:
                _write(self.path / "cgroup.procs", str(pid))
            except ProcessLookupError:
                pass

    def pids(self) -> list[int]:
        if self.path is None:
            return []
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self, wait_sec: float = REMOVE_WAIT_SEC) -> None:
        if self.path is not None and (self.path / "cgroup.kill").exists():
            try:
                _write(self.path / "cgroup.kill", "1")  # kernels >= 5.14: the whole cgroup at once
            except OSError:
                pass
        super().kill(wait_sec)

    def oom_kills(self) -> int:
        return 0 if self.path is None else _read_int_field(self.path / "memory.events", "oom_kill")

    def cpu_seconds(self) -> float | None:
        return None if self.path is None else _read_int_field(self.path / "cpu.stat", "usage_usec") / 1e6

    def memory_bytes(self) -> int:
        return 0 if self.path is None else int((self.path / "memory.current").read_text())


class SystemdScope(V2Cgroup):
    """A transient systemd scope per sandbox process: systemd makes the cgroup and sets the caps; the
    scope ends (and, with --collect, is forgotten) when its last process exits, so remove() finds its
    directory gone once it has killed what was left."""

    backend = "systemd"

    def __init__(self, name: str, caps: CgroupCaps, unified: Path, user: bool):
        super().__init__(name, caps, None)
        self.unified, self.user, self.num_scopes = unified, user, 0

    def scope_argv(self, unit: str) -> list[str]:
        mem = self.caps.memory_bytes
        return (["systemd-run"] + (["--user"] if self.user else []) +
                ["--scope", "--quiet", "--collect", f"--unit={unit}",
                 "-p", f"MemoryMax={mem}", "-p", "MemorySwapMax=0", "-p", f"TasksMax={self.caps.processes}",
                 "-p", f"CPUQuota={round(self.caps.cpus * 100)}%", "--"])

    def wrap(self, argv: list[str]) -> list[str]:
        self.num_scopes += 1  # a restarted sandbox process gets a scope of its own
        return self.scope_argv(f"{self.name}_{self.num_scopes}") + argv

    def adopt(self, pids) -> None:
        """systemd placed them already: find the scope's directory to read its counters from."""
        for pid in pids:
            try:
                path = own_cgroups(f"/proc/{pid}/cgroup").get("")
            except OSError:
                continue
            if path:
                self.path = self.unified / path.lstrip("/")
                return


# ---- choosing and making ---------------------------------------------------------------------------
def _unified_root(root: Path) -> Path | None:
    if (root / "cgroup.controllers").exists():
        return root
    if (root / "unified" / "cgroup.controllers").exists():
        return root / "unified"
    return None


def _v1_hierarchy(root: Path, controller: str) -> Path | None:
    """The mount of the v1 hierarchy that holds `controller` (a `cpu,cpuacct` mount counts for both)."""
    direct = root / controller
    if direct.is_dir() and not (direct / "cgroup.controllers").exists():
        return direct
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        if controller in name.split(",") and (root / name).is_dir():
            return root / name
    return None


def _make_v2(name: str, caps: CgroupCaps, unified: Path, own: str) -> V2Cgroup:
    parent = unified / own.lstrip("/")
    available = set((parent / "cgroup.controllers").read_text().split())
    missing = [c for c in V2_CONTROLLERS if c not in available]
    if missing:
        raise CgroupError(f"cgroup v2 at {parent} does not offer the {', '.join(missing)} controller(s)")
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    if not set(V2_CONTROLLERS) <= enabled:
        try:
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
        except OSError as e:
            why = ("it holds processes (cgroup v2 lets only a cgroup without processes of its own hand "
                   "controllers to children)" if e.errno == errno.EBUSY else str(e))
            raise CgroupError(f"cannot enable {'/'.join(V2_CONTROLLERS)} for children of {parent}: {why}") from e
    path = parent / name
    try:
        path.mkdir()
    except OSError as e:
        raise CgroupError(f"cannot create the cgroup {path}: {e}") from e
    group = V2Cgroup(name, caps, path)
    try:
        _write(path / "memory.max", str(caps.memory_bytes))
        if (path / "memory.swap.max").exists():
            _write(path / "memory.swap.max", "0")
        _write(path / "pids.max", str(caps.processes))
        _write(path / "cpu.max", f"{round(caps.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
    except OSError as e:
        group.remove()
        raise CgroupError(f"cannot set the caps in {path}: {e}") from e
    return group


def _make_v1(name: str, caps: CgroupCaps, root: Path, own: dict[str, str]) -> V1Cgroup:
    mounts = {c: _v1_hierarchy(root, c) for c in (*V1_CAPPING, "cpuacct")}
    missing = [c for c in V1_CAPPING if mounts[c] is None or c not in own]
    if missing:
        raise CgroupError(f"no cgroup v1 hierarchy for {', '.join(missing)} under {root}")
    dirs: dict[str, Path] = {}
    made: dict[Path, Path] = {}  # a real mount directory -> the sandbox's directory in it
    group = V1Cgroup(name, caps, dirs)
    for c, mount in mounts.items():
        if mount is None or c not in own:
            continue
        real = mount.resolve()
        if real not in made:
            path = real / own[c].lstrip("/") / name
            try:
                path.mkdir()
            except OSError as e:
                group.remove()
                raise CgroupError(f"cannot create the cgroup {path}: {e}") from e
            made[real] = path
        dirs[c] = made[real]
    try:
        mem = dirs["memory"]
        _write(mem / "memory.limit_in_bytes", str(caps.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():  # memory + swap: equal to memory, so no swap
            _write(mem / "memory.memsw.limit_in_bytes", str(caps.memory_bytes))
        elif (mem / "memory.swappiness").exists():
            try:  # no swap accounting (swapaccount=0): ask the kernel not to swap the sandbox out
                _write(mem / "memory.swappiness", "0")
            except OSError:
                pass
        _write(dirs["pids"] / "pids.max", str(caps.processes))
        _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(dirs["cpu"] / "cpu.cfs_quota_us", str(round(caps.cpus * CPU_PERIOD_US)))
    except OSError as e:
        group.remove()
        raise CgroupError(f"cannot set the caps in the cgroup {name}: {e}") from e
    return group


def _systemd_available() -> bool:
    return shutil.which("systemd-run") is not None and Path("/run/systemd/system").is_dir()


def create_episode_cgroup(name: str, caps: CgroupCaps, root: str | None = None) -> EpisodeCgroup:
    """A new cgroup named `name` under this process's own cgroup with `caps`, by the first way that works
    here (cgroup v2, cgroup v1, a systemd scope). CgroupError says what each way found."""
    caps.validate()
    root_path = Path(root or CGROUP_ROOT)
    try:
        own = own_cgroups()
    except OSError as e:
        raise CgroupError(f"cannot read {PROC_SELF_CGROUP}: {e}. Fix: {FIX_HINT}") from e
    problems = []
    unified = _unified_root(root_path)
    if unified is not None and "" in own:
        try:
            return _make_v2(name, caps, unified, own[""])
        except (CgroupError, OSError) as e:
            problems.append(f"cgroup v2: {e}")
    else:
        problems.append(f"cgroup v2: no unified hierarchy under {root_path}")
    if any(c in own for c in V1_CAPPING):
        try:
            return _make_v1(name, caps, root_path, own)
        except (CgroupError, OSError) as e:
            problems.append(f"cgroup v1: {e}")
    if unified is not None and _systemd_available():
        return SystemdScope(name, caps, unified, user=os.geteuid() != 0)
    problems.append("systemd: not running here (no /run/systemd/system or no systemd-run)")
    raise CgroupError("no cgroup can be made for the sandbox here (" + "; ".join(problems) + f"). Fix: {FIX_HINT}")
