"""The eval (the LoPA paper's Table 1 on the embedded task) and the demo, over `lopa_fast.generate`: load the
task's models, decode every held-out problem with each row, count. The rows: lopa_fast/tasks/eval_rows.py (from the
strategy specs); the table and plot: lopa_fast/tasks/eval_table.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from lopa_fast import strategies, tasks
from lopa_fast.assets import ASSETS_DIR
from lopa_fast.assets import model_dir as asset_dir

# EVAL_ROWS, EVAL_TASKS, apd_rows, make_rows, out_path: not used here, reached as lopa_fast.tasks.evaluate.<name> by
# tests and bench/
from lopa_fast.tasks.eval_rows import (  # noqa: F401
    APD_ROWS,
    BACKENDS,
    BLOCK,
    DEFAULT_TASK,
    DEMO_ROWS,
    DEMO_TASK,
    EVAL_ROWS,
    EVAL_TASKS,
    GEN_LEN,
    ROWS,
    STUDENT_ROWS,
    VERIFIER_MODEL,
    apd_rows,
    check_block_size,
    eval_task,
    make_rows,
    out_path,
    parse_rows,
    task_rows,
)
from lopa_fast.tasks.eval_table import WHY_WALL_TIME, markdown, plot
from lopa_fast.request.text import answer_ids


def load_default(model_dir=None, dtype=None, task: str = DEFAULT_TASK):
    """(model, tokenizer, directory) of `task`'s embedded model (or `model_dir`); dtype default float32."""
    import torch

    import lopa_fast

    path = Path(model_dir) if model_dir is not None else asset_dir(eval_task(task).model)
    return lopa_fast.load_model(path, dtype=dtype or torch.float32), lopa_fast.load_tokenizer(path), path


def load_verifier(dtype=None, name: str = VERIFIER_MODEL):
    """A shipped APD verifier (default `ar-arith`, a causal qwen2 model with d2f-arith's tokenizer), loaded like
    `load_default` loads the drafter (dtype default float32)."""
    return load_default(asset_dir(name), dtype)[0]


def shipped(name: str) -> bool:
    """Whether lopa_fast/assets/<name> holds a model."""
    return (ASSETS_DIR / name / "config.json").is_file()


def prompt_ids(tok, problem) -> list[int]:
    """The prompt's ids (bos first, as the model was trained)."""
    return tok(problem.prompt)["input_ids"]


def answer_text(tok, ids: list[int]) -> str:
    """Generated ids -> readable text up to the first EOS (the tokenizer's decoder joins digits)."""
    return tok.decode(answer_ids(ids, tok.eos_token_id), skip_special_tokens=True)


def _decode(model, ids, knobs: dict, backend: str, gen_len: int, compile: bool, **extra):
    """(generate's output, None) of one problem at temperature 0 (compile: on the fast backend only, the reference
    runs eagerly), or (None, the reason) when the strategy cannot run in this checkout; a real failure raises."""
    import lopa_fast

    try:
        return lopa_fast.generate(model, ids, backend=backend, max_new_tokens=gen_len, temperature=0.0,
                                  compile=compile and backend != "reference", **knobs, **extra), None
    except (ModuleNotFoundError, NotImplementedError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except ValueError as exc:
        if "does not cover strategy" not in str(exc):
            raise
        return None, str(exc)


def _apd_pair_problem(model, verifier, knobs, gen_len: int = GEN_LEN,
                      verifier_name: str = VERIFIER_MODEL) -> str | None:
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
    """Decode every problem with one row of `task` at `block_size` (APD rows: with `verifier`; compile: on the fast
    backend only, the reference runs eagerly). Returns the row's numbers (or status "unavailable")."""
    import torch

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
    from tqdm.auto import tqdm

    bar = tqdm(total=len(problems), desc=f"{row:>9s}", disable=not progress, file=sys.stderr, leave=True,
               dynamic_ncols=True)
    for i, p in enumerate(problems):
        ids = torch.tensor(prompt_ids(tok, p), dtype=torch.long, device=model.device)
        out, reason = _decode(model, ids, knobs, backend, t.gen_len, compile, **extra)
        if out is None:
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
        })
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
    verifier = None
    if any(r in APD_ROWS for r in rows) and (verifier_dir is not None or shipped(t.verifier)):
        verifier = load_default(verifier_dir or asset_dir(t.verifier), model.dtype)[0]
    student, student_path = None, None
    if any(r in STUDENT_ROWS for r in rows) and (student_dir is not None or shipped(t.student)):
        student, _, student_path = load_default(student_dir or asset_dir(t.student), task=task)
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


# ---- demo -----------------------------------------------------------------------------------------
def fill_order(tok, ids: list[int], trace: list[dict]) -> str:
    """Two aligned lines (lopa_fast.viz.fill_order_text): the generated tokens up to the first EOS and the round
    that filled each (`*` marks a token taken from a winning LoPA lookahead branch), then the EOS filler's rounds."""
    from lopa_fast.viz import fill_order_text, fill_rounds

    eos = tok.eos_token_id
    last = ids.index(eos) if eos in ids else len(ids) - 1
    toks = ["<eos>" if t == eos else tok.convert_ids_to_tokens(t) for t in ids[: last + 1]]
    lines = fill_order_text(trace, toks, width=DEMO_WIDTH - 6).split("\n")  # 6: the indent below
    rounds, _ = fill_rounds(trace, len(ids))
    tail = len(ids) - last - 1
    rounds_tail = sorted({rounds[i] for i in range(last + 1, len(ids)) if rounds[i]})
    extra = ""
    if tail and rounds_tail:
        first, last_r = rounds_tail[0], rounds_tail[-1]
        span = f"round {first}" if first == last_r else f"rounds {first}-{last_r}"
        extra = f"      (+{tail} EOS filler, {span})"
    return "\n".join("      " + line for line in lines) + (f"\n{extra}" if extra else "")


DEMO_WIDTH = 110  # the demo's lines wrap at this width (they were ~300-420 characters wide: issue 42, finding 8)


def wrapped(log):
    """`log` with each line of a message wrapped to DEMO_WIDTH (continuations indented like the line), so that the
    demo reads in a terminal; fill-order lines come pre-wrapped (`fill_order`) and are left as they are."""
    import textwrap

    def out(msg: str = "") -> None:
        lines = []
        for line in str(msg).split("\n"):
            if len(line) <= DEMO_WIDTH or line.lstrip().startswith(("tokens:", "round:")):
                lines.append(line)
                continue
            indent = " " * (len(line) - len(line.lstrip()))
            lines.extend(textwrap.wrap(line, DEMO_WIDTH, subsequent_indent=indent + "  ", break_long_words=False,
                                       break_on_hyphens=False))
        log("\n".join(lines))

    return out


def run_demo(n: int = 3, backend: str = "auto", model_dir=None, log=print, compile: bool = False,
             task: str = DEMO_TASK) -> list[dict]:
    """Decode `n` held-out problems of `task` (default arith-var) with D2F and LoPA (k=4) and print answers, fill
    order and stats, then the two rows' forwards and accuracy side by side."""
    import torch

    t = eval_task(task)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}; allowed: an int >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    log = wrapped(log)
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
            out, reason = _decode(model, ids, ROWS[row], backend, t.gen_len, compile, return_trace=True)
            if out is None:
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
