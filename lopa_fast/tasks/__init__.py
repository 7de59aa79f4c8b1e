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

__all__ = [
    "BOS_ID", "EOS_ID", "MASK_ID", "Problem", "all_tuples", "build_tokenizer", "encode_problem", "extract_answer",
    "generate", "join_digits", "render", "save_tokenizer", "split_of", "vocab",
]
