"""Held-out evaluation (ttt vs frozen), the memory test, and their reports.

  metrics.py   per-round metrics from the event loop's records (NLL, accuracy, exact matches, facts)
  runner.py    evaluate_model: every trajectory in ttt and frozen mode
  heldout.py   run_heldout: the evals/evaluate.py job (test split, exposure label, hashes, outputs)
  memory.py    run_memory_test: the evals/memory_test.py job (32 fresh memory worlds)
  report.py    results.json, summary.md, PNG plots
  adaptation.py  the issue-7 report (evals/adaptation_report.py): targets, current-round vs full context
See docs/evaluation.md.
"""
