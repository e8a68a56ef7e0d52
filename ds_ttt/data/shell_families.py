"""Task families whose later commands depend on shell state from an earlier one: a `cd`, an `export`, a job.

Registered in `families.FAMILIES` as "shell_state"; the generator (`generator.py`) picks them like any
other family. They only make sense in the sandbox's persistent shell (`ds_ttt.sandbox.Sandbox.run`: one bash
per episode), and each policy checks that the state really carried over (a later command relies on
it and its output is asserted), so a sandbox that started a fresh shell per command fails them:

  shell_cd          `cd` into a nested project directory once; later commands use paths relative to it,
                    and `pwd` shows it. A first `cd` to a misspelled directory fails and is corrected.
  shell_export      `export` a variable; two scripts run later read it from the environment.
  shell_background  start a job with `&` that waits for a flag file, see it in `jobs`, release it,
                    `wait` for it and read what it wrote.

Every output is deterministic for a seed: no PIDs or times are printed, and the background job waits
for the flag file, so `jobs` always shows it running. Run them alone with
`.venv/bin/python -c "from ds_ttt.data.generator import generate; print(generate(3, 0, workers=1, family='shell_state'))"`.
"""

from __future__ import annotations

import random

from .family_common import SERVICES, random_lines, random_name


def shell_cd(ep, rng: random.Random) -> None:
    proj = random_name(rng)
    sub = rng.choice(["src", "lib", "app"])
    files = sorted({f"{random_name(rng)}.py" for _ in range(rng.randint(2, 4))})
    for f in files:
        ep.write(f"projects/{proj}/{sub}/{f}", random_lines(rng, rng.randint(2, 9), "# "))
    ep.write(f"projects/{proj}/README.md", f"# {proj}\n")
    ep.write("projects/other/README.md", "# other\n")
    ep.task(f"Work inside projects/{proj}/{sub}: count the lines of each .py file there and write the total "
            f"to total.txt in that directory.")
    typo = f"projects/{proj}/{sub}s"
    out = ep.act("Change into the project directory first.", f"cd {typo}", expect_fail=True)
    assert "No such file or directory" in out, out
    ep.mark_recovery()
    ep.act(f"There is no {sub}s directory; the task says {sub}. cd there.", f"cd projects/{proj}/{sub} && pwd")
    out = ep.act("I am in the directory now; list the .py files.", "ls *.py")
    assert out.split() == files, (out, files)
    out = ep.act("Count the lines of each file (relative paths, as I am already here).", "wc -l *.py")
    total = int(out.splitlines()[-1].split()[0]) if len(files) > 1 else int(out.split()[0])
    out = ep.act(f"The total is {total}; write it here and check where it went.", f"echo {total} > total.txt && pwd && cat total.txt")
    assert out.splitlines()[-1] == str(total), out
    ep.finish("total.txt is in the project directory.", f"The .py files in projects/{proj}/{sub} have {total} lines; "
              f"saved to projects/{proj}/{sub}/total.txt.")


def shell_export(ep, rng: random.Random) -> None:
    var = rng.choice(["DEPLOY_ENV", "APP_MODE", "TARGET_REGION"])
    value = rng.choice(["staging", "canary", "eu-west", "prod-2"])
    svc = rng.choice(SERVICES)
    for script, verb in (("deploy.sh", "deploying"), ("status.sh", "status of")):
        ep.write(script, f"#!/bin/sh\nif [ -z \"${var}\" ]; then echo \"{script}: {var} is not set\" >&2; exit 2; fi\n"
                         f"echo \"{verb} {svc} to ${var}\"\n", mode=0o755)
    ep.task(f"Run ./deploy.sh and then ./status.sh for the {value} environment ({var}={value}).")
    out = ep.act("Run the deploy script.", "./deploy.sh", expect_fail=True)
    assert f"{var} is not set" in out, out
    ep.mark_recovery()
    ep.act(f"It needs {var} in the environment. Export it once for this shell.", f"export {var}={value}")
    out = ep.act("Now deploy again; the variable is exported.", "./deploy.sh")
    assert out.strip() == f"deploying {svc} to {value}", out
    out = ep.act("And the status script, in the same shell.", "./status.sh")
    assert out.strip() == f"status of {svc} to {value}", out
    ep.finish("Both scripts saw the exported variable.", f"Deployed {svc} to {value} ({var} exported) and checked its status.")


def shell_background(ep, rng: random.Random) -> None:
    word = random_name(rng)
    steps = rng.randint(2, 5)
    # After the flag the job lingers for a second: `touch go && wait %1` must find the job still running
    # (one that has already ended and been reported leaves the job table, and `wait %1` answers "no such
    # job", exit 127; seen in 2 of 300 trajectories on a loaded machine). The assertion below makes any
    # such episode fail loudly instead of recording a different trajectory.
    ep.write("build.sh", "#!/bin/sh\n# waits until the go flag exists, then builds\n"
                         "while [ ! -e go ]; do sleep 0.02; done\nsleep 1\n"
                         + "".join(f"echo \"step {i}: {word} ok\"\n" for i in range(1, steps + 1))
                         + "echo BUILD DONE\n", mode=0o755)
    ep.task("Start ./build.sh in the background with its output in build.log, check that it is running, "
            "then create the file go (it waits for it), wait for the build to finish and show the log.")
    ep.act("Start the build as a background job.", "./build.sh > build.log 2>&1 &")
    out = ep.act("Is the job running?", "jobs")
    assert "Running" in out and "./build.sh" in out, out
    out = ep.act("It waits for the go flag; create it and wait for the job.", "touch go && wait %1; echo \"exit $?\"")
    assert out.strip() == "exit 0", out
    out = ep.act("Show the log.", "cat build.log")
    assert out.splitlines()[-1] == "BUILD DONE", out
    ep.finish("The background build finished.", f"The build ran {steps} steps and ended with BUILD DONE.")


SHELL_FAMILIES = {"shell_state": [shell_cd, shell_export, shell_background]}
