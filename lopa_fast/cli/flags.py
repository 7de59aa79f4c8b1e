"""The decoding knobs as flags: one per GenerateConfig field (typed from the field, with its help and the default
it runs with), the eval rows as `--preset`s, other libraries' names (lopa_fast.request.aliases), and the knobs of one
call read back from the parsed flags."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from lopa_fast.cli.checks import CLIError, user_errors

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


def knob_type(hint):
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
    raise TypeError(f"GenerateConfig field type {hint}: no command-line flag type for it "
                    "(lopa_fast.cli.flags.knob_type)")


# the embedded model's own setting: `generate` / `serve` without --model, --preset and --strategy run this eval row
EMBEDDED_PRESET = "lopa-k4"


def preset_names() -> list[str]:
    """Every `--preset`: the dLLM rows, APD's rows (their verifier: the task's shipped one unless --verifier) and the
    dParallel student's rows (their model: the student unless --model)."""
    from lopa_fast.tasks.eval_rows import APD_ROWS, ROWS, STUDENT_ROWS

    return [*ROWS, *APD_ROWS, *STUDENT_ROWS]


def preset_assets(name: str | None, model) -> tuple[str | None, str | None]:
    """(model asset, verifier asset) a preset runs on when --model / --verifier are not given: the student's rows
    its student, APD's rows the task's verifier; (None, None) for the others (the model given, or the embedded)."""
    from lopa_fast.request.model_defaults import task_of
    from lopa_fast.tasks.eval_rows import APD_ROWS, STUDENT_ROWS, eval_task

    if name in STUDENT_ROWS:
        return (eval_task("arith-var").student if model is None else None), None
    if name in APD_ROWS:
        return None, eval_task(task_of(model) or "arith").verifier
    return None, None


def preset_knobs(name: str, model=None) -> dict:
    """The knobs `--preset NAME` sets: the eval row's, at temperature 0 and the max_new_tokens of the task of `model`
    (an embedded model directory: lopa_fast.request.model_defaults; any other model, or None: the `arith` task's 32; the
    student's rows: arith-var's 96), the row's knobs scaled to it as the eval scales them (APD's W and M)."""
    from lopa_fast.request.model_defaults import task_of
    from lopa_fast.tasks.eval_rows import STUDENT_ROWS, eval_task, task_rows

    task = task_of(model) or ("arith-var" if name in STUDENT_ROWS else "arith")
    rows = task_rows(task) if name in task_rows(task) else task_rows("arith-var")
    return dict(rows[name], max_new_tokens=eval_task(task).gen_len, temperature=0.0)


def model_path(args):
    """The model directory a `generate` / `serve` call runs: --model, else the preset's (the student's rows), else the
    embedded model."""
    from lopa_fast.assets import model_dir

    if args.model is not None:
        return args.model
    asset, _ = preset_assets(getattr(args, "preset", None), None)
    return str(model_dir(asset)) if asset else str(model_dir())

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
    """Hugging Face / vLLM names as flags (lopa_fast.request.aliases): --max-length N (prompt + new tokens; generate
    only), --do-sample / --no-do-sample (sampling: needs --temperature > 0; greedy: temperature 0), --n 1; the refused
    names (--typical-p, --num-beams, ...) are parsed, hidden from --help, and refused naming the lopa_fast way."""
    from lopa_fast.request import aliases

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
        typ, is_bool = knob_type(hints[f.name])
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

def other_library_flags(args) -> dict:
    """The flags of other libraries' names: --max-length, --do-sample / --no-do-sample (translated by
    lopa_fast.request.aliases), --n 1 (accepted); the refused ones (--typical-p, --num-beams, ...) raise naming the
    lopa_fast way."""
    from lopa_fast.request import aliases

    out = {}
    for name in (*aliases.REFUSED, "n", "max_length", "do_sample"):
        value = getattr(args, "x_" + name, None)
        if value is not None and name in aliases.REFUSED:
            raise CLIError(f"--{name.replace('_', '-')} {value}: not a lopa_fast knob: {aliases.REFUSED[name]}")
        if value is not None:
            out[name] = value
    if "n" in out and out.pop("n") != 1:
        raise CLIError(f"--n {args.x_n}: one output per prompt (--n 1); run the command once per sample (--seed)")
    return out

def generate_knobs(args, knob_names) -> dict:
    """The knobs of one CLI call: the preset's (--preset, or lopa-k4 on the embedded model when neither --preset
    nor --strategy is given), then every flag given."""
    from lopa_fast.request.model_defaults import model_knobs

    preset, path = args.preset, model_path(args)
    knobs: dict = {}
    if preset is not None:
        knobs.update(preset_knobs(preset, path))
    else:  # the model's own knobs for the strategy (an embedded model: its eval row; lopa_fast.request.model_defaults)
        knobs.update(model_knobs(path, args.strategy))
    if args.strategy is not None:
        knobs["strategy"] = args.strategy
    knobs["backend"] = args.backend
    if args.compile:
        knobs["compile"] = True
    from lopa_fast.request.model_defaults import merge

    knobs = merge(knobs, {k: getattr(args, k) for k in knob_names if hasattr(args, k)})
    extra = other_library_flags(args)
    if "max_length" in extra and not hasattr(args, "max_new_tokens"):
        knobs.pop("max_new_tokens", None)  # --max-length replaces the preset's length
    if extra.get("do_sample") is True and not hasattr(args, "temperature"):
        knobs.pop("temperature", None)  # the preset's greedy 0: --do-sample asks for --temperature itself
    if "do_sample" in extra:
        from lopa_fast.request import aliases

        knobs = user_errors(aliases.translate, {**knobs, "do_sample": extra["do_sample"]}, None)
    if "max_length" in extra:
        knobs["max_length"] = extra["max_length"]  # translated once the prompt's length is known
    return knobs
