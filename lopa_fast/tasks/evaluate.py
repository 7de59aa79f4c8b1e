"""The eval (the LoPA paper's Table 1 on the embedded task) and the demo, over `lopa_fast.generate`.

Rows (decoding knobs; temperature 0 everywhere, max_new_tokens = GEN_LEN = 32, block size 8 by default, i.e.
the spec's GSM8K settings with the block scaled from 32 to this task's answers of at most 27 tokens + EOS;
`block_size` (any divisor of 32, e.g. the spec's 32) applies to every row's block knobs):

  vanilla     Dream vanilla, steps = max_new_tokens (one token per forward), alg="entropy" (Dream's
              own evaluation setting; the default alg "origin" reveals positions at random)
  threshold   Fast-dLLM parallel decoding: threshold 0.9 (Fast-dLLM's default), block_length 8, no cache
  d2f         D2F pipelined blocks: tau_add 0.1, tau_act 0.95, tau_conf 0.9, neg_entropy (the spec's
              GSM8K row), full attention (LoPA's default)
  lopa-kK     LoPA with branching_factor K in {2, 4, 8} and the same D2F thresholds, branch_topp 1,
              alpha 0 (the spec defaults); k = 1 is d2f
  apd-rR      APD (strategy="apd"): the embedded model drafts, the shipped causal `ar-arith` verifies
              (`verifier=`); (R, W, M) = (0.6, 4, 25) and (0.7, 2, 13): upstream's Pareto presets
              (0.6, 32, 200) and (0.7, 16, 100) with kv_window W and max_lookahead M scaled by 32/256 (this
              task's 32 new tokens against upstream's 256, rounded half up), plus R = 0.9 at (2, 13); block
              knobs do not apply. `--backend fast` / `auto` run them on the fast APD step (temperature 0)

Columns: exact-match accuracy, TPF (generated positions / forwards, EOS filler included, the paper's
and upstream Dream's count), TPF until EOS, forwards per answer, tokens/s (wall clock of this run); with
APD rows also dLLM and verifier forwards per answer, mean tokens accepted per step and the share of steps
that accepted their whole lookahead window (APD's TPF counts dLLM forwards only, as upstream and the paper).
A strategy whose implementation is missing is reported as unavailable, never approximated.

Tasks (`task=`, the CLI's `--task`; default `arith`): `arith` (max_new_tokens 32, model d2f-arith, APD verifier
ar-arith) and `arith-var` (issue 12: variable worked solutions of 64-96 tokens incl. EOS, max_new_tokens 96 = 12
blocks of 8, model d2f-arith-var, verifier ar-arith-var, and the dParallel student dparallel-arith-var with rows
`dparallel-h0.45` (the entropy-threshold rule, tau_H 0.45 nats: dParallel's Dream GSM8K setting, block_length
= the block size) and `dparallel-lopa-k4` (LoPA k=4 with the D2F knobs above), beside `threshold-h0.45`: the
teacher under the student's rule), and `left-to-right` (one token per forward in order: threshold decoding in
blocks of one token; alias `one-per-forward` = vanilla + left-to-right). Vanilla takes max_new_tokens
steps; the APD presets scale by max_new_tokens / 256. A model a row needs that is not shipped makes the row
unavailable (with the reason), never approximated.
"""
from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lopa_fast import strategies, tasks
from lopa_fast.tasks import arith_var

GEN_LEN = 32
BLOCK = 8
# block sizes the eval accepts: those that divide GEN_LEN (every decoder splits the answer into whole blocks)
BLOCK_SIZES = tuple(b for b in range(1, GEN_LEN + 1) if GEN_LEN % b == 0)


@dataclass(frozen=True)
class EvalTask:
    """What the eval runs for one task: its answer length and the shipped models of its rows."""

    name: str
    gen_len: int  # max_new_tokens of every row (a multiple of the default block 8)
    model: str  # the dLLM asset (lopa_fast/assets/<model>)
    verifier: str  # the causal verifier of the APD rows
    student: str | None = None  # the dParallel student of the dparallel-* rows (None: the task has no such rows)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(b for b in range(1, self.gen_len + 1) if self.gen_len % b == 0)


# arith-var: the longest solution is 96 tokens incl. EOS (docs/tasks.md); 96 = 12 blocks of 8, as the model was trained
EVAL_TASKS = {
    "arith": EvalTask("arith", GEN_LEN, "d2f-arith", "ar-arith"),
    "arith-var": EvalTask("arith-var", arith_var.GEN_LEN, "d2f-arith-var", "ar-arith-var", "dparallel-arith-var"),
}
DEFAULT_TASK = "arith"


def eval_task(task) -> EvalTask:
    """The EvalTask of a task name; ValueError naming the allowed ones."""
    if task not in EVAL_TASKS:
        raise ValueError(f"task={task!r}; allowed: {', '.join(EVAL_TASKS)}")
    return EVAL_TASKS[task]


def check_block_size(block_size, gen_len: int = GEN_LEN) -> int:
    """Validate the eval's block size (must divide max_new_tokens `gen_len`, 32 for arith); returns it."""
    sizes = tuple(b for b in range(1, gen_len + 1) if gen_len % b == 0)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in sizes:
        raise ValueError(f"block_size={block_size!r}; allowed: a divisor of max_new_tokens {gen_len}: "
                         f"{', '.join(map(str, sizes))}")
    return block_size


# APD rows: upstream's Pareto presets (R, W, M) = (0.6, 32, 200) and (0.7, 16, 100) for 256 new tokens, W and M
# scaled by GEN_LEN / 256 = 1/8 (rounded half up: 12.5 -> 13), plus R = 0.9 at the second preset's (W, M)
APD_SCALE = GEN_LEN / 256
APD_UPSTREAM_PRESETS = {"apd-r0.6": (0.6, 32, 200), "apd-r0.7": (0.7, 16, 100), "apd-r0.9": (0.9, 16, 100)}


def _scaled(v: int, gen_len: int = GEN_LEN) -> int:
    return int(v * gen_len / 256 + 0.5)


def apd_rows(gen_len: int = GEN_LEN) -> dict[str, dict]:
    """The APD rows with kv_window and max_lookahead scaled by gen_len / 256 (rounded half up)."""
    return {name: dict(strategy="apd", apd_mixture_weight=R, kv_window=_scaled(W, gen_len),
                       max_lookahead=_scaled(M, gen_len)) for name, (R, W, M) in APD_UPSTREAM_PRESETS.items()}


APD_ROWS: dict[str, dict] = apd_rows(GEN_LEN)
# the dParallel student's rows (tasks with a student): the entropy-threshold rule at dParallel's Dream GSM8K
# tau_H = 0.45 nats, and LoPA k=4 with the D2F knobs
STUDENT_ROWS = ("dparallel-h0.45", "dparallel-lopa-k4")
STUDENT_ENTROPY_THRESHOLD = 0.45
# the teacher (the task's model) under the student's rule: the row that dParallel's forwards-per-answer ratio
# divides by (student vs teacher under the same rule, issue 27)
TEACHER_RULE_ROW = "threshold-h0.45"
VERIFIER_MODEL = "ar-arith"  # the shipped causal qwen2 model (same tokenizer as d2f-arith): APD's verifier


def make_rows(block_size: int = BLOCK, apd: bool = False, gen_len: int = GEN_LEN,
              student: bool = False) -> dict[str, dict]:
    """Every row's knobs with `block_size` applied to all block knobs (vanilla/threshold block_length too), for
    answers of `gen_len` tokens (vanilla: gen_len steps; APD presets scaled by gen_len / 256).

    apd=True appends the APD rows (no block knobs; they need the verifier, so they are not `generate --preset`s);
    student=True appends the dParallel student's rows (they run on the student model) and the teacher's row under
    the student's rule (TEACHER_RULE_ROW, on the task's model)."""
    block_size = check_block_size(block_size, gen_len)
    d2f = dict(block_size=block_size, block_add_threshold=0.1, decoded_token_threshold=0.95, skip_threshold=0.9,
               sampling_strategy="neg_entropy", use_full_attention=True)
    return {
        "vanilla": dict(strategy="vanilla", block_size=block_size, steps=gen_len, alg="entropy"),
        "threshold": dict(strategy="threshold", block_size=block_size, block_length=block_size, threshold=0.9),
        "d2f": dict(strategy="d2f", **d2f),
        "lopa-k2": dict(strategy="lopa", branching_factor=2, **d2f),
        "lopa-k4": dict(strategy="lopa", branching_factor=4, **d2f),
        "lopa-k8": dict(strategy="lopa", branching_factor=8, **d2f),
    } | (apd_rows(gen_len) if apd else {}) | ({
        # one token per forward, left to right (threshold decoding in blocks of one token: one forward fills its
        # block; LLaDA's semi-autoregressive sampler at block_length 1): the base teacher's gate (issue 27) beside
        # the vanilla row's whole-region entropy order
        "left-to-right": dict(strategy="threshold", block_size=1, block_length=1, threshold=0.9),
        TEACHER_RULE_ROW: dict(strategy="threshold", block_size=block_size, block_length=block_size,
                               entropy_threshold=STUDENT_ENTROPY_THRESHOLD),
        "dparallel-h0.45": dict(strategy="threshold", block_size=block_size, block_length=block_size,
                                entropy_threshold=STUDENT_ENTROPY_THRESHOLD),
        "dparallel-lopa-k4": dict(strategy="lopa", branching_factor=4, **d2f),
    } if student else {})


def task_rows(task: str = DEFAULT_TASK, block_size: int = BLOCK) -> dict[str, dict]:
    """Every eval row of `task` (its APD rows, and its student's rows when it has a student)."""
    t = eval_task(task)
    return make_rows(block_size, apd=True, gen_len=t.gen_len, student=t.student is not None)


ROWS: dict[str, dict] = make_rows(BLOCK)  # the dLLM-only rows (also the CLI's generate presets)
EVAL_ROWS: dict[str, dict] = make_rows(BLOCK, apd=True)  # every eval row
D2F_KNOBS = {k: v for k, v in ROWS["d2f"].items() if k != "strategy"}
ALIASES = {"lopa": ["lopa-k2", "lopa-k4", "lopa-k8"], "apd": list(APD_ROWS), "all": list(EVAL_ROWS)}
BACKENDS = ("reference", "fast", "auto")
# where `eval` writes by default: a directory under the current one, never the package tree nor bench/results
# (the committed tables there are rewritten only by an explicit `--out bench/results`)
OUT_DIR = "lopa_fast_eval"


def out_name(backend: str, n: int, block_size: int = BLOCK, task: str = DEFAULT_TASK) -> str:
    """The table's file name: eval_<backend>_n<n>[_block<b>][_<task>].md (block and task only when not the
    defaults; the names of the committed tables in bench/results)."""
    block = "" if block_size == BLOCK else f"_block{block_size}"
    suffix = "" if task == DEFAULT_TASK else "_" + task.replace("-", "_")
    return f"eval_{backend}_n{n}{block}{suffix}.md"


def out_path(out, backend: str, n: int, block_size: int = BLOCK, task: str = DEFAULT_TASK) -> Path:
    """Where the table goes: `out` itself when it names a .md file, else the directory `out` (default OUT_DIR)
    holding out_name(...); the PNG goes next to it."""
    if out is not None and str(out).endswith(".md"):
        return Path(out)
    return Path(OUT_DIR if out is None else out) / out_name(backend, n, block_size, task)


def parse_rows(spec: str | list[str], task: str = DEFAULT_TASK) -> list[str]:
    """"vanilla,d2f,lopa" -> row names of `task` (aliases: lopa = k2,k4,k8; apd = apd-r0.6,apd-r0.7,apd-r0.9;
    dparallel = the student's rows (tasks with a student); all)."""
    allowed = list(task_rows(task))  # the row names do not depend on the block size
    aliases = {**ALIASES, "all": allowed}
    if eval_task(task).student is not None:
        aliases["dparallel"] = [TEACHER_RULE_ROW, *STUDENT_ROWS]
        aliases["one-per-forward"] = ["vanilla", "left-to-right"]
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        expanded = aliases.get(name, [name])
        for e in expanded:
            if e not in allowed:
                raise ValueError(f"strategies: {name!r} is not a row of task {task}; allowed: "
                                 f"{', '.join(allowed + list(aliases))}")
            if e not in out:
                out.append(e)
    if not out:
        raise ValueError(f"strategies: {spec!r} names no row; allowed: {', '.join(allowed + list(aliases))}")
    return out


def load_default(model_dir=None, dtype=None, task: str = DEFAULT_TASK):
    """(model, tokenizer, directory) of `task`'s embedded model (or `model_dir`); dtype default float32."""
    import torch

    import lopa_fast
    from lopa_fast.assets import model_dir as _embedded

    dtype = torch.float32 if dtype is None else dtype

    path = Path(model_dir) if model_dir is not None else _embedded(eval_task(task).model)
    return lopa_fast.load_model(path, dtype=dtype), lopa_fast.load_tokenizer(path), path


def load_verifier(dtype=None, name: str = VERIFIER_MODEL):
    """A shipped APD verifier (default `ar-arith`, a causal qwen2 model with d2f-arith's tokenizer), loaded like
    `load_default` loads the drafter (dtype default float32)."""
    import torch

    import lopa_fast
    from lopa_fast.assets import model_dir as _embedded

    dtype = torch.float32 if dtype is None else dtype

    return lopa_fast.load_model(_embedded(name), dtype=dtype)


def shipped(name: str) -> bool:
    """Whether lopa_fast/assets/<name> holds a model."""
    from lopa_fast.assets import ASSETS_DIR

    return (ASSETS_DIR / name / "config.json").is_file()


def prompt_ids(tok, problem) -> list[int]:
    """The prompt's ids (bos first, as the model was trained)."""
    return tok(problem.prompt)["input_ids"]


def answer_text(tok, ids: list[int]) -> str:
    """Generated ids -> readable text up to the first EOS (digits joined)."""
    eos = tok.eos_token_id
    cut = ids.index(eos) if eos in ids else len(ids)
    return tok.decode(ids[:cut], skip_special_tokens=True)  # the tokenizer's decoder joins digits


def _unavailable(exc: BaseException) -> str | None:
    """The reason a strategy cannot run in this checkout, or None if `exc` is a real failure."""
    if isinstance(exc, (ModuleNotFoundError, NotImplementedError)):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ValueError) and "does not cover strategy" in str(exc):
        return str(exc)
    return None


def progress_bar(label: str, total: int, enabled: bool = True):
    """A tqdm progress bar on stderr (disabled when `enabled` is False)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{label:>9s}", disable=not enabled, file=sys.stderr, leave=True,
                dynamic_ncols=True)


def _compiles(backend: str, knobs: dict) -> bool:
    """compile=True applies to every row the fast backend runs (every strategy since issue 18); the reference
    backend runs eagerly."""
    return backend != "reference"


def _apd_pair_problem(model, verifier, knobs, gen_len: int = GEN_LEN, verifier_name: str = VERIFIER_MODEL) -> str | None:
    """Why `verifier` cannot verify this drafter with an APD row's knobs (None: the pair fits), checked once
    before the row runs (e.g. `eval --model` on a drafter whose vocabulary ar-arith's is not a prefix of)."""
    from lopa_fast.config import GenerateConfig

    if verifier is None:
        return f"no verifier loaded ({verifier_name} is not shipped)"
    try:
        cfg = GenerateConfig(max_new_tokens=gen_len, temperature=0.0, **knobs).resolve(model)
        strategies.get(cfg.strategy).load("check_models")(model, verifier, cfg)
    except (ValueError, TypeError) as exc:
        return f"verifier {verifier_name} does not fit this drafter: {exc}"
    return None


def run_row(model, tok, problems, row: str, backend: str = "auto", progress: bool = True,
            block_size: int = BLOCK, compile: bool = False, verifier=None, task: str = DEFAULT_TASK) -> dict:
    """Decode every problem with one row of `task` at `block_size` (APD rows: with `verifier`). Returns the row's
    numbers (or status "unavailable")."""
    import torch

    import lopa_fast

    t = eval_task(task)
    knobs = task_rows(task, block_size)[row]
    is_apd = strategies.get(knobs["strategy"]).takes_verifier  # APD's rows run with the shipped verifier
    extra = {"verifier": verifier} if is_apd else {}
    if is_apd and (why := _apd_pair_problem(model, verifier, knobs, t.gen_len, t.verifier)) is not None:
        return {"row": row, "status": "unavailable", "reason": why}
    correct = forwards = tokens = tokens_eos = 0
    dllm_fw = verifier_fw = steps = accepted = full_steps = 0
    seconds = 0.0
    ran = None
    bar = progress_bar(row, len(problems), progress)
    for i, p in enumerate(problems):
        ids = torch.tensor(prompt_ids(tok, p), dtype=torch.long, device=model.device)
        try:
            out = lopa_fast.generate(model, ids, backend=backend, max_new_tokens=t.gen_len, temperature=0.0,
                                     compile=compile and _compiles(backend, knobs), **knobs, **extra)
        except Exception as exc:  # noqa: BLE001 - classified right below; real failures re-raise
            reason = _unavailable(exc)
            if reason is None:
                raise
            bar.close()
            return {"row": row, "status": "unavailable", "reason": reason}
        st = out.stats
        ran = st.get("backend", backend)
        correct += int(tasks.extract_answer(tok.decode(out.generated_ids, skip_special_tokens=True)) == p.answer)
        forwards += st["forwards"]
        tokens += st["generated_tokens"]
        tokens_eos += st["tokens_until_eos"]
        seconds += st["seconds"]
        if is_apd:
            dllm_fw += st["dllm_forwards"]
            verifier_fw += st["verifier_forwards"]
            counts = st["acceptance_counts"]
            steps += len(counts)
            accepted += sum(counts)
            full_steps += _full_window_steps(counts, knobs["max_lookahead"], t.gen_len)
        bar.set_postfix_str(f"acc {correct / (i + 1):.3f} tpf {tokens / max(1, forwards):.2f}", refresh=False)
        bar.update(1)
    bar.close()
    n = len(problems)
    res = {
        "row": row, "status": "ok", "backend": ran, "n": n, "accuracy": correct / n if n else float("nan"),
        "tpf": tokens / forwards if forwards else 0.0, "tpf_until_eos": tokens_eos / forwards if forwards else 0.0,
        "forwards_per_answer": forwards / n if n else 0.0, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }
    if is_apd:
        res.update({
            "dllm_forwards_per_answer": dllm_fw / n if n else 0.0,
            "verifier_forwards_per_answer": verifier_fw / n if n else 0.0,
            "steps": steps, "mean_accepted": accepted / steps if steps else 0.0,
            "full_window_share": full_steps / steps if steps else 0.0,
        })  # fmt: skip
    return res


def _full_window_steps(counts: list[int], max_lookahead: int | None, gen_len: int = GEN_LEN) -> int:
    """Steps of one APD answer that accepted every drafted token: the window of a step starting at offset c holds
    min(M, gen_len - c) drafts (M None: gen_len - c)."""
    full, c = 0, 0
    for a in counts:
        window = gen_len - c if max_lookahead is None else min(max_lookahead, gen_len - c)
        full += a >= window
        c += a
    return full


def markdown_table(rows: list[list], header: list[str]) -> str:
    """A GitHub-flavoured markdown table (tabulate); cells are written as given (no re-parsing of numbers, so a
    formatted "7.90" stays "7.90")."""
    from tabulate import tabulate

    return tabulate(rows, header, tablefmt="github", disable_numparse=True)


def markdown(results: list[dict], *, command: str, model_path, n_params: int, backend: str, n: int,
             block_size: int = BLOCK, task: str = DEFAULT_TASK, student_path=None) -> str:
    import torch

    t = eval_task(task)
    rows = task_rows(task, block_size)
    apd_rows = [r for r in results if r["row"] in APD_ROWS]
    gen = (f"tasks.generate('test', {n}, seed=0)" if task == DEFAULT_TASK
           else f"tasks.generate_task({task!r}, 'test', {n}, seed=0)")
    lines = [
        ("# Eval on the embedded task (held-out split)" if task == DEFAULT_TASK
         else f"# Eval on task `{task}` (held-out split)")
        + (f", block size {block_size}" if block_size != BLOCK else ""),
        "",
        f"Command: `{command}`",
        "",
        f"Model: `{model_path}` ({n_params / 1e6:.2f}M parameters, Dream architecture, float32, CPU)"
        + (f"; dparallel rows: the student `{student_path}`" if student_path else "") + "; "
        f"{n} held-out problems (`{gen}`); backend `{backend}`; "
        f"{platform.machine()} / torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ]
    header = ["strategy", "accuracy", "TPF", "TPF until EOS", "forwards / answer", "tokens/s"]
    if apd_rows:
        header += ["dLLM forwards / answer", "verifier forwards / answer", "accepted / step", "full-window steps"]
    table = []
    for r in results:
        if r["status"] != "ok":
            table.append([r["row"], "unavailable"] + ["-"] * (len(header) - 2))
            continue
        cells = [r["row"], f"{100 * r['accuracy']:.1f}%", f"{r['tpf']:.2f}", f"{r['tpf_until_eos']:.2f}",
                 f"{r['forwards_per_answer']:.1f}", f"{r['tokens_per_s']:.0f}"]
        if apd_rows and r["row"] in APD_ROWS:
            cells += [f"{r['dllm_forwards_per_answer']:.2f}", f"{r['verifier_forwards_per_answer']:.2f}",
                      f"{r['mean_accepted']:.2f}", f"{100 * r['full_window_share']:.0f}%"]
        elif apd_rows:
            cells += [f"{r['forwards_per_answer']:.1f}", "-", "-", "-"]
        table.append(cells)
    lines.append(markdown_table(table, header))
    lines += ["", f"Knobs (temperature 0, max_new_tokens {t.gen_len}, block size {block_size}):", ""]
    for r in results:
        why = f" (unavailable: {r['reason']})" if r["status"] != "ok" else ""
        lines.append(f"- `{r['row']}`: {rows[r['row']]}{why}")
    lines += [
        "",
        "TPF counts every generated position, EOS filler included (upstream Dream/LoPA and the paper);",
        "`TPF until EOS` counts positions up to the first EOS. A LoPA round (k+1 branches) is one forward.",
        "tokens/s is wall clock on this machine with the named backend; compare ratios within one run only.",
        "",
    ]
    by_row = {r["row"]: r for r in results if r["status"] == "ok"}
    if TEACHER_RULE_ROW in by_row and "dparallel-h0.45" in by_row:
        te, st = by_row[TEACHER_RULE_ROW], by_row["dparallel-h0.45"]
        lines += [
            f"dParallel under one rule (entropy threshold {STUDENT_ENTROPY_THRESHOLD}, block {block_size}): the "
            f"teacher needs {te['forwards_per_answer']:.1f} forwards per answer at {100 * te['accuracy']:.1f}%, the "
            f"student {st['forwards_per_answer']:.1f} at {100 * st['accuracy']:.1f}%: "
            f"{te['forwards_per_answer'] / st['forwards_per_answer']:.2f}x fewer forwards "
            f"(accuracy {100 * (st['accuracy'] - te['accuracy']):+.1f} points).",
            "",
        ]
    if apd_rows:
        ran = sorted({r.get("backend") or "?" for r in apd_rows if r["status"] == "ok"})
        p6, p7 = rows["apd-r0.6"], rows["apd-r0.7"]
        lines += [
            f"APD rows: the embedded model drafts and the shipped causal `{t.verifier}` verifies. (R, W, M) are "
            "upstream's Pareto presets (0.6, 32, 200) and (0.7, 16, 100) for 256 new tokens with kv_window W and "
            f"max_lookahead M scaled by {t.gen_len}/256 to this task's {t.gen_len} (rounded half up: "
            f"(0.6, {p6['kv_window']}, {p6['max_lookahead']}), (0.7, {p7['kv_window']}, {p7['max_lookahead']})), "
            f"plus R = 0.9 at ({p7['kv_window']}, {p7['max_lookahead']}); block knobs do not apply. TPF and forwards / answer count dLLM "
            "forwards (upstream's and the paper's convention); the verifier's forwards are reported beside them. "
            "accepted / step = mean tokens accepted per step over all steps of all answers (each step is one dLLM "
            "forward, so it equals TPF before any cut); full-window steps = share of steps that accepted every "
            "drafted token (min(M, tokens left) of them)."
            + (f" Backend that ran them: {', '.join(ran)}." if ran else ""),
            "",
        ]
    lines += ["", WHY_WALL_TIME]
    return "\n".join(lines)


def plot(results: list[dict], path: Path, gen_len: int = GEN_LEN, verifier: str = VERIFIER_MODEL) -> str | None:
    """TPF and accuracy against k (k = 1 is D2F) as a PNG (matplotlib, Agg backend), with a second panel for the
    APD rows (TPF, verifier forwards per answer and accuracy against R) when they ran; returns a note when there
    is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = {"d2f": 1, "lopa-k2": 2, "lopa-k4": 4, "lopa-k8": 8}
    pts = sorted((ks[r["row"]], r) for r in results if r["row"] in ks and r["status"] == "ok")
    apd = sorted((APD_ROWS[r["row"]]["apd_mixture_weight"], r["row"], r) for r in results
                 if r["row"] in APD_ROWS and r["status"] == "ok")
    student = {"dparallel-lopa-k4": 4}
    spts = sorted((student[r["row"]], r) for r in results if r["row"] in student and r["status"] == "ok")
    if not pts and not apd:
        return "no D2F/LoPA/APD rows ran: no plot written"
    n_panels = bool(pts) + bool(apd)
    # constrained layout keeps each panel's legend (under its axes, clear of the data) inside the figure
    fig, axes = plt.subplots(1, n_panels, figsize=(5 * n_panels, 3.8), squeeze=False, layout="constrained")
    if apd:
        _plot_apd(axes[0, -1], apd, apd_rows(gen_len), verifier)
    if not pts:
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None
    x = [k for k, _ in pts]
    tpf = [r["tpf"] for _, r in pts]
    acc = [100 * r["accuracy"] for _, r in pts]
    ax = axes[0, 0]
    ax.plot(x, tpf, "o-", label="TPF")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(k) for k in x])
    ax.set_xlabel("branching factor k (1 = D2F)")
    ax.set_ylabel("tokens per forward")
    if spts:
        ax.plot([k for k, _ in spts], [r["tpf"] for _, r in spts], "D", color="tab:purple",
                label="TPF, dParallel student")
    # both axes from 0: a tie (arith: every k at ~8 tokens per forward) reads as a flat line, not as noise on a
    # 7.6-8.4 axis; the values are printed at the points, so small differences stay readable
    ax.set_ylim(0, 1.2 * max(tpf + [r["tpf"] for _, r in spts]))
    for k, v in zip(x, tpf):
        ax.annotate(f"{v:.2f}", (k, v), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax2 = ax.twinx()
    ax2.plot(x, acc, "s--", color="tab:red", label="accuracy")
    ax2.set_ylabel("exact match (%)")
    ax2.set_ylim(0, 105)
    ax.set_title("D2F / LoPA", fontsize=9)
    _legend_below(ax, ax2)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _plot_apd(ax, apd: list[tuple], knobs: dict = APD_ROWS, verifier: str = VERIFIER_MODEL) -> None:
    """APD panel: TPF (= mean accepted per step) and verifier forwards per answer against R, accuracy on the right."""
    x = list(range(len(apd)))
    labels = [f"R={R:g}\nW={knobs[name]['kv_window']} M={knobs[name]['max_lookahead']}" for R, name, _ in apd]
    ax.plot(x, [r["tpf"] for *_, r in apd], "o-", label="TPF (dLLM forwards)")
    ax.plot(x, [r["verifier_forwards_per_answer"] for *_, r in apd], "^:", color="tab:green",
            label="verifier forwards / answer")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("tokens per forward / forwards")
    ax.set_ylim(bottom=0)
    ax.set_title(f"APD (verifier {verifier})", fontsize=9)
    ax2 = ax.twinx()
    ax2.plot(x, [100 * r["accuracy"] for *_, r in apd], "s--", color="tab:red", label="accuracy")
    ax2.set_ylabel("exact match (%)")
    ax2.set_ylim(0, 100)
    _legend_below(ax, ax2)


def _legend_below(ax, ax2) -> None:
    """One legend for a panel's two y axes, under the panel (never over its points)."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8, frameon=False)


def run_eval(n: int = 100, strategies="all", backend: str = "auto", out=None, model_dir=None,
             progress: bool = True, command: str | None = None, log=print, block_size: int = BLOCK,
             compile: bool = False, task: str = DEFAULT_TASK, student_dir=None, verifier_dir=None) -> list[dict]:
    """Evaluate `task`'s rows on `n` held-out problems at `block_size` (a divisor of the task's max_new_tokens);
    write the markdown table (and PNG) to `out`. The dparallel rows run on the shipped student (or
    `student_dir`); APD rows on the task's shipped verifier (or `verifier_dir`, loaded like the model); a row whose
    model is not shipped is unavailable."""
    t = eval_task(task)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}; allowed: an int >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    check_block_size(block_size, t.gen_len)
    rows = parse_rows(strategies, task)
    model, tok, path = load_default(model_dir, task=task)
    problems = tasks.generate_task(task, "test", n, seed=0)
    apd = any(r in APD_ROWS for r in rows)
    if verifier_dir is not None:
        import lopa_fast

        verifier = lopa_fast.load_model(verifier_dir, dtype=model.dtype) if apd else None
    else:
        verifier = load_verifier(name=t.verifier) if apd and shipped(t.verifier) else None
    student, student_path = None, None
    if any(r in STUDENT_ROWS for r in rows) and (student_dir is not None or shipped(t.student)):
        student, _, student_path = load_default(student_dir or _asset_path(t.student), task=task)
    results = []
    for r in rows:
        if r in STUDENT_ROWS and student is None:
            results.append({"row": r, "status": "unavailable", "reason": f"the student {t.student} is not shipped"})
            continue
        results.append(run_row(student if r in STUDENT_ROWS else model, tok, problems, r, backend, progress,
                               block_size, compile, verifier=verifier, task=task))
    for r in results:
        r["block_size"] = block_size
    n_params = sum(p.numel() for p in model.parameters())
    command = command or (f"python -m lopa_fast eval --n {n} --strategies {','.join(rows)} --backend {backend}"
                          + (f" --block-size {block_size}" if block_size != BLOCK else "")
                          + (f" --task {task}" if task != DEFAULT_TASK else ""))
    md = markdown(results, command=command, model_path=path.name, n_params=n_params, backend=backend, n=n,
                  block_size=block_size, task=task, student_path=student_path and Path(student_path).name)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        note = plot(results, out.with_suffix(".png"), t.gen_len, t.verifier)
        if note:
            md += f"\nPlot: {note}.\n"
        out.write_text(md)
        log(f"wrote {out}" + ("" if note else f" and {out.with_suffix('.png')}"))
    log(md)
    return results


def _asset_path(name: str) -> Path:
    from lopa_fast.assets import model_dir as _embedded

    return _embedded(name)


# ---- demo -----------------------------------------------------------------------------------------
DEMO_ROWS = ("d2f", "lopa-k4")
# the demo's default task: arith-var's worked solutions of 64-96 tokens leave D2F room to be slow (about 4 tokens per
# forward), so LoPA's lookahead branches show what they are for (about half D2F's forwards, the same answers). On
# `arith` the model is so confident that D2F already fills a block per round and LoPA cannot do better.
DEMO_TASK = "arith-var"


def fill_order(tok, ids: list[int], trace: list[dict]) -> str:
    """Two aligned lines (lopa_fast.viz.fill_order_text): the generated tokens up to the first EOS and the round
    that filled each (`*` marks a token taken from a winning LoPA lookahead branch), then the EOS filler's rounds."""
    from lopa_fast.viz import fill_order_text, fill_rounds

    eos = tok.eos_token_id
    last = ids.index(eos) if eos in ids else len(ids) - 1
    toks = ["<eos>" if t == eos else tok.convert_ids_to_tokens(t) for t in ids[: last + 1]]
    top, bot = fill_order_text(trace, toks).split("\n")
    rounds, _ = fill_rounds(trace, len(ids))
    tail = len(ids) - last - 1
    rounds_tail = sorted({rounds[i] for i in range(last + 1, len(ids)) if rounds[i]})
    extra = ""
    if tail and rounds_tail:
        first, last_r = rounds_tail[0], rounds_tail[-1]
        span = f"round {first}" if first == last_r else f"rounds {first}-{last_r}"
        extra = f"   (+{tail} EOS filler, {span})"
    return f"      {top}\n      {bot}{extra}"


def run_demo(n: int = 3, backend: str = "auto", model_dir=None, log=print, compile: bool = False,
             task: str = DEMO_TASK) -> list[dict]:
    """Decode `n` held-out problems of `task` (default arith-var) with D2F and LoPA (k=4) and print answers, fill
    order and stats, then the two rows' forwards and accuracy side by side."""
    import torch

    import lopa_fast

    t = eval_task(task)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}; allowed: an int >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    t0 = time.time()
    model, tok, path = load_default(model_dir, task=task)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"lopa_fast demo (task {task}): embedded model {path.name} ({n_params / 1e6:.2f}M params, Dream architecture, "
        f"trained by lopa_fast.train.d2f), backend {backend}, temperature 0")
    log("knobs: block 8, tau_add 0.1, tau_act 0.95, tau_conf 0.9, neg_entropy, full attention; LoPA k=4: each "
        "round also verifies 4 lookahead branches in the same forward and keeps the most confident (* in the fill "
        "order: a token from a winning lookahead)\n")
    records = []
    for p in tasks.generate_task(task, "test", n, seed=0):
        log(f"Q: {tasks.join_digits(p.prompt)}")
        log(f"   expected: #### {p.answer}")
        ids = torch.tensor(prompt_ids(tok, p), dtype=torch.long)
        for row in DEMO_ROWS:
            try:
                out = lopa_fast.generate(model, ids, backend=backend, max_new_tokens=t.gen_len, temperature=0.0,
                                         return_trace=True, compile=compile and _compiles(backend, ROWS[row]),
                                         **ROWS[row])
            except Exception as exc:  # noqa: BLE001
                reason = _unavailable(exc)
                if reason is None:
                    raise
                log(f"   {row:8s} unavailable ({reason})")
                records.append({"row": row, "status": "unavailable"})
                continue
            st = out.stats
            text = answer_text(tok, out.generated_ids)
            ok = tasks.extract_answer(text) == p.answer
            log(f"   {row:8s} {'ok ' if ok else 'BAD'} {text}")
            log(f"            TPF {st['tpf']:.2f} (until EOS {st['tpf_until_eos']:.2f}), forwards {st['forwards']}, "
                f"wall {1000 * st['seconds']:.0f} ms" + (f", lookahead wins {st['lookahead_wins']}"
                                                       if "lookahead_wins" in st else ""))
            if out.trace is not None:
                log(fill_order(tok, out.generated_ids, out.trace))
            records.append({"row": row, "status": "ok", "correct": ok, "tpf": st["tpf"], "forwards": st["forwards"],
                            "seconds": st["seconds"]})
        log("")
    good = [r for r in records if r["status"] == "ok"]
    summary = demo_summary(good)
    if summary:
        log(summary)
        log(WHY_WALL_TIME)
    if good:
        acc = sum(r["correct"] for r in good) / len(good)
        log(f"{len(good)} decodes, {100 * acc:.0f}% exact match, total wall {time.time() - t0:.1f}s "
            f"(python -m lopa_fast eval for the full table)")
    return records


# Why LoPA's fewer forwards do not show as less wall time on a CPU: said under the demo's summary and in eval's table
WHY_WALL_TIME = (
    "Forwards vs wall time: a LoPA round verifies k + 1 branches in ONE forward. On a GPU a decode forward is "
    "memory-bound (one pass over the weights serves every branch: a round costs about one forward), so fewer "
    "forwards is less time; on a CPU it is compute-bound (k + 1 branches cost about k + 1 forwards' arithmetic), so "
    "here the saving shows in forwards, not in seconds (bench/results/projection.md projects a GPU round)."
)


def demo_summary(records: list[dict]) -> str | None:
    """One line: LoPA's forwards, wall time and accuracy against D2F's over the demo's problems (None when a row
    did not run)."""
    rows = {row: [r for r in records if r["row"] == row and r["status"] == "ok"] for row in DEMO_ROWS}
    d2f, lopa = rows["d2f"], rows["lopa-k4"]
    if not d2f or not lopa:
        return None
    fd, fl = sum(r["forwards"] for r in d2f), sum(r["forwards"] for r in lopa)
    ad, al = sum(r["correct"] for r in d2f), sum(r["correct"] for r in lopa)
    verdict = f"{fd / fl:.2f}x fewer forwards" if fl < fd else ("the same forwards" if fl == fd else
                                                                f"{fl / fd:.2f}x more forwards")
    sd, sl = sum(r["seconds"] for r in d2f), sum(r["seconds"] for r in lopa)
    return (f"LoPA k=4: {fl} forwards in {sl:.2f} s for {len(lopa)} answers ({al}/{len(lopa)} right) against D2F's "
            f"{fd} forwards in {sd:.2f} s ({ad}/{len(d2f)} right): {verdict}, {sd / sl:.2f}x D2F's speed in wall time")

