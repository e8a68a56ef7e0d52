"""Procedural task families and their scripted expert policies for the embedded generator.

Each family is a function `(ep: Episode, rng: random.Random) -> None` that builds a small world in the
sandbox (files written directly), states a task, then acts through `ep.act(reasoning, command)`, which
runs the command in real bash and returns the real output. Policies read those outputs (ls listings,
error messages, grep counts) to decide what to do next, so the trajectories are causally consistent.
Listings are always sorted (`ls`, `find | sort`) so a seed reproduces the same bytes.

Families (meta.family):
  memory          a fact (port, token, file name, version) appears in an observation and a later action
                  must reproduce it; meta.memory_checks = [{"round", "fact", "source_round"}].
  error_recovery  a command fails (typo, missing file, wrong flag, permission, case-sensitive grep) and the next action uses
                  the error text to fix it; some runs end in failure (meta.success = False);
                  meta.recovery_rounds = [round of the action after the failing command].
  explore_edit    find, count, grep, sed, mv, verify.
"""

from __future__ import annotations

import random
import shlex

from .family_common import SERVICES, WORDS, random_hex, random_lines, random_name
from .shell_families import SHELL_FAMILIES


# ---------------------------------------------------------------------------------------- memory
def memory_config(ep, rng: random.Random) -> None:
    svc = rng.choice(SERVICES)
    kind = rng.choice(["port", "token", "version"])
    port = str(rng.randint(20000, 65000))
    token = random_hex(rng, 12)
    version = f"{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
    fact = {"port": port, "token": token, "version": version}[kind]
    cfg_dir = rng.choice(["config", "etc", "conf"])
    ep.write(f"{cfg_dir}/{svc}.ini", f"[{svc}]\nhost = 127.0.0.1\nport = {port}\nworkers = {rng.randint(2, 16)}\n"
             f"token = {token}\nversion = {version}\nlog_level = {rng.choice(['info', 'debug', 'warn'])}\n")
    ep.write(f"{cfg_dir}/defaults.ini", f"[defaults]\nport = 8080\ntimeout = {rng.randint(5, 60)}\n")
    ep.write("logs/boot.log", random_lines(rng, rng.randint(3, 6), "boot: "))
    target = {"port": "start.sh", "token": "deploy/auth.env", "version": "RELEASE"}[kind]
    ep.task(f"The {svc} service configuration is somewhere in this directory. Find its {kind} and record it: "
            + {"port": f"write a launcher start.sh that runs `./{svc} --port <PORT>`.",
               "token": "write it to deploy/auth.env as TOKEN=<value>.",
               "version": "write the bare version string to RELEASE."}[kind]
            + " Then show the file you wrote.")
    out = ep.act("First I need to see which config files exist.", "ls")
    ep.act(f"There is a {cfg_dir} directory; list it to find the {svc} config.", f"ls {cfg_dir}")
    r_src = ep.round + 1
    out = ep.act(f"Read {cfg_dir}/{svc}.ini to get the {kind}.", f"cat {cfg_dir}/{svc}.ini")
    assert fact in out, (fact, out)
    if rng.random() < 0.5:
        ep.act("Before writing, glance at the boot log in case it overrides the config.", "tail -n 3 logs/boot.log")
    reason = f"The {kind} in {cfg_dir}/{svc}.ini is {fact}; write it to {target}."
    cmd = {"port": f"printf '#!/bin/sh\\nexec ./{svc} --port {port}\\n' > start.sh && chmod +x start.sh",
           "token": f"mkdir -p deploy && echo 'TOKEN={token}' > deploy/auth.env",
           "version": f"echo {version} > RELEASE"}[kind]
    ep.act(reason, cmd)
    ep.check_memory(fact, r_src)
    out = ep.act(f"Verify {target}.", f"cat {target}")
    ep.finish(f"{target} contains the {kind}.", f"Recorded the {svc} {kind} ({fact}) in {target}.", success=fact in out)


def memory_filename(ep, rng: random.Random) -> None:
    days = sorted(rng.sample(range(1, 29), 4))
    month = rng.randint(1, 12)
    prefix = rng.choice(["db", "site", "vault", "repo"])
    names = [f"{prefix}-2024{month:02d}{d:02d}.tar.gz" for d in days]
    for n in names:
        ep.write(f"backups/{n}", f"backup {n}\n")
    ep.write("restore/README", "Put the restored archive here.\n")
    newest = names[-1]
    ep.task(f"Copy the newest {prefix} backup from backups/ into restore/ and confirm the copy.")
    r_src = ep.round + 1
    out = ep.act("List the backups; their names carry the date, so sorted order shows the newest last.", "ls backups")
    assert newest in out
    if rng.random() < 0.5:
        ep.act("Count the backups first.", "ls backups | wc -l")
    ep.act(f"The newest backup is {newest}; copy it.", f"cp backups/{newest} restore/")
    ep.check_memory(newest, r_src)
    out = ep.act("Confirm the copy is in restore/.", "ls restore")
    ep.finish("The archive is in restore/.", f"Copied {newest} into restore/.", success=newest in out)


# A memory world's pools. Training worlds draw key names, value formats and ways to store and read a
# value from "train"; the memory test draws from "heldout", which shares none of them with training
# (its names are words that training shows only as file contents, never as key names; its formats
# rearrange characters training values use, so every token is still a trained one).
MEMORY_POOLS = {
    "train": {
        "names": ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"),
        "formats": ("hex", "digits", "upper"),
        "stores": ("cat", "head", "grep", "ini"),
        "num_keys": (1, 4),
    },
    "heldout": {
        "names": ("cedar", "ember", "falcon", "garnet", "maple", "quartz"),
        "formats": ("hexdash", "hexupper"),
        "stores": ("sed", "json"),
        "num_keys": (2, 2),
    },
}
# keygen's output filter per format: the value is the sha256 of "<name>-<salt>", cut to a length, mapped
VALUE_FORMATS = {
    "hex": ("", (6, 12)),
    "digits": (" | tr a-f 0-5", (6, 10)),
    "upper": (" | tr 0-9a-f A-P", (8, 10)),
    "hexdash": (" | sed 's/..../&-/'", (8, 10)),
    "hexupper": (" | tr a-f A-F", (8, 10)),
}


def _store_and_read(store: str, name: str) -> tuple[str, str, str]:
    """(the command that generates a key and shows its value once, the readback command, the file)."""
    if store in ("cat", "head", "sed"):
        path = f"vault/{name}.key"
        read = {"cat": f"cat {path}", "head": f"head -n 1 {path}", "sed": f"sed -n 1p {path}"}[store]
        return f"bin/keygen {name} | tee {path}", read, path
    if store == "grep":  # one file of name=value lines
        path = "vault/keys.txt"
        return (f"v=$(bin/keygen {name}) && echo \"{name}=$v\" >> {path} && echo \"$v\"",
                f"grep '^{name}=' {path} | cut -d= -f2", path)
    if store == "ini":  # a config field
        path = "vault/keys.ini"
        return (f"echo \"{name} = $(bin/keygen {name})\" >> {path} && tail -n 1 {path} | cut -d' ' -f3",
                f"awk -F' = ' '$1 == \"{name}\" {{print $2}}' {path}", path)
    if store == "json":
        path = f"vault/{name}.json"
        return (f"printf '{{\"{name}\": \"%s\"}}\\n' \"$(bin/keygen {name})\" > {path} && cut -d'\"' -f4 {path}",
                f"cut -d'\"' -f4 {path}", path)
    raise ValueError(f"unknown memory store {store!r}")


def memory_world(ep, rng: random.Random, num_distractors: int | None = None, pool: str = "train") -> None:
    """1-4 keys are generated by real commands (each value observed once), distractor files and
    commands follow, then each key is read back and all are reported in a summary.

    pool: "train" or "heldout" (MEMORY_POOLS): names, value formats (alphabet and length) and how a
    value is stored and read back (cat, head, grep over name=value lines, a config field; held out:
    sed, a JSON field)."""
    spec = MEMORY_POOLS[pool]
    salt = random_hex(rng, 8)
    fmt = rng.choice(spec["formats"])
    filt, (lo, hi) = VALUE_FORMATS[fmt]
    length = rng.randint(lo, hi)
    ep.write("bin/keygen", f"#!/bin/sh\nprintf '%s' \"$1-{salt}\" | sha256sum | cut -c1-{length}{filt}\n", mode=0o755)
    ep.write("vault/.keep", "")
    num_keys = rng.randint(*spec["num_keys"])
    names = rng.sample(spec["names"], num_keys)
    store = rng.choice(spec["stores"])
    # distractor files: values of other keys (same format), never generated in this episode
    others = [n for n in spec["names"] if n not in names]
    decoys = rng.sample(others, min(len(others), rng.randint(0, 2)))
    for d in decoys:
        ep.write(f"vault/old-{d}.key", "".join(rng.choice("0123456789abcdef") for _ in range(length)) + "\n")
    listed = " and ".join(names) if num_keys <= 2 else ", ".join(names[:-1]) + f" and {names[-1]}"
    ep.task(f"Use bin/keygen to generate {'a key' if num_keys == 1 else f'{num_keys} keys'} named {listed}, store "
            f"{'it' if num_keys == 1 else 'each'} in the vault, then read {'it' if num_keys == 1 else 'them'} back "
            "and write vault/summary.txt with the values.")
    values, sources, reads = {}, {}, {}
    for n in names:
        gen, read, path = _store_and_read(store, n)
        out = ep.act(f"Generate the {n} key and keep a copy in the vault.", gen)
        values[n], sources[n], reads[n] = out.strip(), ep.round, (read, path)
        assert values[n] and "\n" not in values[n], (gen, out)
    k = rng.randint(1, 3) if num_distractors is None else num_distractors
    distractors = [("Check what the vault holds.", "ls vault"),
                   ("Check the vault file sizes.", "wc -c vault/*"),
                   ("Look at the keygen script once.", "cat bin/keygen | head -n 1"),
                   ("Make sure nothing else is in the vault.", "ls -a vault | wc -l")]
    distractors += [(f"Look at the old {d} key, which is not one of ours.", f"cat vault/old-{d}.key") for d in decoys]
    for j in range(k):  # more distractors than checks repeat them (longer memory distance)
        reason, cmd = distractors[j % len(distractors)]
        ep.act(reason, cmd)
    readbacks = []
    for n in names:
        read, path = reads[n]
        out = ep.act(f"Read the {n} key back.", read)
        readbacks.append({"round": ep.round, "path": path, "value": values[n], "source_round": sources[n]})
        assert out.strip() == values[n], (read, out, values[n])
    line = " ".join(f"{n}={values[n]}" for n in names)
    ep.act("Write the summary with the values.", f"echo '{line}' > vault/summary.txt && cat vault/summary.txt")
    for n in names:
        ep.check_memory(values[n], sources[n])
    ep.meta["readbacks"] = readbacks
    ep.meta["values"] = values
    ep.meta["memory_pool"] = pool
    ep.meta["memory_format"] = {"format": fmt, "length": length, "store": store, "num_keys": num_keys}
    ep.finish("The keys are stored and summarized.", f"Stored the keys and wrote vault/summary.txt ({line}).")


# ---------------------------------------------------------------------------------------- error recovery
TYPOS = {"cat": ["catt", "cta", "ca"], "grep": ["gerp", "grpe"], "ls": ["sl", "lss"], "wc": ["wcc", "cw"], "head": ["haed", "hed"]}


def recovery_typo(ep, rng: random.Random) -> None:
    f = f"{random_name(rng)}_notes.txt"
    ep.write(f, random_lines(rng, rng.randint(3, 8)))
    tool = rng.choice(["cat", "wc", "head"])
    good = {"cat": f"cat {f}", "wc": f"wc -l {f}", "head": f"head -n 2 {f}"}[tool]
    goal = {"cat": "Show the contents of", "wc": "Count the lines in", "head": "Show the first two lines of"}[tool]
    ep.task(f"{goal} {f}.")
    typo = rng.choice(TYPOS[tool])
    out = ep.act(f"Use {tool} on {f}.", good.replace(tool, typo, 1), expect_fail=True)
    assert "command not found" in out, out
    ep.mark_recovery()
    ep.act(f"'{typo}' is not a command (typo). Retry with {tool}.", good)
    ep.finish("The corrected command worked.", f"Done: ran `{good}`.")


def recovery_missing_file(ep, rng: random.Random) -> None:
    stem = rng.choice(["settings", "config", "deploy", "hosts"])
    real_ext, asked_ext = rng.choice([("yml", "yaml"), ("yaml", "yml"), ("conf", "cfg"), ("json", "jsn")])
    sub = rng.choice(["", "app/"])
    key = rng.choice(["replicas", "retries", "threads"])
    val = rng.randint(2, 12)
    body = f"name: {random_name(rng)}\n{key}: {val}\nregion: {random_name(rng)}-{rng.randint(1, 4)}\n"
    if rng.random() < 0.8:  # otherwise the file exists nowhere and the run ends in failure
        ep.write(f"{sub}{stem}.{real_ext}", body)
    ep.write(f"{sub}README.md", f"# {random_name(rng)}\n")
    ep.task(f"Report the value of `{key}` in {sub}{stem}.{asked_ext}.")
    out = ep.act(f"Read {sub}{stem}.{asked_ext} and look for {key}.", f"grep {key} {sub}{stem}.{asked_ext}", expect_fail=True)
    assert "No such file" in out, out
    ep.mark_recovery()
    out = ep.act(f"The file {sub}{stem}.{asked_ext} does not exist. Search for a file with a similar name.",
                 f"find . -name '{stem}.*' | sort")
    found = [l for l in out.splitlines() if l.startswith("./")]
    if not found:
        ep.finish(f"No {stem}.* file exists anywhere in the workspace, so {key} cannot be read.",
                  f"I could not find {sub}{stem}.{asked_ext} or any similarly named file; the task cannot be completed.",
                  success=False)
        return
    path = found[0][2:]
    out = ep.act(f"Found {path}; read {key} from it.", f"grep {key} {path}")
    ep.finish(f"The line says {out.strip()}.", f"`{key}` is {val} (in {path}; {sub}{stem}.{asked_ext} does not exist).",
              success=str(val) in out)


def recovery_bad_flag(ep, rng: random.Random) -> None:
    f = "numbers.txt"
    nums = [rng.randint(1, 500) for _ in range(rng.randint(4, 8))]
    ep.write(f, "".join(f"{n}\n" for n in nums))
    variant = rng.choice(["sort", "ls", "head"])
    if variant == "sort":
        ep.task(f"Print the numbers in {f} sorted from largest to smallest.")
        bad, fix, why = f"sort -x {f}", f"sort -rn {f}", "sort has no -x; numeric reverse is -rn"
    elif variant == "ls":
        ep.write(f"data/{random_name(rng)}.csv", "a,b\n")
        ep.write(f"data/{random_name(rng)}_old.csv", "a,b\n")
        ep.task("List the files in data/ in reverse alphabetical order.")
        bad, fix, why = "ls --sorted data", "ls -r data", "ls has no --sorted option; -r reverses the order"
    else:
        ep.task(f"Show the first 3 numbers in {f}.")
        bad, fix, why = f"head --count 3 {f}", f"head -n 3 {f}", "head has no --count; the line count flag is -n"
    out = ep.act("Run the command for the task.", bad, expect_fail=True)
    assert "option" in out, out
    ep.mark_recovery()
    ep.act(f"The error says the option is invalid: {why}.", fix)
    ep.finish("The corrected command printed the result.", f"Done with `{fix}`.")


def recovery_permission(ep, rng: random.Random) -> None:
    name = rng.choice(["build.sh", "run_tests.sh", "setup.sh"])
    word = random_name(rng)
    ep.write(name, f"#!/bin/sh\necho \"{name}: step 1 ok\"\necho \"{name}: {word} done\"\n", mode=0o644)
    ep.task(f"Run ./{name} and report its last line.")
    out = ep.act(f"Run ./{name}.", f"./{name}", expect_fail=True)
    assert "Permission denied" in out, out
    ep.mark_recovery()
    out = ep.act("Permission denied: the script is not executable. Add the execute bit and run it again.",
                 f"chmod +x {name} && ./{name}")
    last = out.strip().splitlines()[-1]
    ep.finish("The script ran after chmod.", f"The last line is: {last}")


def recovery_grep_case(ep, rng: random.Random) -> None:
    word = rng.choice(["error", "warning", "timeout"])
    log = f"{rng.choice(SERVICES)}.log"
    lines = []
    for i in range(rng.randint(5, 9)):
        if rng.random() < 0.4:
            lines.append(f"2024-05-{i + 1:02d} {word.upper()}: {random_name(rng)} {random_name(rng)} failed")
        else:
            lines.append(f"2024-05-{i + 1:02d} INFO: {random_name(rng)} ok")
    if not any(word.upper() in l for l in lines):
        lines.append(f"2024-05-30 {word.upper()}: {random_name(rng)} failed")
    ep.write(f"logs/{log}", "\n".join(lines) + "\n")
    ep.task(f"How many {word} lines are in logs/{log}? Show them too.")
    ep.act(f"Search logs/{log} for '{word}'.", f"grep -n {word} logs/{log}", expect_fail=True)
    ep.mark_recovery()
    out = ep.act("grep found nothing (exit code 1), but the log may use upper case. Search case-insensitively.",
                 f"grep -in {word} logs/{log}")
    n = len(out.splitlines())
    ep.finish(f"{n} matching lines.", f"logs/{log} has {n} {word} line(s) (written in upper case).")


# ---------------------------------------------------------------------------------------- explore + edit
def explore_replace(ep, rng: random.Random) -> None:
    flag = rng.choice(["DEBUG", "VERBOSE", "USE_CACHE", "DRY_RUN"])
    dirs = rng.sample(["src", "services", "tools", "web"], 2)
    n_on = 0
    for d in dirs:
        for i in range(rng.randint(1, 3)):
            on = rng.random() < 0.7
            n_on += on
            ep.write(f"{d}/{random_name(rng)}{i}.env", f"NAME={random_name(rng)}\n{flag}={'true' if on else 'false'}\nPORT={rng.randint(1000, 9999)}\n")
    if n_on == 0:
        ep.write(f"{dirs[0]}/extra.env", f"{flag}=true\n")
    ep.write("README.md", "env files live in subfolders\n")
    ep.task(f"Turn {flag} off (set it to false) in every .env file of this project and verify nothing still has it on.")
    out = ep.act("Find all .env files first.", "find . -name '*.env' | sort")
    out = ep.act(f"Which of them have {flag}=true?", f"grep -rl '{flag}=true' --include='*.env' . | sort")
    files = [l for l in out.splitlines() if l.startswith("./")]
    ep.act(f"{len(files)} file(s) have it on; replace true with false in them.",
           "sed -i 's/^" + flag + "=true$/" + flag + "=false/' " + " ".join(shlex.quote(f) for f in files))
    out = ep.act("Verify: count remaining true values (grep -c prints 0 per file).", f"grep -rc '{flag}=true' --include='*.env' . | sort")
    ok = all(l.endswith(":0") for l in out.splitlines())
    ep.finish("All counts are 0.", f"Set {flag}=false in {len(files)} file(s); no .env file has it on now.", success=ok)


def explore_count(ep, rng: random.Random) -> None:
    ext = rng.choice(["py", "sh", "txt"])
    n = 0
    for d in rng.sample(["lib", "app", "scripts", "docs"], 2):
        for i in range(rng.randint(1, 3)):
            k = rng.randint(0, 3)
            n += k
            body = "".join(f"# TODO: {random_name(rng)} {random_name(rng)}\n" if j < k else f"x{j} = {rng.randint(0, 9)}\n" for j in range(k + 2))
            ep.write(f"{d}/{random_name(rng)}_{i}.{ext}", body)
    if n == 0:  # grep exits 1 on no match; keep the task non-trivial
        ep.write(f"{d}/extra.{ext}", "# TODO: check this\n")
        n = 1
    ep.task(f"How many TODO comments are in the .{ext} files? Write the number to todo_count.txt.")
    ep.act(f"List the .{ext} files.", f"find . -name '*.{ext}' | sort")
    out = ep.act("Show every TODO line with its file and line number.", f"grep -rn 'TODO' --include='*.{ext}' . | sort")
    count = sum(1 for l in out.splitlines() if "TODO" in l)
    out = ep.act(f"I see {count} TODO lines; count them exactly with wc.", f"grep -r 'TODO' --include='*.{ext}' . | wc -l")
    real = int(out.strip())
    ep.act(f"wc confirms {real}; write it.", f"echo {real} > todo_count.txt && cat todo_count.txt")
    ep.finish("The count is written.", f"There are {real} TODO comments; saved to todo_count.txt.", success=real == n)


def explore_rename(ep, rng: random.Random) -> None:
    old = f"{rng.choice(['load', 'parse', 'fetch', 'build'])}_{random_name(rng)}"
    new = f"{old}_v2"
    files = []
    for i in range(rng.randint(2, 4)):
        f = f"pkg/{random_name(rng)}{i}.py"
        uses = rng.randint(0, 2) if i else 1
        body = (f"def {old}(x):\n    return x\n" if i == 0 else "from pkg import *\n") + "".join(f"y{j} = {old}({j})\n" for j in range(uses))
        ep.write(f, body)
        files.append(f)
    ep.task(f"Rename the function {old} to {new} everywhere in pkg/ and show the result.")
    out = ep.act(f"Find where {old} is used.", f"grep -rn '{old}' pkg | sort")
    hit_files = sorted({l.split(":")[0] for l in out.splitlines() if ":" in l})
    ep.act(f"{len(hit_files)} file(s) use it; rename with sed on word boundaries.",
           f"sed -i 's/\\b{old}\\b/{new}/g' " + " ".join(hit_files))
    out = ep.act("Verify: the old name should be gone.", f"grep -rn '\\b{old}\\b' pkg | wc -l")
    ep.act("Show the new definition.", f"grep -rn 'def {new}' pkg")
    ep.finish("The old name no longer appears.", f"Renamed {old} to {new} in {len(hit_files)} file(s).", success=out.strip() == "0")


def explore_largest(ep, rng: random.Random) -> None:
    names = rng.sample(WORDS, rng.randint(3, 5))
    sizes = rng.sample(range(10, 400), len(names))
    for n, k in zip(names, sizes):
        ep.write(f"data/{n}.bin", "x" * k)
    ep.write("archive/.keep", "")
    ep.task("Move the largest file in data/ into archive/ and show what is left in data/.")
    out = ep.act("Compare the file sizes in bytes, sorted.", "wc -c data/* | sort -n")
    rows = [l.split() for l in out.splitlines() if l.strip() and not l.strip().endswith("total")]
    largest = rows[-1][1]
    ep.act(f"The largest is {largest}; move it.", f"mv {largest} archive/")
    out = ep.act("Show the remaining files.", "ls data")
    ep.finish(f"{largest} moved.", f"Moved {largest} ({rows[-1][0]} bytes) to archive/; {len(out.splitlines())} file(s) remain in data/.",
              success=largest.split("/")[-1] not in out)


def explore_csv(ep, rng: random.Random) -> None:
    regions = ["north", "south", "east", "west"]
    target = rng.choice(regions)
    rows = [f"{i},{rng.choice(regions)},{rng.randint(10, 999)}" for i in range(1, rng.randint(8, 16))]
    if not any(f",{target}," in r for r in rows):
        rows.append(f"{len(rows) + 1},{target},{rng.randint(10, 999)}")
    ep.write("sales.csv", "id,region,amount\n" + "\n".join(rows) + "\n")
    n = sum(f",{target}," in r for r in rows)
    ep.task(f"Count the sales rows for the {target} region in sales.csv and write the count to answer.txt.")
    ep.act("Look at the header and first rows.", "head -n 3 sales.csv")
    out = ep.act(f"Region is the second column; count rows with ,{target},.", f"grep -c ',{target},' sales.csv")
    ep.act(f"The count is {out.strip()}; save it.", f"grep -c ',{target},' sales.csv > answer.txt && cat answer.txt")
    ep.finish("answer.txt holds the count.", f"{out.strip()} rows are in the {target} region; saved to answer.txt.", success=out.strip() == str(n))


FAMILIES = {
    "memory": [memory_config, memory_filename, memory_world],
    "error_recovery": [recovery_typo, recovery_missing_file, recovery_bad_flag, recovery_permission, recovery_grep_case],
    "explore_edit": [explore_replace, explore_count, explore_rename, explore_largest, explore_csv],
    **SHELL_FAMILIES,  # cd / export / background-job families (shell_families.py)
}
