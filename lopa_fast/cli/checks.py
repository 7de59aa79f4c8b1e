"""The command line's checks and plumbing, shared by every subcommand: its error type and one-line parser, the
checks run before any work (device, environment, output paths, the prompt), the log lines on stderr, and the
`--stop-text` reader."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys

from lopa_fast.errors import LopaError


class CLIError(LopaError, ValueError):
    """A command-line user error (bad prompt, unreadable file, a knob the validation refused)."""

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2, no usage block)."""

    def error(self, message):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

def user_errors(fn, *args, **kw):
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

    user_errors(env_backend)

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
