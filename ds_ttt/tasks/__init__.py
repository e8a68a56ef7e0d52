"""The closed-loop task suite: held-out tasks with tests on their outcome, as a Harbor dataset.

  kinds.py    task kinds: the generator families' worlds and instructions (seen in training) and
              kinds training never shows; each with an outcome test and a reference solution
  checks.py   exact outcome checks (files, the final answer) and the verifier script they render to
  suite.py    instances on a split's seeds, written as Harbor tasks (evals/task_suite.py) and read back
  blind_policies.py  agents that never read an observation (the gate: each must fail every task) and
              blind replays of other instances' solutions (which tasks and kinds need the observation)

The closed-loop runner that puts a model to work on them is ds_ttt/evaluation/closed_loop.py.
"""
