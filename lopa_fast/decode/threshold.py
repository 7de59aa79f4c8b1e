"""The fast threshold decoder (Fast-dLLM v1 / dParallel): the step on the device, one host read per step.

Semantics are exactly `lopa_fast.reference.threshold` (docs/semantics.md sections 4.2-4.4 and 5; token- and
forward-exact at T = 0 and, with the keyed sampler, at T > 0): blocks of `block_length` left to right, per
step the masked positions of the block (cache=None: every mask before the block end) are candidates and one
rule commits (rank 1 always): `threshold` (conf >= tau), `factor` (the first rank k with c(k) < 1 - f/(k+1),
upstream's edge cases), `entropy_threshold` (H <= h). Caches: None, "prefix" (refresh forward at each block
start, then the block and every later position over the cached prefix), "dual" (refresh caches every
position; later steps forward only the block, overwriting its K/V in place). Dream refresh steps commit the
block's first token unconditionally; `count_noop_forward` keeps the old loop's extra forward.

What changes is how: the commit rule is tensor ops on the device (`select`), the candidates never leave it,
the LM head runs only on the rows a step reads (the candidates' rows, `steps.raw_rows`), the forwards are
the fused static-cache ones of `steps.StepForward`, and the step's one host read is the head
(first non-finite row, first mask, block full). compile=True runs each step as one compiled / captured
callable instead (lopa_fast.decode.static_steps, through CompiledRounds.steps_step), with the same one host read.
"""
from __future__ import annotations

import torch

from lopa_fast.contracts import after_step
from lopa_fast.decode import static_steps, steps
from lopa_fast.decode.steps import threshold_select as select  # noqa: F401  (the step's rule, shared)
from lopa_fast.decode.shapes import pow2_bucket as bucket
from lopa_fast.keyed import TOKEN, request_noise
from lopa_fast.output import Clock, GenerateOutput, finalize_stats, round_cap_hit
from lopa_fast.sampling import threshold_stats


def generate(model, prompt: torch.Tensor, cfg, on_round=None) -> GenerateOutput:
    """Threshold decoding on the fast backend. prompt: LongTensor [P] on model.device; cfg: bound
    GenerateConfig (covered: lopa_fast.decode.fast_not_covered); on_round: the progress hook."""
    P, G, B = prompt.numel(), cfg.max_new_tokens, cfg.block_length
    mask_id = cfg.mask_token_id
    dev = prompt.device
    noise = request_noise(cfg, dev)
    x = torch.cat([prompt, prompt.new_full((G,), mask_id)])
    L = x.numel()
    fw = steps.StepForward(model, L, cache=cfg.cache is not None)
    llada = model.config.kind == "llada"
    shift = bool(model.logits_shift)
    suppress = mask_id if cfg.suppress_mask_token else None
    stats = {"forwards": 0, "model_calls": 0, "refresh_forwards": 0, "host_reads": 0}
    zero = torch.zeros((), dtype=torch.long, device=dev)
    counters = {"multi_token_steps": zero.clone(), "noop_forwards": zero.clone()}
    trace = [] if cfg.return_trace else None
    stopped = False
    compiled = None  # compile=True: every step through CompiledRounds (lopa_fast.decode.static_steps)
    from lopa_fast.decode.compiled import CompiledRounds, compile_wanted

    if compile_wanted(cfg, dev):
        compiled = CompiledRounds.for_model(model, cfg)
        geo = static_steps.geometry(model, cfg, L)
        cst = {}
        cst["st"], T = static_steps.init(model, x, P, geo, noise.seed)

    def budget() -> bool:
        if stats["forwards"] >= cfg.max_rounds:
            round_cap_hit(cfg, stats, "threshold")
            return False
        return True

    def count(refresh=False):
        stats["forwards"] += 1
        stats["model_calls"] += 1
        stats["refresh_forwards"] += int(refresh)

    def stats_of(logits: torch.Tensor, lo: int):
        keys = noise.keys(TOKEN, stats["forwards"], 0, lo + torch.arange(logits.shape[0], device=dev)) \
            if cfg.temperature > 0 else None
        return threshold_stats(logits, llada=llada, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                               suppress_token=suppress, keys=keys)  # fmt: skip

    def step(logits: torch.Tensor, lo: int, hi: int, s: int, e: int, wstart: int, only_first: bool = False):
        """Decode one step from aligned logits [hi - lo, V] predicting positions [lo, hi); ends in the step's
        one host read: (block [s, e) full, the first mask position) after the numerics guard."""
        cand = x[lo:hi] == mask_id
        read = torch.ones_like(cand) if only_first else cand
        bad = steps.first_bad_row(logits, read, cfg.temperature)
        x0, conf, ent = stats_of(logits, lo)
        if only_first:  # Dream refresh: the block's first token, unconditionally (Fast-dLLM's Dream loop)
            sel = torch.ones_like(cand)
        else:
            sel = select(conf, ent, cand, cfg)
            nsel = sel.sum()
            counters["multi_token_steps"] += nsel >= 2
            counters["noop_forwards"] += nsel == 0
        before = x.clone() if trace is not None else None
        x[lo:hi] = torch.where(sel, x0, x[lo:hi])
        stats["host_reads"] += 1
        b, full, fm = steps.read_head(bad, ~(x[s:e] == mask_id).any(), steps.first_mask(x, mask_id))
        finish(b, logits, lo, before, wstart)
        return bool(full), fm

    def finish(b: int, logits: torch.Tensor, lo: int, before, wstart: int) -> None:
        """After the step's one host read: the numerics error, the trace."""
        if b >= 0:
            steps.refuse(logits[b], lo + b, stats["forwards"], "threshold", cfg.temperature)
        if trace is not None:
            pos = ((before == mask_id) & (x != mask_id)).nonzero(as_tuple=True)[0]
            trace.append({"round": stats["forwards"], "accepted": [[int(q) - P, int(x[q])] for q in pos],
                          "window_start": wstart})  # fmt: skip

    def run(kind: str, s: int, e: int, fm: int) -> tuple[bool, int]:
        """One step of `kind` (full | refresh | refresh_first | prefix | dual: lopa_fast.decode.static_steps) in
        block [s, e) with the first mask fm: eager, the forward then `step`; compile=True, the compiled / captured
        step. Returns (block full, first mask) from the step's one host read."""
        # the positions [lo, hi) the step's rows predict, and the trace's window start
        lo, hi, wstart = {"full": (fm, e, -P), "refresh": (fm, e, -P), "refresh_first": (s, s + 1, 0)}.get(
            kind, (s, e, s - P))  # fmt: skip
        count(refresh=kind.startswith("refresh"))
        if compiled is not None:
            sizes = {"full": (bucket(max(e - fm, 1)),), "refresh": (bucket(max(e - fm, 1)),), "refresh_first": (1,),
                     "prefix": (bucket(L - s),), "dual": ()}[kind]  # fmt: skip
            before = x.clone() if trace is not None else None
            cst["st"], info = static_steps.run_compiled(compiled, model, cst["st"], T, geo, kind, sizes)
            stats["host_reads"] += 1
            b, full, fm, _ = cst["st"]["head"].tolist()  # the step's one device-to-host read
            x.copy_(cst["st"]["x"])  # the host's canvas (hook, trace, result): a device copy, no read
            finish(b, info["logits"], lo, before, wstart)
            return bool(full), fm
        rows = steps.raw_rows(lo, hi, lo if kind in ("prefix", "dual") else 0, shift, dev)
        if kind == "full":
            logits = fw.full(x[None], rows)
        elif kind in ("refresh", "refresh_first"):
            logits = fw.refresh(x, rows, s if cfg.cache == "prefix" else L)
        else:
            logits = fw.prefix(x[s:], s, rows) if kind == "prefix" else fw.dual(x[s:e], s, rows)
        return step(logits, lo, hi, s, e, wstart, only_first=kind == "refresh_first")

    def hook() -> bool:
        return after_step(x[P:], cfg, stats, on_round)

    with Clock(dev) as clock:
        fm = P  # the first mask position (read with each step's head): candidates never lie before it
        for blk in range(G // B):
            s, e = P + blk * B, P + (blk + 1) * B
            if compiled is not None:  # in place (the CUDA workspace): a kernel launch each, no host read
                cst["st"]["s"].fill_(s)
                cst["st"]["e"].fill_(e)
            if cfg.cache is None:
                while True:
                    if not budget():
                        break
                    full, fm = run("full", s, e, fm)
                    stopped = hook()
                    if full or stopped:
                        break
            else:
                if not budget():
                    break
                # LLaDA: candidates every mask before the block end; Dream: the block's first token
                full, fm = run("refresh" if llada else "refresh_first", s, e, fm)
                stopped = hook()
                first = True
                while not stopped:
                    if full and not (cfg.count_noop_forward and first):
                        break
                    first = False
                    if not budget():
                        break
                    full, fm = run(cfg.cache, s, e, fm)
                    stopped = hook()
                    if full:
                        break
            if stats.get("hit_round_cap") or stopped:
                break
    ids = x[P:].tolist()
    if compiled is not None:
        counters = {"multi_token_steps": cst["st"]["multi"], "noop_forwards": cst["st"]["noop"]}
        stats.update(compiled.stats())
    stats.update({k: int(v) for k, v in counters.items()})
    stats["host_reads_per_step"] = stats["host_reads"] / max(1, stats["forwards"])
    finalize_stats(stats, ids, cfg.eos_token_id, mask_id, clock.seconds, steps_plus_one=False)
    return GenerateOutput(ids, stats, trace)
