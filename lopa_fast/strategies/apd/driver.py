"""The fast APD driver (lopa_fast.decode.driver): one APD / leftright request stepped by the one loop
(lopa_fast.decode.batch), ONE host read per step.

The step itself is lopa_fast.strategies.apd.step (its stages around the drafter's and the verifier's forwards, the
state layout and the 11-int head); this module holds the request: its geometry, tables and state, the eager step
in stages around the scheduler's shared forwards (`prepare` / `forwards` / `forward_args` / `finish`), the compiled
step as a batch step (`batch_step`, compile=True after the prefill), the counters, errors, trace and result.
Semantics are exactly those of the APD reference (docs/semantics.md "APD"; upstream `apd_sample`).
"""
from __future__ import annotations

import torch

from lopa_fast import keyed
from lopa_fast.output.progress import report_round
from lopa_fast.strategies.apd.step import (
    HEAD_FIELDS, ApdGeometry, apd_knobs, commit, draft_inputs, drafted, next_window, verified, verify_inputs,
)
from lopa_fast.decode.compiled import compiled_for
from lopa_fast.decode.fused_head import fused_head_wanted
from lopa_fast.decode.compiled_batch import BatchStep
from lopa_fast.decode.kv_pool import request_cache
from lopa_fast.decode.shapes import knob, pow2_bucket, quantized_length, stop_table
from lopa_fast.errors import NonFiniteLogitsError
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit


def cache_rows(prompt_len: int, cfg) -> int:
    """Rows of the drafter's static cache of one request (kv_window given: its buffer Lb + the trash row; None:
    one unused row), e.g. a batch's KV pool slot (the APD spec's `cache_rows`)."""
    return quantized_length(prompt_len + cfg.max_new_tokens) + 1 if cfg.kv_window is not None else 1


class FastApd:
    """One APD / leftright request on the fast machinery. drafter: a Dream-family DecoderLM; verifier: a causal
    qwen2 DecoderLM or None; prompt: LongTensor [P] on drafter.device; cfg: bound, validated and checked by
    lopa_fast.api (knobs, prompt, the drafter / verifier pair); cache: None (the request allocates the drafter's
    static cache) or (k, v) views [num_layers, cache_rows(P, cfg), Hkv, D] of a batch's KV pool slot, zeroed.
    `result()` equals the reference's output.

    A driver (lopa_fast.decode.driver; the APD spec's `driver`) stepped by the one loop (lopa_fast.decode.batch,
    solo as a batch of one), with a round of two forwards (`forwards`: the drafter's, then, with a verifier, the
    verifier's over the drafts), each shared by every live request; compile=True: `batch_step` after the prefill."""

    name = "apd"
    mode = "full"  # the drafter forward's attention (the batch's first forward)

    def __init__(self, drafter, prompt: torch.Tensor, cfg, verifier=None, cache=None):
        from lopa_fast.ops import _backend

        self.drafter, self.verifier, self.cfg = drafter, verifier, cfg
        dev = self.dev = prompt.device
        P, L = prompt.numel(), prompt.numel() + cfg.max_new_tokens
        self.P, self.L = P, L
        Lb = quantized_length(L)
        R = cfg.apd_mixture_weight
        self.geo = ApdGeometry(
            Lb=Lb, W=cfg.kv_window, M=cfg.max_lookahead, verify=R is not None,
            K=cfg.tokens_per_step if cfg.tokens_per_step is not None else 1,
            V_ar=verifier.config.vocab_size if verifier is not None else 0, mask_id=cfg.mask_token_id,
            eos_id=cfg.eos_token_id, exact_prev=bool(cfg.exact_prev_logits),
            suppress_mask=bool(cfg.suppress_mask_token),
            nucleus=cfg.top_p is not None and cfg.top_p < 1, top_k=cfg.top_k,
            stop_lens=tuple(len(q) for q in cfg.stop or ()),
            attn_backend=_backend.resolve("branch_attention", None, dev),
            sampling=cfg.temperature > 0, single_temperature=bool(cfg.single_temperature),
            coupled_gumbel=bool(cfg.coupled_gumbel), fused_head=fused_head_wanted(cfg, dev),
        )
        seed = keyed.resolve_seed(cfg.seed) if keyed.needs_draws(cfg) else 0  # as the reference's KeyedNoise
        self.tables = {"P": torch.tensor(P, device=dev), "L": torch.tensor(L, device=dev),
                       "stops": stop_table(cfg.stop, dev, min_rows=1), "seed": torch.tensor(seed, device=dev),
                       **{name: knob(v, dev) for name, v in apd_knobs(cfg).items()}}
        x = torch.full((Lb + 1,), cfg.mask_token_id, dtype=torch.long, device=dev)
        x[:P] = prompt
        self.st = {"x": x, "step": torch.zeros((), dtype=torch.long, device=dev)}  # step: dLLM forwards (keys)
        self.use_cache(*request_cache(drafter, cache_rows(P, cfg), cache))
        drafter.fused_layers()  # the merged-weight views, built or checked once per request (outside any graph)
        if R is not None:
            self.st["vk"], self.st["vv"] = request_cache(verifier, Lb + 1)
            self.st["prev"] = torch.zeros(verifier.config.vocab_size, dtype=verifier.dtype, device=dev)
            verifier.fused_layers()
        self.host_reads = 0
        self.compiled, self.cview = compiled_for(drafter, cfg, dev)  # the steps after the prefill: `batch_step`
        self.attn_backend = self.geo.attn_backend

    def heads(self) -> tuple:
        """(the drafter's, the verifier's) LM-head weights the fused head reads (geo.fused_head), else (None, None)."""
        if not self.geo.fused_head:
            return None, None
        return self.drafter.head_weight(), self.verifier.head_weight() if self.geo.verify else None

    def forwards(self, w: dict) -> tuple:
        """The forwards of the step `w` (`prepare`'s), in order, as (model, attention mask, attention backend): the
        drafter's, then (with a verifier) the verifier's, whose tokens are the drafter's drafts
        (lopa_fast.decode.batch runs each for every live request at once)."""
        out = ((self.drafter, "full", self.geo.attn_backend),)
        return out if not self.geo.verify else out + ((self.verifier, "causal", self.geo.attn_backend),)

    def use_cache(self, cache_k, cache_v) -> None:
        """The drafter's static cache: a batch's pool slot views (re-pointed when the pool grows)."""
        self.st["dk"], self.st["dv"] = cache_k, cache_v

    # ---- a compiled / captured step in a batch (lopa_fast.decode.compiled_batch: one graph per bucket and batch size)
    def batch_step(self, first: bool, curr: int, left: int, right: int):
        """The coming step as a compiled batch's BatchStep (its two forwards, drafter then verifier, each shared by
        the group), or None when it runs eagerly (compile off, or the prefill step: as alone)."""
        if self.compiled is None or first:
            return None
        if not getattr(self, "_owned", False):  # the batch copies lane results into these tensors from now on:
            self.st = {k: v if k in ("dk", "dv") else v.clone() for k, v in self.st.items()}  # own them (not the
            self._owned = True  # pool slot's drafter cache)
        geo, verifier = self.geo, self.verifier
        Nb, Db = pow2_bucket(right - left), pow2_bucket(right - curr)
        d_head, v_head = self.heads()

        def pre(st: dict, T: dict):
            a = draft_inputs(st, geo, Nb, Db, False, None)
            return _part(a, st["dk"], st["dv"]), a

        def mid(st: dict, T: dict, a: dict, l_d, k_win, v_win):  # between the drafter's and the verifier's forward
            drafted(st, T, geo, a, l_d, k_win, v_win, d_head)
            return _part(verify_inputs(st, geo, a, False, None), st["vk"], st["vv"]), a

        def post(st: dict, T: dict, a: dict, logits, k_win, v_win):  # after the last forward (leftright: the drafter's)
            if geo.verify:
                verified(st, T, geo, a, False, logits, k_win, v_win, v_head)
            else:
                drafted(st, T, geo, a, logits, k_win, v_win, d_head)
            return commit(st, T, geo, a)

        key = ("apd", id(verifier), geo, Nb, Db)  # as alone: the verifier is bound into the callable
        return BatchStep(self.compiled, key, (Nb, Db), f"apd_{Nb}x{Db}", ("apd", id(verifier), geo), pre, post,
                         "full", geo.attn_backend, self.st, self.tables, self.cview, forwards=self.forwards(None),
                         mids=(mid,) if geo.verify else ())

    def take(self, st: dict, info: dict) -> None:
        """The batched step's result for this request (its state, {"x0"}); then `read_head`."""
        self.st, self.info = st, info

    # ---- one eager step in stages, for lopa_fast.decode.batch (each forward shared by many requests)
    def prepare(self, first: bool, curr: int, left: int, right: int) -> dict:
        """The step's working dict on its exact window (eager shapes): the drafter's forward inputs first."""
        w = draft_inputs(self.st, self.geo, right - left, right - curr, first, (left, curr))
        w.update(first=first, prefix=(left, curr), phase=0)
        return w

    def forward_args(self, w: dict) -> dict:
        """This request's part of the coming forward's `forward_requests` (the arguments of the solo step's
        `forward_static`): the drafter's (phase 0), then the verifier's (phase 1, after `finish` of the drafter)."""
        st = self.st
        return _part(w, st["dk"], st["dv"]) if w["phase"] == 0 else _part(w["verify"], st["vk"], st["vv"])

    def finish(self, w: dict, logits, k_win, v_win) -> None:
        """After one of the step's forwards (this request's logits and window K/V): the drafter's -> the draft (and
        the verifier's inputs); the step's last forward -> the acceptance and the commit (step.py's stages)."""
        geo = self.geo
        d_head, v_head = self.heads()
        if w["phase"] == 0:
            drafted(self.st, self.tables, geo, w, logits, k_win, v_win, d_head)
            if geo.verify:
                w["verify"], w["phase"] = verify_inputs(self.st, geo, w, w["first"], w["prefix"]), 1
                return
        else:
            verified(self.st, self.tables, geo, w, w["first"], logits, k_win, v_win, v_head)
        self.st, self.info = commit(self.st, self.tables, geo, w)

    def read_head(self) -> None:
        """The step's one host read (inside the caller's round_scope)."""
        self.host_reads += 1
        self.head = dict(zip(HEAD_FIELDS, self.st["head"].tolist()))

    def _refuse(self, head: dict, step: int) -> None:
        """The reference's errors, in its order, for the step just run (before any of its tokens is returned)."""
        if head["nonfinite_drafter"] >= 0:
            raise NonFiniteLogitsError(strategy="apd", round=step, position=head["nonfinite_drafter"],
                                       value="NaN/inf (drafter)")
        if head["outside_vocab"]:
            raise RuntimeError(
                f"apd: the drafter drafted a token id outside the verifier's vocabulary [0, {self.geo.V_ar}) "
                "(upstream's verifier cannot embed it either)"
            )
        if head["nonfinite_verifier"] >= 0:
            raise NonFiniteLogitsError(strategy="apd", round=step, position=head["nonfinite_verifier"],
                                       value="NaN/inf (verifier)")

    # ---- the request as a driver (lopa_fast.decode.driver): lopa_fast.decode.batch's one loop steps it
    def begin(self, on_round=None) -> None:
        """Start the clock and plan step 1. on_round: the progress hook (lopa_fast.output.progress.report_round), called
        after every step with the committed prefix (one extra host read per step, only with a hook)."""
        self.on_round = on_round
        self.stats = {"forwards": 0, "model_calls": 0, "dllm_forwards": 0, "verifier_forwards": 0}
        self.counts: list[int] = []
        self.trace = [] if self.cfg.return_trace else None
        self.curr, self.first, self.ended = self.P, True, False
        self.left, self.right = next_window(self.curr, 0, self.L, self.geo, self.first)
        self.eos_detected = self.mask_pending = False
        self.st.update(curr=torch.tensor(self.curr, device=self.dev), left=torch.tensor(self.left, device=self.dev),
                       right=torch.tensor(self.right, device=self.dev))
        self.clock = Clock(self.dev).__enter__()

    def next_bucket(self) -> tuple[bool, int, int, int] | None:
        """The coming step's (first, curr, left, right) (host ints), or None when the request has finished (done,
        a stop sequence, or the round cap: said in stats). Raises the reference's error when the last step
        committed a drafted mask id."""
        if self.ended:
            return None
        if self.stats["forwards"] >= self.cfg.max_rounds:
            round_cap_hit(self.cfg, self.stats, "apd")
            return None
        if self.mask_pending:  # the reference finds the committed mask in this step's window
            raise RuntimeError(
                f"apd: the window [{self.left}, {self.right}) holds more masks than the {self.right - self.curr} "
                "ahead of the decoding position: the drafter emitted the mask token as a draft token (upstream's "
                "apd_sample misaligns the draft here). Pass suppress_mask_token=True"
            )
        return self.first, self.curr, self.left, self.right

    def after_round(self) -> None:
        """Counters, the reference's errors, the trace entry, the progress hook and the end tests of the step just
        run (outside the step's scope)."""
        cfg, geo, stats, head, P, L = self.cfg, self.geo, self.stats, self.head, self.P, self.L
        curr, left, right = self.curr, self.left, self.right
        stats["dllm_forwards"] += 1
        stats["verifier_forwards"] += geo.verify
        stats["forwards"] += 1
        self._refuse(head, stats["forwards"])
        accepted = head["accepted"]
        if self.trace is not None:
            x0 = self.info["x0"][: right - curr].tolist()
            self.trace.append({
                "round": stats["forwards"], "window_start": left - P, "window_len": right - left, "draft": x0,
                "num_accept": accepted,
                "accepted": [[curr + q - P, x0[q]] for q in range(min(accepted, L - curr))],
            })
        self.counts.append(accepted)
        if self.on_round is not None:
            report_round(self.on_round, self.st["x"][P:L], geo.mask_id, cfg.max_new_tokens, stats["forwards"])
        self.curr, self.left, self.right = head["curr"], head["left"], head["right"]
        self.first = False
        self.mask_pending = bool(head["mask_committed"])
        self.eos_detected |= bool(head["eos"])
        if head["stop"]:  # a stop sequence in the committed prefix (the API cuts the output before it)
            stats["stopped"] = True
            self.ended = True
        elif head["done"]:
            self.ended = True

    def result(self) -> GenerateOutput:
        """Stop the clock; the tokens, the counters and stats, the trace."""
        self.clock.__exit__(None, None, None)
        cfg, stats, counts = self.cfg, self.stats, self.counts
        ids = self.st["x"][self.P : min(self.curr, self.L)].tolist()
        stats["model_calls"] = stats["dllm_forwards"] + stats["verifier_forwards"]
        stats["acceptance_counts"] = counts
        stats["mean_accepted"] = sum(counts) / len(counts) if counts else 0.0
        stats["eos_detected"] = self.eos_detected
        stats["host_reads"] = self.host_reads
        stats["host_reads_per_round"] = self.host_reads / max(1, stats["forwards"])
        if self.compiled is not None:
            stats.update(self.compiled.stats(self.cview))
        finalize_stats(stats, ids, cfg.eos_token_id, cfg.mask_token_id, self.clock.seconds, steps_plus_one=False)
        return GenerateOutput(ids, stats, self.trace)


def _part(f: dict, cache_k, cache_v) -> dict:
    """A forward's `forward_requests` part from its inputs f (step.py's draft_inputs / verify_inputs) over the
    model's cache (cache_k / cache_v: the drafter's or the verifier's)."""
    return dict(tokens=f["tokens"], start=f["start"], cache_k=cache_k, cache_v=cache_v, prefix_len=f["prefix_len"],
                win_lens=f["win_lens"], bids=None, rows=f["rows"], output=f["output"])
