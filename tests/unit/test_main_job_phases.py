"""benchmarks/main_job_phases.py: the phases of a main-job log, and a clear error for an unfinished one."""

import importlib.util
import pathlib

import pytest

SPEC = importlib.util.spec_from_file_location(
    "main_job_phases", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "main_job_phases.py")
phases_mod = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(phases_mod)

LOG = """
=== [0 s] 1/8 generate 300 trajectories
generated
=== [21 s] 2/8 prepare the manifest
=== [27 s] 3/8 meta-train: 2 CPU ranks
train: 100%
=== [900 s] 4/8 evaluate the manifest's held-out split
=== [910 s] 5/8 the model's score on the held-out sets
=== [1080 s] 6/8 and 7/8: export and the closed loop (beside steps 4 and 5)
=== [900 s] 6/8 export for serving
=== [905 s] 7/8 closed-loop held-out tasks
=== [1085 s] 8/8 report
=== [1088 s] done in 1088 s (with setup: 19.0 min)
"""


def test_phases_of_a_finished_job():
    rec = phases_mod.phases(LOG, "x\nwritten and blind-checked in 401 s; 204 tasks\n")
    assert (rec["generate_seconds"], rec["prepare_seconds"], rec["train_seconds"]) == (21, 6, 873)
    assert rec["after_training_seconds"] == 185 and rec["main_seconds"] == 1088
    assert rec["task_suite_seconds"] == 401
    assert rec["progress_lines"][0] == "[0 s] 1/8 generate 300 trajectories" and len(rec["progress_lines"]) == 10


def test_an_unfinished_job_is_refused_naming_the_missing_steps(tmp_path):
    cut = LOG.split("=== [900 s] 4/8")[0]
    with pytest.raises(ValueError, match="4/8, 8/8, done"):
        phases_mod.phases(cut)
    log = tmp_path / "main.log"
    log.write_text(cut)
    assert phases_mod.main([str(log), "--what", "a test"]) == 1
