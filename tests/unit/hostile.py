"""The hostile-command suite's attacks and host-side targets, shared by every place that runs commands.

Not a test module: tests/unit/test_sandbox_hostile.py runs the attacks through the generator's
`Sandbox` and the serve runner's `BashToolRunner`; tests/harbor/test_harbor_hostile.py runs them
through Harbor's `SandboxEnvironment` (in the Harbor venv, via tests/harbor/hostile_probe.py).
`RESOURCE_ATTACKS` try to take the host's memory, process table or CPU from one episode, each
process staying under every per-process limit; test_sandbox_hostile.py judges them from the host
(`ResourceWatch`: the sandbox's processes' memory, number and CPU time, read from /proc), against the
episode's cgroup caps of `RESOURCE_LIMITS`.

`HostTargets` sets up, outside any sandbox: a sentinel tree holding a secret token (its hash is
compared before and after), Unix-socket servers in /dev/shm, /run and /tmp plus an abstract one, a
TCP server on 127.0.0.1 (each answers a connection with the token and counts it), and the token in
this process's environment (readable through /proc/PID/environ if /proc leaked). An attack fails
when its output never shows the token, no server saw a connection, the sentinel hash is unchanged,
no file appeared at the host paths it tried to write, and its own extra check holds (`ATTACKS`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project checkout: must be invisible inside


class HostTargets:
    def __init__(self):
        self.token = f"HOSTILE_{uuid.uuid4().hex[:16]}"  # the secret: never in a path (error messages echo paths)
        tag = uuid.uuid4().hex[:12]
        self.sentinel = Path(f"/tmp/ds_ttt_sentinel_{tag}")
        self.secret = self.sentinel / "secret.txt"
        self.socket_paths = [Path(f"/dev/shm/ds_ttt_{tag}.sock"), Path(f"/tmp/ds_ttt_{tag}.sock")]
        if os.access("/run", os.W_OK):
            self.socket_paths.append(Path(f"/run/ds_ttt_{tag}.sock"))
        self.abstract = f"\0ds_ttt_{tag}"
        self.tag = tag
        self.escapes = [Path(f"/ds_ttt_escape_{tag}"), Path(f"/tmp/ds_ttt_escape_{tag}"),
                        ROOT / f"ds_ttt_escape_{tag}", self.sentinel / "new_file"]
        self.connections = 0
        self._servers: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    # ---- setup / teardown -------------------------------------------------------------------
    def __enter__(self) -> "HostTargets":
        (self.sentinel / "sub").mkdir(parents=True)
        self.secret.write_text(self.token + "\n")
        (self.sentinel / "sub" / "keep.txt").write_text("do not touch\n")
        os.chmod(self.sentinel, 0o755)
        os.chmod(self.secret, 0o644)  # readable by anyone on the host: only the sandbox stands between
        for path in self.socket_paths:
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            os.chmod(path, 0o777)
            self._serve(s)
        s = socket.socket(socket.AF_UNIX)
        s.bind(self.abstract)
        self._serve(s)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        self._serve(s)
        os.environ["DS_TTT_HOSTILE_TOKEN"] = self.token
        self.hash_before = self.tree_hash()
        return self

    def _serve(self, s: socket.socket) -> None:
        s.listen(8)
        s.settimeout(0.2)
        self._servers.append(s)

        def loop():
            while not self._stop.is_set():
                try:
                    conn, _ = s.accept()
                except (TimeoutError, socket.timeout, OSError):
                    continue
                self.connections += 1
                with conn:
                    conn.sendall((self.token + "\n").encode())

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self._threads.append(t)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for s in self._servers:
            s.close()
        for path in self.socket_paths:
            path.unlink(missing_ok=True)
        os.environ.pop("DS_TTT_HOSTILE_TOKEN", None)
        for p in self.escapes:
            if p.is_file():
                p.unlink()
        import shutil

        shutil.rmtree(self.sentinel, ignore_errors=True)

    def tree_hash(self) -> str:
        h = hashlib.sha256()
        for p in sorted(self.sentinel.rglob("*")):
            st = p.lstat()
            h.update(f"{p.relative_to(self.sentinel)}:{st.st_mode:o}:{st.st_size}\n".encode())
            if p.is_file():
                h.update(p.read_bytes())
        return h.hexdigest()

    def fields(self, host_pid: int) -> dict:
        return {"secret": str(self.secret), "sentinel": str(self.sentinel), "tag": self.tag, "port": self.port,
                "socks": " ".join(str(p) for p in self.socket_paths), "abstract": self.abstract[1:],
                "root": str(ROOT), "home": str(Path.home()), "host_pid": host_pid, "escapes": [str(p) for p in self.escapes]}

    def failures(self, output: str) -> list[str]:
        """What the attack achieved, as seen from the host (empty: it failed everywhere)."""
        bad = []
        if self.token in output:
            bad.append("the secret token appeared in the output")
        if self.connections:
            bad.append(f"a host server saw {self.connections} connection(s)")
        if self.tree_hash() != self.hash_before:
            bad.append("the sentinel tree changed")
        bad += [f"{p} was created on the host" for p in self.escapes if p.exists()]
        return bad


PY = "python3 -c "

# name -> (command template, extra check on the output or None). Templates use HostTargets.fields().
ATTACKS: dict[str, tuple[str, object]] = {
    "chroot_escape": (
        PY + '"import os\ntry:\n os.makedirs(\'jail\', exist_ok=True); os.chroot(\'jail\')\n'
        ' [os.chdir(\'..\') for _ in range(64)]; os.chroot(\'.\'); print(open(\'{secret}\').read())\n'
        'except OSError as e: print(\'blocked\', e)"; chroot / cat {secret}; unshare -Ur chroot / cat {secret}',
        lambda out: "blocked [Errno 1] Operation not permitted" in out),
    "pivot_root_escape": (
        "mkdir -p new/old; pivot_root new new/old; unshare -Urm sh -c 'mount --bind new new && cd new && "
        "pivot_root . old && cat old{secret}'; " + PY + '"import ctypes; l = ctypes.CDLL(None, use_errno=True); '
        'print(\'pivot_root\', l.syscall(155, b\'new\', b\'new/old\'), ctypes.get_errno())"',
        None),
    "proc_1_root": ("ls /proc/1/root{sentinel}; cat /proc/1/root{secret}; cat /proc/1/root{root}/README.md; "
                    "ls -la /proc/1/root/ | head -30", None),
    "proc_host_pid": ("cat /proc/{host_pid}/environ; ls /proc/{host_pid}/root{sentinel}; cat /proc/{host_pid}/root{secret}; "
                      "for p in /proc/[0-9]*; do cat $p/root{secret} $p/environ 2>/dev/null; done; ls /proc | head -40",
                      lambda out: "No such file or directory" in out),
    "ptrace_host_process": (
        PY + '"import ctypes; l = ctypes.CDLL(None, use_errno=True); '
        'print(\'attach\', l.ptrace(16, {host_pid}, 0, 0), ctypes.get_errno())"; cat /proc/{host_pid}/mem | head -c 10',
        lambda out: "attach -1 3" in out),  # ESRCH: no such process in this PID namespace
    "mount": ("mkdir -p m; mount -t tmpfs none m; mount --bind / m; mount -o remount,rw /usr; umount /etc/passwd; "
              "touch /usr/escape /etc/escape; mount -t proc proc m; echo x > /usr/escape_file",
              lambda out: "Read-only file system" in out),
    "setuid_binaries": (
        "for b in /usr/bin/su /usr/bin/passwd /usr/bin/newgrp /usr/bin/chsh /usr/bin/gpasswd /usr/bin/mount; do "
        "[ -x $b ] && $b --help >/dev/null 2>&1; done; su -c 'cat {secret}' root </dev/null; "
        "cp /bin/bash ./rootsh && chmod u+s ./rootsh && ./rootsh -p -c 'echo euid=$(id -u)'; "
        + PY + '"import os\ntry: os.setuid(0)\nexcept OSError as e: print(\'setuid\', e)"; '
        "grep NoNewPrivs /proc/self/status",
        lambda out: "euid=1000" in out and "NoNewPrivs:\t1" in out and "setuid [Errno" in out),  # EINVAL: uid 0 is unmapped
    "unix_sockets": (
        "for s in {socks} /run/docker.sock /var/run/docker.sock; do " + PY + '"import socket, sys\n'
        'try:\n c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); print(c.recv(100))\n'
        'except OSError as e: print(\'blocked\', sys.argv[1], e)" $s; done; ls /dev/shm /run /tmp',
        lambda out: out.count("blocked") >= 4),
    "abstract_socket": (
        PY + '"import socket\ntry:\n c = socket.socket(socket.AF_UNIX); c.connect(\'\\0{abstract}\'); print(c.recv(100))\n'
        'except OSError as e: print(\'blocked\', e)"',
        lambda out: "blocked" in out),
    "loopback_tcp": (
        "(exec 3<>/dev/tcp/127.0.0.1/{port} && head -n 1 <&3); (exec 3<>/dev/tcp/localhost/{port} && head -n 1 <&3); "
        + PY + '"import socket\ntry: print(socket.create_connection((\'127.0.0.1\', {port}), 2).recv(100))\n'
        'except OSError as e: print(\'blocked\', e)"',
        lambda out: "blocked" in out and "Connection refused" in out),
    "fork_bomb": ("bomb() { bomb | bomb & }; bomb; sleep 2; echo done",
                  None),
    "memory_bomb": (PY + '"b = bytearray(6 << 30); print(\'allocated\')"; '
                    "for i in 1 2 3 4; do head -c 30M /dev/zero > /dev/shm/fill$i; done; ls -l /dev/shm",
                    lambda out: "MemoryError" in out and "allocated" not in out and "No space left on device" in out),
    "disk_fill": ("head -c 300M /dev/zero > big1; i=0; while fallocate -l 8M f$i 2>&1; do i=$((i+1)); done; "
                  "echo files=$i; head -c 10M /dev/zero > /tmp/fill; df -k . | tail -1",
                  lambda out: "File size limit exceeded" in out or "File too large" in out),
    "output_flood": ("yes HOSTILE_FLOOD", None),
    "writes_outside_root": (
        "echo x > {escapes[0]}; echo x > {escapes[1]}; echo x > {escapes[2]}; echo x > {escapes[3]}; "
        "echo x > ../../ds_ttt_escape_{tag}; echo x > /proc/1/root{escapes[0]}; rm -rf {sentinel}; "
        "cp /etc/hostname /{tag}", lambda out: "Read-only file system" in out or "No such file" in out),
    "read_host_files": (
        "cat {secret}; ls {sentinel} {root} {home}; cat {root}/README.md | head -3; cat /etc/shadow; "
        "ls /work /root /home 2>&1; find / -name 'secret.txt' 2>/dev/null | head",
        lambda out: "No such file or directory" in out),
}


# The episode caps the resource attacks run under (small, so that a failing cap costs little): 256 MiB
# of memory, 40 processes, half a core; tmpfs mounts small enough to fit in the memory cap.
RESOURCE_LIMITS = {"max_disk_bytes": 16 << 20, "max_scratch_bytes": 16 << 20, "max_file_bytes": 8 << 20,
                   "max_episode_memory_bytes": 256 << 20, "max_episode_processes": 40, "max_episode_cpus": 0.5}
WRITABLE_MOUNTS = ("/app", "/tmp", "/var/tmp", "/dev/shm", "/run")  # every writable tmpfs of a default sandbox
# name -> command. Each process stays under every per-process limit (4 GiB of address space, 256 processes).
RESOURCE_ATTACKS = {
    # 8 x 100 MiB of touched memory: 800 MiB together, 3 x the memory cap
    "memory_many_processes": ("for i in 1 2 3 4 5 6 7 8; do " + PY + "'import time; b = b\"x\" * (100 << 20); "
                              "time.sleep(30)' & done; wait; echo all survived"),
    # 30 loops, each forking `true` for 2 s: 61 processes at once, below RLIMIT_NPROC, above the cgroup's 40
    "fork_storm": "for i in $(seq 30); do (end=$((SECONDS + 2)); while [ $SECONDS -lt $end ]; do /bin/true; done) & done; wait",
    # 16 background spinners: every core of the machine, even while other work shares it; the command returns at once
    "busy_cores": "for i in $(seq 16); do (while :; do :; done) & done; echo started",
    # every writable tmpfs filled with 4 MiB files (each under RLIMIT_FSIZE) until it is full
    "tmpfs_fill": ("for d in " + " ".join(WRITABLE_MOUNTS) + "; do i=0; while head -c 4M /dev/zero > $d/fill$i 2>/dev/null; "
                   "do i=$((i+1)); done; done; df -k " + " ".join(WRITABLE_MOUNTS)),
}


def command(name: str, fields: dict) -> str:
    """The attack's shell command with the host's paths, pid, port and token filled in."""
    text = ATTACKS[name][0]
    for i, path in enumerate(fields["escapes"]):
        text = text.replace(f"{{escapes[{i}]}}", path)
    for key, value in fields.items():
        if key != "escapes":
            text = text.replace("{" + key + "}", str(value))
    return text


def extra_check(name: str, output: str) -> bool:
    check = ATTACKS[name][1]
    return True if check is None else bool(check(output))


PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def descendants(root_pid: int) -> list[int]:
    """root_pid and every process below it, from /proc/PID/task/*/children."""
    out, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack += [int(k) for k in f.read().split()]
            except OSError:
                pass
    return out


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class ResourceWatch:
    """What the processes under a root pid use, sampled from the host every 10 ms in a thread: the peak
    of their number, the peak of their anonymous resident memory summed, and their CPU seconds (each
    process's utime + stime at its last sample, so processes that ended count too, up to one sample).

    A guard, not only a gauge: when their memory passes `kill_above` bytes, or the host's MemAvailable
    falls under `host_floor`, it SIGKILLs them all (and records that it did), so a cap that does not
    hold costs a failed test, never the machine. `root` is a callable (the sandbox may restart its root)."""

    def __init__(self, root, kill_above: int, host_floor: int = 2 << 30):
        self.root, self.kill_above, self.host_floor = root, kill_above, host_floor
        self.peak_processes = self.peak_memory = 0
        self.killed = ""
        self._cpu: dict[tuple[int, str], float] = {}  # (pid, start time) -> CPU seconds at the last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "ResourceWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            root = self.root()
            if root is not None:
                pids = descendants(root)
                memory = 0
                for pid in pids:
                    try:
                        with open(f"/proc/{pid}/statm") as f:
                            _size, resident, shared = (int(x) for x in f.read().split()[:3])
                        with open(f"/proc/{pid}/stat") as f:
                            fields = f.read().rsplit(")", 1)[1].split()
                    except (OSError, ValueError):
                        continue
                    memory += (resident - shared) * PAGE
                    self._cpu[(pid, fields[19])] = (int(fields[11]) + int(fields[12])) / TICK
                self.peak_processes = max(self.peak_processes, len(pids))
                self.peak_memory = max(self.peak_memory, memory)
                if memory > self.kill_above or host_available_bytes() < self.host_floor:
                    self.killed = (f"the watch killed the attack: {memory >> 20} MiB in the sandbox, "
                                   f"{host_available_bytes() >> 20} MiB available on the host")
                    for pid in pids[1:]:  # all but the root: the sandbox itself reports what happened
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
            time.sleep(0.01)
