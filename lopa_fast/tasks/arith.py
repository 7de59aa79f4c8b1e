"""Templated three-step arithmetic word problems in a GSM8K-like format (the embedded task).

Every problem is fixed by its parameters (template, a, b, c, d, name, item) and has one exact answer.
The worked solution is three short equations and a final "#### <answer>", e.g.

    prompt:   "Lily has 7 apples . She buys 4 boxes with 6 apples in each . She gives away 5 apples .
               How many apples does Lily have now ? Answer :"
    solution: "4 * 6 = 24 . 7 + 24 = 31 . 31 - 5 = 26 . #### 26"

Why this task: the answer needs multi-step arithmetic where later numbers depend on earlier ones
(so decoding many positions in one forward is non-trivial: copied operands are easy, results are
not), yet a ~1M-parameter model learns it in tens of CPU minutes. Numbers are split into single
digits by the tokenizer (as Qwen's tokenizer does).

Splits are disjoint on the numeric parameters (a, b, c, d), not only on the text: a tuple is held
out iff a keyed hash of it falls in the test bucket (10% of tuples) or the dev bucket (5%, used only
to monitor training), whatever template, name or item it is rendered with. The generator is seeded
and deterministic (Python's `random.Random(seed)`; no global state).
"""
from __future__ import annotations

import functools
import hashlib
import random
import re
from dataclasses import dataclass

# Parameter ranges (inclusive) per difficulty variant; every variant also requires d < a, so no
# intermediate result is negative.
#   v2 (the default, the task the shipped model is evaluated on): one-digit a, b, c, d; the steps are
#      a one-digit product, a one-digit + two-digit sum and a two-digit - one-digit difference
#      (largest result 9 + 81 = 90). 36 (a, d) pairs x 64 (b, c) pairs = 2304 tuples.
#   v1 (harder: two-digit a and d, results up to 148): the first training stage of the shipped model
#      (the 0.8M model stayed at ~7% exact match on v1's dev split after 1250 steps, see its log).
VARIANTS = {
    "v1": {"a": (20, 69), "b": (2, 9), "c": (2, 9), "d": (2, 19)},
    "v2": {"a": (2, 9), "b": (2, 9), "c": (2, 9), "d": (1, 8)},
}
DEFAULT_VARIANT = "v2"
MAX_SOLUTION_TOKENS = {"v1": 33, "v2": 28}  # longest solution incl. the final EOS, in tokens (tested)
TEST_PERCENT = 10  # share of (a, b, c, d) tuples held out for the test split
DEV_PERCENT = 5  # a further share held out for monitoring during training (never trained on)

NAMES = [("Lily", "She"), ("Tom", "He"), ("Anna", "She"), ("Ben", "He"),
         ("Mia", "She"), ("Sam", "He"), ("Zoe", "She"), ("Max", "He")]
ITEMS = ["apples", "pens", "cards", "eggs", "books", "stamps", "shells", "coins"]
CONTAINERS = ["boxes", "bags", "packs", "jars"]

# Three templates with different operation orders; each renders (prompt, [(x, op, y, z), ...]).
TEMPLATES = ("buy", "find", "lose")

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Problem:
    """One problem: its parameters, the rendered prompt and worked solution, and the answer."""

    template: str
    a: int
    b: int
    c: int
    d: int
    name: str
    pron: str
    item: str
    container: str
    prompt: str
    solution: str
    answer: int

    @property
    def numbers(self) -> tuple[int, int, int, int]:
        return (self.a, self.b, self.c, self.d)


def split_of(a: int, b: int, c: int, d: int) -> str:
    """"train", "dev" or "test" for a numeric tuple (keyed hash, stable across Python versions and runs)."""
    key = f"lopa-arith-v1:{a}:{b}:{c}:{d}".encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:4], "little") % 100
    if bucket < TEST_PERCENT:
        return "test"
    return "dev" if bucket < TEST_PERCENT + DEV_PERCENT else "train"


def _check_variant(fn: str, variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"{fn}: variant={variant!r}; allowed: {sorted(VARIANTS)}")
    return VARIANTS[variant]


def all_tuples(split: str, variant: str = DEFAULT_VARIANT) -> list[tuple[int, int, int, int]]:
    """Every numeric tuple of `split` in `variant`, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"all_tuples: split={split!r}; allowed: {SPLITS}")
    r = _check_variant("all_tuples", variant)
    out = []
    for a in range(r["a"][0], r["a"][1] + 1):
        for b in range(r["b"][0], r["b"][1] + 1):
            for c in range(r["c"][0], r["c"][1] + 1):
                for d in range(r["d"][0], r["d"][1] + 1):
                    if d < a and split_of(a, b, c, d) == split:
                        out.append((a, b, c, d))
    return out


# template -> (prompt format, the worked steps (x, op, y, x op y) from a, b, c, d and m = b * c)
_FORMS = {
    "buy": ("{name} has {a} {item} . {pron} buys {b} {container} with {c} {item} in each . "
            "{pron} gives away {d} {item} . How many {item} does {name} have now ? Answer :",
            lambda a, b, c, d, m: [(b, "*", c, m), (a, "+", m, a + m), (a + m, "-", d, a + m - d)]),
    "find": ("{name} has {b} {container} with {c} {item} in each . {pron} finds {a} more {item} "
             "and loses {d} {item} . How many {item} does {name} have now ? Answer :",
             lambda a, b, c, d, m: [(b, "*", c, m), (m, "+", a, m + a), (m + a, "-", d, m + a - d)]),
    "lose": ("{name} has {a} {item} . {pron} loses {d} {item} . Then {pron_low} gets {b} {container} "
             "with {c} {item} in each . How many {item} does {name} have now ? Answer :",
             lambda a, b, c, d, m: [(a, "-", d, a - d), (b, "*", c, m), (a - d, "+", m, a - d + m)]),
}


def render(template: str, a: int, b: int, c: int, d: int, name: str, pron: str, item: str, container: str) -> Problem:
    """Render one problem (prompt text, worked solution text, answer)."""
    if template not in _FORMS:
        raise ValueError(f"render: template={template!r}; allowed: {TEMPLATES}")
    fmt, worked = _FORMS[template]
    prompt = fmt.format(name=name, a=a, b=b, c=c, d=d, item=item, container=container, pron=pron,
                        pron_low=pron.lower())
    steps = worked(a, b, c, d, b * c)
    r = steps[-1][3]
    solution = " ".join(f"{x} {op} {y} = {z} ." for x, op, y, z in steps) + f" #### {r}"
    return Problem(template, a, b, c, d, name, pron, item, container, prompt, solution, r)


def generate(split: str, n: int, seed: int = 0, variant: str = DEFAULT_VARIANT) -> list[Problem]:
    """`n` problems of `split`, deterministic in (split, n, seed, variant).

    train: numeric tuples drawn with replacement from the train tuples (an endless stream for
    training is `generate("train", n, seed=step)`). test: a fixed seeded sample *without*
    replacement from the held-out tuples (so n <= len(all_tuples("test")) = a few thousand); dev
    likewise.
    """
    if split not in SPLITS:
        raise ValueError(f"generate: split={split!r}; allowed: {SPLITS}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"generate: n={n!r}; expected an int >= 0")
    _check_variant("generate", variant)
    rng = random.Random(f"{split}:{seed}")
    return [render(*problem) for problem in draw_problems(rng, split, variant, n)]


def draw_problems(rng: random.Random, split: str, variant, n: int):
    """Yield n problems of `split` as render()'s leading arguments (template, a, b, c, d, name, pronoun, item,
    container), drawn from `rng` one problem at a time (a caller may draw more from rng between two problems):
    held-out splits without replacement, train with replacement."""
    tuples = _tuples_cached(split, variant)
    if split != "train":
        if n > len(tuples):
            raise ValueError(f"generate: n={n} exceeds the {len(tuples)} held-out tuples")
        chosen = rng.sample(tuples, n)
    else:
        chosen = [tuples[rng.randrange(len(tuples))] for _ in range(n)]
    for a, b, c, d in chosen:
        template = TEMPLATES[rng.randrange(len(TEMPLATES))]
        name, pron = NAMES[rng.randrange(len(NAMES))]
        item = ITEMS[rng.randrange(len(ITEMS))]
        container = CONTAINERS[rng.randrange(len(CONTAINERS))]
        yield template, a, b, c, d, name, pron, item, container


@functools.cache
def _tuples_cached(split: str, variant: str) -> list[tuple[int, int, int, int]]:
    return all_tuples(split, variant)


_ANSWER_RE = re.compile(r"####\s*(-?[\d ]+)")


def extract_answer(text: str) -> int | None:
    """The integer after the first "####" in decoded text (digits may be space-separated, as the
    word-level tokenizer decodes them), or None."""
    mt = _ANSWER_RE.search(text)
    if not mt:
        return None
    digits = mt.group(1).replace(" ", "")
    try:
        return int(digits)
    except ValueError:
        return None


def join_digits(text: str) -> str:
    """Undo the tokenizer's digit split for display: "2 3 + 2 4" -> "23 + 24"."""
    return re.sub(r"(?<=\d) (?=\d)", "", text)
