"""Held-out evaluation (ttt vs frozen), the memory test, the fair comparison, and their reports.

  metrics.py      per-round metrics from the event loop's records (NLL, accuracy, exact matches, facts)
  runner.py       evaluate_model: every trajectory in ttt and frozen mode
  heldout.py      run_heldout: the evals/evaluate.py job (test split, exposure label, hashes, outputs)
  memory.py       run_memory_test: the evals/memory_test.py job (32 fresh memory worlds)
  report.py       results.json, summary.md, PNG plots
  intervals.py    Wilson intervals for rates, bootstrap intervals for token-weighted NLLs
  comparison.py   the fair comparison: held-out sets, per-model rows with intervals, paired differences
                  (evals/heldout_sets.py, evals/score_baseline.py, evals/baselines_report.py)
  closed_loop.py  the agent acts on held-out tasks in a sandbox; verifier.py runs each task's test where
                  the agent cannot have touched it; contamination.py compares a suite with the training corpus
See docs/evaluation.md.
"""
