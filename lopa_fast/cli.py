"""Command line: `python -m lopa_fast {demo, eval, generate, lm-eval}` (`lopa-fast` when installed).

    python -m lopa_fast demo                      # the main job: LoPA vs D2F on the embedded arith-var model
    python -m lopa_fast eval --n 100              # Table 1 on the embedded task -> ./lopa_fast_eval/ (--out DIR)
    python -m lopa_fast generate --prompt "Tom has 23 pens . ..." --preset lopa-k4
    python -m lopa_fast generate --model DIR [--lora DIR] --chat --prompt "..." --strategy lopa --block-size 32 --json
    python -m lopa_fast generate --prompt "..." --png fill.png   # + the fill-order heatmap (lopa_fast.viz)
    python -m lopa_fast generate --prompt "..." --stream --stop-text '\\n\\n'   # text as it becomes final
    python -m lopa_fast generate --prompt "..." --show-steps   # the live denoising view, round by round
    python -m lopa_fast serve [--model DIR] [--lora DIR] [--host H] [--port P]  # OpenAI-compatible (docs/serve.md)
    python -m lopa_fast lm-eval --model lopa_fast --model_args pretrained=DIR,strategy=lopa --tasks gsm8k  # lm-eval's args

`generate` takes every knob of `lopa_fast.generate` as a flag of the same name (dashes for underscores), typed
from GenerateConfig's fields. From the command line (`main()` with no argv) every user error (unknown flag or
value, a missing / unreadable model directory, a non-UTF-8 prompt file, an empty prompt, a lopa_fast error, a
knob the validation refuses) prints one line to stderr and exits 2; called with an argv list, `main` raises the
typed exception instead (programmatic use, tests). Every subcommand shows lopa_fast's INFO log lines on stderr
(what a long step is doing: a compile, a large model load); `-q` only warnings, `-v` DEBUG.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import sys
import types
import typing
import warnings

from lopa_fast.errors import LopaError
from lopa_fast.text import encode_prompt, unknown_words  # noqa: F401  (the CLI's prompt encoding; re-exported)


class CLIError(LopaError, ValueError):
    """A command-line user error (bad prompt, unreadable file, a knob the validation refused)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2, no usage block)."""

    def error(self, message):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _user_errors(fn, *args, **kw):
    """Run a validation; its ValueError / TypeError (by type) becomes a CLIError (exit 2 from the command line)."""
    try:
        return fn(*args, **kw)
    except LopaError:
        raise
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from e

# ---- checks every subcommand runs before any work; its log lines ----------------------------------------
MAX_PROMPT_BYTES = 4 * 2**20  # no supported model's context holds this much text; a bound on reading a stream


class _StderrHandler(logging.Handler):
    """One line per record on the sys.stderr of the moment (pytest's capture, a redirected stream), written
    through tqdm so that a progress bar on the same terminal is not torn."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's contract: a broken stream never raises into the caller
            self.handleError(record)


@contextlib.contextmanager
def log_to_stderr(level: int):
    """lopa_fast's records at `level` and above on stderr while a command runs; the "lopa_fast" logger is left
    as it was afterwards (main() with an argv list is a library call)."""
    logger = logging.getLogger("lopa_fast")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    before = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def available_devices() -> list[str]:
    """The devices this torch can run on: cpu, then cuda:0 .. cuda:N-1 (and mps) when present."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


def check_device(value: str | None) -> None:
    """--device VALUE names a device this torch has, or a CLIError names the value and what is available."""
    if value is None:
        return
    import torch

    where = f"--device {value}"
    have = f"available: {', '.join(available_devices())}"
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise CLIError(f"{where}: not a device name (like cpu, cuda, cuda:1); {have}") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise CLIError(f"{where}: this torch {torch.__version__} has no CUDA ({why}); {have}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CLIError(f"{where}: there are {torch.cuda.device_count()} CUDA device(s); {have}")
        return
    if str(dev) not in available_devices():
        raise CLIError(f"{where}: not available with this torch {torch.__version__}; {have}")


def check_environment() -> None:
    """The environment variables that steer decoding, read before any work (a typo names its variable)."""
    from lopa_fast.ops._backend import env_backend

    _user_errors(env_backend)


def check_out(path, flag: str) -> None:
    """An output file can be written at `path`, checked before the work: not a directory; its directory is made
    (as the write would) and a probe file written and removed there (permission bits do not bind root)."""
    import tempfile

    if os.path.isdir(path):
        raise CLIError(f"{flag}: a directory; pass a file path")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise CLIError(f"{flag}: cannot write under {parent} ({e.strerror or type(e).__name__})") from e


def _demo(args) -> int:
    from lopa_fast.tasks.evaluate import BACKENDS, run_demo

    if args.n < 1:
        raise CLIError(f"--n {args.n}; allowed: an int >= 1")
    if args.backend not in BACKENDS:
        raise CLIError(f"--backend {args.backend!r}; allowed: {', '.join(BACKENDS)}")
    run_demo(n=args.n, backend=args.backend, model_dir=args.model, compile=args.compile, task=args.task)
    return 0


def _eval(args) -> int:
    from lopa_fast.tasks.evaluate import check_block_size, eval_task, out_path, parse_rows, run_eval

    task = _user_errors(eval_task, args.task)  # before any work (model load, decoding)
    if args.verifier is not None and not os.path.isdir(args.verifier):
        raise CLIError(f"--verifier {args.verifier}: not a directory (an HF-format causal qwen2 model directory)")
    _user_errors(check_block_size, args.block_size, task.gen_len)
    _user_errors(parse_rows, args.strategies, args.task)
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


# ---- generate -------------------------------------------------------------------------------------------
_OWN_FLAGS = ("strategy", "backend", "compile")  # GenerateConfig fields with their own (common) flag


def token_sequences(text: str) -> list[list[int]]:
    """`--stop 13,198;7` -> [[13, 198], [7]] (token-id sequences separated by ';', ids by ',')."""
    try:
        seqs = [[int(t) for t in part.split(",")] for part in text.split(";") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token ids like 13,198;7") from None
    if not seqs:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token ids like 13,198;7")
    return seqs


token_sequences.__name__ = "ids"  # the metavar


def _knob_type(hint):
    """(argparse type, is_bool) of a GenerateConfig field from its type (`typing.get_type_hints`): `X | None` is
    read as X; bool is a --flag / --no-flag pair; the token-id sequences (stop) are read by token_sequences."""
    args = [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1:
        (t,) = args
        if t in (bool, int, float, str):
            return t, t is bool
        if typing.get_origin(t) is tuple and typing.get_args(t) == (tuple[int, ...], ...):
            return token_sequences, False
    raise TypeError(f"GenerateConfig field type {hint}: no command-line flag type for it (lopa_fast.cli._knob_type)")


# the embedded model's own setting: `generate` / `serve` without --model, --preset and --strategy run this eval row
EMBEDDED_PRESET = "lopa-k4"


def preset_knobs(name: str) -> dict:
    """The knobs `--preset NAME` sets: the eval row's, at the eval's max_new_tokens and temperature 0."""
    from lopa_fast.tasks.evaluate import GEN_LEN, ROWS

    return dict(ROWS[name], max_new_tokens=GEN_LEN, temperature=0.0)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def knob_help(f: dataclasses.Field, preset: dict | None = None, note: str = "") -> str:
    """The --help text of a knob flag: the field's own description (GenerateConfig metadata), then the value it
    runs with when the flag is not given: GenerateConfig's default (for None: what None runs as), or the embedded
    model's preset value where that differs, saying so. `note` is appended to the description. (%% escaped for
    argparse.)"""
    default = f.metadata.get("unset", "unset") if f.default is None else _shown(f.default)
    if preset is not None and f.name in preset and preset[f.name] != f.default:
        shown = (f"default: {_shown(preset[f.name])} on the embedded model, its preset {EMBEDDED_PRESET}; "
                 f"GenerateConfig: {default}")
    else:
        shown = f"default: {default}"
    return f"{f.metadata['help']}{note} ({shown})".replace("%", "%%")


VERIFIER_HELP = ("APD's verifier: a causal AR qwen2 model directory whose vocabulary is a prefix of the model's "
                 "(the embedded model's: lopa_fast/assets/ar-arith); needed by --apd-mixture-weight")


def add_other_library_flags(parser: argparse.ArgumentParser, length: bool = True) -> None:
    """Hugging Face / vLLM names as flags (lopa_fast.aliases): --max-length N (prompt + new tokens; generate only),
    --do-sample / --no-do-sample (sampling: needs --temperature > 0; greedy: temperature 0), --n 1; the refused names
    (--typical-p, --num-beams, ...) are parsed, hidden from --help, and refused naming the lopa_fast way."""
    from lopa_fast import aliases

    grp = parser.add_argument_group("names from Hugging Face / vLLM (docs/decoding.md, 'Knobs from other libraries')")
    if length:
        grp.add_argument("--max-length", dest="x_max_length", type=int, default=None, metavar="N",
                         help="prompt + new tokens (HF): max_new_tokens = N - the prompt's length")
    grp.add_argument("--do-sample", dest="x_do_sample", action=argparse.BooleanOptionalAction, default=None,
                     help="HF's do_sample: --do-sample samples (needs --temperature > 0; lopa_fast's default is 0), "
                          "--no-do-sample is greedy (temperature 0)")
    grp.add_argument("--n", dest="x_n", type=int, default=None, metavar="N",
                     help="outputs per prompt: only 1 (vLLM's n)")
    for name in aliases.REFUSED:
        grp.add_argument("--" + name.replace("_", "-"), dest="x_" + name, default=None, help=argparse.SUPPRESS)


def add_knob_flags(parser: argparse.ArgumentParser, hidden=()) -> list[str]:
    """One flag per GenerateConfig field (`--max-new-tokens`, `--no-use-full-attention`, ...), typed from the
    field's type (typing.get_type_hints), with its description, choices and the default it runs with from the field
    (`knob_help`); unset flags stay absent from the namespace (the config's or the preset's default applies).
    Returns the field names. `hidden`: fields the command refuses (serve: NOT_SERVED), left out of --help; still
    parsed, so that passing one is refused with the reason instead of "unrecognized arguments"."""
    from lopa_fast.config import GenerateConfig, knob_choices

    hints = typing.get_type_hints(GenerateConfig)
    preset = preset_knobs(EMBEDDED_PRESET)
    names = []
    grp = parser.add_argument_group(
        "decoding knobs (lopa_fast.generate; docs/decoding.md)",
        f"Each default is GenerateConfig's; without --model, --preset and --strategy the embedded model runs its "
        f"preset {EMBEDDED_PRESET}, whose values are shown where they differ.")
    for f in dataclasses.fields(GenerateConfig):
        if f.name in _OWN_FLAGS:
            continue
        typ, is_bool = _knob_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        note = "; here ids like 13,198;7 for [[13, 198], [7]]" if typ is token_sequences else ""
        shown = argparse.SUPPRESS if f.name in hidden else knob_help(f, preset, note)
        if is_bool:
            grp.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                             help=shown)
        else:
            choices = knob_choices(f)
            grp.add_argument(flag, dest=f.name, type=typ, default=argparse.SUPPRESS, choices=choices,
                             metavar=None if choices else typ.__name__.upper(), help=shown)
        names.append(f.name)
    return names


def read_prompt(args) -> str:
    """The prompt text from --prompt, --prompt-file or stdin; CLIError when unreadable, over MAX_PROMPT_BYTES, not
    UTF-8 or empty."""
    if args.prompt is not None:
        text, where = args.prompt, "--prompt"
    else:
        if args.prompt_file is not None:
            where = f"--prompt-file {args.prompt_file}"
            try:
                with open(args.prompt_file, "rb") as fh:
                    data = fh.read(MAX_PROMPT_BYTES + 1)  # bounded: /dev/zero or a huge file is refused, not read
            except OSError as e:
                raise CLIError(f"{where}: cannot read it ({e.strerror or type(e).__name__})") from e
        else:
            where = "stdin"
            if sys.stdin is None or sys.stdin.isatty():
                raise CLIError("no prompt: pass --prompt TEXT, --prompt-file F, or pipe the text on stdin")
            data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        if len(data) > MAX_PROMPT_BYTES:
            raise CLIError(f"{where}: more than {MAX_PROMPT_BYTES // 2**20} MiB, the cap on a prompt (no supported "
                           "model's context holds that much text)")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CLIError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from e
    if not text.strip():
        raise CLIError(f"{where}: the prompt is empty (or only whitespace)")
    return text


def text_stop(text: str) -> str:
    """`--stop-text '\\n\\n'` -> the stop string, with the escapes \\n, \\t and \\\\ read as newline, tab, backslash."""
    if not text:
        raise argparse.ArgumentTypeError("an empty stop string")
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}.get(m.group(1), m.group(0)), text)


text_stop.__name__ = "text"  # the metavar


def _load(args):
    """(model, tokenizer) for --model / --lora / --dtype / --device."""
    import torch

    import lopa_fast
    from lopa_fast.assets import model_dir

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    embedded = args.model is None
    path = model_dir() if embedded else args.model
    if not embedded and not os.path.isdir(path):
        raise CLIError(f"--model {path}: not a directory (an HF-format model directory with config.json)")
    try:
        model = lopa_fast.load_model(path, dtype=args.dtype, device=device, lora=args.lora)  # None: default_dtype
        tok = lopa_fast.load_tokenizer(path)
    except OSError as e:
        raise CLIError(f"--model {path}: cannot read it ({e.strerror or type(e).__name__})") from e
    except RuntimeError as e:  # e.g. torch: the device does not exist on this machine
        if "device" in type(e).__name__.lower() or not device.startswith("cpu"):
            raise CLIError(f"--device {device}: {str(e).splitlines()[0]}") from e
        raise
    return model, tok


def load_verifier(args, model):
    """--verifier DIR: APD's causal AR verifier, loaded like the drafter (its dtype, its device); None without it."""
    import lopa_fast

    path = getattr(args, "verifier", None)
    if path is None:
        return None
    if not os.path.isdir(path):
        raise CLIError(f"--verifier {path}: not a directory (an HF-format causal qwen2 model directory, e.g. "
                       "lopa_fast/assets/ar-arith)")  # fmt: skip
    try:
        return lopa_fast.load_model(path, dtype=next(model.parameters()).dtype, device=model.device)
    except OSError as e:
        raise CLIError(f"--verifier {path}: cannot read it ({e.strerror or type(e).__name__})") from e


def check_verifier_flag(args, knobs: dict) -> None:
    """Before any load: --verifier given to a strategy that takes none, or a knob that needs one without it."""
    from lopa_fast import api
    from lopa_fast.config import GenerateConfig

    cfg = _user_errors(lambda: GenerateConfig(**knobs).validate())
    _user_errors(api.check_verifier_given, cfg, args.verifier is not None, "--verifier DIR")


def other_library_flags(args) -> dict:
    """The flags of other libraries' names: --max-length, --do-sample / --no-do-sample (translated by
    lopa_fast.aliases), --n 1 (accepted); the refused ones (--typical-p, --num-beams, ...) raise naming the lopa_fast
    way."""
    from lopa_fast import aliases

    out = {}
    for name in (*aliases.REFUSED, "n", "max_length", "do_sample"):
        if getattr(args, "x_" + name, None) is not None:
            out[name] = getattr(args, "x_" + name)
    for name in out:
        if name in aliases.REFUSED:
            raise CLIError(f"--{name.replace('_', '-')} {out[name]}: not a lopa_fast knob: {aliases.REFUSED[name]}")
    if "n" in out and out.pop("n") != 1:
        raise CLIError(f"--n {args.x_n}: one output per prompt (--n 1); run the command once per sample (--seed)")
    return out


def generate_knobs(args, knob_names) -> dict:
    """The knobs of one CLI call: the preset's (--preset, or lopa-k4 on the embedded model when neither --preset
    nor --strategy is given), then every flag given."""
    preset = args.preset
    if preset is None and args.model is None and args.strategy is None:
        preset = EMBEDDED_PRESET  # the embedded model's own setting
    knobs: dict = {}
    if preset is not None:
        knobs.update(preset_knobs(preset))
    if args.strategy is not None:
        knobs["strategy"] = args.strategy
    knobs["backend"] = args.backend
    if args.compile:
        knobs["compile"] = True
    knobs.update({k: getattr(args, k) for k in knob_names if hasattr(args, k)})
    extra = other_library_flags(args)
    if "max_length" in extra and not hasattr(args, "max_new_tokens"):
        knobs.pop("max_new_tokens", None)  # --max-length replaces the preset's length
    if extra.get("do_sample") is True and not hasattr(args, "temperature"):
        knobs.pop("temperature", None)  # the preset's greedy 0: --do-sample asks for --temperature itself
    if "do_sample" in extra:
        from lopa_fast import aliases

        knobs = _user_errors(aliases.translate, {**knobs, "do_sample": extra["do_sample"]}, None)
    if "max_length" in extra:
        knobs["max_length"] = extra["max_length"]  # translated once the prompt's length is known
    return knobs


def _generate(args) -> int:
    import torch

    text = read_prompt(args)  # before any load: a bad prompt costs nothing
    knobs = generate_knobs(args, args.knob_names)
    if knobs.get("distributed"):  # launched by torchrun: the group must exist before the knob checks
        from lopa_fast.distributed import init_from_env

        if args.stream or args.show_steps:
            raise CLIError("--distributed prints the result once decoded; --stream / --show-steps are not supported with it")
        args.device = init_from_env(args.device)  # NCCL -> cuda:LOCAL_RANK, gloo -> cpu
    try:
        return _generate_one(args, text, knobs)
    finally:
        if knobs.get("distributed"):
            torch.distributed.destroy_process_group()


def _generate_one(args, text: str, knobs: dict) -> int:
    import torch

    from lopa_fast import api
    from lopa_fast.config import GenerateConfig
    from lopa_fast.text import answer_text, split_stops, text_decoder

    want_trace = bool(knobs.get("return_trace"))  # --return-trace: the trace goes into --json's object
    if args.png is not None:
        check_out(args.png, f"--png {args.png}")
        knobs["return_trace"] = True  # the picture is drawn from the run's trace
    max_length = knobs.pop("max_length", None)
    if max_length is not None and knobs.get("max_new_tokens") is not None:
        raise CLIError(f"--max-length {max_length} and --max-new-tokens {knobs['max_new_tokens']} both given; pass one")
    if max_length is not None and max_length < 2:
        raise CLIError(f"--max-length {max_length}; allowed: an int > the prompt's length (prompt + new tokens)")
    check_verifier_flag(args, knobs)  # before any load
    model, tok = _load(args)
    verifier = load_verifier(args, model)
    ids = encode_prompt(tok, text, args.chat, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    if max_length is not None:
        from lopa_fast import aliases

        knobs = _user_errors(aliases.translate, {**knobs, "max_length": max_length}, [len(ids)])
    ids_t = torch.tensor(ids, dtype=torch.long, device=model.device)
    seqs, texts = _user_errors(split_stops, tok, args.stop_text)  # text stops: tokenised + matched on the text
    if seqs:
        knobs["stop"] = [*(knobs.get("stop") or []), *seqs]
    cfg = _user_errors(lambda: GenerateConfig(**knobs).validate())
    decode = text_decoder(tok)
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.eos_token_id

    def check():  # the checks generate runs before any forward, here so their ValueError / TypeError exit 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # generate itself warns once, below
            planned, _ = cfg.plan_length(model, ids_t.numel())
            bound = planned.resolve(model)
            api.check_prompt(model, api.prepare_prompt(model, ids_t), bound)
            api.resolve_backend(bound, hook=args.stream or args.show_steps)
            api.check_pair(model, verifier, ids_t, bound)

    _user_errors(check)
    for note in cfg.sampling_notes():
        print(f"warning: {note}", file=sys.stderr)
    if args.stream or args.show_steps:
        answer, out = _stream(args, model, tok, ids_t, knobs, texts, verifier)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".* has no effect at temperature=0")  # printed above
            out = api.generate_with_config(model, ids_t, cfg, verifier=verifier)
        answer = answer_text(out, decode, eos, texts)
    gen = out.generated_ids
    st = out.stats
    if cfg.distributed and torch.distributed.get_rank() != 0:  # every rank holds the result; rank 0 prints it
        return 0
    if args.json:
        obj = {"text": answer, "generated_ids": gen, "stats": st}
        if want_trace and out.trace is not None:
            obj["trace"] = out.trace
        print(json.dumps(obj, default=str))
    else:
        if not args.stream:
            print(answer)
        print(f"{st['strategy']} ({st['backend']}): TPF {st['tpf']:.2f}, forwards {st['forwards']}, "
              f"{st['generated_tokens']} tokens, finish_reason {st['finish_reason']}, "
              f"wall {1000 * st['seconds']:.0f} ms" + (f"; {st['max_new_tokens_clipped']}"
                                                       if "max_new_tokens_clipped" in st else ""), file=sys.stderr)
    if args.png is not None:
        write_png(out, tok, args.png)
    return 0


def _stream(args, model, tok, ids_t, knobs, text_stops, verifier=None):
    """--stream: print the text as it becomes final (lopa_fast.stream); --show-steps: the live denoising view
    (lopa_fast.viz.StepView: redrawn in place on a terminal, one line per round otherwise). (text, output)."""
    import lopa_fast
    from lopa_fast.viz import StepView

    view = None
    if args.show_steps:
        view = StepView(lambda ids: [tok.decode([t]) for t in ids])
    knobs = dict(knobs)
    stop = [*(knobs.pop("stop", None) or []), *text_stops] or None
    s = _user_errors(lopa_fast.stream, model, ids_t, tokenizer=tok, stop=stop, verifier=verifier,
                     on_round=view, **knobs)  # fmt: skip
    with s:
        for piece in s:
            if args.stream:
                print(piece, end="", flush=True)
    if args.stream:
        print(flush=True)
    return s.text, s.result


def _serve(args) -> int:
    """`serve`: the OpenAI-compatible server (lopa_fast.server) on --model (default the embedded model). Its default
    knobs: GenerateConfig's, then the model's generation_config.json sampling, then the --preset / flags given
    (the embedded model: lopa-k4 as `generate`); every request may override them."""
    try:
        from lopa_fast import server
    except ModuleNotFoundError as e:
        if e.name not in ("fastapi", "uvicorn", "starlette"):
            raise
        raise CLIError(f"serve: {e.name} is not installed; pip install '.[serve]' (fastapi, uvicorn)") from e
    from lopa_fast.config import GenerateConfig
    from lopa_fast.server.served import NOT_SERVED

    if not 0 <= args.port < 65536:
        raise CLIError(f"--port {args.port}; allowed: 0..65535")
    if not args.drain_timeout >= 0:
        raise CLIError(f"--drain-timeout {args.drain_timeout}; allowed: seconds >= 0")
    knobs = generate_knobs(args, args.knob_names)
    refused = [k for k in knobs if k in NOT_SERVED]
    if refused:
        raise CLIError(f"serve: --{refused[0].replace('_', '-')} is not a server default ({NOT_SERVED[refused[0]]})")
    api_key = args.api_key if args.api_key is not None else (os.environ.get(server.API_KEY_ENV) or None)
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError("--api-key is empty; pass a key, or --no-api-key to serve without one")
    try:
        server.check_auth(args.host, api_key, args.no_api_key)
        limits = server.Limits(max_branching_factor=args.max_branching_factor, max_model_len=args.max_model_len,
                               max_num_seqs=args.max_num_seqs, max_batch_rows=args.max_batch_rows,
                               max_body_bytes=args.max_body_bytes, read_timeout_s=args.read_timeout,
                               max_request_memory=None if args.max_request_memory is None
                               else int(args.max_request_memory * 2**30),
                               memory_budget=None if args.memory_budget is None else int(args.memory_budget * 2**30))
    except ValueError as e:
        raise CLIError(f"serve: {e}") from e
    try:
        server.check_address(args.host, args.port)  # before the load: a busy port costs nothing
    except OSError as e:
        raise CLIError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})") from e
    if "max_length" in knobs:
        raise CLIError("serve: --max-length is prompt + new tokens, which a server default cannot know; pass "
                       "--max-new-tokens (a request's max_tokens)")  # fmt: skip
    from lopa_fast import api, strategies

    def check_defaults(defaults):  # a default that needs the verifier, without one: before any load
        cfg = _user_errors(lambda: GenerateConfig(**defaults).validate())
        given = args.verifier is not None and strategies.get(cfg.strategy).takes_verifier
        _user_errors(api.check_verifier_given, cfg, given, "serve --verifier DIR")

    check_defaults(knobs)
    if args.verifier is not None and not os.path.isdir(args.verifier):
        raise CLIError(f"--verifier {args.verifier}: not a directory (an HF-format causal qwen2 model directory)")
    model, tok = _load(args)
    path = model.name_or_path if getattr(model, "name_or_path", None) else args.model
    defaults = {**_user_errors(server.model_sampling_defaults, path), **knobs}
    check_defaults(defaults)
    verifier = load_verifier(args, model)
    if verifier is not None:  # one verifier for the server's life: checked against the drafter now
        import lopa_fast

        _user_errors(api.check_verifier_fits, model, verifier, tok, lopa_fast.load_tokenizer(args.verifier))
    name = args.model_name or os.path.basename(os.path.normpath(str(path)))
    print(f"serving {name} on http://{args.host}:{args.port} (defaults: {defaults})", file=sys.stderr, flush=True)
    server.serve(model, tok, model_id=name, defaults=defaults, host=args.host, port=args.port,
                 log_level=logging.getLevelName(args.log_level).lower(),  # uvicorn's lines follow -q / -v too
                 limits=limits, api_key=api_key, verifier=verifier, access_log=args.access_log,
                 drain_timeout_s=args.drain_timeout)
    return 0


def write_png(out, tok, path) -> None:
    """The fill-order heatmap of a traced run (`lopa_fast.viz.fill_order_png`), one cell per returned token."""
    from lopa_fast import viz

    if not out.trace:
        raise CLIError(f"--png {path}: strategy {out.stats['strategy']!r} returned no trace to draw")
    st = out.stats
    tokens = [str(t) for t in tok.convert_ids_to_tokens(out.generated_ids)]
    title = (f"fill order: {st['strategy']} ({st['backend']}), {len(tokens)} tokens, {st['forwards']} forwards, "
             f"TPF {st['tpf']:.2f}")
    try:
        viz.fill_order_png(out.trace, path, tokens=tokens, title=title)
    except OSError as e:
        raise CLIError(f"--png {path}: cannot write it ({e.strerror or type(e).__name__})") from e
    print(f"wrote {path} (fill order)", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    from lopa_fast.tasks.evaluate import (BACKENDS, BLOCK, BLOCK_SIZES, DEMO_TASK, EVAL_ROWS, EVAL_TASKS, GEN_LEN,
                                          OUT_DIR, ROWS, out_name)

    from lopa_fast.config import GenerateConfig, strategy_names

    STRATEGIES = strategy_names()
    knob = {f.name: f for f in dataclasses.fields(GenerateConfig)}

    from lopa_fast.server.served import NOT_SERVED

    # allow_abbrev=False: `--n 2` is not an "ambiguous option" prefix of ten --no-* flags (each flag by its name)
    ap = _Parser(prog="python -m lopa_fast", description="Fast diffusion-LLM decoding (LoPA, D2F, ...)",
                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = _Parser(add_help=False, allow_abbrev=False)
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
    d.set_defaults(fn=_demo)

    e = sub.add_parser("eval", parents=[common], allow_abbrev=False,
                       help="accuracy / TPF / forwards / tokens/s for every strategy")
    e.add_argument("--n", type=int, default=100, help="held-out problems per strategy (default 100)")
    e.add_argument("--strategies", default="all",
                   help=f"comma-separated rows: {', '.join(EVAL_ROWS)}; aliases lopa (= k2,k4,k8), apd (the three apd rows), all (default); --task arith-var adds threshold-h0.45 (the teacher under the student's rule), dparallel-h0.45, dparallel-lopa-k4 (alias dparallel: these three)")
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
    e.set_defaults(fn=_eval)

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
    g.add_argument("--strategy", default=None, choices=STRATEGIES, help=knob_help(knob["strategy"]))
    g.add_argument("--preset", default=None, choices=list(ROWS),
                   help=f"an eval row's knobs (the embedded model: {EMBEDDED_PRESET} unless --strategy is given)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights dtype (default bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default cuda when available)")
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
    g.set_defaults(fn=_generate, knob_names=add_knob_flags(g))
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
    lim.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                     help="at SIGTERM / SIGINT, seconds in-flight requests may finish in (default 30; then they are "
                          "cancelled; a second signal ends the wait at once)")
    v.add_argument("--strategy", default=None, choices=STRATEGIES, help=knob_help(knob["strategy"]))
    v.add_argument("--preset", default=None, choices=list(ROWS),
                   help=f"an eval row's knobs as defaults (the embedded model: {EMBEDDED_PRESET} unless --strategy "
                        "is given)")
    v.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights dtype (default bfloat16 on CUDA, float32 on CPU)")
    v.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default cuda when available)")
    v.add_argument("--verifier", default=None, metavar="DIR",
                   help=VERIFIER_HELP + "; one for the server, checked against the model at start, used by the "
                                        "requests that set apd_mixture_weight")
    v.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access log line per request (default: one INFO line each: method, path, status, latency)")
    v.set_defaults(fn=_serve, knob_names=add_knob_flags(v, hidden=NOT_SERVED))
    add_other_library_flags(v, length=False)

    sub.add_parser("lm-eval", add_help=False, help="lm-evaluation-harness with the lopa_fast model registered: "
                   "python -m lopa_fast lm-eval --model lopa_fast --model_args pretrained=DIR,... --tasks T "
                   "(every argument is lm-eval's; needs pip install .[eval])")  # fmt: skip
    return ap


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
    check_environment()
    with log_to_stderr(args.log_level):
        from lopa_fast import logs

        # torch's import: 1.5 s on a quiet machine, 4-6 s under load (said while it runs when it takes > 2 s)
        with logs.step(logging.getLogger("lopa_fast.cli"), "importing torch", "imported torch", long=False):
            import torch

        torch.set_num_threads(args.threads)
        return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
