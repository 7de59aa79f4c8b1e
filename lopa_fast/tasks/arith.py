"""Templated three-step arithmetic word problems in a GSM8K-like format (the embedded task).

Every problem is fixed by its parameters (template, a, b, c, d, name, item) and has one exact answer.
The worked solution is three short equations and a final "#### <answer>", e.g.

    prompt:   "Lily has 23 apples . She buys 4 boxes with 6 apples in each box . She gives away 17
               apples . How many apples does Lily have now ? Answer :"
    solution: "4 * 6 = 24 . 23 + 24 = 47 . 47 - 17 = 30 . #### 30"

Why this task: the answer needs multi-step arithmetic where later numbers depend on earlier ones
(so decoding many positions in one forward is non-trivial: copied operands are easy, results are
not), yet a ~1M-parameter model learns it in tens of CPU minutes. Numbers are split into single
digits by the tokenizer (as Qwen's tokenizer does).

Splits are disjoint on the numeric parameters (a, b, c, d), not only on the text: a tuple is held
out iff a keyed hash of it falls in the test bucket (10% of tuples) or the dev bucket (5%, used only
to monitor training), whatever template, name or item it is rendered with. The generator is seeded and deterministic (Python's `random.Random(seed)`;
no global state).
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

# Parameter ranges (inclusive). a - d >= 1 always (a >= 20 > 19 >= d), so no result is negative;
# the largest result is 69 + 81 - 2 = 148 (3 digits).
A_RANGE = (20, 69)
B_RANGE = (2, 9)
C_RANGE = (2, 9)
D_RANGE = (2, 19)
TEST_PERCENT = 10  # share of (a, b, c, d) tuples held out for the test split
DEV_PERCENT = 5  # a further share held out for monitoring during training (never trained on)

NAMES = [("Lily", "She"), ("Tom", "He"), ("Anna", "She"), ("Ben", "He"),
         ("Mia", "She"), ("Sam", "He"), ("Zoe", "She"), ("Max", "He")]
ITEMS = ["apples", "pens", "cards", "eggs", "books", "stamps", "shells", "coins"]
CONTAINERS = ["boxes", "bags", "packs", "jars"]

# Three templates with different operation orders; each renders (prompt, [(x, op, y, z), ...]).
TEMPLATES = ("buy", "find", "lose")

SPLITS = ("train", "dev", "test")
MAX_SOLUTION_TOKENS = 33  # longest solution incl. the final EOS, in tokens (checked in tests)


@dataclass(frozen=True)
class Problem:
    """One problem: its parameters, the rendered prompt and worked solution, and the answer."""

    template: str
    a: int
    b: int
    c: int
    d: int
    name: str
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


def all_tuples(split: str) -> list[tuple[int, int, int, int]]:
    """Every numeric tuple of `split`, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"all_tuples: split={split!r}; allowed: {SPLITS}")
    out = []
    for a in range(A_RANGE[0], A_RANGE[1] + 1):
        for b in range(B_RANGE[0], B_RANGE[1] + 1):
            for c in range(C_RANGE[0], C_RANGE[1] + 1):
                for d in range(D_RANGE[0], D_RANGE[1] + 1):
                    if split_of(a, b, c, d) == split:
                        out.append((a, b, c, d))
    return out


def _eq(x: int, op: str, y: int, z: int) -> str:
    return f"{x} {op} {y} = {z} ."


def render(template: str, a: int, b: int, c: int, d: int, name: str, pron: str, item: str, container: str) -> Problem:
    """Render one problem (prompt text, worked solution text, answer)."""
    m = b * c
    if template == "buy":
        prompt = (f"{name} has {a} {item} . {pron} buys {b} {container} with {c} {item} in each . "
                  f"{pron} gives away {d} {item} . How many {item} does {name} have now ? Answer :")
        s = a + m
        r = s - d
        steps = [(b, "*", c, m), (a, "+", m, s), (s, "-", d, r)]
    elif template == "find":
        prompt = (f"{name} has {b} {container} with {c} {item} in each . {pron} finds {a} more {item} "
                  f"and loses {d} {item} . How many {item} does {name} have now ? Answer :")
        s = m + a
        r = s - d
        steps = [(b, "*", c, m), (m, "+", a, s), (s, "-", d, r)]
    elif template == "lose":
        prompt = (f"{name} has {a} {item} . {pron} loses {d} {item} . Then {pron.lower()} gets {b} {container} "
                  f"with {c} {item} in each . How many {item} does {name} have now ? Answer :")
        s = a - d
        r = s + m
        steps = [(a, "-", d, s), (b, "*", c, m), (s, "+", m, r)]
    else:
        raise ValueError(f"render: template={template!r}; allowed: {TEMPLATES}")
    solution = " ".join(_eq(*st) for st in steps) + f" #### {r}"
    return Problem(template, a, b, c, d, name, item, container, prompt, solution, r)


def generate(split: str, n: int, seed: int = 0) -> list[Problem]:
    """`n` problems of `split`, deterministic in (split, n, seed).

    train: numeric tuples drawn with replacement from the train tuples (an endless stream for
    training is `generate("train", n, seed=step)`). test: a fixed seeded sample *without*
    replacement from the held-out tuples (so n <= len(all_tuples("test")) = a few thousand); dev
    likewise.
    """
    if split not in SPLITS:
        raise ValueError(f"generate: split={split!r}; allowed: {SPLITS}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"generate: n={n!r}; expected an int >= 0")
    rng = random.Random(f"{split}:{seed}")
    tuples = _tuples_cached(split)
    if split != "train":
        if n > len(tuples):
            raise ValueError(f"generate: n={n} exceeds the {len(tuples)} held-out tuples")
        chosen = rng.sample(tuples, n)
    else:
        chosen = [tuples[rng.randrange(len(tuples))] for _ in range(n)]
    out = []
    for a, b, c, d in chosen:
        template = TEMPLATES[rng.randrange(len(TEMPLATES))]
        name, pron = NAMES[rng.randrange(len(NAMES))]
        item = ITEMS[rng.randrange(len(ITEMS))]
        container = CONTAINERS[rng.randrange(len(CONTAINERS))]
        out.append(render(template, a, b, c, d, name, pron, item, container))
    return out


_CACHE: dict[str, list] = {}


def _tuples_cached(split: str) -> list[tuple[int, int, int, int]]:
    if split not in _CACHE:
        _CACHE[split] = all_tuples(split)
    return _CACHE[split]


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
