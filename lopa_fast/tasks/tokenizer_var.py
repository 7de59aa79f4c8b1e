"""The tokenizer of `arith-var`: one word-level tokenizer for both embedded tasks.

Its first ids are the `arith` tokenizer's vocabulary unchanged (`lopa_fast.tasks.tokenizer.vocab()`: the 4
special tokens, the ten digits, the 51 words of `arith`: ids 0-64), followed by the words only `arith-var`
emits, sorted (ids 65 and up). So every `arith` text encodes to the same ids under both tokenizers, and the
shipped `d2f-arith` / `ar-arith` models (embedding of 65 rows) keep working on `arith` text with this
tokenizer; an `arith-var` solution contains ids >= 65, which those models cannot embed: `arith-var` needs a
model trained with this vocabulary (issue 12's `d2f-arith-var`). The shipped assets are not changed.

Same pre-tokenizer (whitespace split, every digit a token), same special ids and chat template as
`tokenizer.py`; `model_max_length` is raised to 256 (prompt <= 32 tokens + solution <= 128 tokens incl. EOS).
The appended words are the frozen list `VAR_WORDS` (new phrasings append their new words at its end).
"""
from __future__ import annotations

from pathlib import Path

from lopa_fast.tasks import tokenizer as base

EOS_ID, MASK_ID, BOS_ID, UNK_ID = base.EOS_ID, base.MASK_ID, base.BOS_ID, base.UNK_ID


# The words `arith-var` adds to the `arith` vocabulary (ids 65, 66, ...), frozen: a new phrasing's new words go at
# the end of this list, so that the ids of a trained model's vocabulary never move (tests: no word of
# `arith_var.task_words()` is missing, and no word here is unused). The list was rebuilt once, before any
# arith-var model shipped, when the phrasings stopped naming the prompt's person / item / container.
VAR_WORDS = (
    ",", "Adding", "In", "Let", "So", "Taking", "The", "There", "To", "We", "Without", "a", "after", "all",
    "answer", "any", "are", "at", "before", "by", "count", "end", "find", "first", "from", "go", "gone", "groups",
    "hold", "how", "is", "it", "keep", "leaves", "left", "losing", "make", "mind", "number", "of", "one", "order",
    "out", "point", "remain", "since", "so", "start", "step", "that", "the", "them", "then", "there", "this",
    "time", "total", "us", "want", "we", "which", "work",
)


def vocab() -> dict[str, int]:
    """token -> id: `tokenizer.vocab()` unchanged, then `VAR_WORDS`."""
    v = dict(base.vocab())
    for w in VAR_WORDS:
        v[w] = len(v)
    return v


def build_tokenizer():
    """A `tokenizers.Tokenizer` over `vocab()` (as `tokenizer.build_tokenizer`, with the larger vocabulary)."""
    return base.word_level_tokenizer(vocab())


TOKENIZER_CONFIG = {**base.TOKENIZER_CONFIG, "model_max_length": 256}


def save_tokenizer(path: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json into `path` (created if missing)."""
    base.save_tokenizer(path, build_tokenizer, TOKENIZER_CONFIG)


encode_problem = base.encode_problem  # (prompt ids with bos, solution + EOS padded to gen_len); any tokenizer
