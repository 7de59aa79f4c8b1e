"""The driver protocol: what the one decoding loop (`lopa_fast.decode.batch.Scheduler.step`) asks of a request.

Every fast request, solo or batched, eager or compiled, one process or distributed, is a driver stepped by the
scheduler: a solo request is a batch of one (`batch.run_solo`), compile=True is the compiled batch step of batch
bucket 1 (lopa_fast.decode.compiled_batch). A driver is built by its strategy's spec as
`driver(model, prompt [P], cfg, cache=(k, v) views of its KV pool slot, **extra)` (extra: verifier= for a spec with
`check_models`) and then runs as

    begin(on_round)                       once: the clock, the first plan (and its host read)
    loop:  bucket = next_bucket()         None: finished (done, a stop, the round cap)
           compiled: st = batch_step(*bucket) (a BatchStep, or None for an eager round), the group's graph runs,
                     take(state, info)
           eager:    w = prepare(*bucket); per forward of forwards(w): forward_args(w) -> one shared
                     `forward_requests`, then finish(w, logits, k_win, v_win)
           read_head()                    the round's one host read (inside the round's scope)
           after_round()                  guard, counters, trace, hook, stop test (outside the scope)
    result()                              -> GenerateOutput

`Driver` below is that contract as one definition (the stages above and `use_cache`; `CompiledDriver` adds the two
compiled-round members); the optional members' defaults live here too (`forwards_of`, `batch_step_of`), so the
loop has one place that knows them.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from lopa_fast.output import GenerateOutput


@runtime_checkable
class Driver(Protocol):
    """One request of a fast strategy as the scheduler steps it (module docstring). Buckets are host tuples (the
    round's shapes and plan: e.g. (Nb, Rb, s) for d2f / lopa, (first, curr, left, right) for APD)."""

    def begin(self, on_round=None) -> None:
        """Start the request: the clock, the first plan. on_round: the progress hook, called after every round
        (lopa_fast.output.progress.report_round) or None."""

    def next_bucket(self) -> tuple | None:
        """The coming round's bucket (host ints), or None when the request has finished. Raises the request's own
        error found by the last round (non-finite logits, its round cap under on_round_cap="error")."""

    def prepare(self, *bucket) -> dict:
        """An eager round's working dict `w` on `bucket`: the inputs of its first forward and what `finish` needs."""

    def forward_args(self, w: dict) -> dict:
        """This request's part of the coming forward's `model.forward_requests`: tokens [NB, Nb], start, cache_k /
        cache_v [layers, Lc, Hkv, D], prefix_len, win_lens [NB], bids [NB, Nb] or None, rows [R] (flat rows that get
        the LM head), optionally output="hidden"."""

    def finish(self, w: dict, logits: torch.Tensor, k_win: torch.Tensor | None, v_win: torch.Tensor | None) -> None:
        """After one of the round's forwards: this request's logits [R, V] (hidden rows [R, H] with output="hidden")
        and window K/V [layers, NB, Nb, Hkv, D]; the last forward's finish completes the round on the device."""

    def read_head(self) -> None:
        """The round's one device-to-host read (the next plan's head)."""

    def after_round(self) -> None:
        """After the round's scope: the guard's refusal, counters, trace entry, progress hook, stop test."""

    def result(self) -> GenerateOutput:
        """Stop the clock; the output ids, stats and trace."""

    def use_cache(self, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Point the request's static cache at (re-pointed) pool slot views [layers, cache_rows, Hkv, D]."""


@runtime_checkable
class CompiledDriver(Driver, Protocol):
    """A driver whose spec says `compile_batches`: its compiled rounds run as batched graphs."""

    def batch_step(self, *bucket) -> Any:
        """The coming round as a lopa_fast.decode.compiled_batch.BatchStep, or None when it runs eagerly (compile
        off, or a prefill round whose shapes depend on the prompt)."""

    def take(self, state: dict, info: dict) -> None:
        """The compiled round's result for this request (its state tensors, its info); `read_head` follows."""


def forwards_of(dec, w: dict, model) -> tuple:
    """The forwards of `dec`'s eager round `w` as ((model, attention mask, attention backend), ...) in order: its
    own `forwards(w)` (APD: drafter then verifier; threshold's dual step: an in-place stand-in), else one forward of
    the scheduler's `model` with the driver's `mode` / `attn_backend` (the one-forward drivers)."""
    own = getattr(dec, "forwards", None)
    return (own(w) if own is not None else None) or ((model, dec.mode, dec.attn_backend),)


def batch_step_of(dec, bucket: tuple):
    """`dec.batch_step(*bucket)` (a compiled round's BatchStep), or None for a driver without compiled rounds."""
    own = getattr(dec, "batch_step", None)
    return own(*bucket) if own is not None else None
