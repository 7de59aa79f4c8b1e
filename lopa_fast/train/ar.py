"""Recipe: a small causal AR model (Qwen2 architecture, model_type "qwen2") with the task tokenizer,
the drafter for APD on the embedded task.

    python -m lopa_fast.train.ar --out lopa_fast/assets/ar-arith
    python -m lopa_fast.train.ar --out runs/ar-arith-var --task arith-var --gen-len 96 --max-positions 160 \
        --init-from lopa_fast/assets/ar-arith        # APD's verifier for arith-var (issue 12)

Plain next-token cross-entropy on the generation region (solution, EOS, then the EOS filler up to
gen_len, the same targets the diffusion model learns, so that the drafter agrees with it after EOS);
the prompt is context only. Seeded, CPU-only, float32; same data stream and init as lopa_fast.train.d2f,
and like it: `--task`, `--init-from` (a smaller vocabulary grows, its rows copied) and resumable (`--resume`
from OUT/resume.pt, written every `ckpt_every` steps and at every eval).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from lopa_fast import tasks
from lopa_fast.train import run
from lopa_fast.train.d2f import build, prepare
from lopa_fast.train.d2f import hf_config as d2f_config
from lopa_fast.train.data import make_batch

DEFAULTS = dict(
    hidden=128, layers=3, heads=4, kv_heads=2, intermediate=384, gen_len=32, batch=64, steps=600, lr=2e-3,
    min_lr_frac=0.05, warmup=50, weight_decay=0.01, seed=0, eval_every=300, eval_n=60, threads=1,
    task="arith", max_positions=128, init_from="", ckpt_every=100, stop_at=0,
)


def hf_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
              max_positions: int = 128) -> dict:
    """config.json of the AR drafter (Qwen2ForCausalLM layout, no mask token)."""
    return d2f_config(vocab_size, hidden, layers, heads, kv_heads, intermediate, max_positions, kind="qwen2")


def loss_on(model, batch) -> torch.Tensor:
    """Next-token CE on the generation region: the raw logit at j - 1 predicts token j, for j in
    [P, P + gen_len)."""
    logits = model(batch.ids, mask="causal", win_lens=batch.lens)
    j = torch.arange(batch.ids.shape[1])[None, :]
    tgt = (j >= batch.prompt_lens[:, None]) & (j < batch.lens[:, None])
    b, p = tgt.nonzero(as_tuple=True)
    return F.cross_entropy(logits[b, p - 1].float(), batch.ids[b, p])


@torch.no_grad()
def greedy_accuracy(model, problems, tok, gen_len: int) -> float:
    """Exact match of plain greedy AR decoding (no cache; the region is tiny)."""
    correct = 0
    for p in problems:
        prompt, _ = tasks.encode_problem(tok, p, gen_len)
        ids = torch.tensor(prompt)[None]
        for _ in range(gen_len):
            nxt = model(ids, mask="causal")[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if int(nxt) == tasks.EOS_ID:
                break
        text = tok.decode(ids[0, len(prompt):].tolist(), skip_special_tokens=True)
        correct += int(tasks.extract_answer(text) == p.answer)
    return correct / max(1, len(problems))


def train(out: str | os.PathLike, log=print, resume: bool = False, **overrides) -> dict:
    """Train and save to `out` (HF layout + tokenizer + training_log.txt). Returns a summary dict."""
    a = run.options(DEFAULTS, overrides)
    tasks.check_task(a["task"])
    out, state, rl, tok_mod, tok = prepare(out, a, log, resume)
    emit = rl.emit
    dev = tasks.generate_task(a["task"], "dev", a["eval_n"], seed=0)
    cfg, model, opt, n_params, (start, *trace, spent) = build(hf_config, tok, a, state, out, emit, "ar")

    def evaluate(step: int) -> float:
        acc = greedy_accuracy(model, dev, tok, a["gen_len"])
        emit(f"eval step {step + 1:5d} dev_exact_match {acc:.4f} (n={len(dev)}, greedy AR) t {steps.seconds():7.1f}s")
        return acc

    def save() -> None:
        run.save(model, cfg, out, "lopa_fast.train.ar", a, tok_mod.save_tokenizer)

    steps = run.Steps(a, out, model, opt, emit, spent, *trace, evaluate, save)
    for step in range(start, steps.last_step):
        problems = tasks.generate_task(a["task"], "train", a["batch"], seed=a["seed"] * 1_000_003 + step)
        steps.update(step, loss_on(model, make_batch(problems, tok, a["gen_len"])))
    return rl.finish(steps.summary(n_params))


if __name__ == "__main__":
    run.main("lopa_fast.train.ar", __doc__, DEFAULTS, train)
