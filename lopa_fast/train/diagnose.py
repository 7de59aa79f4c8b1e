"""Where a diffusion model of `arith-var` goes wrong: the cross-entropy of the next token, left to right, by
token category, and the exact match under different fill orders (issue 12's teacher diagnosis).

    python -m lopa_fast.train.diagnose DIR [--n 96] [--cuts 16] [--orders]

What it does and why, with the measurements: docs/training.md.
"""
from __future__ import annotations

import argparse
import random
from collections import defaultdict

import torch

from lopa_fast import tasks
from lopa_fast.tasks import arith_var
from lopa_fast.train.data import make_batch

CATEGORIES = ("word", "phrase_digit", "eq_left", "eq_right", "eq_result", "final", "eos")
_OPS = ("*", "+", "-")


def token_categories(solution: str) -> list[str]:
    """The category of every token of `solution` (`arith_var.tokens` order) and of the EOS after it."""
    words = solution.split()
    out: list[str] = []
    for j, w in enumerate(words):
        if not w.isdigit():
            out.append("word")
            continue
        prev, nxt = (words[j - 1] if j else ""), (words[j + 1] if j + 1 < len(words) else "")
        cat = ("eq_left" if nxt in _OPS else "eq_right" if prev in _OPS else "eq_result" if prev == "="
               else "final" if prev == "####" else "phrase_digit")
        out += [cat] * len(w)  # every digit is its own token
    return out + ["eos"]


@torch.no_grad()
def next_token_ce(model, problems, tok, cuts: int = 16, seed: int = 0) -> dict[str, dict]:
    """category -> {"n", "ce", "acc"} over `cuts` seeded cut points per problem (see the module docstring)."""
    if isinstance(cuts, bool) or not isinstance(cuts, int) or cuts < 1:
        raise ValueError(f"next_token_ce: cuts={cuts!r}; expected an int >= 1")
    G = arith_var.GEN_LEN
    batch = make_batch(problems, tok, G)
    labels = [token_categories(p.solution) for p in problems]
    rng = random.Random(seed)
    tot, cnt, hit = defaultdict(float), defaultdict(int), defaultdict(int)
    for _ in range(cuts):
        ids = batch.ids.clone()
        cut = [rng.randrange(len(lab)) for lab in labels]  # a solution token or its EOS
        for b, c in enumerate(cut):
            P = int(batch.prompt_lens[b])
            ids[b, P + c : P + G] = tasks.MASK_ID
        logits = model(ids, mask="full", win_lens=batch.lens).float()
        for b, c in enumerate(cut):
            P = int(batch.prompt_lens[b])
            lp = logits[b, P + c - 1].log_softmax(-1)
            target = batch.ids[b, P + c]
            cat = labels[b][c]
            tot[cat] += float(-lp[target])
            cnt[cat] += 1
            hit[cat] += int(lp.argmax() == target)
    return {c: {"n": cnt[c], "ce": tot[c] / cnt[c], "acc": hit[c] / cnt[c]} for c in CATEGORIES if cnt[c]}


ORDERS = ("left_to_right", "max_prob", "entropy", "entropy_true_tail")


@torch.no_grad()
def fill_order_accuracy(model, problems, tok, orders=ORDERS) -> dict[str, float]:
    """order -> exact match of `train.greedy.greedy_fill` on `problems` (entropy_true_tail: alg="entropy" with the
    solution's EOS positions given clean, i.e. the length known)."""
    from lopa_fast.train.greedy import greedy_fill

    bad = [o for o in orders if o not in ORDERS]
    if bad:
        raise ValueError(f"fill_order_accuracy: orders {bad}; allowed: {ORDERS}")
    G = arith_var.GEN_LEN
    batch = make_batch(problems, tok, G)
    rows = torch.arange(len(problems))[:, None]
    region = batch.ids[rows, batch.prompt_lens[:, None] + torch.arange(G)[None]]
    out = {}
    for order in orders:
        tail = order == "entropy_true_tail"
        gen = greedy_fill(model, batch, G, alg="entropy" if tail else order, given=(region == tasks.EOS_ID) if tail
                          else None)
        texts = tok.decode_batch(gen.tolist(), skip_special_tokens=True)
        out[order] = sum(tasks.extract_answer(t) == p.answer for t, p in zip(texts, problems)) / len(problems)
    return out


@torch.no_grad()
def posterior_probe(model, problems, tok) -> dict:
    """Vanilla decoding (one token per forward, lowest entropy first over the whole region, the eval's vanilla
    row) checked against the exact posterior (`train.posterior`) at every fill.

    Returns {"n", "correct": exact matches, "off": decodes that wrote a token no rendering agreeing with the
    visible ones has (they left the task's distribution), "off_determined": of those, how many first left it at a
    position the visible tokens had already determined (posterior entropy 0: a model error, not a guess between
    valid continuations), "first_step": mean fill index of the first such token, "model_entropy": the model's
    mean entropy (nats) at those fills}. The shipped teacher on 48 dev problems: 37 correct, 33 off, 21 of them
    at a determined position (docs/tasks.md)."""
    from lopa_fast.train import posterior as post

    G = arith_var.GEN_LEN
    batch = make_batch(problems, tok, G)
    B = len(problems)
    rows = torch.arange(B)[:, None]
    gen_pos = batch.prompt_lens[:, None] + torch.arange(G)[None, :]
    ids = batch.ids.clone()
    ids[rows, gen_pos] = tasks.MASK_ID
    V = tok.get_vocab_size()
    tables = [post.table_for(p, G) for p in problems]
    first = [None] * B  # (fill index, posterior entropy, model entropy) of the first off-distribution token
    for step in range(G):
        prob = model(ids, mask="full", win_lens=batch.lens).float()[rows, gen_pos - 1].softmax(-1)
        ent = -(prob * prob.clamp_min(1e-30).log()).sum(-1)  # [B, G]
        still = ids[rows, gen_pos] == tasks.MASK_ID
        pick = (-ent).masked_fill(~still, -float("inf")).argmax(-1)
        x0 = prob.argmax(-1)
        for b in range(B):
            j, t = int(pick[b]), int(x0[b, pick[b]])
            if first[b] is None:
                region = ids[b, gen_pos[b]]
                q, _ = post.posterior(*tables[b], region, region != tasks.MASK_ID, V)
                if float(q[j, t]) == 0.0:
                    qj = q[j]
                    first[b] = (step, float(-(qj * qj.clamp_min(1e-300).log()).sum()), float(ent[b, j]))
            ids[b, gen_pos[b, j]] = t
    texts = tok.decode_batch(ids[rows, gen_pos].tolist(), skip_special_tokens=True)
    off = [f for f in first if f is not None]
    det = [f for f in off if f[1] < 1e-9]
    return {"n": B, "correct": sum(tasks.extract_answer(t) == p.answer for t, p in zip(texts, problems)),
            "off": len(off), "off_determined": len(det),
            "first_step": sum(f[0] for f in off) / len(off) if off else None,
            "model_entropy": sum(f[2] for f in det) / len(det) if det else None}


def main(argv=None) -> int:
    import lopa_fast

    ap = argparse.ArgumentParser(prog="python -m lopa_fast.train.diagnose", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an arith-var model directory (HF layout)")
    ap.add_argument("--n", type=int, default=96, help="dev problems (default 96)")
    ap.add_argument("--cuts", type=int, default=16, help="cut points per problem (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--orders", action="store_true", help="also the exact match under four fill orders (--n problems)")
    ap.add_argument("--posterior", action="store_true",
                    help="also vanilla decoding checked against the exact posterior at every fill (--n problems)")
    a = ap.parse_args(argv)
    if a.n < 1 or a.cuts < 1:
        ap.error(f"--n={a.n} --cuts={a.cuts}; both must be >= 1")  # one line, exit code 2
    torch.set_num_threads(1)
    try:
        model = lopa_fast.load_model(a.model, dtype=torch.float32)
    except (OSError, ValueError) as exc:  # CheckpointError is a ValueError: a bad path is a user error
        ap.error(str(exc))
    probs = arith_var.generate("dev", a.n, seed=4)
    tok = tasks.TOKENIZERS["arith-var"].build_tokenizer()
    res = next_token_ce(model, probs, tok, a.cuts, a.seed)
    for c, r in res.items():
        print(f"{c:13s} n={r['n']:5d}  CE {r['ce']:.3f} nats  argmax {r['acc']:.2f}")
    if a.orders:
        for order, acc in fill_order_accuracy(model, probs, tok).items():
            print(f"fill order {order:18s} exact match {acc:.3f} (n={a.n}, one token per forward)")
    if a.posterior:
        r = posterior_probe(model, probs, tok)
        print(f"posterior probe (entropy order, n={r['n']}): {r['correct']} correct; {r['off']} left every valid "
              f"rendering, {r['off_determined']} first at a determined position (mean fill {r['first_step']}, "
              f"model entropy there {r['model_entropy']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
