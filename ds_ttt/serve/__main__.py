"""`python -m ds_ttt.serve --model EXPORT ...`: the JSONL front end (ds_ttt/serve/frontends/jsonl.py).

The other front ends run as their own modules: `python -m ds_ttt.serve.frontends.http` (OpenAI-compatible
HTTP) and `python -m ds_ttt.serve.frontends.task_cli` (one sandboxed episode); docs/serving.md.
"""

import sys

from ds_ttt.serve.frontends.jsonl import main

if __name__ == "__main__":
    sys.exit(main())
