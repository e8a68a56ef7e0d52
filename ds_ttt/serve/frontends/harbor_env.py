"""A Harbor environment on the project's bubblewrap sandbox, for tasks made of plain files (no Docker).

    harbor run -p TASK_DIR --agent ds_ttt.serve.frontends.harbor_agent:TTTAgent \
        --env ds_ttt.serve.frontends.harbor_env:SandboxEnvironment [--ek keep=true] [--ek cgroup_caps=none] ...

Runs in the Harbor venv (Python >= 3.12, `bash setup_harbor.sh`); see docs/harbor.md and
docs/sandbox.md. Each trial is one `ds_ttt.sandbox.Sandbox` (the generator's and the task
CLI's sandbox): bubblewrap with no network, uid 1000 without capabilities, the host's /usr and /etc
read-only, and as private size-capped tmpfs mounts the task's workdir (`/app` by default, holding the
task's `environment/` files), HOME=/root, /tmp, /var/tmp and Harbor's `/logs`, `/tests`, `/solution`;
everything else is read-only and no host path outside the system directories exists inside. Each
trial's sandbox is a cgroup of its own capping its total memory, processes and CPU, so parallel trials
cannot take the host's memory; where no cgroup can be made the trial fails with the fix, and
`--ek cgroup_caps=none` accepts running without (a warning in the trial's log says so; the log records
what was used).

  exec(command, cwd, env, timeout_sec)  `bash -c` in a new shell inside the trial's sandbox (as `docker
                                        exec`: background processes live on); stdout and stderr apart;
                                        at the timeout its processes are killed and Harbor's "Command
                                        timed out after N seconds" error is raised
  shell(command, timeout_sec)           the trial's one persistent shell (cd, export, jobs carry over),
                                        as the generator's trajectories run; a CommandResult, stderr
                                        merged, a timeout noted in it (harbor_agent may call this)
  upload_*/download_*                   cat/tar inside the sandbox, so links made by a command resolve
                                        there; a downloaded link pointing outside is skipped
  stop                                  kills every process of the sandbox; its files go with it

The verifier. Harbor's shared-mode verifier uploads the task's tests to /tests, runs /tests/test.sh with
exec and downloads /logs/verifier, all in the agent's environment. The first upload into /tests after
the agent ran seals the trial (ds_ttt/evaluation/verifier.py `seal`): every process of the agent's
sandbox is killed (its persistent shell, through which exec used to be sent, included), its files move to
a fresh sandbox with the same mounts, /tests and /logs/verifier are made new and empty there, and every
uploaded test file is read back and compared. So an agent cannot plant its own test, a reward file, a
link in their place, a job rewriting the reward, or a shell function answering for the host's commands.
What it left in /tests or /logs/verifier is named in a warning and discarded.

Refused: a task whose environment is a Dockerfile, docker-compose file or `docker_image` (run it with
`--env docker`), Windows tasks, and network allow-lists. A task whose network policy is public runs
without network (a warning says so): the sandbox never has any. Harbor's `user=` is not honoured
(one user, uid 1000).
"""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path, PurePosixPath
from typing import override

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.definition import COMPOSE_FILE_NAME, DOCKERFILE_NAME
from harbor.environments.tar_transfer import extract_dir
from harbor.models.task.config import NetworkMode, TaskOS
from harbor.models.trial.paths import EnvironmentPaths

from ds_ttt.evaluation.verifier import VerificationError, place_verified, seal
from ds_ttt.sandbox import CommandResult, Sandbox, SandboxError, isolation_problem

DEFAULT_WORKDIR = "/app"
HOME = "/root"
EXEC_OUTPUT_BYTES = 8 << 20  # what one exec may print (the agent keeps far less)
NO_TIMEOUT_SEC = 24 * 3600.0  # Harbor's timeout_sec=None


class SandboxEnvironment(BaseEnvironment):
    """Harbor `BaseEnvironment`: one bubblewrap `Sandbox` per trial."""

    def __init__(self, *args, keep: bool = False, cgroup_caps: str = "required", **kwargs):
        self._keep = bool(keep) if not isinstance(keep, str) else keep.lower() in ("1", "true", "yes")
        if cgroup_caps not in ("required", "none"):
            raise ValueError(f"cgroup_caps={cgroup_caps!r}: choose required (the default) or none (--ek cgroup_caps=none)")
        self._cgroup_caps = cgroup_caps
        self._sandbox: Sandbox | None = None
        self._sealed = False  # the last call sealed the sandbox or uploaded a test into it (`_seal_for_verifier`)
        self._lock = asyncio.Lock()
        super().__init__(*args, **kwargs)

    # ---- identity and capabilities -------------------------------------------------------------
    @staticmethod
    @override
    def type() -> str:
        return "ds-ttt-sandbox"

    @property
    @override
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    @override
    def preflight(cls) -> None:
        problem = isolation_problem()
        if problem is not None:
            raise SystemExit(f"ds_ttt.serve.frontends.harbor_env.SandboxEnvironment cannot run here: {problem}. Install bubblewrap "
                             "(apt-get install bubblewrap), or use a Harbor environment with a container runtime "
                             "(--env docker).")

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
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("SandboxEnvironment is not started")
        return self._sandbox

    @property
    def root(self) -> Path:
        """The host directory the sandbox's files are exported to at `stop` with keep=true."""
        return self.sandbox.fs_root

    # ---- lifecycle -----------------------------------------------------------------------------
    @override
    async def start(self, force_build: bool) -> None:
        mode = self.network_policy.network_mode
        if mode == NetworkMode.ALLOWLIST:
            raise RuntimeError("SandboxEnvironment has no network, so it cannot honour a network allow-list; "
                               "run this task with --env docker")
        if mode == NetworkMode.PUBLIC:
            self.logger.warning("SandboxEnvironment has no network: this task's policy is public, so commands that "
                                "need the internet will fail (run it with --env docker if it needs any)")
        paths = EnvironmentPaths()
        try:
            sb = Sandbox(keep=self._keep, timeout=NO_TIMEOUT_SEC, workdir=self.workdir, home=HOME,
                         dirs=(str(paths.logs_dir), str(paths.tests_dir), str(paths.solution_dir)),
                         cgroup_caps=self._cgroup_caps)
        except SandboxError as e:
            raise RuntimeError(f"SandboxEnvironment cannot start: {e}") from e
        if self.environment_dir.is_dir():  # plain task files (a Dockerfile was rejected above)
            sb.add_tree(self.environment_dir)
        self._sandbox = sb
        subdirs = [paths.agent_dir, paths.user_agent_dir, paths.verifier_dir, paths.artifacts_dir]
        res = await self._call(sb.run_fresh, "mkdir -p " + " ".join(str(d) for d in subdirs), timeout=60.0)
        if res.exit_code != 0:
            raise RuntimeError(f"SandboxEnvironment: setting up the log directories failed: {res.stderr.strip()}")
        if sb.cgroup_caps == "none":
            self.logger.warning("SandboxEnvironment: cgroup_caps=none: this trial's commands can use all of this "
                                "machine's memory, processes and CPU")
        self.logger.info(f"sandbox {sb.base} started: isolation={sb.isolation} cgroup_caps={sb.cgroup_caps}")

    @override
    async def stop(self, delete: bool) -> None:
        if self._sandbox is not None:
            sb, self._sandbox = self._sandbox, None
            await asyncio.to_thread(sb.close)  # not under the lock: a running command must not delay the kill
            if self._keep:
                self.logger.info(f"kept the sandbox's files in {sb.fs_root}")

    async def _call(self, fn, *args, **kwargs):
        """Sandbox calls block; they run in a thread, one at a time, so Harbor's event loop keeps its timers."""
        async with self._lock:
            return await asyncio.to_thread(fn, *args, **kwargs)

    # ---- commands ------------------------------------------------------------------------------
    @override
    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        # `user` is not honoured: the sandbox has one user (see the module docstring)
        self._sealed = False
        res = await self._call(self.sandbox.run_fresh, command, cwd=cwd or self.workdir, env=self._merge_env(env),
                               timeout=NO_TIMEOUT_SEC if timeout_sec is None else float(timeout_sec),
                               max_output_bytes=EXEC_OUTPUT_BYTES)
        if res.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=res.output or None, stderr=res.stderr or None, return_code=res.exit_code)

    async def shell(self, command: str, timeout_sec: float | None = None) -> CommandResult:
        """Run `command` in the trial's persistent shell (state carries over; stderr merged)."""
        self._sealed = False
        return await self._call(self.sandbox.run, command, NO_TIMEOUT_SEC if timeout_sec is None else float(timeout_sec))

    async def _checked(self, what: str, fn, *args, **kwargs):
        try:
            res = await self._call(fn, *args, **kwargs)
        except SandboxError as e:
            raise RuntimeError(f"SandboxEnvironment {what} failed: {e}") from e
        if isinstance(res, CommandResult) and res.exit_code != 0:
            raise RuntimeError(f"SandboxEnvironment {what} failed (exit {res.exit_code}): {res.stderr.strip()}")
        return res

    # ---- the verifier ------------------------------------------------------------------------------
    @staticmethod
    def _is_tests_path(target: str) -> bool:
        tests = str(EnvironmentPaths().tests_dir)
        target = str(PurePosixPath(target))
        return target == tests or target.startswith(tests.rstrip("/") + "/")

    async def _seal_for_verifier(self) -> None:
        """The agent's sandbox killed, its files in a fresh one with new, empty /tests and /logs/verifier
        (the module docstring). Once per run of uploads into /tests: any other call (exec, shell, another
        upload: a multi-step task's next agent step) means the next upload into /tests seals again."""
        if self._sealed:
            return
        paths = EnvironmentPaths()
        notes: list[str] = []
        async with self._lock:
            try:
                self._sandbox = await asyncio.to_thread(seal, self.sandbox, notes=notes,
                                                        fresh=(str(paths.tests_dir), str(paths.verifier_dir)))
            except VerificationError as e:
                self._sandbox = None
                raise RuntimeError(f"SandboxEnvironment: the verifier cannot run: {e}") from e
        self._sealed = True
        for note in notes:
            self.logger.warning(f"SandboxEnvironment: {note}")
        self.logger.info(f"sandbox sealed for the verifier: {self.sandbox.base}")

    # ---- files ---------------------------------------------------------------------------------
    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data, target = Path(source_path).read_bytes(), str(PurePosixPath(target_path))
        if self._is_tests_path(target):
            await self._seal_for_verifier()
            try:
                await self._call(place_verified, self.sandbox, data, target)
            except VerificationError as e:
                raise RuntimeError(f"SandboxEnvironment upload of {source_path} to {target}: {e}") from e
            return
        self._sealed = False
        await self._checked(f"upload of {source_path} to {target_path}", self.sandbox.put, data, target)

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:  # contents of source_dir (like `docker cp src/. dst`)
            tar.add(str(source_dir), arcname=".")
        tests = self._is_tests_path(target_dir)
        if tests:
            await self._seal_for_verifier()
        else:
            self._sealed = False
        await self._checked(f"upload of {source_dir} to {target_dir}", self.sandbox.put_tree, buf.getvalue(), target_dir)
        if tests:  # every file read back: the test that runs is the task's
            for path in sorted(p for p in Path(source_dir).rglob("*") if p.is_file() and not p.is_symlink()):
                target = str(PurePosixPath(target_dir) / path.relative_to(source_dir).as_posix())
                back = await self._checked(f"reading back {target}", self.sandbox.read, target)
                if back != path.read_bytes():
                    raise RuntimeError(f"SandboxEnvironment: {target} does not hold the uploaded {path}")

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._checked(f"download of {source_path}", self.sandbox.read, source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        data = await self._checked(f"download of {source_dir}", self.sandbox.get_tree, source_dir)
        refused = extract_dir(io.BytesIO(data), target_dir)  # skips absolute paths and links out of target_dir
        for reason in refused:
            self.logger.warning(f"download of {source_dir}: skipped {reason}")
