"""The embedded real-shell trajectory generator: scripted expert policies over procedural tasks.

    trajs = generate(num=300, seed=0)               # list of canonical trajectories (deterministic)
    world = generate_memory_world(seed=7)           # one fresh memory world for the memory eval

Every observation is the real output of the command in real bash inside the episode's sandbox
(`ds_ttt/sandbox/`: bubblewrap, no network, an unprivileged uid, only the episode's own root writable,
process/memory/file/output limits, and one persistent shell per episode, so a `cd`, an `export` or a
background job carries over to the next command; without bwrap the generator refuses unless called
with isolation="none", which `data_prep/generate.py --no-isolation` passes). `meta.isolation` records
which was used ("bwrap" or "none"). Each episode also runs in a cgroup of its own capping its memory,
processes and CPU; where none can be made it refuses unless called with cgroup_caps="none"
(`--no-cgroup-caps`), and `meta.cgroup_caps` records what was used ("cgroup-v1", "cgroup-v2",
"systemd" or "none"). Each
trajectory: system prompt + the `bash` tool schema, the task, then assistant turns with short reasoning
and one Qwen3 tool call `{"name": "bash", "arguments": {"command": ...}}`, the tool results, and a final
assistant answer. Per-trajectory RNG = Random(f"{seed}:{index}") so any trajectory can be regenerated
alone and a pool of workers gives the same bytes as one process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
from pathlib import Path

from ds_ttt.sandbox import Sandbox, format_observation, resolve_cgroup_caps, resolve_isolation

from .families import FAMILIES, memory_world

SYSTEM_PROMPT = (
    "You are a careful terminal agent in a Linux sandbox. Use the bash tool to run one command at a time, "
    "read its output, and think briefly before each step. When the task is done, reply with a short summary."
)
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the working directory and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command to run."}},
                       "required": ["command"]},
    },
}
FAMILY_NAMES = tuple(FAMILIES)


class Episode:
    """Records one trajectory while a policy acts in a sandbox."""

    def __init__(self, sandbox: Sandbox, traj_id: str, family: str, variant: str):
        self.sb = sandbox
        self.id = traj_id
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.round = 0
        self.meta: dict = {"family": family, "variant": variant}
        self._pending_recovery = False

    # world + task
    def write(self, rel: str, text: str, mode: int | None = None) -> None:
        self.sb.write(rel, text, mode)

    def task(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        self.meta["task"] = text

    # acting
    def act(self, reasoning: str, command: str, expect_fail: bool = False) -> str:
        self.round += 1
        call_id = f"call_{self.round}"
        self.messages.append({
            "role": "assistant", "content": "", "reasoning_content": reasoning,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": "bash", "arguments": json.dumps({"command": command}, ensure_ascii=False)}}],
        })
        result = self.sb.run(command)
        if expect_fail != (result.exit_code != 0):
            raise RuntimeError(f"{self.id}: `{command}` exited {result.exit_code} (expected {'failure' if expect_fail else 'success'}): {result.output!r}")
        obs = format_observation(result)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": obs})
        return obs

    def mark_recovery(self) -> None:
        """The next action is the one after a failing command."""
        self.meta.setdefault("recovery_rounds", []).append(self.round + 1)

    def check_memory(self, fact: str, source_round: int) -> None:
        """The latest action must reproduce `fact`, first seen in the observation of `source_round`."""
        args = self.messages[-2]["tool_calls"][0]["function"]["arguments"]
        assert fact in args, (fact, args)
        self.meta.setdefault("memory_checks", []).append({"round": self.round, "fact": fact, "source_round": source_round})

    def finish(self, reasoning: str, answer: str, success: bool = True) -> None:
        self.round += 1
        self.messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
        self.meta["success"] = bool(success)
        self.meta["reward"] = 1.0 if success else 0.0

    def trajectory(self) -> dict:
        self.meta["num_rounds"] = self.round
        return {"id": self.id, "source": "ds_ttt_generator", "tools": [BASH_TOOL], "messages": self.messages, "meta": self.meta}


def generate_one(seed: int, index: int, family: str | None = None, keep_dir: str | None = None,
                 isolation: str = "required", cgroup_caps: str = "required") -> dict:
    rng = random.Random(f"{seed}:{index}")
    family = family or FAMILY_NAMES[rng.randrange(len(FAMILY_NAMES))]
    policy = rng.choice(FAMILIES[family])
    return _run_episode(f"gen-{seed}-{index:05d}", family, policy.__name__, lambda ep: policy(ep, rng), seed, keep_dir,
                        isolation, cgroup_caps)


def _run_episode(traj_id: str, family: str, variant: str, play, seed: int, keep_dir: str | None, isolation: str,
                 cgroup_caps: str = "required") -> dict:
    """Play one scripted episode in a throwaway sandbox and return its canonical trajectory."""
    with Sandbox(parent=keep_dir, keep=keep_dir is not None, isolation=isolation, cgroup_caps=cgroup_caps) as sb:
        ep = Episode(sb, traj_id, family, variant)
        play(ep)
        traj = ep.trajectory()
        traj["meta"]["isolation"] = sb.isolation
        traj["meta"]["cgroup_caps"] = sb.cgroup_caps
        if keep_dir is not None:
            traj["meta"]["sandbox"] = str(sb.root)
    traj["meta"]["seed"] = seed
    traj["meta"]["group"] = traj["id"]
    return traj


def generate_memory_world(seed: int, num_distractors: int | None = None, keep_dir: str | None = None,
                          isolation: str = "required", pool: str = "heldout", cgroup_caps: str = "required") -> dict:
    """A fresh memory world (families.memory_world) from the held-out pool unless `pool="train"`:
    keys written by real commands, read back in later rounds.

    meta.values = {name: key}; meta.readbacks = [{"round", "path", "value", "source_round"}] (the
    observation of `round` must reproduce the value first observed in `source_round`);
    meta.memory_checks = [{"round", "fact", "source_round"}] for the final action that writes the keys.
    """
    rng = random.Random(f"memory-world:{seed}")
    return _run_episode(f"memworld-{seed}", "memory", "memory_world",
                        lambda ep: memory_world(ep, rng, num_distractors=num_distractors, pool=pool), seed, keep_dir,
                        isolation, cgroup_caps)


def _work(args):
    return generate_one(*args)


def generate(num: int, seed: int, workers: int | None = None, progress: bool = False, family: str | None = None,
             isolation: str = "required", cgroup_caps: str = "required") -> list[dict]:
    """`num` trajectories for `seed` (identical for any number of workers)."""
    resolve_isolation(isolation)  # refuse before starting any worker
    resolve_cgroup_caps(cgroup_caps)
    jobs = [(seed, i, family, None, isolation, cgroup_caps) for i in range(num)]
    workers = workers if workers is not None else min(mp.cpu_count(), 8)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num, desc="generate", unit="traj")
    out = []
    if workers <= 1:
        for j in jobs:
            out.append(_work(j))
            bar and bar.update(1)
    else:
        with mp.get_context("fork").Pool(workers) as pool:
            for t in pool.imap(_work, jobs, chunksize=4):
                out.append(t)
                bar and bar.update(1)
    bar and bar.close()
    return out


def write_outputs(trajs: list[dict], out_dir: str | Path) -> dict[str, Path]:
    """DIR/trajectories.jsonl (canonical) and DIR/atif/<id>.json (ATIF), written deterministically."""
    from .atif import canonical_to_atif

    out = Path(out_dir)
    (out / "atif").mkdir(parents=True, exist_ok=True)
    jsonl = out / "trajectories.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for t in trajs:
            f.write(json.dumps(t, ensure_ascii=False, sort_keys=True) + "\n")
    for t in trajs:
        (out / "atif" / f"{t['id']}.json").write_text(json.dumps(canonical_to_atif(t), ensure_ascii=False, indent=1, sort_keys=True) + "\n")
    return {"jsonl": jsonl, "atif": out / "atif"}
