"""The argument parser: the common flags, then each subcommand's (`demo`, `eval`, `generate`, `serve`, `lm-eval`),
the knob flags generated from GenerateConfig. Built from light modules only: `--help` imports no torch."""
from __future__ import annotations

import argparse
import dataclasses
import logging

from lopa_fast.cli import run_eval, run_generate, run_serve
from lopa_fast.cli.checks import Parser, text_stop
from lopa_fast.cli.flags import (EMBEDDED_PRESET, VERIFIER_HELP, add_knob_flags, add_other_library_flags, knob_help,
                                 preset_names)


def build_parser() -> argparse.ArgumentParser:
    from lopa_fast import strategies
    from lopa_fast.config import GenerateConfig
    from lopa_fast.tasks.eval_rows import (
        BACKENDS,
        BLOCK,
        BLOCK_SIZES,
        DEMO_TASK,
        EVAL_ROWS,
        EVAL_TASKS,
        GEN_LEN,
        OUT_DIR,
        out_name,
    )

    knob = {f.name: f for f in dataclasses.fields(GenerateConfig)}

    def model_flags(p, preset_as: str) -> None:  # generate's and serve's --strategy, --preset, --dtype, --device
        p.add_argument("--strategy", default=None, choices=strategies.names(), help=knob_help(knob["strategy"]))
        p.add_argument("--preset", default=None, choices=preset_names(),
                       help=f"an eval row's knobs{preset_as} (the embedded model: {EMBEDDED_PRESET} unless --strategy "
                            "is given)")
        p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                       help="weights dtype (default bfloat16 on CUDA, float32 on CPU)")
        p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default cuda when available)")

    from lopa_fast.server.served import NOT_SERVED

    # allow_abbrev=False: `--n 2` is not an "ambiguous option" prefix of ten --no-* flags (each flag by its name)
    ap = Parser(prog="python -m lopa_fast", description="Fast diffusion-LLM decoding (LoPA, D2F, ...)",
                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = Parser(add_help=False, allow_abbrev=False)
    common.add_argument("--backend", default="auto", choices=BACKENDS, help=knob_help(knob["backend"]))
    common.add_argument("--model", default=None, help="model directory (default: the embedded model: d2f-arith for "
                                                      "generate / serve, the --task's model for demo / eval)")
    # one thread: the embedded model's matmuls are tiny (~65 x 128 x 384), and on a shared 2-core machine
    # a second OpenMP thread made each forward ~60x slower (18 ms vs 0.3 ms per matmul, measured)
    common.add_argument("--compile", action="store_true", help=knob_help(knob["compile"]))
    common.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    loud = common.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG,
                      default=logging.INFO, help="debug log lines too (default: info lines on stderr say what a "
                                                  "long step is doing: a compile, a large model load)")
    loud.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING,
                      help="only warnings and errors (no info lines, no progress bar)")

    d = sub.add_parser("demo", parents=[common], allow_abbrev=False,
                       help="decode a few held-out prompts with D2F and LoPA")
    d.add_argument("--n", type=int, default=3, help="number of held-out problems (default 3)")
    d.add_argument("--task", default=DEMO_TASK, choices=list(EVAL_TASKS),
                   help=f"the held-out task (default {DEMO_TASK}: worked solutions of 64-96 tokens on its model "
                        "d2f-arith-var, where LoPA needs about half D2F's forwards; arith: 32 new tokens on d2f-arith, "
                        "where D2F already fills a block per round)")
    d.set_defaults(fn=run_eval.demo)

    e = sub.add_parser("eval", parents=[common], allow_abbrev=False,
                       help="accuracy / TPF / forwards / tokens/s for every strategy")
    e.add_argument("--n", type=int, default=100, help="held-out problems per strategy (default 100)")
    e.add_argument("--strategies", default="all",
                   help=f"comma-separated rows: {', '.join(EVAL_ROWS)}; aliases lopa (= k2,k4,k8), apd (the three "
                        "apd rows), all (default); --task arith-var adds threshold-h0.45 (the teacher under the "
                        "student's rule), dparallel-h0.45, dparallel-lopa-k4 (alias dparallel: these three)")
    e.add_argument("--out", default=None, metavar="DIR",
                   help=f"directory of the table and its PNG, named {out_name('BACKEND', 'N')} (+ _block<b>, "
                        f"_<task> when not the defaults); default ./{OUT_DIR}/ under the current directory; a path "
                        "ending in .md names the file itself. The committed tables: --out bench/results")
    e.add_argument("--block-size", type=int, default=BLOCK,
                   help=f"block size for every row's block knobs; a divisor of max_new_tokens {GEN_LEN}: "
                        f"{', '.join(map(str, BLOCK_SIZES))} (default {BLOCK}); --task arith-var: a divisor of "
                        f"{EVAL_TASKS['arith-var'].gen_len}")
    e.add_argument("--task", default=DEMO_TASK, choices=list(EVAL_TASKS),
                   help=f"the held-out task (default {DEMO_TASK}, where parallel decoding is hard: max_new_tokens 96 "
                        "(block sizes: the divisors of 96), its model d2f-arith-var, verifier ar-arith-var and "
                        "dparallel rows; arith: 32 new tokens on d2f-arith, where D2F already fills a block per round "
                        "and every LoPA row ties it)")
    e.add_argument("--student", default=None,
                   help="model directory of the dparallel rows (default: the task's shipped student)")
    e.add_argument("--verifier", default=None, metavar="DIR",
                   help="the APD rows' causal AR verifier (default: the task's shipped one, e.g. ar-arith)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(fn=run_eval.evaluate)

    g = sub.add_parser("generate", parents=[common], allow_abbrev=False,
                       help="decode one prompt (any model; default the embedded one)",
                       description="Decode one prompt. Every knob of lopa_fast.generate is a flag of the same name "
                                   "(dashes for underscores); unset knobs keep GenerateConfig's defaults (or the "
                                   "--preset's; the embedded model runs its preset " + EMBEDDED_PRESET + "). Text to "
                                   "stdout, stats to stderr; --json prints one JSON object.")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text")
    src.add_argument("--prompt-file", default=None, help="UTF-8 file holding the prompt (neither: read stdin)")
    g.add_argument("--lora", default=None, help="PEFT LoRA adapter directory, merged at load (e.g. D2F's)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    model_flags(g, "")
    g.add_argument("--stop-text", action="append", default=None, type=text_stop, metavar="TEXT",
                   help="a text stop (repeatable; escapes \\n \\t \\\\): its tokenisation ends decoding early "
                        "and the text is cut at its first occurrence (--stop takes token ids)")
    shown = g.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true",
                       help="print one JSON object: text, generated_ids, stats (and trace with --return-trace)")
    shown.add_argument("--stream", action="store_true",
                       help="print the text as it becomes final (a block once it and every earlier one is complete)")
    shown.add_argument("--show-steps", action="store_true",
                       help="draw the live denoising view each round (redrawn in place on a terminal; one line "
                            "per round otherwise), then the text")
    g.add_argument("--png", default=None, metavar="PATH",
                   help="also write the fill-order heatmap of the run (lopa_fast.viz.fill_order_png) to PATH")
    g.add_argument("--verifier", default=None, metavar="DIR", help=VERIFIER_HELP)
    g.set_defaults(fn=run_generate.generate, knob_names=add_knob_flags(g))
    add_other_library_flags(g)

    v = sub.add_parser("serve", parents=[common], allow_abbrev=False,
                       help="OpenAI-compatible HTTP server (docs/serve.md)",
                       description="Serve a model over HTTP: POST /v1/completions, /v1/chat/completions (stream: "
                                   "true for server-sent events), GET /health, /v1/models, /metrics (Prometheus text: "
                                   "requests by route and status, latency, queue, tokens, forwards). The knob flags "
                                   "set the server's defaults; a request's body fields of the same names override "
                                   "them. One access log line per request (method, path, status, latency) unless "
                                   "--no-access-log.")
    v.add_argument("--lora", default=None, help="PEFT LoRA adapter directory, merged at load (e.g. D2F's)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument("--model-name", default=None, help="the served model id (default the model directory's name)")
    v.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY of every client (default: $LOPA_FAST_API_KEY; required "
                        "when --host is not a loopback address, unless --no-api-key)")
    v.add_argument("--no-api-key", action="store_true",
                   help="serve without a key even when --host listens beyond this machine")
    lim = v.add_argument_group("per-request caps (docs/serve.md, 'Caps')")
    lim.add_argument("--max-branching-factor", type=int, default=16, metavar="K",
                     help="the largest branching_factor a request may ask for (default 16)")
    lim.add_argument("--max-model-len", type=int, default=None, metavar="N",
                     help="prompt + max_tokens in tokens (default the model's max_position_embeddings)")
    lim.add_argument("--max-num-seqs", type=int, default=16, metavar="N",
                     help="requests decoding at once (default 16); more wait in the queue")
    lim.add_argument("--max-batch-rows", type=int, default=64, metavar="N",
                     help="branch rows of one batched forward (default 64, at least --max-branching-factor + 1)")
    lim.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="B",
                     help="the largest request body (default 1048576; larger: 413)")
    lim.add_argument("--max-request-memory", type=float, default=None, metavar="GIB",
                     help="one request's memory estimate (default a quarter of the device's memory)")
    lim.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                     help="the running requests' estimates together (default half of the device's memory)")
    lim.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                     help="seconds to receive a request body (default 30; slower: 408)")
    lim.add_argument("--step-timeout", type=float, default=300.0, metavar="S",
                     help="seconds one batched decoding step may take (default 300); longer: its requests fail (503) "
                          "and /health reports unhealthy until the step returns")
    lim.add_argument("--min-body-rate", type=int, default=1024, metavar="BYTES_PER_S",
                     help="bytes per second a request body must average after its first 2 s (default 1024; slower: "
                          "408, the connection closed; 0: only --read-timeout)")
    lim.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                     help="at SIGTERM / SIGINT, seconds in-flight requests may finish in (default 30; then they are "
                          "cancelled; a second signal ends the wait at once)")
    model_flags(v, " as defaults")
    v.add_argument("--verifier", default=None, metavar="DIR",
                   help=VERIFIER_HELP + "; one for the server, checked against the model at start, used by the "
                                        "requests that set apd_mixture_weight")
    v.add_argument("--log-prompts", action="store_true",
                   help="log notes that quote prompt text (words the tokenizer does not know) at WARNING; default: "
                        "a line without the text at INFO (prompt text in logs is opt-in)")
    v.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access log line per request (default: one INFO line each: method, path, status, latency)")
    v.set_defaults(fn=run_serve.serve, knob_names=add_knob_flags(v, hidden=NOT_SERVED))
    add_other_library_flags(v, length=False)

    sub.add_parser("lm-eval", add_help=False, help="lm-evaluation-harness with the lopa_fast model registered: "
                   "python -m lopa_fast lm-eval --model lopa_fast --model_args pretrained=DIR,... --tasks T "
                   "(every argument is lm-eval's; needs pip install .[eval])")
    return ap
