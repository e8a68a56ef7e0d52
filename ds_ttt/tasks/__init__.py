"""The closed-loop task suite: held-out tasks with tests on their outcome, as a Harbor dataset.

  kinds.py    task kinds: the generator families' worlds and instructions (seen in training) and
              kinds training never shows; each with an outcome test and a reference solution
  checks.py   outcome checks (files, the final answer) and the verifier script they render to
  suite.py    instances on a split's seeds, written as Harbor tasks (evals/task_suite.py) and read back

The closed-loop runner that puts a model to work on them is ds_ttt/evaluation/closed_loop.py.
"""
