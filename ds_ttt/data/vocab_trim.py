"""Trim the Qwen3 tokenizer to the tokens a corpus uses: a compact, reversible vocabulary for small models.

    tok_small, qwen3_ids = trim_tokenizer(tok, token_id_lists)     # qwen3_ids[new_id] = Qwen3 id
    tok_small.qwen3_ids is qwen3_ids                               # saved with it (save_tokenizer)

Why: a tiny CPU model with Qwen3's 151,936-row embedding and LM head spends almost all of its time
and parameters on tokens the corpus never uses (WorldTUI cut the table to a few hundred tokens).
We keep the byte-level BPE *algorithm* and cut its tables:

  kept tokens = the 256 byte-level symbols + every token id in the corpus + (closure) every token
                from which a kept token can be merged (all merge rules producing it); then all special tokens (new ids after the base)
  kept merges = the merges whose two parts and result are kept, in their original rank order

Properties (tested):
  * every text still encodes and decodes exactly (the 256 byte symbols are always there);
  * text made of corpus words tokenizes to exactly the same tokens as the full tokenizer: BPE
    applies, at each step, the lowest-ranked applicable merge; every merge the full tokenizer applied
    to a corpus word produced an ancestor of a kept token, so it is kept and still lowest-ranked;
  * unseen words fall back to shorter kept pieces (never to an unknown token);
  * new ids preserve Qwen3's order; `qwen3_ids` maps each new id back to its Qwen3 id.
"""

from __future__ import annotations

import json
from typing import Iterable

from tokenizers import Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def trim_tokenizer(tokenizer: PreTrainedTokenizerFast, corpus_ids: Iterable[Iterable[int]]
                   ) -> tuple[PreTrainedTokenizerFast, list[int]]:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"vocabulary trimming needs a BPE tokenizer, got {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    id_to_token = {i: t for t, i in vocab.items()}
    specials = sorted(spec["added_tokens"], key=lambda a: a["id"])
    special_ids = {a["id"] for a in specials}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    parents: dict[str, list[str]] = {}  # every way a token can be merged (BPE may take any of them)
    for a, b in merges:
        parents.setdefault(a + b, []).extend((a, b))

    keep = set(pre_tokenizers.ByteLevel.alphabet())
    missing = keep - set(vocab)
    if missing:
        raise ValueError(f"tokenizer lacks byte-level symbols {sorted(missing)[:5]}")
    for ids in corpus_ids:
        for i in ids:
            if i in special_ids:
                continue
            if i not in id_to_token:
                raise ValueError(f"token id {i} is not in the tokenizer's vocabulary")
            keep.add(id_to_token[i])
    stack = list(keep)
    while stack:  # closure: the pieces every kept token is merged from
        tok = stack.pop()
        for part in parents.get(tok, ()):
            if part not in keep:
                keep.add(part)
                stack.append(part)

    base = sorted(keep, key=lambda t: vocab[t])
    new_vocab = {t: i for i, t in enumerate(base)}
    qwen3_ids = [vocab[t] for t in base]
    for a in specials:
        a["id"] = len(qwen3_ids)
        qwen3_ids.append(next(s for s in tokenizer.added_tokens_decoder if tokenizer.added_tokens_decoder[s].content == a["content"]))
    model["vocab"] = new_vocab
    model["merges"] = [[a, b] for a, b in merges if a in keep and b in keep and a + b in keep]
    backend = Tokenizer.from_str(json.dumps(spec))
    init = {k: v for k, v in tokenizer.init_kwargs.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    trimmed = PreTrainedTokenizerFast(tokenizer_object=backend, **{k: str(v) for k, v in init.items() if v is not None})
    trimmed.chat_template = tokenizer.chat_template
    trimmed.qwen3_ids = qwen3_ids  # travels with the tokenizer: save_tokenizer writes qwen3_ids.json
    return trimmed, qwen3_ids
