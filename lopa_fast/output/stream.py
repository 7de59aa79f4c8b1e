"""`lopa_fast.stream`: the generated text as it becomes final, built on generate's per-round hook (`on_round=`).

    s = lopa_fast.stream(model, "Tom has 23 pens ...", tokenizer=tok, strategy="lopa", stop=["\\n\\n"])
    for piece in s:            # str pieces, append-only
        print(piece, end="", flush=True)
    s.text, s.result.stats     # the same text and stats as generate (lopa_fast.request.text.answer_text)

What is final: after every round the hook reports the accepted sequence's finalised prefix (the tokens before
its first mask; no later round changes them). The stream cuts it to whole blocks (`GenerateConfig.length_unit`:
block_size for d2f / lopa, block_length for threshold and LLaDA vanilla, one token for Dream vanilla and apd),
so a block's text is shown once it and every earlier block are complete, and to the requested length, the first
EOS and the first token-id stop. It decodes that whole prefix (never token by token: multi-byte characters and
merged tokens decode correctly) and yields the new suffix only when it extends what was yielded, holding back a
tail that a later token may still change (trailing whitespace, an unfinished character, the start of a text
stop). When decoding ends the rest of the final text is yielded: the concatenation of the pieces is `.text`.

Decoding runs in a worker thread (the hook cannot yield); closing the stream early (`break`, `.close()`) stops
decoding at the next round. Bad input raises from `stream(...)` itself, before any decoding.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import warnings

from lopa_fast import api
from lopa_fast.request import aliases, plan
from lopa_fast.config import GenerateConfig
from lopa_fast.request.model_defaults import with_model_knobs
from lopa_fast.output.progress import first_stop
from lopa_fast.request.prompts import prompt_lens
from lopa_fast.request.text import (
    answer_ids,
    answer_text,
    cut_at_text_stop,
    encode_prompt,
    held_back,
    split_stops,
    text_decoder,
)


class _Closed(Exception):
    """Raised inside the decoding thread's hook when the consumer closed the stream."""


class TextStream:
    """Iterator over str pieces of the generated text (see the module docstring).

    After the iteration ends: `.text` (the whole text, equal to the pieces joined), `.result` (the
    GenerateOutput: generated_ids, stats, trace; stats["finish_reason"] "stop" also when a text stop cut the
    text, with stats["stop_text"]), `.prompt_ids` (the encoded prompt, list[int]). Both are None before.
    `on_round(prefix, info)`, if given, runs in the consuming thread for every round, before that round's piece.
    The request is resolved once, here (lopa_fast.request.plan: bad input raises before any decoding), and the decoding
    thread runs that plan.
    """

    def __init__(self, model, ids, cfg: GenerateConfig, decode, text_stops: list[str], verifier=None, on_round=None,
                 engine=None, streamer=None, *, planned=None, unit: int | None = None):
        self._events: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        if planned is None:
            self._plan = plan.make(model, ids, cfg, verifier=verifier, on_round=self._report, streamer=streamer)
        else:  # a plan the caller resolved and checked already (the server's parse: validated once)
            self._plan = dataclasses.replace(planned, on_round=self._report)
        self._cfg, self._engine = self._plan.cfg, engine
        self._length = self._plan.length["requested"]
        self._decode, self._text_stops, self._on_round = decode, text_stops, on_round
        # the pieces' unit: the requested config's block (LLaDA vanilla without block_length: one token; bound, its
        # block_length is the whole generation)
        self._unit = max(1, unit if unit is not None else cfg.length_unit(self._plan.spec))
        self._eos = self._cfg.eos_token_id
        self._thread: threading.Thread | None = None
        self.prompt_ids = self._plan.ids.tolist()
        self.text: str | None = None
        self.result = None
        self._cut = (-1, "")  # (finalised length, its stable text) of the last round (`_stable_text`)
        self._iter = self._pieces()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._iter)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Stop decoding (at the next round) and wait for the decoding thread."""
        self._closed.set()
        self._iter.close()
        if self._thread is not None:
            self._thread.join()

    @classmethod
    def of_plan(cls, planned, decode, text_stops: list[str], unit: int, on_round=None, engine=None) -> "TextStream":
        """A stream of a plan resolved and checked by the caller (lopa_fast.request.plan.Plan; the server's parse
        builds it once). unit: the requested config's length unit (the pieces' unit)."""
        return cls(planned.model, None, None, decode, text_stops, on_round=on_round, engine=engine, planned=planned,
                   unit=unit)

    def run(self, emit) -> None:
        """Decode in the calling thread, without a thread of its own: every new piece goes to `emit(piece)` from
        the thread that runs the round (a batched request's: the engine's; `emit` must be thread-safe), the rest of
        the final text once decoding ends; then `.text` / `.result` are set. The per-round hook (`on_round`) runs
        there too, before the round's piece; an exception it raises ends decoding and propagates from here."""
        hook, shown = self._emitting(emit)
        self._finish(api.run_plan(dataclasses.replace(self._plan, on_round=hook), self._engine), shown[0], emit)

    @property
    def on_engine(self) -> bool:
        """Whether the engine given covers this request (`submit` hands it over; lopa_fast.api.on_engine)."""
        return api.on_engine(self._plan, self._engine)

    def submit(self, emit, on_end) -> None:
        """`run` without blocking, for a request `on_engine`: the plan goes to the engine in ONE hand-off
        (BatchEngine.submit) and this returns at once. The engine thread calls `emit(piece)` as `run` does, and when
        the request ends sets `.text` / `.result`, emits the rest and calls `on_end(None)`, or `on_end(error)`: the
        request's own exception (the per-round hook's included). Both must be thread-safe and must not block."""
        hook, shown = self._emitting(emit)
        p = self._plan

        def done(out, error):
            if error is None:
                try:
                    self._finish(api.finish_output(p, out, batched=True), shown[0], emit)
                except Exception as e:  # noqa: BLE001 - e.g. the tokenizer's decoding: this request's error
                    error = e
            on_end(error)

        self._engine.submit(p.ids, p.cfg, hook, p.verifier, spec=p.spec, on_done=done)

    def _emitting(self, emit) -> tuple:
        """(the per-round hook that emits each new piece, [the text shown so far])."""
        shown = [""]

        def hook(prefix, info):
            if self._on_round is not None:
                self._on_round(prefix, info)
            text = self._stable_text(prefix)
            if len(text) > len(shown[0]) and text.startswith(shown[0]):
                emit(text[len(shown[0]) :])
                shown[0] = text

        return hook, shown

    def _finish(self, out, shown: str, emit) -> None:
        """Decoding ended with `out`: `.result`, `.text`, and the text not shown yet to `emit`."""
        self.result = out
        self.text = answer_text(out, self._decode, self._eos, self._text_stops)
        self._closed.set()
        self._iter.close()
        rest = self._rest(shown)
        if rest:
            emit(rest)

    def _rest(self, shown: str) -> str:
        """What of the final `.text` is not shown yet (a warning when the shown pieces are not its prefix)."""
        if self.text.startswith(shown):
            return self.text[len(shown) :]
        # the tokenizer's decoding was not prefix-stable: the pieces already shown cannot be taken back
        warnings.warn(f"stream: the text shown ({shown!r}) is not a prefix of the final text ({self.text!r}); the "
                      "tokenizer's decoding changed earlier characters", RuntimeWarning, stacklevel=3)
        return ""

    # ---- the worker ------------------------------------------------------------------------------------
    def _report(self, prefix, info) -> None:
        """The plan's progress hook (the decoding thread): the round to the consumer, or stop when it closed."""
        if self._closed.is_set():
            raise _Closed
        self._events.put(("round", prefix, info))

    def _run(self, events: queue.Queue) -> None:
        try:
            out = api.run_plan(self._plan, self._engine)
            events.put(("done", out, None))
        except _Closed:
            events.put(("closed", None, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread, raised there
            events.put(("error", e, None))

    def _stable_text(self, prefix: list[int]) -> str:
        """The text of a finalised prefix that no later round can change, cut as the module docstring says."""
        n = min(len(prefix) // self._unit * self._unit, self._length)
        if n == self._cut[0]:  # no new whole block: the same ids, the same text (not decoded again every round, on
            return self._cut[1]  # the engine's thread that steps every request)
        ids = answer_ids(prefix[:n], self._eos)
        if self._cfg.stop:
            at = first_stop(ids, self._cfg.stop)
            ids = ids if at is None else ids[:at]
        text, hit = cut_at_text_stop(self._decode(ids), self._text_stops)
        self._cut = (n, text if hit is not None else held_back(text, self._text_stops))
        return self._cut[1]

    def _pieces(self):
        events = self._events
        self._thread = threading.Thread(target=self._run, args=(events,), name="lopa_fast.stream", daemon=True)
        self._thread.start()
        shown = ""
        try:
            while True:
                kind, a, b = events.get()
                if kind == "round":
                    if self._on_round is not None:
                        self._on_round(a, b)
                    text = self._stable_text(a)
                    if len(text) > len(shown) and text.startswith(shown):
                        piece, shown = text[len(shown) :], text
                        yield piece
                    continue
                if kind == "error":
                    raise a
                if kind == "closed":
                    return
                self.result = a
                self.text = answer_text(a, self._decode, self._eos, self._text_stops)
                rest = self._rest(shown)
                if rest:
                    yield rest
                return
        finally:
            self._closed.set()
            self._thread.join()


def stream(model, prompt, tokenizer=None, *, chat: bool = False, stop=None,
           verifier=None, on_round=None, engine=None, **knobs) -> TextStream:
    """Stream the generated text of one prompt (module docstring). Returns a TextStream (iterate it for str pieces;
    then `.text` and `.result` hold generate's text and output).

    model:      a DecoderLM (lopa_fast.load_model).
    prompt:     text (str; encoded with `tokenizer`, or its chat template with chat=True; empty or
                whitespace-only text is a KnobError, unknown words are warned about) or token ids (a list of ints /
                LongTensor [P] / [1, P], as generate takes).
    tokenizer:  the model's tokenizer (lopa_fast.load_tokenizer); required (the text is decoded with it).
    stop:       stop strings (text) and / or token-id sequences, e.g. ["\\n\\n", [13, 198]] (lopa_fast.request.text
                .split_stops: a text stop ends decoding early when the model emits its tokenisation, and cuts the
                text at its first occurrence in any case).
    verifier, on_round: as generate's (on_round runs in the consuming thread).
    streamer:   as generate's (a TextStreamer-style put() / end() object, driven from the decoding thread).
    engine:     a lopa_fast.decode.batch.BatchEngine shared by concurrent streams (the server): a request it covers
                decodes in its running batch, with the same result (lopa_fast.api.generate_with_config).
    **knobs:    every knob of lopa_fast.generate (strategy, backend, max_new_tokens, ...).
    """
    if tokenizer is None:
        raise TypeError("stream(): tokenizer= is required (the model's tokenizer, lopa_fast.load_tokenizer(dir))")
    if on_round is not None and not callable(on_round):
        raise TypeError(f"on_round: {type(on_round).__name__}; expected a callable on_round(prefix, info) or None")
    if "stop_strings" in knobs:  # HF's text stops: the same as text items of stop=
        stop = api._with_stop_strings(stop, knobs.pop("stop_strings"))
    ids = encode_prompt(tokenizer, prompt, chat) if isinstance(prompt, str) else prompt
    seqs, texts = split_stops(tokenizer, stop)
    streamer = knobs.pop("streamer", None)
    knobs = aliases.translate(knobs, prompt_lens(ids) if {"max_length", "attention_mask"} & set(knobs) else None)
    if knobs.get("stop"):  # a list eos_token_id's extra ids: one-token stops beside the text ones
        seqs = [*(seqs or []), *knobs.pop("stop")]
    names = {f.name for f in dataclasses.fields(GenerateConfig)}
    bad = sorted(set(knobs) - names)
    if bad:
        raise aliases.unknown_knobs_error("stream", bad, names)
    knobs = with_model_knobs(model, knobs)  # the model's own knobs where none is given (request.model_defaults)
    api.check_streamer(streamer)
    return TextStream(model, ids, GenerateConfig(**knobs, stop=seqs), text_decoder(tokenizer), texts,
                      verifier=verifier, on_round=on_round, engine=engine, streamer=streamer)
