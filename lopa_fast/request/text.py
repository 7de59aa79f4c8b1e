"""Text in, text out: the pieces every text entry point shares (`lopa_fast.stream`, the CLI, the lm-eval model, the
server): prompts encoded (`encode_prompt`), stops split (`split_stops`), outputs decoded (`answer_text`)."""
from __future__ import annotations

import re
import warnings

from lopa_fast.errors import KnobError


def text_decoder(tokenizer):
    """ids -> text: `tokenizer.decode(ids, skip_special_tokens=True)`. How text is spelled belongs to the tokenizer
    (the embedded tokenizers' own decoder joins the digits they split), whatever path the model came from."""

    def decode(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return decode


def unknown_words(tokenizer, text: str) -> list[str]:
    """The words of `text` the tokenizer maps to its unknown token (empty when it has none or maps everything)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    words = [text[a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if t == unk]
    return list(dict.fromkeys(w for w in words if w))


def check_text_prompt(text, where: str = "prompt") -> str:
    """A text prompt as given, or KnobError (knob "prompt") when it is not a str, or empty / only whitespace."""
    if not isinstance(text, str):
        raise TypeError(f"{where}: {type(text).__name__}; expected text (str)")
    if not text.strip():
        raise KnobError(f"{where}: the prompt is empty (or only whitespace)", knob="prompt", value=text)
    check_unicode(text, where)
    return text


def max_token_chars(tokenizer) -> int:
    """The longest token of the tokenizer's vocabulary, in characters (byte-level BPE: in bytes; cached on the
    tokenizer): a text of n characters encodes to at least n / max_token_chars tokens, so a text too long for
    max_model_len tokens is known before it is tokenised (barring an unknown-word token that covers a whole word)."""
    n = getattr(tokenizer, "_lopa_fast_max_token_chars", None)
    if n is None:
        n = max((len(t) for t in tokenizer.get_vocab()), default=1)
        try:
            tokenizer._lopa_fast_max_token_chars = n
        except AttributeError:
            pass
    return max(1, n)


def check_unicode(text: str, where: str = "prompt") -> None:
    """KnobError (knob "prompt") naming the first lone UTF-16 surrogate of `text` (JSON's "\\ud800" decodes to one;
    no tokenizer can encode it, and its own message does not say where it is)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KnobError(f"{where}: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}; allowed: "
                        "valid Unicode text (a surrogate only as half of an escaped pair)", knob="prompt",
                        value=text[e.start])


def encode_prompt(tokenizer, text: str, chat: bool = False, *, warn=None) -> list[int]:
    """Token ids of a text prompt: the tokenizer's own special tokens (e.g. bos), or (chat=True) its chat
    template with one user message and the generation prompt. Empty / whitespace-only text: KnobError. Words
    the tokenizer does not know are reported through `warn(message)` (default: a UserWarning) by name."""
    check_text_prompt(text)
    missing = unknown_words(tokenizer, text)
    if missing:
        (warn or (lambda m: warnings.warn(m, UserWarning, stacklevel=3)))(unknown_note(tokenizer, missing))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise KnobError("chat=True: the model's tokenizer has no chat template (tokenizer_config.json "
                            "'chat_template' or chat_template.jinja)", knob="chat", value=True)
        return chat_ids(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])


UNKNOWN_NOTE = "word(s) unknown to the tokenizer"  # unknown_note's mark: that note quotes prompt text


def unknown_note(tokenizer, words: list[str]) -> str:
    """The warning about `words` the tokenizer does not know (`unknown_words`), naming them."""
    return (f"{len(words)} {UNKNOWN_NOTE} (encoded as {tokenizer.unk_token!r}): "
            + ", ".join(repr(w) for w in words))


def generation_prompt(tokenizer) -> str:
    """The text the chat template appends for `add_generation_prompt=True` (the embedded models': "Answer :"), found
    by rendering one message with and without it; "" when the template adds nothing or renders the message
    differently."""
    msg = [{"role": "user", "content": "x"}]
    try:
        with_gp = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(msg, add_generation_prompt=False, tokenize=False)
    except Exception:  # a template that needs other roles or fields: no suffix to compare
        return ""
    return with_gp[len(without):] if with_gp.startswith(without) else ""


def without_generation_prompt(tokenizer, messages: list[dict]) -> list[dict]:
    """`messages` with the generation prompt cut from the end of the last user message when it already ends with it:
    the embedded template appends "Answer :", and the task's own prompts (lopa_fast.tasks) end with "Answer :" too, so
    without the cut the model sees "... Answer : Answer :" and answers "#### #### 2" (issue 42, finding 1)."""
    gp = generation_prompt(tokenizer).strip()
    if not gp or not messages or messages[-1].get("role") != "user":
        return messages
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content.rstrip().endswith(gp) or not content.rstrip()[: -len(gp)].strip():
        return messages
    return [*messages[:-1], {**messages[-1], "content": content.rstrip()[: -len(gp)].rstrip()}]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` ({role, content} dicts) under the tokenizer's chat template, with the generation
    prompt (said once: `without_generation_prompt`)."""
    messages = without_generation_prompt(tokenizer, messages)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding on some transformers versions
        ids = ids["input_ids"]
    return list(ids)


def split_stops(tokenizer, stop) -> tuple[list[list[int]] | None, list[str]]:
    """(token-id stop sequences for generate's `stop=`, text stop strings) from a text entry point's `stop=`:
    a list whose str items are text stops and whose list-of-int items are token-id stops (None: no stops).

    A text stop is used twice: its tokenisation (`add_special_tokens=False`, unless it holds the unknown token)
    joins the token-id stops, so decoding ends early when the model emits exactly those tokens (the one stop
    mechanism of `generate`), and the decoded text is cut at the string's first occurrence (`answer_text`), so a
    stop string the model produced with other tokens (e.g. merged into a longer token) still ends the text."""
    if stop is None:
        return None, []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not stop:
        raise TypeError(f"stop={stop!r}; expected a non-empty list of stop strings and/or token-id sequences")
    seqs: list[list[int]] = []
    texts: list[str] = []
    unk = getattr(tokenizer, "unk_token_id", None)
    for item in stop:
        if isinstance(item, str):
            if item == "":
                raise KnobError("stop: an empty stop string; allowed: non-empty text", knob="stop", value=item)
            texts.append(item)
            ids = list(tokenizer(item, add_special_tokens=False)["input_ids"])
            if ids and (unk is None or unk not in ids) and list(ids) not in seqs:
                seqs.append(ids)
        elif isinstance(item, (list, tuple)):
            seqs.append(list(item))  # checked by GenerateConfig.validate (ids, lengths, count)
        else:
            raise TypeError(f"stop item {item!r} ({type(item).__name__}); expected a str or a list of token ids")
    return (seqs or None), texts


def cut_at_text_stop(text: str, stops) -> tuple[str, str | None]:
    """(text before the earliest text stop, that stop or None; at one position the first listed)."""
    found = [(i, s) for s in stops or () if (i := text.find(s)) >= 0]
    if not found:
        return text, None
    i, s = min(found, key=lambda f: f[0])  # min keeps the first of equal keys
    return text[:i], s


def held_back(text: str, stops) -> str:
    """`text` less a tail that may still turn into a text stop (a proper prefix of one ends the text) or that a
    later token may rewrite (trailing whitespace; an unfinished multi-byte character, decoded as U+FFFD)."""
    text = re.sub("\ufffd+$", "", text)
    for s in stops or ():
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                text = text[:-k]
                break
    return text.rstrip()


def answer_ids(ids: list[int], eos_token_id: int | None) -> list[int]:
    """The generated ids before the first EOS (all of them without one)."""
    return ids[: ids.index(eos_token_id)] if eos_token_id is not None and eos_token_id in ids else list(ids)


def answer_text(out, decode, eos_token_id: int | None, text_stops=()) -> str:
    """The text of a GenerateOutput: ids before the first EOS, `decode`d, cut before the first text stop. A text
    cut sets stats["finish_reason"] = "stop" and stats["stop_text"] (the string) on `out`."""
    text, hit = cut_at_text_stop(decode(answer_ids(out.generated_ids, eos_token_id)), text_stops)
    if hit is not None:
        out.stats["finish_reason"] = "stop"
        out.stats["stop_text"] = hit
    return text
