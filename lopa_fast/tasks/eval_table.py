"""The eval's table and plot (lopa_fast.tasks.evaluate.run_eval writes them).

Columns: exact-match accuracy, TPF (generated positions / forwards, EOS filler included, the paper's
and upstream Dream's count), TPF until EOS, forwards per answer, tokens/s (wall clock of this run); with
APD rows also dLLM and verifier forwards per answer, mean tokens accepted per step and the share of steps
that accepted their whole lookahead window (APD's TPF counts dLLM forwards only, as upstream and the paper).
A strategy whose implementation is missing is reported as unavailable, never approximated.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

from lopa_fast.tasks.eval_rows import (
    APD_ROWS,
    BLOCK,
    DEFAULT_TASK,
    GEN_LEN,
    STUDENT_ENTROPY_THRESHOLD,
    TEACHER_RULE_ROW,
    VERIFIER_MODEL,
    apd_rows,
    eval_task,
    task_rows,
)

# Why LoPA's fewer forwards do not show as less wall time on a CPU: said under the demo's summary and in eval's table
WHY_WALL_TIME = (
    "Forwards vs wall time: a LoPA round verifies k + 1 branches in ONE forward. On a GPU a decode forward is "
    "memory-bound (one pass over the weights serves every branch: a round costs about one forward), so fewer "
    "forwards is less time; on a CPU it is compute-bound (k + 1 branches cost about k + 1 forwards' arithmetic), so "
    "here the saving shows in forwards, not in seconds (bench/results/projection.md projects a GPU round)."
)


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
    from tabulate import tabulate

    lines.append(tabulate(table, header, tablefmt="github", disable_numparse=True))  # cells as given: "7.90" stays
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
            f"plus R = 0.9 at ({p7['kv_window']}, {p7['max_lookahead']}); block knobs do not apply. TPF and "
            "forwards / answer count dLLM "
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
    if pts:
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
