"""The embedded task: seeded GSM8K-like arithmetic word problems, its tokenizer and batching helpers."""
from lopa_fast.tasks.arith import all_tuples, extract_answer, generate, join_digits
from lopa_fast.tasks.tokenizer import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    build_tokenizer,
    encode_problem,
    save_tokenizer,
    vocab,
)
from lopa_fast.tasks import arith, arith_var, tokenizer, tokenizer_var  # noqa: E402  task `arith-var` (issue 12), its tokenizer

TASKS = {"arith": arith, "arith-var": arith_var}  # task name -> module (generate, split_of, ...)
TOKENIZERS = {"arith": tokenizer, "arith-var": tokenizer_var}  # task name -> its tokenizer module


def check_task(task) -> str:
    """Validate a task name; returns it."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}; allowed: {', '.join(TASKS)}")
    return task


def generate_task(task: str, split: str, n: int, seed: int = 0, variant: str = arith.DEFAULT_VARIANT) -> list:
    """`n` problems of `task` (`arith`: in `variant`; `arith-var` has one numeric variant, v2, and rejects others)."""
    if check_task(task) == "arith":
        return arith.generate(split, n, seed=seed, variant=variant)
    if variant != arith_var.VARIANT:
        raise ValueError(f"variant={variant!r}: task arith-var has only variant {arith_var.VARIANT!r}")
    return arith_var.generate(split, n, seed=seed)

__all__ = [
    "BOS_ID", "EOS_ID", "MASK_ID", "all_tuples", "build_tokenizer", "encode_problem", "extract_answer", "generate",
    "join_digits", "save_tokenizer", "vocab",
    "TASKS", "TOKENIZERS", "arith_var", "check_task", "generate_task", "tokenizer_var",
]
