"""A Harbor environment backed by the project's sandbox, for machines without a Docker daemon.

    harbor run -p TASK_DIR --agent ds_ttt.serve.harbor_agent:TTTAgent \
        --env ds_ttt.serve.harbor_env:SandboxEnvironment [--ek keep=true] ...

Runs in the Harbor venv (Python >= 3.12, `bash setup_harbor.sh`); see docs/harbor.md. Harbor's
trial runner addresses the environment by absolute container paths (`/app` the task's workdir,
`/tests/test.sh`, `/logs/verifier/reward.txt`, `/logs/agent`, `/tmp` for transfer archives), so each
trial gets a throwaway directory R that becomes `/` of a private namespace. It follows the data
generator's sandbox (`ds_ttt.data.sandbox`: the same fixed command environment, the same kind of
user/mount/pid namespaces) but keeps one namespace alive for the whole trial and chroots into R,
because Harbor needs absolute paths and processes that persist between commands:

    unshare --user --map-root-user --mount --pid --fork [--net]   (one long-lived init, `sleep infinity`)
      R/usr, R/etc        read-only bind mounts of the host's (the task uses this machine's tools)
      R/bin, lib, sbin …  the host's merged-/usr symlinks (or read-only bind mounts where they are dirs)
      R/dev               recursive bind mount of the host's /dev
      R/proc              a fresh proc for the new pid namespace
      R/app, /tests, /logs/{agent,verifier,artifacts}, /tmp, /root, anything else   plain directories
                          of R, private to the trial
    chroot R

Every `exec` enters that namespace with `nsenter` (so background processes live on between commands,
as in `docker exec`), runs `bash -c COMMAND` with the sandbox's fixed environment (C locale, fixed
PATH, HOME=/root) plus Harbor's, and is killed (process group) at its timeout. Files move in and out
with tar/cat through the same namespace, so paths and symlinks resolve inside it. `stop` kills the
namespace's init, which ends every process in it, and removes R (unless `keep=true`).

What it does not do — a convenience for running Harbor tasks here, not a security boundary:
  * no image build: a task whose environment is a Dockerfile, docker-compose file or `docker_image`
    is rejected (run those with Harbor's docker environment); plain files in the task's
    `environment/` are copied into the workdir instead;
  * one user: every command runs as the namespace's root, i.e. as the invoking user outside; Harbor's
    `user=` requests are not honored;
  * no CPU/memory limits, the host's /dev (including /dev/shm) is shared, and the network is the
    host's unless the task's network policy is `no-network` (then `--net`: loopback only).
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import override

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.definition import COMPOSE_FILE_NAME, DOCKERFILE_NAME
from harbor.environments.tar_transfer import extract_dir
from harbor.models.task.config import NetworkMode, TaskOS
from harbor.models.trial.paths import EnvironmentPaths

from ds_ttt.data.sandbox import SANDBOX_ENV

DEFAULT_WORKDIR = "/app"
HOST_READ_ONLY_DIRS = ("usr", "etc")  # bind-mounted read-only into every sandbox root
HOST_TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr symlinks (or dirs)
NAMESPACE_START_TIMEOUT_SEC = 10.0


@functools.lru_cache(maxsize=2)
def namespace_problem(*, network: bool = False) -> str | None:
    """None when the sandbox's namespaces (with their own network, if asked) can be made here, else why not."""
    for tool in ("unshare", "nsenter", "setpriv", "chroot", "bash", "tar"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    argv = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork"] + (["--net"] if network else [])
    try:
        proc = subprocess.run(argv + ["true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{' '.join(argv)} true` failed: {e}"
    if proc.returncode != 0:
        return (f"`{' '.join(argv)} true` exited {proc.returncode}: {proc.stderr.decode(errors='replace').strip()} "
                "(unprivileged user namespaces disabled?)")
    return None


class SandboxEnvironment(BaseEnvironment):
    """Harbor `BaseEnvironment`: a throwaway root directory, chrooted inside user+mount+pid namespaces."""

    def __init__(self, *args, keep: bool = False, **kwargs):
        self._keep = bool(keep)
        self._root: Path | None = None
        self._unshare: asyncio.subprocess.Process | None = None
        self._init_pid: int | None = None
        self._own_network = False
        super().__init__(*args, **kwargs)

    # ---- identity and capabilities -------------------------------------------------------------
    @staticmethod
    @override
    def type() -> str:
        return "ds-ttt-sandbox"

    @property
    @override
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=namespace_problem(network=True) is None)

    @classmethod
    @override
    def preflight(cls) -> None:
        problem = namespace_problem()
        if problem is not None:
            raise SystemExit(f"ds_ttt.serve.harbor_env.SandboxEnvironment cannot run here: {problem}. "
                             "Use a Harbor environment with a container runtime (e.g. --env docker).")

    @override
    def _validate_definition(self):
        if self.task_env_config.os == TaskOS.WINDOWS:
            raise RuntimeError("SandboxEnvironment runs Linux tasks only ([environment].os = 'windows' given)")
        if self.task_env_config.docker_image:
            raise ValueError(f"task sets [environment].docker_image = {self.task_env_config.docker_image!r}: "
                             "SandboxEnvironment has no images (it runs on this machine's own /usr); "
                             "run this task with --env docker, or remove docker_image")
        for name in (DOCKERFILE_NAME, COMPOSE_FILE_NAME):
            if (self.environment_dir / name).exists():
                raise ValueError(f"{self.environment_dir / name}: SandboxEnvironment does not build images; "
                                 "run this task with --env docker, or ship plain files in environment/ "
                                 "(they are copied into the workdir)")

    @property
    def workdir(self) -> str:
        return self.task_env_config.workdir or DEFAULT_WORKDIR

    @property
    def root(self) -> Path:
        """The sandbox directory that is `/` inside the namespace."""
        if self._root is None:
            raise RuntimeError("SandboxEnvironment is not started")
        return self._root

    # ---- lifecycle -----------------------------------------------------------------------------
    def _layout_root(self, root: Path) -> None:
        for name in HOST_READ_ONLY_DIRS + ("dev", "proc", "tmp", "root"):
            (root / name).mkdir(exist_ok=True)
        (root / "tmp").chmod(0o1777)
        for name in HOST_TOP_LEVEL_LINKS:
            host = Path("/") / name
            if host.is_symlink():
                (root / name).symlink_to(os.readlink(host))
            elif host.is_dir():
                (root / name).mkdir(exist_ok=True)
        paths = EnvironmentPaths()  # the directories Harbor's docker environment mounts from the trial dir
        for log_dir in (paths.agent_dir, paths.verifier_dir, paths.artifacts_dir):
            (root / log_dir.relative_to("/")).mkdir(parents=True, exist_ok=True)
        workdir = root / PurePosixPath(self.workdir).relative_to("/")
        workdir.mkdir(parents=True, exist_ok=True)
        if self.environment_dir.is_dir():  # plain task files (a Dockerfile was rejected above)
            shutil.copytree(self.environment_dir, workdir, dirs_exist_ok=True, symlinks=True)

    def _mount_script(self, root: Path) -> str:
        q = shlex.quote
        lines = ["set -e"]
        binds = list(HOST_READ_ONLY_DIRS) + [n for n in HOST_TOP_LEVEL_LINKS
                                             if (Path("/") / n).is_dir() and not (Path("/") / n).is_symlink()]
        for name in binds:
            target = q(str(root / name))
            lines += [f"mount --rbind /{name} {target}", f"mount -o remount,bind,ro {target}"]
        lines += [f"mount --rbind /dev {q(str(root / 'dev'))}", f"mount -t proc proc {q(str(root / 'proc'))}",
                  f"exec chroot {q(str(root))} /bin/sleep infinity"]
        return "\n".join(lines)

    @override
    async def start(self, force_build: bool) -> None:
        problem = namespace_problem(network=self.network_policy.network_mode == NetworkMode.NO_NETWORK)
        if problem is not None:
            raise RuntimeError(f"SandboxEnvironment cannot start: {problem}")
        self._root = root = Path(tempfile.mkdtemp(prefix="ds_ttt_harbor_")).resolve()
        self._layout_root(root)
        # --kill-child: the namespace ends with unshare; setpriv --pdeathsig: unshare ends with this process
        argv = ["setpriv", "--pdeathsig", "KILL", "unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork",
                "--kill-child"]
        self._own_network = self.network_policy.network_mode == NetworkMode.NO_NETWORK
        if self._own_network:
            argv.append("--net")
        self._unshare = await asyncio.create_subprocess_exec(
            *argv, "bash", "--noprofile", "--norc", "-c", self._mount_script(root),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        deadline = time.monotonic() + NAMESPACE_START_TIMEOUT_SEC
        while True:  # the init is ready once it runs chrooted into R
            if self._unshare.returncode is not None or time.monotonic() > deadline:
                await self._abort_start()
            pid = self._child_pid(self._unshare.pid)
            if pid is not None and _proc_root(pid) == root.resolve():
                self._init_pid = pid
                break
            await asyncio.sleep(0.02)
        self.logger.debug(f"sandbox root {root}, namespace init pid {self._init_pid}")

    async def _abort_start(self):
        proc = self._unshare
        if proc.returncode is None:
            proc.kill()
        _, err = await proc.communicate()
        self._cleanup()
        raise RuntimeError(f"SandboxEnvironment: the namespace did not start (exit {proc.returncode}): "
                           f"{(err or b'').decode(errors='replace').strip()}")

    @staticmethod
    def _child_pid(pid: int) -> int | None:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    @override
    async def stop(self, delete: bool) -> None:
        if self._init_pid is not None:
            try:  # SIGKILL to the pid namespace's init ends every process in it
                os.kill(self._init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._init_pid = None
        if self._unshare is not None:
            await self._unshare.communicate()
            self._unshare = None
        self._cleanup()

    def _cleanup(self) -> None:
        if self._root is not None:
            if self._keep:
                self.logger.info(f"kept sandbox root {self._root}")
            else:
                shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    # ---- commands ------------------------------------------------------------------------------
    def _enter_argv(self, argv: list[str], cwd: str, env: dict[str, str] | None) -> list[str]:
        if self._init_pid is None:
            raise RuntimeError("SandboxEnvironment is not started")
        variables = {**SANDBOX_ENV, "HOME": "/root", **(env or {})}
        # the network namespace only when it is the sandbox's own (the host's needs no entering)
        namespaces = ["--user", "--mount", "--pid"] + (["--net"] if self._own_network else [])
        return (["nsenter", "-t", str(self._init_pid), *namespaces, "--root", "env", "-i", "-C", cwd]
                + [f"{k}={v}" for k, v in variables.items()] + argv)

    async def _run(self, argv: list[str], *, cwd: str, env: dict[str, str] | None = None,
                   stdin: bytes | None = None, timeout_sec: float | None = None) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(
            *self._enter_argv(argv, cwd, env), stdin=asyncio.subprocess.PIPE if stdin is not None else
            asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=timeout_sec)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            try:  # nsenter and the command share this process group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return proc.returncode, out, err

    @override
    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        # `user` is not honored: the sandbox has one user (see the module docstring)
        code, out, err = await self._run(["bash", "--noprofile", "--norc", "-c", command], cwd=cwd or self.workdir,
                                         env=self._merge_env(env), timeout_sec=timeout_sec)
        return ExecResult(stdout=out.decode(errors="replace") or None, stderr=err.decode(errors="replace") or None,
                          return_code=code)

    async def _checked(self, what: str, argv: list[str], stdin: bytes | None = None) -> bytes:
        code, out, err = await self._run(argv, cwd="/", stdin=stdin)
        if code != 0:
            detail = err.decode(errors="replace").strip()
            raise RuntimeError(f"SandboxEnvironment {what} failed (exit {code}): {detail}")
        return out

    # ---- files ---------------------------------------------------------------------------------
    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        await self._checked(f"upload of {source_path} to {target_path}",
                            ["bash", "-c", 'mkdir -p -- "$(dirname -- "$0")" && cat > "$0"', target_path], data)

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:  # contents of source_dir (like `docker cp src/. dst`)
            tar.add(str(source_dir), arcname=".")
        await self._checked(f"upload of {source_dir} to {target_dir}",
                            ["bash", "-c", 'mkdir -p -- "$0" && tar -x -C "$0"', target_dir], buf.getvalue())

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._checked(f"download of {source_path}", ["cat", "--", source_path])
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        data = await self._checked(f"download of {source_dir}", ["tar", "-c", "-C", source_dir, "."])
        refused = extract_dir(io.BytesIO(data), target_dir)  # skips absolute paths and links out of target_dir
        for reason in refused:
            self.logger.warning(f"download of {source_dir}: skipped {reason}")


def _proc_root(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/root"))
    except OSError:
        return None
