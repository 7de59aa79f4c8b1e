"""Command line: `python -m lopa_fast {demo, eval, generate, lm-eval}` (`lopa-fast` when installed).

    python -m lopa_fast demo                      # the main job: LoPA vs D2F on the embedded arith-var model
    python -m lopa_fast eval --n 100              # Table 1 on the embedded task -> ./lopa_fast_eval/ (--out DIR)
    python -m lopa_fast generate --prompt "Tom has 23 pens . ..." --preset lopa-k4
    python -m lopa_fast generate --model DIR [--lora DIR] --chat --prompt "..." --strategy lopa --block-size 32 --json
    python -m lopa_fast generate --prompt "..." --png fill.png   # + the fill-order heatmap (lopa_fast.viz)
    python -m lopa_fast generate --prompt "..." --stream --stop-text '\\n\\n'   # text as it becomes final
    python -m lopa_fast generate --prompt "..." --show-steps   # the live denoising view, round by round
    python -m lopa_fast serve [--model DIR] [--lora DIR] [--host H] [--port P]  # OpenAI-compatible (docs/serve.md)
    python -m lopa_fast lm-eval --model lopa_fast --model_args pretrained=DIR,strategy=lopa --tasks gsm8k  # its args

`generate` takes every knob of `lopa_fast.generate` as a flag of the same name (dashes for underscores), typed
from GenerateConfig's fields. From the command line (`main()` with no argv) every user error (unknown flag or
value, a missing / unreadable model directory, a non-UTF-8 prompt file, an empty prompt, a lopa_fast error, a
knob the validation refuses) prints one line to stderr and exits 2; called with an argv list, `main` raises the
typed exception instead (programmatic use, tests). Every subcommand shows lopa_fast's INFO log lines on stderr
(what a long step is doing: a compile, a large model load); `-q` only warnings, `-v` DEBUG.

Modules: parser.py (the parser, built from light modules: `--help` imports no torch), flags.py (the knob flags
generated from GenerateConfig, presets, other libraries' names), checks.py (the error type and the checks run
before any work), run_generate.py / run_serve.py / run_eval.py (each subcommand's runner); `main` here.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time

from lopa_fast.cli.checks import CLIError, check_device, check_environment, log_to_stderr, text_stop
from lopa_fast.cli.flags import EMBEDDED_PRESET, generate_knobs, knob_type, preset_knobs, token_sequences
from lopa_fast.cli.parser import build_parser
from lopa_fast.errors import LopaError
from lopa_fast.request.text import encode_prompt, unknown_words

# the names tests, docs and other modules reach through lopa_fast.cli
__all__ = ["CLIError", "EMBEDDED_PRESET", "LopaError", "build_parser", "encode_prompt", "generate_knobs", "knob_type",
           "log_to_stderr", "main", "preset_knobs", "text_stop", "token_sequences", "unknown_words"]


def main(argv=None, *, exit_on_error: bool | None = None) -> int:
    """Run the CLI. From the command line (argv None) a user error prints one line to stderr and returns 2;
    with an argv list the typed exception propagates (exit_on_error= overrides either way)."""
    if exit_on_error is None:
        exit_on_error = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except LopaError as e:  # CLIError, CheckpointError, KnobError, RoundCapError, ...: by type, never by message
        if not exit_on_error:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"python -m lopa_fast: error: {msg}", file=sys.stderr)
        return 2

def _lm_eval(argv) -> int:
    """`lm-eval ARGS`: lm-eval's own command line with the `lopa_fast` model registered (lopa_fast.lm_eval)."""
    from lopa_fast import logs

    with log_to_stderr(logging.INFO):  # lm-eval's own flags have no -q / -v: lopa_fast's INFO lines, as elsewhere
        try:  # lm-eval, datasets, torch, transformers: 5-15 s on a 2-core machine (said while it runs)
            with logs.step(logging.getLogger("lopa_fast.cli"), "importing lm-eval", "imported lm-eval", long=False):
                from lopa_fast import lm_eval

                lm_eval.prepare()
        except ModuleNotFoundError as e:
            if e.name is None or not e.name.startswith("lm_eval"):
                raise
            raise CLIError("lm-eval: lm-evaluation-harness is not installed; pip install '.[eval]' (or lm-eval)") from e
        return lm_eval.main(argv)

def _run(argv) -> int:
    if argv[:1] == ["lm-eval"]:  # every further argument is lm-eval's own (it parses them)
        return _lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.threads < 1:
        raise CLIError(f"--threads {args.threads}; allowed: an int >= 1")
    check_device(getattr(args, "device", None))  # before any work: a load, a build, a decode
    had_torch, t0 = "torch" in sys.modules, time.perf_counter()
    check_environment()  # imports torch (lopa_fast.ops): the import's time, for -v's line below
    env_s = time.perf_counter() - t0
    with log_to_stderr(args.log_level):
        from lopa_fast import logs

        cli_log = logging.getLogger("lopa_fast.cli")
        if not had_torch and "torch" in sys.modules:  # -v said "imported torch in 0.0 s" here (issue 42, finding 8):
            # the import happened in check_environment, before the log handler (so a bad variable is one line). Said
            # after the fact, so at DEBUG (-v) however long it took: at INFO a busy machine's >= 2 s import put two
            # lines before a user error found next (`--model /no/such/dir`), which must be ONE line
            cli_log.debug("importing torch...")
            cli_log.debug("imported torch in %.1f s", env_s)
        # torch's import: 1.5 s on a quiet machine, 4-6 s under load (said while it runs when it takes > 2 s)
        with logs.step(cli_log, "importing torch", "imported torch", long=False) if "torch" not in sys.modules \
                else contextlib.nullcontext():
            import torch

        torch.set_num_threads(args.threads)
        return args.fn(args)
