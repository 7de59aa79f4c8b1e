"""Command line: `python -m lopa_fast {demo, eval, generate}` (`lopa-fast` when installed).

    python -m lopa_fast demo                      # the main job: embedded model, D2F vs LoPA, fill order
    python -m lopa_fast eval --n 100              # Table 1 on the embedded task -> bench/results/
    python -m lopa_fast generate --prompt "Tom has 23 pens . ..." --strategy lopa
"""
from __future__ import annotations

import argparse
import shlex
import sys

DEFAULT_EVAL_OUT = "bench/results/eval_{backend}_n{n}{block}.md"  # {block}: "_block32" unless the default 8


def _demo(args) -> int:
    from lopa_fast.tasks.evaluate import run_demo

    run_demo(n=args.n, backend=args.backend, model_dir=args.model, compile=args.compile)
    return 0


def _eval(args) -> int:
    from lopa_fast.tasks.evaluate import BLOCK, check_block_size, run_eval

    check_block_size(args.block_size)  # before any work (model load, decoding)
    block = "" if args.block_size == BLOCK else f"_block{args.block_size}"
    out = args.out if args.out is not None else DEFAULT_EVAL_OUT.format(backend=args.backend, n=args.n, block=block)
    command = "python -m lopa_fast " + " ".join(shlex.quote(a) for a in args.argv)
    run_eval(n=args.n, strategies=args.strategies, backend=args.backend, out=out, model_dir=args.model,
             progress=not args.no_progress, command=command, block_size=args.block_size, compile=args.compile)
    return 0


def _generate(args) -> int:
    import torch

    import lopa_fast
    from lopa_fast.tasks.evaluate import GEN_LEN, ROWS, answer_text, load_default

    if args.strategy not in ROWS:
        raise ValueError(f"--strategy {args.strategy!r}; allowed: {', '.join(ROWS)}")
    model, tok, _ = load_default(args.model)
    ids = torch.tensor(tok(args.prompt)["input_ids"], dtype=torch.long)
    out = lopa_fast.generate(model, ids, backend=args.backend, max_new_tokens=GEN_LEN, temperature=0.0,
                             compile=args.compile, **ROWS[args.strategy])
    st = out.stats
    print(answer_text(tok, out.generated_ids))
    print(f"TPF {st['tpf']:.2f}, forwards {st['forwards']}, wall {1000 * st['seconds']:.0f} ms", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from lopa_fast.tasks.evaluate import BACKENDS, BLOCK, BLOCK_SIZES, GEN_LEN, ROWS

    ap = argparse.ArgumentParser(prog="python -m lopa_fast", description="Fast diffusion-LLM decoding (LoPA, D2F, ...)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", default="reference", choices=BACKENDS, help="decoder backend (default reference)")
    common.add_argument("--model", default=None, help="model directory (default: the embedded d2f-arith model)")
    # one thread: the embedded model's matmuls are tiny (~65 x 128 x 384), and on a shared 2-core machine
    # a second OpenMP thread made each forward ~60x slower (18 ms vs 0.3 ms per matmul, measured)
    common.add_argument("--compile", action="store_true",
                        help="compile each round bucket once and replay it (fast backend; d2f / lopa rows)")
    common.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")

    d = sub.add_parser("demo", parents=[common], help="decode a few held-out prompts with D2F and LoPA")
    d.add_argument("--n", type=int, default=3, help="number of held-out problems (default 3)")
    d.set_defaults(fn=_demo)

    e = sub.add_parser("eval", parents=[common], help="accuracy / TPF / forwards / tokens/s for every strategy")
    e.add_argument("--n", type=int, default=100, help="held-out problems per strategy (default 100)")
    e.add_argument("--strategies", default="all",
                   help=f"comma-separated rows: {', '.join(ROWS)}; aliases lopa (= k2,k4,k8), all (default)")
    e.add_argument("--out", default=None, help=f"markdown path (PNG next to it); default {DEFAULT_EVAL_OUT}")
    e.add_argument("--block-size", type=int, default=BLOCK,
                   help=f"block size for every row's block knobs; a divisor of max_new_tokens {GEN_LEN}: "
                        f"{', '.join(map(str, BLOCK_SIZES))} (default {BLOCK})")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(fn=_eval)

    g = sub.add_parser("generate", parents=[common], help="decode one prompt with the embedded model")
    g.add_argument("--prompt", required=True, help="task-format prompt text (ends with 'Answer :')")
    g.add_argument("--strategy", default="lopa-k4", help=f"one of {', '.join(ROWS)} (default lopa-k4)")
    g.set_defaults(fn=_generate)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads}; allowed: an int >= 1")
    import torch

    torch.set_num_threads(args.threads)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
