"""`arith-var`: the embedded task's word problems with variable worked solutions (issue 12, first piece): the
problems of `lopa_fast.tasks.arith`, each training solution one of thousands of equivalent renderings (three plans,
three phrasings a step, operand orders, optional sentences), 64-96 tokens with EOS. The design, its reasons and the
measured statistics (`python -m lopa_fast.tasks.arith_var`): docs/tasks.md "arith-var".
"""
from __future__ import annotations

import itertools
import math
import random
import re
from collections import Counter
from dataclasses import dataclass

from lopa_fast.tasks import arith

TASK = "arith-var"
VARIANT = "v2"  # the numeric ranges of arith's default variant
SPLITS = arith.SPLITS
PLANS = ("A", "B", "C")
MIN_SOLUTION_TOKENS = 64  # incl. the final EOS (tested for every tuple over every slot's extremes)
MAX_SOLUTION_TOKENS = 128
GEN_LEN = 96  # max_new_tokens of the task's models and eval: the longest solution is 96 tokens incl. EOS (tested)

# ---- phrasings. Fields: a b c d the parameters, m = b*c, s = a+m, t = a-d, r the answer; x y the operands of the
# step (both orders for * and +).
_OPEN = (
    "Let us work it out one step at a time , in order .",
    "We count them all , one step at a time .",
    "To find how many there are now , we go step by step .",
)
_PRODUCT = (  # m = x * y with {x, y} = {b, c}
    "There are {b} groups with {c} in each , so the groups hold {x} * {y} = {m} .",
    "The groups hold {x} * {y} = {m} in total , since each of them has {c} .",
    "{b} groups of {c} each make {x} * {y} = {m} in the groups .",
)
_RESTATE = (  # optional, after the first step
    "",
    "We keep this number in mind .",
)
_SUM_AM = (  # s = x + y with {x, y} = {a, m} (plan A, step 2)
    "Adding the {a} from the start gives {x} + {y} = {s} .",
    "So now there are {x} + {y} = {s} , before losing any of them .",
    "{x} + {y} = {s} , so there are {s} at this point .",
)
_SUB_SD = (  # r = s - d (plan A, step 3)
    "Then {d} are gone , and {s} - {d} = {r} are left .",
    "Taking away the {d} then leaves {s} - {d} = {r} in all .",
    "{s} - {d} = {r} , so {r} are left after the {d} are gone .",
)
_SUB_AD = (  # t = a - d (plans B and C)
    "Without the {d} , we keep {a} - {d} = {t} of the first {a} .",
    "Taking away {d} from the {a} leaves {a} - {d} = {t} .",
    "{a} - {d} = {t} , so {t} of the first {a} remain .",
)
_SUM_TM = (  # r = x + y with {x, y} = {t, m} (plans B and C, last step)
    "Adding the {m} from the groups gives {x} + {y} = {r} .",
    "So now there are {x} + {y} = {r} in all .",
    "{x} + {y} = {r} , so in all there are {r} .",
)
_CLOSE = (
    "The answer is {r} , the number we want .",
    "So there are {r} now , which is the answer .",
    "In the end there are {r} , and that is the answer .",
)

# A plan is a list of slots; a slot is (phrasings, operands): operands None, or the two names of the
# commutative operands (then the slot's options are every phrasing x both orders).
_PLAN_SLOTS = {
    "A": [(_OPEN, None), (_PRODUCT, ("b", "c")), (_RESTATE, None), (_SUM_AM, ("a", "m")), (_SUB_SD, None),
          (_CLOSE, None)],
    "B": [(_OPEN, None), (_PRODUCT, ("b", "c")), (_RESTATE, None), (_SUB_AD, None), (_SUM_TM, ("t", "m")),
          (_CLOSE, None)],
    "C": [(_OPEN, None), (_SUB_AD, None), (_RESTATE, None), (_PRODUCT, ("b", "c")), (_SUM_TM, ("t", "m")),
          (_CLOSE, None)],
}


def slot_sizes(plan: str) -> list[int]:
    """The number of options of each slot of `plan` (phrasings, times 2 for a commutative step)."""
    return [len(ph) * (2 if ops else 1) for ph, ops in _PLAN_SLOTS[plan]]


def n_choices() -> int:
    """The number of rendering choices per problem (distinct renderings may be fewer: b == c, a == m, t == m)."""
    return sum(math.prod(slot_sizes(pl)) for pl in PLANS)


@dataclass(frozen=True)
class Choice:
    """One rendering: the plan and one option index per slot."""

    plan: str
    slots: tuple[int, ...]


@dataclass(frozen=True)
class VarProblem(arith.Problem):
    """One arith-var problem: arith's fields (the prompt is arith's; the solution one rendering) and its choice."""

    choice: Choice


def _fields(a, b, c, d, name, pron, item, container) -> dict:
    m = b * c
    return dict(N=name, P=pron, p=pron.lower(), I=item, C=container, a=a, b=b, c=c, d=d, m=m, s=a + m,
                t=a - d, r=a + m - d)


def _slot_text(slot, k: int, f: dict) -> str:
    phrasings, ops = slot
    if ops is None:
        return phrasings[k].format(**f)
    x, y = (ops if k % 2 == 0 else ops[::-1])
    return phrasings[k // 2].format(**f, x=f[x], y=f[y])


def render_solution(choice: Choice, a, b, c, d, name, pron, item, container) -> str:
    """The worked solution text of one rendering choice (words, symbols and numbers separated by spaces)."""
    if choice.plan not in _PLAN_SLOTS:
        raise ValueError(f"render_solution: plan={choice.plan!r}; allowed: {PLANS}")
    slots = _PLAN_SLOTS[choice.plan]
    sizes = slot_sizes(choice.plan)
    if len(choice.slots) != len(slots) or any(not 0 <= k < n for k, n in zip(choice.slots, sizes)):
        raise ValueError(f"render_solution: slots={choice.slots!r} do not fit plan {choice.plan} (sizes {sizes})")
    f = _fields(a, b, c, d, name, pron, item, container)
    parts = [_slot_text(sl, k, f) for sl, k in zip(slots, choice.slots)]
    return " ".join(p for p in parts if p) + f" #### {f['r']}"


def sample_choice(rng: random.Random) -> Choice:
    """A rendering choice: plan uniform, every slot uniform."""
    plan = PLANS[rng.randrange(len(PLANS))]
    return Choice(plan, tuple(rng.randrange(n) for n in slot_sizes(plan)))


def all_choices():
    """Every rendering choice, in a fixed order, with its sampling probability."""
    for plan in PLANS:
        sizes = slot_sizes(plan)
        w = 1.0 / (len(PLANS) * math.prod(sizes))
        for ks in itertools.product(*(range(n) for n in sizes)):
            yield Choice(plan, ks), w


def render(template, a, b, c, d, name, pron, item, container, choice: Choice) -> VarProblem:
    """One problem with the rendering `choice` (the prompt is arith's prompt of the same parameters)."""
    base = arith.render(template, a, b, c, d, name, pron, item, container)
    sol = render_solution(choice, a, b, c, d, name, pron, item, container)
    return VarProblem(template, a, b, c, d, name, pron, item, container, base.prompt, sol, base.answer, choice)


def generate(split: str, n: int, seed: int = 0) -> list[VarProblem]:
    """`n` problems of `split`, deterministic in (split, n, seed). As `arith.generate`: train draws tuples with
    replacement (an endless stream is `generate("train", n, seed=step)`); dev/test sample held-out tuples
    without replacement. Each problem's rendering is sampled by `sample_choice` from the same seeded stream."""
    if split not in SPLITS:
        raise ValueError(f"generate: split={split!r}; allowed: {SPLITS}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"generate: n={n!r}; expected an int >= 0")
    rng = random.Random(f"{TASK}:{split}:{seed}")
    # the rendering choice is drawn right after each problem's surface, from the same stream
    return [render(*problem, sample_choice(rng)) for problem in arith.draw_problems(rng, split, VARIANT, n)]


def _args(p: VarProblem) -> tuple:
    return (p.a, p.b, p.c, p.d, p.name, p.pron, p.item, p.container)


def renderings(problem: VarProblem) -> list[str]:
    """Every distinct valid solution text of `problem`'s parameters, sorted."""
    return sorted({render_solution(ch, *_args(problem)) for ch, _ in all_choices()})


def count_renderings(problem: VarProblem) -> int:
    """The number of distinct valid solution texts of `problem`, computed per slot: within a plan the slots'
    distinct texts multiply (a commutative step with equal operands, b == c or a == m or t == m, has half its
    options), and different plans never render the same text (their equations differ). Tests check it against
    `len(renderings(problem))`."""
    return _count(*_args(problem))


def _count(a, b, c, d, name="Lily", pron="She", item="apples", container="boxes") -> int:
    f = _fields(a, b, c, d, name, pron, item, container)
    return sum(math.prod(len({_slot_text(sl, k, f) for k in range(n)})
                         for sl, n in zip(_PLAN_SLOTS[plan], slot_sizes(plan))) for plan in PLANS)


def min_renderings() -> int:
    """The fewest distinct renderings of any problem (over every tuple of every split): the guaranteed floor."""
    return min(_count(*tp) for sp in SPLITS for tp in arith._tuples_cached(sp, VARIANT))


def rendering_distribution(problem: VarProblem) -> dict[str, float]:
    """Distinct solution text -> probability under the generator's sampling."""
    out: Counter = Counter()
    for ch, w in all_choices():
        out[render_solution(ch, *_args(problem))] += w
    return dict(out)


def tokens(text: str) -> list[str]:
    """The tokenizer's pre-tokenization (whitespace split, every digit its own token) in plain Python."""
    return [t for w in text.split() for t in (list(w) if w.isdigit() else [w])]


def solution_length(text: str) -> int:
    """Tokens of a solution including the final EOS."""
    return len(tokens(text)) + 1


_EQ_RE = re.compile(r"(\d+) ([*+-]) (\d+) = (\d+)")


def check_solution(text: str) -> int | None:
    """The final answer if every equation of `text` is correct and the last equation's result is the answer
    after `####`; else None."""
    eqs = _EQ_RE.findall(text)
    if len(eqs) != 3:
        return None
    ops = {"*": lambda u, v: u * v, "+": lambda u, v: u + v, "-": lambda u, v: u - v}
    for x, op, y, z in eqs:
        if ops[op](int(x), int(y)) != int(z):
            return None
    ans = arith.extract_answer(text)
    return ans if ans == int(eqs[-1][3]) else None


def length_bounds(a, b, c, d, name="Lily", pron="She", item="apples", container="boxes") -> tuple[int, int]:
    """(shortest, longest) solution of a tuple in tokens incl. EOS, over every choice, computed per slot (slot
    lengths add up, so the extremes are the sums of the per-slot extremes of each plan)."""
    f = _fields(a, b, c, d, name, pron, item, container)
    lo, hi = math.inf, 0
    for plan in PLANS:
        slots = _PLAN_SLOTS[plan]
        lens = [[len(tokens(_slot_text(sl, k, f))) for k in range(n)] for sl, n in zip(slots, slot_sizes(plan))]
        fixed = 1 + len(tokens(str(f["r"]))) + 1  # "####", the answer's digits, EOS
        lo = min(lo, fixed + sum(min(x) for x in lens))
        hi = max(hi, fixed + sum(max(x) for x in lens))
    return int(lo), hi


def position_entropy(problem: VarProblem, length: int = MAX_SOLUTION_TOKENS) -> list[float]:
    """Entropy (bits) of the token at each solution position under the generator's rendering distribution of
    one problem (positions past a rendering's end hold EOS, as the training targets are padded)."""
    counts = [Counter() for _ in range(length)]
    for text, w in rendering_distribution(problem).items():
        toks = tokens(text) + ["<eos>"]
        toks += ["<eos>"] * (length - len(toks))
        for i, t in enumerate(toks[:length]):
            counts[i][t] += w
    return [max(0.0, -sum(w * math.log2(w) for w in cnt.values() if w > 0)) for cnt in counts]


def task_words() -> list[str]:
    """Every non-digit word an arith-var prompt or solution can emit, sorted."""
    words: set[str] = set()
    for template in arith.TEMPLATES:
        for name, pron in arith.NAMES:
            words.update(arith.render(template, 7, 4, 6, 5, name, pron, "apples", "boxes").prompt.split())
    for name, pron in arith.NAMES:
        for item in arith.ITEMS:
            for container in arith.CONTAINERS:
                f = _fields(7, 4, 6, 5, name, pron, item, container)
                for plan in PLANS:
                    for sl, n in zip(_PLAN_SLOTS[plan], slot_sizes(plan)):
                        for k in range(n):
                            words.update(_slot_text(sl, k, f).split())
                words.update(arith.render("buy", 7, 4, 6, 5, name, pron, item, container).prompt.split())
    words.add("####")
    return sorted(w for w in words if not w.isdigit())


def statistics(n_problems: int = 20, seed: int = 0) -> dict:
    """Measured statistics of the rendering distribution on `n_problems` test problems (docs/tasks.md)."""
    probs = generate("test", n_problems, seed=seed)
    counts, ents, mean_len = [], [], []
    lens: Counter = Counter()
    for p in probs:
        dist = rendering_distribution(p)
        counts.append(len(dist))
        mean_len.append(sum(w * solution_length(t) for t, w in dist.items()))
        for t, w in dist.items():
            lens[solution_length(t)] += w / n_problems
        ents.append(position_entropy(p))
    all_bounds = [length_bounds(*tp) for sp in SPLITS for tp in arith._tuples_cached(sp, VARIANT)]
    all_counts = [_count(*tp) for sp in SPLITS for tp in arith._tuples_cached(sp, VARIANT)]
    per_pos = [sum(e[i] for e in ents) / len(ents) for i in range(MAX_SOLUTION_TOKENS)]
    return dict(choices=n_choices(), distinct=counts,
                distinct_all_tuples=(min(all_counts), sum(all_counts) / len(all_counts)),
                length_hist=dict(sorted(lens.items())),
                mean_len=sum(mean_len) / len(mean_len), min_len=min(b[0] for b in all_bounds),
                max_len=max(b[1] for b in all_bounds), per_position_entropy=per_pos)


if __name__ == "__main__":  # prints the statistics of docs/tasks.md
    st = statistics()
    pe = st["per_position_entropy"]
    print(f"choices per problem: {st['choices']}; distinct renderings on 20 test problems: min {min(st['distinct'])} "
          f"mean {sum(st['distinct']) / len(st['distinct']):.0f} max {max(st['distinct'])}; "
          f"over all tuples: min {st['distinct_all_tuples'][0]} mean {st['distinct_all_tuples'][1]:.0f}")
    print(f"solution length (tokens incl. EOS) over all tuples and choices: {st['min_len']}-{st['max_len']}; "
          f"mean {st['mean_len']:.1f}")
    hist = st["length_hist"]
    for lo in range(60, 130, 10):
        print(f"  len {lo}-{lo + 9}: {sum(v for k, v in hist.items() if lo <= k < lo + 10):.3f}")
    for lo in range(0, MAX_SOLUTION_TOKENS, 16):
        seg = pe[lo:lo + 16]
        print(f"  positions {lo}-{lo + 15}: mean entropy {sum(seg) / len(seg):.2f} bits, max {max(seg):.2f}")
    print(f"mean over 128 positions: {sum(pe) / len(pe):.2f} bits; positions with entropy > 1 bit: "
          f"{sum(e > 1 for e in pe)}; = 0: {sum(e < 1e-9 for e in pe)}")
