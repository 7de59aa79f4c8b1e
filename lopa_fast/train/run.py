"""What every training recipe does around its own model and loss: option checks, the training log, one
optimiser step, the checkpoint layout and the command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from lopa_fast.models import save_checkpoint


def options(defaults: dict, overrides: dict) -> dict:
    """The recipe's defaults updated by `overrides`; unknown names raise ValueError."""
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise ValueError(f"train: unknown options {sorted(unknown)}; allowed: {sorted(defaults)}")
    return {**defaults, **overrides}


def lr_at(step: int, steps: int, lr: float, warmup: int, min_frac: float) -> float:
    """Linear warmup, then cosine to min_frac * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def last_step(a: dict) -> int:
    """The step a run ends before: `stop_at` ends it early on the same schedule."""
    return a["stop_at"] if 0 < a["stop_at"] < a["steps"] else a["steps"]


def due(a: dict, step: int, last: bool) -> str | None:
    """What follows `step`: "eval" (every `eval_every` steps and after the last; a checkpoint follows it),
    "checkpoint" (every `ckpt_every` steps) or None."""
    if (a["eval_every"] and (step + 1) % a["eval_every"] == 0) or last:
        return "eval"
    return "checkpoint" if a["ckpt_every"] and (step + 1) % a["ckpt_every"] == 0 else None


class Steps:
    """The loss recipes' (d2f, ar) bookkeeping around their own batches and loss. `update(step, loss)`: the lr
    schedule, the optimiser step, the loss trace (the run's first loss, its EMA at 0.98, a log line every 50 steps
    and at the last), then what `due` says follows the step: `evaluate(step) -> dev accuracy` (the model in eval
    mode) and `save()`, and the resumable checkpoint (`extra()`: the recipe's own entries)."""

    def __init__(self, a: dict, out: Path, model, opt, emit, spent: float, ema, first, acc, evaluate, save,
                 extra=lambda: None):
        self.a, self.out, self.model, self.opt, self.emit = a, out, model, opt, emit
        self.t0, self.ema, self.first, self.acc = time.time() - spent, ema, first, acc
        self.evaluate, self.save, self.extra = evaluate, save, extra
        self.last_step = last_step(a)

    def update(self, step: int, loss: torch.Tensor, what: str = "") -> None:
        a = self.a
        lr = lr_at(step, a["steps"], a["lr"], a["warmup"], a["min_lr_frac"])
        v = optimizer_step(self.model, self.opt, loss, lr)
        self.ema = v if self.ema is None else 0.98 * self.ema + 0.02 * v
        self.first = v if self.first is None else self.first
        last = step == self.last_step - 1
        if step % 50 == 0 or last:
            self.emit(f"step {step:5d} {what}loss {v:.4f} ema {self.ema:.4f} lr {lr:.2e} t {self.seconds():7.1f}s")
        when = due(a, step, last)
        if when == "eval":
            self.model.eval()
            self.acc = self.evaluate(step)
            self.model.train()
            self.save()
        if when:
            checkpoint(self.out, a, self.model, self.opt, step + 1, self.ema, self.first, self.acc, self.t0,
                       self.extra())

    def seconds(self) -> float:
        return time.time() - self.t0

    def summary(self, n_params: int) -> dict:
        return summary(n_params, self.last_step, self.t0, self.ema, self.first, self.acc)


class RunLog:
    """`emit(msg)` prints through `log` and appends the line to out/training_log.txt."""

    def __init__(self, out: Path, log=print, append: bool = False):
        self.log = log
        self.f = open(out / "training_log.txt", "a" if append else "w")

    def emit(self, msg: str) -> None:
        self.log(msg)
        self.f.write(msg + "\n")
        self.f.flush()

    def finish(self, summary: dict) -> dict:
        self.emit(f"# done: {json.dumps(summary)}")
        self.f.close()
        return summary


def optimizer_step(model, opt, loss: torch.Tensor, lr: float) -> float:
    """Set the learning rate, back-propagate, clip the gradient norm at 1 and step; returns the loss value."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def save(model, cfg: dict, out: Path, recipe: str, args: dict, save_tokenizer) -> None:
    """HF layout (config.json, model.safetensors), the task tokenizer (`save_tokenizer(out)`) and train_args.json."""
    save_checkpoint(model, out, cfg)
    save_tokenizer(out)
    with open(out / "train_args.json", "w") as f:
        json.dump({"recipe": recipe, **args}, f, indent=2, sort_keys=True)


RESUME_FILE = "resume.pt"  # the periodic training state inside the output directory (train + optimiser + step)


def save_state(out: Path, state: dict) -> None:
    """Write the resumable training state atomically (a temporary file, then a rename: a job killed while
    writing leaves the previous state intact)."""
    tmp = out / (RESUME_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out / RESUME_FILE)


# options that do not change the weights' trajectory (each step's data and masks are seeded by the step number and
# the evals draw no random numbers), so a resumed run may change them
RESUME_FREE = ("threads", "stop_at", "eval_every", "eval_n", "ckpt_every")


def begin(state: dict | None, model, opt, out: Path, emit, recipe: str, a: dict, grown, vocab_size: int,
          n_params: int) -> tuple:
    """Restore a resumed run (model, optimiser, torch RNG from `state`, the training state `load_state` read) or
    log a fresh run's header. Returns (start step, loss EMA, first loss, dev accuracy, seconds trained before)."""
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["torch_rng"])
        emit(f"# resumed at step {state['step']} from {out / RESUME_FILE} ({state['seconds']:.1f}s trained before)")
        return tuple(state[k] for k in ("step", "ema", "first_loss", "dev_acc", "seconds"))
    emit(f"# {recipe} recipe: {json.dumps(a, sort_keys=True)}")
    if a["init_from"]:
        emit(f"# init_from {a['init_from']}: grown {grown or 'nothing'} to vocab {vocab_size}")
    emit(f"# params {n_params} ({n_params * 4 / 2**20:.2f} MiB fp32); threads {torch.get_num_threads()}")
    return 0, None, None, None, 0.0


def summary(n_params: int, steps: int, t0: float, ema, first_loss, dev_acc) -> dict:
    """The `# done:` line of a training log (the loss recipes': d2f, ar)."""
    return {"params": n_params, "steps": steps, "seconds": round(time.time() - t0, 1),
            "final_loss_ema": None if ema is None else round(ema, 4),
            "first_loss": None if first_loss is None else round(first_loss, 4), "dev_exact_match": dev_acc}


def checkpoint(out: Path, a: dict, model, opt, next_step: int, ema, first_loss, dev_acc, t0: float,
               extra: dict | None = None) -> None:
    """The resumable state after `next_step` steps (run.save_state): weights, optimiser, counters, torch RNG, and a
    recipe's own `extra` entries (tensors, numbers; e.g. the d2f recipe's current policy pool)."""
    save_state(out, dict(args=a, model=model.state_dict(), opt=opt.state_dict(), step=next_step, ema=ema,
                         first_loss=first_loss, dev_acc=dev_acc, seconds=time.time() - t0,
                         torch_rng=torch.get_rng_state(), **(extra or {})))


def load_state(out: Path, args: dict, ignore=RESUME_FREE) -> dict:
    """The resumable state of `out`; its recorded options must equal `args` (except `ignore`), so a resumed run
    continues the same schedule, data stream and masks."""
    path = out / RESUME_FILE
    if not path.is_file():
        raise FileNotFoundError(f"resume: no training state {path}")
    try:  # weights_only: tensors, numbers, strings and containers; a resume.pt never runs code when read
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated / corrupt / foreign file, whatever torch raises for it
        raise ResumeError(f"resume: {path} is not a readable training state ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}); restore it or start a fresh run without --resume") from e
    missing = [k for k in ("args", "model", "opt", "step") if not isinstance(state, dict) or k not in state]
    if missing or not isinstance(state["args"], dict):
        raise ResumeError(f"resume: {path} is not a training state (missing {missing or ['args']})")
    diff = sorted(k for k in set(args) | set(state["args"])
                  if k not in ignore and args.get(k) != state["args"].get(k))
    if diff:
        raise ResumeError(f"resume: options {diff} differ from the checkpointed run's "
                          f"{ {k: state['args'].get(k) for k in diff} }")
    return state


class ResumeError(ValueError):
    """resume.pt cannot continue this run (unreadable, not a training state, other options): `main` prints it as
    one line and exits with status 2."""


def main(recipe: str, doc: str, defaults: dict, train, argv=None) -> None:
    """`python -m <recipe> --out DIR [--resume] [--option value ...]`, one flag per default."""
    ap = argparse.ArgumentParser(prog=f"python -m {recipe}", description=doc.split("\n")[0])
    ap.add_argument("--out", required=True, help="output model directory")
    ap.add_argument("--resume", action="store_true",
                    help=f"continue from OUT/{RESUME_FILE} (same options; the log is appended)")
    for k, v in defaults.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    ns = vars(ap.parse_args(argv))
    out = ns.pop("out")
    try:
        train(out, **ns)
    except (ResumeError, FileNotFoundError) as e:
        if not str(e).startswith("resume:"):
            raise
        print(f"python -m {recipe}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
