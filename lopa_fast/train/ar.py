"""Recipe: a small causal AR model (Qwen2 architecture, model_type "qwen2") with the task tokenizer,
the drafter for APD on the embedded task.

    python -m lopa_fast.train.ar --out lopa_fast/assets/ar-arith

Plain next-token cross-entropy on the generation region (solution, EOS, then the EOS filler up to
gen_len, the same targets the diffusion model learns, so that the drafter agrees with it after EOS);
the prompt is context only. Seeded, CPU-only, float32; same data stream and init as lopa_fast.train.d2f.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lopa_fast import tasks
from lopa_fast.models import save_checkpoint
from lopa_fast.train.d2f import hf_config as _dream_config
from lopa_fast.train.d2f import init_model, lr_at
from lopa_fast.train.data import make_batch

DEFAULTS = dict(
    hidden=128, layers=3, heads=4, kv_heads=2, intermediate=384, gen_len=32, batch=64, steps=600, lr=2e-3,
    min_lr_frac=0.05, warmup=50, weight_decay=0.01, seed=0, eval_every=300, eval_n=60, threads=1,
)


def hf_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    """config.json of the AR drafter (Qwen2ForCausalLM layout, no mask token)."""
    cfg = _dream_config(vocab_size, hidden, layers, heads, kv_heads, intermediate)
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    cfg.pop("mask_token_id")
    return cfg


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


def train(out: str | os.PathLike, log=print, **overrides) -> dict:
    """Train and save to `out` (HF layout + tokenizer + training_log.txt). Returns a summary dict."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"train: unknown options {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
    a = {**DEFAULTS, **overrides}
    torch.set_num_threads(a["threads"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "training_log.txt", "w")

    def emit(msg: str) -> None:
        log(msg)
        logf.write(msg + "\n")
        logf.flush()

    tok = tasks.build_tokenizer()
    cfg = hf_config(tok.get_vocab_size(), a["hidden"], a["layers"], a["heads"], a["kv_heads"], a["intermediate"])
    model = init_model(cfg, a["seed"])
    n_params = sum(p.numel() for p in model.parameters())
    emit(f"# ar recipe: {json.dumps(a, sort_keys=True)}")
    emit(f"# params {n_params} ({n_params * 4 / 2**20:.2f} MiB fp32); threads {torch.get_num_threads()}")
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(0.9, 0.98), weight_decay=a["weight_decay"])
    dev = tasks.generate("dev", a["eval_n"], seed=0)
    t0, ema, first, acc = time.time(), None, None, None
    for step in range(a["steps"]):
        problems = tasks.generate("train", a["batch"], seed=a["seed"] * 1_000_003 + step)
        batch = make_batch(problems, tok, a["gen_len"])
        lr = lr_at(step, a["steps"], a["lr"], a["warmup"], a["min_lr_frac"])
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_on(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        v = float(loss.detach())
        first = v if first is None else first
        ema = v if ema is None else 0.98 * ema + 0.02 * v
        if step % 50 == 0 or step == a["steps"] - 1:
            emit(f"step {step:5d} loss {v:.4f} ema {ema:.4f} lr {lr:.2e} t {time.time() - t0:7.1f}s")
        if (a["eval_every"] and (step + 1) % a["eval_every"] == 0) or step == a["steps"] - 1:
            model.eval()
            acc = greedy_accuracy(model, dev, tok, a["gen_len"])
            model.train()
            emit(f"eval step {step + 1:5d} dev_exact_match {acc:.4f} (n={len(dev)}, greedy AR)")
            save_checkpoint(model, out, cfg)
            tasks.save_tokenizer(out)
            with open(out / "train_args.json", "w") as f:
                json.dump({"recipe": "lopa_fast.train.ar", **a}, f, indent=2, sort_keys=True)
    summary = {"params": n_params, "steps": a["steps"], "seconds": round(time.time() - t0, 1),
               "final_loss_ema": round(ema, 4), "first_loss": round(first, 4), "dev_exact_match": acc}
    emit(f"# done: {json.dumps(summary)}")
    logf.close()
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lopa_fast.train.ar", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output model directory")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    ns = vars(ap.parse_args(argv))
    out = ns.pop("out")
    train(out, **ns)


if __name__ == "__main__":
    main()
