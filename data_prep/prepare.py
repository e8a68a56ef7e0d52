"""Import raw trajectories, validate, render, capacity-filter, split and write a verified manifest.

    python data_prep/prepare.py --inputs PATHS... --out DIR [--capacity N] [--test-fraction F] [--seed S]
                                [--allow-rejects] [--model DIR] [--hub-pin PIN.json [--hub-mirror URL|DIR]]
                                [--trim-vocab] [--train-only PATHS...]

PATHS: ATIF *.json (continuations `*.cont-N.json` beside their parent), Terminus-2 trial folders,
OpenAI-messages / canonical *.jsonl, or folders of these (such as the folder data_prep/generate.py
wrote: of a trajectory found twice with the same content, the canonical JSONL copy is kept; the same id
with different content is rejected). With --hub-pin the pinned files are downloaded (sha256-verified)
into DIR/raw/ first and imported too. Exit status 1 when any record was rejected (the error names the
file, line and step of each; all are in DIR/rejects.jsonl) unless --allow-rejects; 2 on a hub error.
"""

import sys

from ds_ttt.data.cli import prepare_main

if __name__ == "__main__":
    sys.exit(prepare_main(description=__doc__))
