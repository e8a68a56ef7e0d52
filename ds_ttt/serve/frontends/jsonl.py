"""The JSONL front end: one JSON request per line on stdin, one JSON response per line on stdout.

    .venv/bin/python -m ds_ttt.serve --model EXPORT [--device cpu] [--max-sessions 64] \
        [--attention-backend {auto,reference,cpu,cuda}]

(`python -m ds_ttt.serve` runs this module's `main`.) The protocol is ds_ttt/serve/service.py's
(reset / act / observe ... per named session; docs/serving.md). Logs go to stderr.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from ds_ttt.config import ATTENTION_BACKENDS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="export directory (launch/export.py) or training checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="reference",
                   help="attention kernel: reference (default), auto (cuda on a GPU, cpu kernel on a CPU), cpu, cuda")
    args = p.parse_args(argv)
    from ds_ttt.serve.service import Service
    from ds_ttt.serve.session import AgentModel

    agent = AgentModel.load(args.model, device=args.device, attention_backend=args.attention_backend)
    print(f"[ds_ttt.serve] ready: {args.model} on {args.device}; policy {agent.model.ttt.context_policy}, "
          f"attention {agent.attention_backend}", file=sys.stderr, flush=True)
    Service(agent, max_sessions=args.max_sessions).serve(sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
