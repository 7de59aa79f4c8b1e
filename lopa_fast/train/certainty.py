"""dParallel's diagnosis, the certainty-convergence curve: per decoding step of one-token-per-forward decoding, the
share of the still-masked positions whose confidence (max probability) is above a threshold.

    python -m lopa_fast.train.certainty MODEL_DIR [MODEL_DIR ...] --n 32 --threshold 0.9 \\
        --out bench/results/certainty_convergence.md --png bench/results/certainty_convergence.png

Why: dParallel's premise is that a plain masked-diffusion model's masked tokens become certain one after another
("sequential certainty convergence": at each step few masked positions are confident, so a threshold rule commits
about one token per forward), and certainty forcing trains a student whose masked positions are confident early,
so the same rule commits several per forward. A curve near 1/(masks left) is sequential; a curve well above it is
the parallel regime. Decoding: the eval's vanilla row (full attention over prompt + the whole region, the lowest-
entropy masked position filled with its argmax each forward; `train.greedy`), on the dev split of arith-var (or
`--task arith`), the model's own trajectory (not teacher-forced).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lopa_fast import tasks
from lopa_fast.train.data import make_batch
from lopa_fast.train.greedy import greedy_fill

GEN_LEN = {"arith": 32, "arith-var": 96}


def certainty_curve(model, problems, tok, gen_len: int, threshold: float = 0.9, alg: str = "entropy",
                    batch_size: int = 32) -> dict:
    """{"share": [gen_len] floats, the share of still-masked positions with max probability > threshold at each step
    (pooled over problems; steps where no problem had a mask left are None), "confident": [gen_len] the mean count
    of such positions, "masked": [gen_len] the mean count of masked positions, "accuracy": the exact match}."""
    conf = torch.zeros(gen_len, dtype=torch.float64)
    masked = torch.zeros(gen_len, dtype=torch.float64)
    correct = 0

    def observe(step, p_max, still):
        conf[step] += float(((p_max > threshold) & still).sum())
        masked[step] += float(still.sum())

    model.eval()
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        out = greedy_fill(model, make_batch(chunk, tok, gen_len), gen_len, alg, observe=observe)
        for p, row in zip(chunk, out.tolist()):
            correct += int(tasks.extract_answer(tok.decode(row, skip_special_tokens=True)) == p.answer)
    n = max(1, len(problems))
    share = [None if m == 0 else float(c / m) for c, m in zip(conf, masked)]
    return {"share": share, "confident": (conf / n).tolist(), "masked": (masked / n).tolist(),
            "accuracy": correct / n}


def table(curves: dict, every: int = 8) -> str:
    """Markdown (tabulate, GitHub format): one row per `every`-th step, one column per model (share of confident
    masked positions, with the mean counts)."""
    from tabulate import tabulate

    names = list(curves)
    rows = []
    for s in range(0, len(next(iter(curves.values()))["share"]), every):
        row = [s]
        for c in curves.values():
            row.append("-" if c["share"][s] is None else
                       f"{c['share'][s]:.3f} ({c['confident'][s]:.1f} / {c['masked'][s]:.1f})")
        rows.append(row)
    rows.append(["accuracy", *(f"{curves[n]['accuracy']:.1%}" for n in names)])
    return tabulate(rows, headers=["step", *(f"{n}: share (confident / masked)" for n in names)], tablefmt="github")


def plot(curves: dict, path, threshold: float) -> None:
    """The curves as a PNG (matplotlib): share of confident masked positions per step, and the sequential
    reference 1 / (masks left) of a model that is confident about exactly one position per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    for name, c in curves.items():
        xs = [s for s, v in enumerate(c["share"]) if v is not None]
        ax.plot(xs, [c["share"][s] for s in xs], label=f"{name} (acc {c['accuracy']:.0%})")
    first = next(iter(curves.values()))
    ref = [(s, 1.0 / m) for s, m in enumerate(first["masked"]) if m > 0]
    ax.plot([s for s, _ in ref], [v for _, v in ref], "k:", label="one confident position per step")
    ax.set_xlabel("decoding step (one token per forward, lowest entropy first)")
    ax.set_ylabel(f"share of masked positions with p_max > {threshold}")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("certainty convergence (dParallel's diagnosis)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lopa_fast.train.certainty", description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="model directories (HF layout) of the task")
    ap.add_argument("--task", default="arith-var", choices=sorted(GEN_LEN))
    ap.add_argument("--n", type=int, default=32, help="dev problems (default 32)")
    ap.add_argument("--threshold", type=float, default=0.9, help="the confidence threshold (default 0.9)")
    ap.add_argument("--out", default=None, help="write the markdown table here (default: stdout)")
    ap.add_argument("--png", default=None, help="write the plot here")
    a = ap.parse_args(argv)
    if a.n < 1 or not 0 < a.threshold < 1:
        print(f"error: --n {a.n} must be >= 1 and --threshold {a.threshold} in (0, 1)", file=sys.stderr)
        return 2
    import lopa_fast

    torch.set_num_threads(1)
    tok = tasks.TOKENIZERS[a.task].build_tokenizer()
    problems = tasks.generate_task(a.task, "dev", a.n, seed=0)
    curves = {}
    for d in a.models:
        if not (Path(d) / "config.json").is_file():
            print(f"error: {d}: not a model directory (no config.json)", file=sys.stderr)
            return 2
        model = lopa_fast.load_model(d, dtype=torch.float32)
        curves[Path(d).name] = certainty_curve(model, problems, tok, GEN_LEN[a.task], a.threshold)
    cmd = "python -m lopa_fast.train.certainty " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# Certainty convergence ({a.task}, {a.n} dev problems, threshold {a.threshold})\n\nCommand: `{cmd}`\n\n"
            + table(curves) + "\n")
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    if a.png:
        plot(curves, a.png, a.threshold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
