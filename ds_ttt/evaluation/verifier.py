"""The verifier: a task's test run where the agent cannot have touched it, after every process of the agent is dead.

    from ds_ttt.evaluation.verifier import run_verifier, seal
    ok, log = run_verifier(sb, test_script, answer="42")    # closes `sb` (the agent's sandbox); reward == 1?
    [(ok, log), ...] = run_verifier_each(sb, test_script, ["0", "1"])   # one agent's files, one verifier per answer
    verifier_sb = seal(sb, fresh=("/tests", "/logs/verifier"))   # the agent's files in a new sandbox (Harbor)

Why a second sandbox. Everything that runs inside the agent's sandbox after the agent stopped can be
steered by what the agent left there: its background processes (a loop rewriting the reward file),
files it planted (its own /tests/test.sh, made read-only so the copy over it fails; a reward file in a
directory the test cannot write to; /logs/verifier as a link to one), and the persistent shell itself,
through which the host's own commands (`run_fresh`, `put`, `read`) are sent: a shell function named
`exec` or `cd` defined by the agent runs in place of the host's command, so `read(reward)` can print
"1" without the test ever running. So the test never runs there:

  1. snapshot: the writable directories of the agent's sandbox (`sb.mounts`: the workdir, HOME, /tmp,
     /var/tmp, /logs, /tests, ...) as one tar archive;
  2. kill: `sb.close()` kills every process of the sandbox (its PID namespace ends with its PID 1) and
     removes its cgroup (which also kills what left the process tree); its mounts go with it;
  3. seal: a new sandbox with the same mounts and limits, whose shell has only ever run the host's
     commands; the archive is unpacked into its mounts (`tar -x` as the sandbox's uid, inside it: at
     worst it adds files the agent could have written itself), then each FRESH directory (the test's
     and the reward's) is removed with all it holds and made again, empty;
  4. the test is written to TEST_PATH and read back, byte for byte equal to the task's, or the episode
     fails; the answer (when given) is written to ANSWER_PATH; the reward file must be absent;
  5. the test runs (`bash TEST_PATH`, cwd /app, the sandbox's fixed environment); reward == 1 is success.

`run_verifier` sends steps 3 and 4 as one request (the same commands; each file compared inside with
`cmp` against the host's upload it was copied from, which is what reading it back checks): should any
part fail, it does them again one request each in another new sandbox from the same archive, so that
the log gives the failing step's reason exactly. `seal` (Harbor's verifier) does step 3 one request each.

Whatever goes wrong on the way (a snapshot that cannot be read, a copy that does not verify, a test
that writes no reward) fails the episode with the reason in its log. What the agent left in a FRESH
directory is named in the log ("discarded ..."), never used.

What crosses over is the agent's files only: that is its work, what the test is meant to read. A
background job still writing while its directory is archived changes that work, nothing else; a
directory the agent made unreadable cannot be archived and fails the episode.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import shlex
import tarfile
from pathlib import PurePosixPath

from ds_ttt.sandbox import Sandbox, SandboxError
from ds_ttt.sandbox.shell import MAX_TRANSFER_BYTES, put_command, put_tree_command
from ds_ttt.tasks.checks import ANSWER_PATH, REWARD_PATH, WORKDIR

TEST_PATH = "/tests/test.sh"
TESTS_DIR = str(PurePosixPath(TEST_PATH).parent)
REWARD_DIR = str(PurePosixPath(REWARD_PATH).parent)
FRESH_DIRS = (TESTS_DIR, REWARD_DIR)  # made empty by the verifier's own shell, never carried over
VERIFIER_TIMEOUT_SEC = 60.0
MAX_LOG_CHARS = 2000


class VerificationError(Exception):
    """The verifier could not run the task's test as it must; the episode fails with this reason."""


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _member_names(tar_bytes: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        return [m.name for m in tar.getmembers()]


def _sandbox_like(sb: Sandbox) -> Sandbox:
    """A new, unstarted bubblewrap sandbox with `sb`'s mounts, limits and cgroup caps."""
    extra = tuple(m for m in sb.mounts if m not in (sb.workdir, sb.home, "/tmp", "/var/tmp"))
    scratch = [size for m, size in sb.mounts.items() if m != sb.workdir]
    return Sandbox(keep=sb.keep, timeout=max(sb.timeout, VERIFIER_TIMEOUT_SEC), isolation="required",
                   workdir=sb.workdir, home=sb.home, dirs=extra, max_output_bytes=sb.max_output_bytes,
                   max_processes=sb.max_processes, max_memory_bytes=sb.max_memory_bytes,
                   max_file_bytes=sb.max_file_bytes, max_cpu_seconds=sb.max_cpu_seconds,
                   max_disk_bytes=sb.mounts[sb.workdir], max_scratch_bytes=max(scratch, default=256 << 20),
                   cgroup_caps="none" if sb.cgroup_caps == "none" else "required",
                   max_episode_memory_bytes=sb.caps.memory_bytes, max_episode_processes=sb.caps.processes,
                   max_episode_cpus=sb.caps.cpus)


def seal(sb: Sandbox, *, fresh: tuple[str, ...] = FRESH_DIRS, notes: list[str] | None = None) -> Sandbox:
    """Steps 1-3 of the module docstring: `sb`'s files (less the `fresh` directories) in a new sandbox;
    `sb` is closed, every process of it dead. `notes` gets what was discarded from `fresh`.
    Raises VerificationError (with `sb` closed) when the agent's files cannot be carried over."""
    notes = notes if notes is not None else []
    archive, new = _snapshot(sb, fresh, notes)
    _restore(new, archive, fresh)
    return new


def _fresh_command(fresh: tuple[str, ...]) -> str:
    """Step 3's shell loop: each FRESH directory made writable (the agent may have made it read-only) and
    removed with whatever is in it; one that is a mount is emptied (`rm -rf` of a mount point fails: hence
    `find`); exit 1 unless each is then an empty directory."""
    q = " ".join(shlex.quote(d) for d in fresh)
    return (f"for d in {q}; do "
            '{ [ -L "$d" ] || chmod -R u+rwX -- "$d"; } 2>/dev/null; '
            'if mountpoint -q "$d" 2>/dev/null; then find "$d" -mindepth 1 -delete; else rm -rf -- "$d"; fi; '
            'mkdir -p -- "$d" || exit 1; [ -d "$d" ] && [ ! -L "$d" ] && [ -z "$(ls -A -- "$d")" ] || exit 1; done')


def _snapshot(sb: Sandbox, fresh: tuple[str, ...], notes: list[str]) -> tuple[bytes, Sandbox]:
    """Steps 1-2: (the archive of `sb`'s mounts, a new unstarted sandbox like `sb`); `sb` is closed, every
    process of it dead, whatever happens. Raises VerificationError when the archive cannot be made."""
    new = None
    try:
        if sb.isolation == "none":  # its paths are host paths: /tests would be this machine's
            raise VerificationError("the verifier needs an isolated sandbox (isolation='none' was used)")
        new = _sandbox_like(sb)  # unstarted; made while `sb`'s settings (keep) are still its own
        # one archive of every mount, named from / (one request: each costs tens of ms)
        names = " ".join(shlex.quote(m.lstrip("/")) for m in sb.mounts)
        res = sb.run_fresh(f"tar -c -C / -- {names}", cwd="/", timeout=VERIFIER_TIMEOUT_SEC,
                           max_output_bytes=MAX_TRANSFER_BYTES)
        if res.exit_code != 0 or res.output_truncated:
            raise VerificationError(f"tar exited {res.exit_code}: {res.stderr.strip()[:500]}")
        archive = res.raw
        dropped = [p for p in ("/" + posixpath.normpath(n).lstrip("/") for n in _member_names(archive))
                   if any(_within(p, d) and p != d for d in fresh)]
        if dropped:
            notes.append(f"[verifier: discarded what the agent left in {' and '.join(fresh)}: {', '.join(dropped[:10])}"
                         + (f" (+{len(dropped) - 10} more)]" if len(dropped) > 10 else "]"))
    except (SandboxError, tarfile.TarError, VerificationError) as e:
        if new is not None:
            new.close()
        reason = "what came back is no tar archive" if isinstance(e, tarfile.TarError) else str(e)
        raise VerificationError(f"the agent's files could not be carried over: {reason}") from e
    finally:
        sb.close()  # every process of the agent: killed here, before anything of the verifier runs
        # its BASE is gone: the caller's own close() (a `with` block) must not remove it again, since
        # removing a missing tree makes files.remove_tree chmod its parent (the shared /tmp) to 0700
        sb.keep = True
    return archive, new


def _restore(new: Sandbox, archive: bytes, fresh: tuple[str, ...]) -> None:
    """Step 3 in `new`, one request each: the archive unpacked, the `fresh` directories made empty.
    Raises VerificationError (with `new` closed) when either fails."""
    try:
        res = new.put_tree(archive, "/")  # into the same mounts; whatever lands in a FRESH one is removed below
        if res.exit_code != 0:
            raise VerificationError(f"the agent's files could not be restored: {res.stderr.strip()[:500]}")
        res = new.run_fresh(_fresh_command(fresh), cwd="/", timeout=VERIFIER_TIMEOUT_SEC)
        if res.exit_code != 0:
            raise VerificationError(f"the verifier's directories could not be made fresh: {res.stderr.strip()[:500]}")
    except (SandboxError, VerificationError) as e:
        new.close()
        raise e if isinstance(e, VerificationError) else VerificationError(str(e)) from e


def _prepare_at_once(new: Sandbox, archive: bytes, test_script: str, answer: str | None) -> bool:
    """Steps 3 and 4 in `new` as one request (each step a request costs a shell start inside and the host's
    bookkeeping around it; the gate of the task suite runs thousands): the same commands `_restore`,
    `place_verified` and the reward check send, each file compared with `cmp` against the upload it was
    copied from, as the read-back compares it with the host's bytes. True when every step succeeded;
    False (a step failed, or the sandbox did) leaves `new` to be discarded: run_verifier then does the
    steps again, one request each, in another new sandbox from the same archive, so the log says which
    step failed and why, word for word as when each step was always its own request."""
    q = shlex.quote
    places = ([(answer.encode(), ANSWER_PATH, None)] if answer is not None else []) + [
        (test_script.encode(), TEST_PATH, 0o755)]
    try:
        with new.staged(archive, *(data for data, _path, _mode in places)) as (tar, *uploads):
            lines = [put_tree_command(tar, "/") + " || exit 1", _fresh_command(FRESH_DIRS),
                     f"cd -- {q(new.workdir)} || exit 1"]  # put and read run in the working directory
            for src, (_data, path, mode) in zip(uploads, places):
                lines += [put_command(src, path, mode) + " || exit 1", f"cmp -s -- {q(src)} {q(path)} || exit 1"]
            lines.append(f"[ ! -e {q(REWARD_PATH)} ]")
            return new.run_fresh("\n".join(lines), cwd="/", timeout=VERIFIER_TIMEOUT_SEC).exit_code == 0
    except SandboxError:
        return False


def place_verified(sb: Sandbox, data: bytes, path: str, mode: int | None = None) -> None:
    """Write `data` to `path` in `sb` and read it back: VerificationError unless the bytes are equal."""
    res = sb.put(data, path, mode)
    if res.exit_code != 0:
        raise VerificationError(f"writing {path} failed (exit {res.exit_code}): {res.stderr.strip()[:500]}")
    try:
        back = sb.read(path)
    except SandboxError as e:
        raise VerificationError(f"reading {path} back failed: {e}") from e
    if back != data:
        raise VerificationError(f"{path} does not hold what was written (sha256 "
                                f"{hashlib.sha256(back).hexdigest()[:12]} instead of "
                                f"{hashlib.sha256(data).hexdigest()[:12]})")


def run_verifier(sb: Sandbox, test_script: str, answer: str | None) -> tuple[bool, str]:
    """Steps 1-5 of the module docstring: (reward == 1, the log). Closes `sb`, the agent's sandbox.
    `answer` (the episode's final reply) goes to ANSWER_PATH; None keeps the file the episode left."""
    return run_verifier_each(sb, test_script, [answer])[0]


def run_verifier_each(sb: Sandbox, test_script: str, answers: list[str | None]) -> list[tuple[bool, str]]:
    """`run_verifier` for several final replies to what one agent left in `sb`: steps 1-2 once, then steps
    3-5 for each answer in a new verifier sandbox of its own, from the same archive, exactly as
    `run_verifier` would run them after an agent that left the same files (the blind-policy gate scores
    the policies that run no command, and differ only in their reply, this way). Closes `sb`."""
    notes: list[str] = []
    try:
        archive, verifier = _snapshot(sb, FRESH_DIRS, notes)
    except VerificationError as e:
        return [(False, "\n".join(notes + [f"[verifier: {e}]"]))] * len(answers)
    out = []
    for i, answer in enumerate(answers):
        if i:
            try:  # the next verifier: the settings of the last one (closed by now), a sandbox of its own
                verifier = _sandbox_like(verifier)
            except SandboxError as e:
                out.append((False, "\n".join(notes + [f"[verifier: the agent's files could not be carried over: {e}]"])))
                continue
        out.append(_verify(verifier, archive, test_script, answer, list(notes)))
    return out


def _verify(verifier: Sandbox, archive: bytes, test_script: str, answer: str | None,
            notes: list[str]) -> tuple[bool, str]:
    """Steps 3-5 in `verifier` (new, unstarted) from the agent's `archive`; closes `verifier`."""
    try:
        prepared = _prepare_at_once(verifier, archive, test_script, answer)
        if not prepared:  # one request each, in a sandbox that has run none of them, for the reason
            try:
                again = _sandbox_like(verifier)
            except SandboxError as e:
                raise VerificationError(f"the agent's files could not be carried over: {e}") from e
            finally:
                verifier.close()
            verifier = again
            _restore(verifier, archive, FRESH_DIRS)
    except VerificationError as e:
        return False, "\n".join(notes + [f"[verifier: {e}]"])
    with verifier:
        if not prepared:
            try:
                if answer is not None:
                    place_verified(verifier, answer.encode(), ANSWER_PATH)
                place_verified(verifier, test_script.encode(), TEST_PATH, 0o755)
                if verifier.run_fresh(f"[ ! -e {shlex.quote(REWARD_PATH)} ]", cwd="/").exit_code != 0:
                    raise VerificationError(f"{REWARD_PATH} exists before the test ran")
            except (SandboxError, VerificationError) as e:
                return False, "\n".join(notes + [f"[verifier: {e}]"])
        out = verifier.run_fresh(f"bash {TEST_PATH}", cwd=WORKDIR, timeout=VERIFIER_TIMEOUT_SEC)
        log = "\n".join(notes + [(out.output + out.stderr)[-MAX_LOG_CHARS:]])
        try:
            reward = verifier.read(REWARD_PATH).decode(errors="replace").strip()
        except SandboxError as e:  # a test that wrote no reward fails the episode; the log says why
            return False, f"{log}\n[verifier: no reward file: {e}]"
    return reward == "1", log + ("" if reward in ("0", "1") else f"\n[verifier: reward {reward[:40]!r}]")
