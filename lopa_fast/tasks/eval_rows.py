"""The eval's rows and tasks: which strategies and knobs `python -m lopa_fast eval` runs (and `generate --preset`
names), on which task and models, and where the table goes. Light (no torch): the CLI's parser reads it. What each
row and task is: docs/tasks.md "Eval rows".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lopa_fast import strategies
from lopa_fast.tasks import arith_var

GEN_LEN = 32
BLOCK = 8
# block sizes the eval accepts: those that divide GEN_LEN (every decoder splits the answer into whole blocks)
BLOCK_SIZES = tuple(b for b in range(1, GEN_LEN + 1) if GEN_LEN % b == 0)


@dataclass(frozen=True)
class EvalTask:
    """What the eval runs for one task: its answer length and the shipped models of its rows."""

    name: str
    gen_len: int  # max_new_tokens of every row (a multiple of the default block 8)
    model: str  # the dLLM asset (lopa_fast/assets/<model>)
    verifier: str  # the causal verifier of the APD rows
    student: str | None = None  # the dParallel student of the dparallel-* rows (None: the task has no such rows)


# arith-var: the longest solution is 96 tokens incl. EOS (docs/tasks.md); 96 = 12 blocks of 8, as the model was trained
EVAL_TASKS = {
    "arith": EvalTask("arith", GEN_LEN, "d2f-arith", "ar-arith"),
    "arith-var": EvalTask("arith-var", arith_var.GEN_LEN, "d2f-arith-var", "ar-arith-var", "dparallel-arith-var"),
}
DEFAULT_TASK = "arith"


def eval_task(task) -> EvalTask:
    """The EvalTask of a task name; ValueError naming the allowed ones."""
    if task not in EVAL_TASKS:
        raise ValueError(f"task={task!r}; allowed: {', '.join(EVAL_TASKS)}")
    return EVAL_TASKS[task]


def check_block_size(block_size, gen_len: int = GEN_LEN) -> int:
    """Validate the eval's block size (must divide max_new_tokens `gen_len`, 32 for arith); returns it."""
    sizes = tuple(b for b in range(1, gen_len + 1) if gen_len % b == 0)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in sizes:
        raise ValueError(f"block_size={block_size!r}; allowed: a divisor of max_new_tokens {gen_len}: "
                         f"{', '.join(map(str, sizes))}")
    return block_size


def strategy_rows(block_size: int = BLOCK, gen_len: int = GEN_LEN, verifier: bool = False) -> dict[str, dict]:
    """The rows the registered strategies give (`Strategy.eval_rows`), in registration order: those of the
    strategies without a verifier, or (verifier=True) of those that take one (APD's: they need the verifier model,
    so they are not `generate --preset`s)."""
    specs = [strategies.get(name) for name in strategies.names()]
    return {row: knobs for s in specs if s.takes_verifier == verifier
            for row, knobs in s.eval_rows(block_size, gen_len).items()}


def apd_rows(gen_len: int = GEN_LEN) -> dict[str, dict]:
    """The rows of the strategies that take a verifier (APD: upstream's presets scaled by gen_len / 256)."""
    return strategy_rows(BLOCK, gen_len, verifier=True)


APD_ROWS: dict[str, dict] = apd_rows(GEN_LEN)

# the dParallel student's rows (tasks with a student): the entropy-threshold rule at dParallel's Dream GSM8K
# tau_H = 0.45 nats, and LoPA k=4 with the D2F knobs
STUDENT_ROWS = ("dparallel-h0.45", "dparallel-lopa-k4")
STUDENT_ENTROPY_THRESHOLD = 0.45
# the teacher (the task's model) under the student's rule: the row that dParallel's forwards-per-answer ratio
# divides by (student vs teacher under the same rule, issue 27)
TEACHER_RULE_ROW = "threshold-h0.45"
VERIFIER_MODEL = "ar-arith"  # the shipped causal qwen2 model (same tokenizer as d2f-arith): APD's verifier


def make_rows(block_size: int = BLOCK, apd: bool = False, gen_len: int = GEN_LEN,
              student: bool = False) -> dict[str, dict]:
    """Every row's knobs with `block_size` applied to all block knobs (vanilla/threshold block_length too), for
    answers of `gen_len` tokens (vanilla: gen_len steps; APD presets scaled by gen_len / 256): the strategies' own
    rows (`strategy_rows`).

    apd=True appends the rows of the strategies with a verifier (APD's); student=True appends the dParallel student's
    rows (they run on the student model) and the teacher's row under the student's rule (TEACHER_RULE_ROW, on the
    task's model)."""
    block_size = check_block_size(block_size, gen_len)
    rows = strategy_rows(block_size, gen_len)
    return rows | (strategy_rows(block_size, gen_len, verifier=True) if apd else {}) | ({
        # one token per forward, left to right (threshold decoding in blocks of one token: one forward fills its
        # block; LLaDA's semi-autoregressive sampler at block_length 1): the base teacher's gate (issue 27) beside
        # the vanilla row's whole-region entropy order
        "left-to-right": dict(strategy="threshold", block_size=1, block_length=1, threshold=0.9),
        TEACHER_RULE_ROW: dict(strategy="threshold", block_size=block_size, block_length=block_size,
                               entropy_threshold=STUDENT_ENTROPY_THRESHOLD),
        "dparallel-h0.45": dict(strategy="threshold", block_size=block_size, block_length=block_size,
                                entropy_threshold=STUDENT_ENTROPY_THRESHOLD),
        "dparallel-lopa-k4": dict(rows["lopa-k4"]),  # the lopa-k4 row, on the student
    } if student else {})


def task_rows(task: str = DEFAULT_TASK, block_size: int = BLOCK) -> dict[str, dict]:
    """Every eval row of `task` (its APD rows, and its student's rows when it has a student)."""
    t = eval_task(task)
    return make_rows(block_size, apd=True, gen_len=t.gen_len, student=t.student is not None)


ROWS: dict[str, dict] = make_rows(BLOCK)  # the dLLM-only rows (also the CLI's generate presets)
EVAL_ROWS: dict[str, dict] = make_rows(BLOCK, apd=True)  # every eval row
# an alias per strategy with several rows (lopa = k2,k4,k8; apd = its three presets), and all
ALIASES = {s: list(rows) for s in strategies.names() if len(rows := strategies.get(s).eval_rows(BLOCK, GEN_LEN)) > 1}
ALIASES["all"] = list(EVAL_ROWS)
BACKENDS = ("reference", "fast", "auto")
# where `eval` writes by default: a directory under the current one, never the package tree nor bench/results
# (the committed tables there are rewritten only by an explicit `--out bench/results`)
OUT_DIR = "lopa_fast_eval"


def out_name(backend: str, n: int, block_size: int = BLOCK, task: str = DEFAULT_TASK) -> str:
    """The table's file name: eval_<backend>_n<n>[_block<b>][_<task>].md (block and task only when not the
    defaults; the names of the committed tables in bench/results)."""
    block = "" if block_size == BLOCK else f"_block{block_size}"
    suffix = "" if task == DEFAULT_TASK else "_" + task.replace("-", "_")
    return f"eval_{backend}_n{n}{block}{suffix}.md"


def out_path(out, backend: str, n: int, block_size: int = BLOCK, task: str = DEFAULT_TASK) -> Path:
    """Where the table goes: `out` itself when it names a .md file, else the directory `out` (default OUT_DIR)
    holding out_name(...); the PNG goes next to it."""
    if out is not None and str(out).endswith(".md"):
        return Path(out)
    return Path(OUT_DIR if out is None else out) / out_name(backend, n, block_size, task)


def parse_rows(spec: str | list[str], task: str = DEFAULT_TASK) -> list[str]:
    """"vanilla,d2f,lopa" -> row names of `task` (aliases: lopa = k2,k4,k8; apd = apd-r0.6,apd-r0.7,apd-r0.9;
    dparallel = the student's rows (tasks with a student); all)."""
    allowed = list(task_rows(task))  # the row names do not depend on the block size
    aliases = {**ALIASES, "all": allowed}
    if eval_task(task).student is not None:
        aliases["dparallel"] = [TEACHER_RULE_ROW, *STUDENT_ROWS]
        aliases["one-per-forward"] = ["vanilla", "left-to-right"]
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        expanded = aliases.get(name, [name])
        for e in expanded:
            if e not in allowed:
                raise ValueError(f"strategies: {name!r} is not a row of task {task}; allowed: "
                                 f"{', '.join(allowed + list(aliases))}")
            if e not in out:
                out.append(e)
    if not out:
        raise ValueError(f"strategies: {spec!r} names no row; allowed: {', '.join(allowed + list(aliases))}")
    return out


# the demo's rows and task (lopa_fast.tasks.evaluate.run_demo)
DEMO_ROWS = ("d2f", "lopa-k4")
# the demo's default task: arith-var's worked solutions of 64-96 tokens leave D2F room to be slow (about 4 tokens per
# forward), so LoPA's lookahead branches show what they are for (about half D2F's forwards, the same answers). On
# `arith` the model is so confident that D2F already fills a block per round and LoPA cannot do better.
DEMO_TASK = "arith-var"
