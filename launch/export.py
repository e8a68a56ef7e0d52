"""Export a training checkpoint (or re-export an export) to a Hugging Face directory for serving.

    .venv/bin/python launch/export.py --checkpoint RUN --out EXPORT [--max-shard-size 5GB] [--dtype bfloat16]

EXPORT gets config.json, model-*.safetensors + model.safetensors.index.json (standard Qwen3 names;
`transformers.AutoModelForCausalLM.from_pretrained(EXPORT)` loads the backbone), prime.safetensors +
ttt_config.json (fast weights W_0, TTT settings, provenance) and the tokenizer with its chat template.
Load it back with `ds_ttt.loading.load_export(EXPORT)`; serve it with `python -m ds_ttt.serve --model EXPORT`.
Layout and guarantees: ds_ttt/export.py, docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training run / checkpoint directory, or an export")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-shard-size", default="5GB", help="largest backbone shard (e.g. 5GB, 500MB); default 5GB")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast the weights (default: keep the checkpoint's dtype)")
    args = p.parse_args(argv)
    import torch

    from ds_ttt.export import export_checkpoint

    summary = export_checkpoint(args.checkpoint, args.out, max_shard_size=args.max_shard_size,
                                dtype=getattr(torch, args.dtype) if args.dtype else None)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
