"""The embedded task: seeded GSM8K-like arithmetic word problems, its tokenizer and batching helpers."""
from lopa_fast.tasks.arith import (
    Problem,
    all_tuples,
    extract_answer,
    generate,
    join_digits,
    render,
    split_of,
)
from lopa_fast.tasks.tokenizer import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    build_tokenizer,
    encode_problem,
    save_tokenizer,
    vocab,
)
from lopa_fast.tasks import arith, arith_var, tokenizer_var  # noqa: E402  task `arith-var` (issue 12), its tokenizer

TASKS = {"arith": arith, "arith-var": arith_var}  # task name -> module (generate, split_of, ...)

__all__ = [
    "BOS_ID", "EOS_ID", "MASK_ID", "Problem", "all_tuples", "build_tokenizer", "encode_problem", "extract_answer",
    "generate", "join_digits", "render", "save_tokenizer", "split_of", "vocab",
    "TASKS", "arith_var", "tokenizer_var",
]
