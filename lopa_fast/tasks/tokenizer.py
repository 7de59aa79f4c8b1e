"""The task's word-level tokenizer, in the `tokenizers` library's tokenizer.json format.

Vocabulary: 4 special tokens, the ten digits (numbers are split into single digits, as Qwen's
tokenizer does), then every word and symbol the templates can emit, in sorted order. The text
already separates words and punctuation by spaces, so the pre-tokenizer is a whitespace split
followed by a per-digit split. The decoder (tokenizer.json's own, so it holds wherever the model is loaded from:
the CLI, `lopa_fast.stream`, lm-eval, the server) joins tokens with spaces and digits without them: "23" encodes
as "2", "3" and decodes as "23" again.

Special ids are fixed: 0 <|endoftext|> (eos = pad, as in Dream), 1 <|mask|>, 2 <|beginoftext|>
(bos, prepended by `encode_prompt`, like Dream's add_bos_token=true), 3 <|unk|>.
"""
from __future__ import annotations

import json
from pathlib import Path

from lopa_fast.tasks import arith

EOS, MASK, BOS, UNK = "<|endoftext|>", "<|mask|>", "<|beginoftext|>", "<|unk|>"
SPECIAL_TOKENS = [EOS, MASK, BOS, UNK]
EOS_ID, MASK_ID, BOS_ID, UNK_ID = 0, 1, 2, 3


def task_words() -> list[str]:
    """Every non-digit word the task can emit, sorted (rendered from every template/name/item/container)."""
    words: set[str] = set()
    for template in arith.TEMPLATES:
        for name, pron in arith.NAMES:
            for item in arith.ITEMS:
                for container in arith.CONTAINERS:
                    p = arith.render(template, 23, 4, 6, 17, name, pron, item, container)
                    words.update(p.prompt.split())
                    words.update(p.solution.split())
    return sorted(w for w in words if not w.isdigit())


def vocab() -> dict[str, int]:
    """token -> id."""
    toks = SPECIAL_TOKENS + [str(i) for i in range(10)] + task_words()
    return {t: i for i, t in enumerate(toks)}


def digit_joining_decoder():
    """tokenizer.json's decoder: tokens joined by single spaces (WordPiece with a prefix no token has, so every
    token but the first gets a space), then the space between two digits removed: ["x", "=", "4", "9"] -> "x = 49".
    Without it a path-loaded model decoded "4 9" and an lm-eval answer "49" scored 0."""
    from tokenizers import Regex, decoders

    return decoders.Sequence([decoders.WordPiece(prefix="\x00##", cleanup=False), decoders.Fuse(),
                              decoders.Replace(Regex(r"(?<=\d) (?=\d)"), "")])


def word_level_tokenizer(token_ids: dict[str, int]):
    """A `tokenizers.Tokenizer` over `token_ids` (word-level, digits split individually, the special tokens,
    bos prepended, the digit-joining decoder); both tasks' tokenizers are this over their vocabularies."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=token_ids, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = digit_joining_decoder()
    # bos is prepended to every encoded text (Dream's add_bos_token=true); encode targets with
    # add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    return tok


def build_tokenizer():
    """This task's tokenizer (`word_level_tokenizer` over `vocab()`)."""
    return word_level_tokenizer(vocab())


# A minimal chat template (so `--chat` and chat entry points can be tested on the embedded model): bos, each user
# message's text, each assistant message as "Answer : <text> <eos>", and "Answer :" as the generation prompt (the
# task's answer cue). Words outside the task's vocabulary still encode as <|unk|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ 'Answer : ' + message['content'] + ' ' + eos_token + ' ' }}{% else %}{{ message['content'] + ' ' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Answer :' }}{% endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "unk_token": UNK,
    "mask_token": MASK,
    "add_bos_token": True,
    "model_max_length": 128,
    "chat_template": CHAT_TEMPLATE,
}


def save_tokenizer(path: str | Path, build=None, config: dict | None = None) -> None:
    """Write tokenizer.json + tokenizer_config.json into `path` (created if missing); `build` / `config`
    default to this task tokenizer's (another task's tokenizer passes its own)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (build or build_tokenizer)().save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(TOKENIZER_CONFIG if config is None else config, f, indent=2)


def encode_problem(tok, problem, gen_len: int) -> tuple[list[int], list[int]]:
    """(prompt ids with the leading bos, target ids of length `gen_len`: the solution, then EOS up to
    gen_len, as Dream pads its generation region). `tok` is a `tokenizers.Tokenizer`."""
    prompt = tok.encode(problem.prompt).ids
    target = tok.encode(problem.solution, add_special_tokens=False).ids + [EOS_ID]
    if len(target) > gen_len:
        raise ValueError(f"encode_problem: solution needs {len(target)} tokens > gen_len={gen_len}")
    return prompt, target + [EOS_ID] * (gen_len - len(target))
