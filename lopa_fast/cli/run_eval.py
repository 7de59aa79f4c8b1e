"""`demo` and `eval`: the embedded task's held-out problems decoded by the eval rows (lopa_fast.tasks.evaluate)."""
from __future__ import annotations

import logging
import os
import shlex

from lopa_fast.cli.checks import CLIError, check_out, user_errors


def demo(args) -> int:
    from lopa_fast.tasks.evaluate import run_demo

    if args.n < 1:
        raise CLIError(f"--n {args.n}; allowed: an int >= 1")
    run_demo(n=args.n, backend=args.backend, model_dir=args.model, compile=args.compile, task=args.task)
    return 0

def evaluate(args) -> int:
    from lopa_fast.tasks.eval_rows import check_block_size, eval_task, out_path, parse_rows
    from lopa_fast.tasks.evaluate import run_eval

    task = user_errors(eval_task, args.task)  # before any work (model load, decoding)
    if args.verifier is not None and not os.path.isdir(args.verifier):
        raise CLIError(f"--verifier {args.verifier}: not a directory (an HF-format causal qwen2 model directory)")
    user_errors(check_block_size, args.block_size, task.gen_len)
    user_errors(parse_rows, args.strategies, args.task)
    if args.n < 1:
        raise CLIError(f"--n {args.n}; allowed: an int >= 1")
    out = out_path(args.out, args.backend, args.n, args.block_size, args.task)
    check_out(out, f"--out {args.out if args.out is not None else out.parent}")  # before hours of decoding
    command = "python -m lopa_fast " + " ".join(shlex.quote(a) for a in args.argv)
    run_eval(n=args.n, strategies=args.strategies, backend=args.backend, out=out, model_dir=args.model,
             progress=not args.no_progress and args.log_level <= logging.INFO, command=command,
             block_size=args.block_size, compile=args.compile, task=args.task, student_dir=args.student,
             verifier_dir=args.verifier)
    return 0
