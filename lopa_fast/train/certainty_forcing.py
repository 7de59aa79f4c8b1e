"""Recipe: dParallel's certainty-forcing distillation (arXiv 2509.26488; spec section 4) for a Dream-architecture
model on the embedded tasks.

    python -m lopa_fast.train.certainty_forcing --out runs/dparallel-arith-var \\
        --teacher lopa_fast/assets/d2f-arith-var                      # the student of `arith-var`
    python -m lopa_fast.train.certainty_forcing --out runs/dparallel-arith-var --teacher ... --resume

What it does and why, with the measurements: docs/training.md.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lopa_fast import tasks
from lopa_fast.tasks import arith_var
from lopa_fast.train import run
from lopa_fast.train.data import make_batch

MASK_EPS = 1e-3  # p = (1 - eps) * t + eps with t = 0.5 (upstream's forward_process)
TRAJ_FILE = "trajectories.pt"

DEFAULTS = dict(
    teacher="lopa_fast/assets/d2f-arith-var", task="arith-var", gen_len=arith_var.GEN_LEN, n_problems=1024,
    traj_batch=64,
    batch=16, steps=600, lr=1e-4, min_lr_frac=0.1, warmup=30, weight_decay=0.01, lam=1.0, temperature=0.5,
    mask_t=0.5, seed=0, eval_every=200, eval_n=32, entropy_threshold=0.45, eval_block=8, threads=1,
    ckpt_every=50, stop_at=0, views="dream", view_block=8, traj_order="entropy",
)
VIEWS = ("dream", "semiar")  # spec 4.3's two masking variants (Dream: the whole response; LLaDA: semi-AR blocks)


@dataclass
class Trajectories:
    """The teacher's correct answers: prompts [N] (lists of ids with bos), responses [N, gen_len] int64 (the
    generated region, EOS padding included), answers [N]; `kept` of `total` decoded answers were correct."""

    prompts: list
    responses: torch.Tensor
    answers: list
    total: int

    @property
    def kept(self) -> int:
        return len(self.prompts)


@torch.no_grad()
def collect_trajectories(teacher, problems, tok, gen_len: int, batch_size: int = 64, log=None,
                         order: str = "entropy") -> Trajectories:
    """Decode `problems` with the teacher one token per forward (order: which masked position each forward fills,
    `train.greedy.greedy_fill`'s alg: "entropy" (lowest entropy first, Dream's), "left_to_right" (LLaDA's semi-AR
    sampler at block length 1), "max_prob") and keep the answers whose final answer is right. Raises ValueError
    when none is."""
    from lopa_fast.train.greedy import greedy_fill

    teacher.eval()
    prompts, responses, answers = [], [], []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        batch = make_batch(chunk, tok, gen_len)
        out = greedy_fill(teacher, batch, gen_len, alg=order)  # [B, gen_len]
        for b, (p, row) in enumerate(zip(chunk, out)):
            if tasks.extract_answer(tok.decode(row.tolist(), skip_special_tokens=True)) == p.answer:
                prompts.append(batch.ids[b, : int(batch.prompt_lens[b])].tolist())
                responses.append(row)
                answers.append(p.answer)
        if log is not None:
            log(f"trajectories: {min(i + batch_size, len(problems))}/{len(problems)} decoded, {len(prompts)} correct")
    if not prompts:
        raise ValueError(f"certainty forcing: none of the teacher's {len(problems)} answers is correct; "
                         "train the teacher first")
    return Trajectories(prompts, torch.stack(responses), answers, len(problems))


def batch_of(traj: Trajectories, index: list[int]):
    """Rows [prompt, response] right-padded with EOS: (ids [B, n], prompt_lens [B], lens [B] = P + gen_len)."""
    gen_len = traj.responses.shape[1]
    plens = torch.tensor([len(traj.prompts[i]) for i in index])
    n = int(plens.max()) + gen_len
    ids = torch.full((len(index), n), tasks.EOS_ID, dtype=torch.long)
    for r, i in enumerate(index):
        P = len(traj.prompts[i])
        ids[r, :P] = torch.tensor(traj.prompts[i])
        ids[r, P : P + gen_len] = traj.responses[i]
    return ids, plens, plens + gen_len


def complementary_masks(prompt_lens: torch.Tensor, lens: torch.Tensor, n: int, g: torch.Generator,
                        t: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, complement) bool [B, n]: inside each row's response segment [P, lens) every position is masked
    with p = (1 - 1e-3) t + 1e-3 in `mask` and exactly the others in `complement`; outside it neither."""
    j = torch.arange(n)[None, :]
    segment = (j >= prompt_lens[:, None]) & (j < lens[:, None])
    p = (1 - MASK_EPS) * t + MASK_EPS
    draw = torch.rand(len(prompt_lens), n, generator=g) < p
    return draw & segment, ~draw & segment


def semiar_masks(prompt_lens: torch.Tensor, lens: torch.Tensor, n: int, g: torch.Generator, t: float = 0.5,
                 block: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, complement) bool [B, n] of spec 4.3's LLaDA variant: per row j ~ UniformInt[0, R // block] with R =
    lens - P the response length; positions [P, P + j block) clean, the active block [P + j block, P + (j + 1)
    block) (to lens when it is the last) masked with p = (1 - 1e-3) t + 1e-3 in `mask` and exactly the others in
    `complement`, every position in [P + (j + 1) block, lens) masked in both."""
    B = len(prompt_lens)
    R = lens - prompt_lens
    jb = (torch.rand(B, generator=g) * (R // block + 1)).long().clamp(max=R // block) * block  # [B] j * block
    lo = prompt_lens + jb
    hi = torch.minimum(lo + block, lens)  # [B] end of the active segment
    mask, comp = complementary_masks(lo, hi, n, g, t)  # the active segment [lo, hi)
    pos = torch.arange(n)[None, :]
    suffix = (pos >= hi[:, None]) & (pos < lens[:, None])
    return mask | suffix, comp | suffix


def view_terms(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, temperature: float = 0.5):
    """Per-example (CE, H) of one view: logits [B, n, V] (raw, position j - 1 predicts j), targets [B, n],
    masked [B, n] bool (position 0 is never masked). CE: mean cross-entropy over the masked positions; H: mean
    entropy of softmax(logits / temperature) over the masked positions whose argmax equals the target (0 where
    there is none). Returns two [B] tensors."""
    pred = logits[:, :-1].float()  # [B, n-1, V]: predictions for positions 1..n-1
    tgt, m = targets[:, 1:], masked[:, 1:]
    ce = F.cross_entropy(pred.transpose(1, 2), tgt, reduction="none")  # [B, n-1]
    logp = F.log_softmax(pred / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)  # [B, n-1]
    right = m & (pred.argmax(-1) == tgt)
    cnt = m.sum(1).clamp_min(1)
    ce_mean = (ce * m).sum(1) / cnt
    h_mean = (ent * right).sum(1) / right.sum(1).clamp_min(1)
    return ce_mean, h_mean


def certainty_forcing_loss(model, ids, prompt_lens, lens, g: torch.Generator, lam: float = 1.0,
                           temperature: float = 0.5, t: float = 0.5, views: str = "dream",
                           view_block: int = 8) -> tuple[torch.Tensor, dict]:
    """L = CE + CE' + lam * (H + H') averaged over the batch, with the parts (floats) for the log. Two forwards:
    the masked view and its complement (full attention, keys up to `lens`); views: "dream" (complementary_masks)
    or "semiar" (semiar_masks with view_block)."""
    if views == "semiar":
        mask, comp = semiar_masks(prompt_lens, lens, ids.shape[1], g, t, view_block)
    else:
        mask, comp = complementary_masks(prompt_lens, lens, ids.shape[1], g, t)
    parts, total = {}, 0.0
    for tag, m in (("", mask), ("'", comp)):
        noisy = torch.where(m, torch.full_like(ids, tasks.MASK_ID), ids)
        logits = model(noisy, mask="full", win_lens=lens)
        ce, h = view_terms(logits, ids, m, temperature)
        total = total + ce.mean() + lam * h.mean()
        parts[f"ce{tag}"], parts[f"h{tag}"] = float(ce.mean().detach()), float(h.mean().detach())
    return total, parts


@torch.no_grad()
def masked_entropy(model, ids, prompt_lens, lens, seed: int = 0, t: float = 0.5) -> float:
    """Mean entropy (nats, temperature 1) of the model's predictions at the masked positions of one seeded view:
    the certainty dParallel forces (lower = more positions cross an entropy threshold together)."""
    mask, _ = complementary_masks(prompt_lens, lens, ids.shape[1], torch.Generator().manual_seed(seed), t)
    logits = model(torch.where(mask, torch.full_like(ids, tasks.MASK_ID), ids), mask="full", win_lens=lens)
    logp = F.log_softmax(logits[:, :-1].float(), -1)
    ent = -(logp.exp() * logp).sum(-1)
    m = mask[:, 1:]
    return float((ent * m).sum() / m.sum())


def decode_eval(model, tok, problems, gen_len: int, entropy_threshold: float, block: int) -> tuple[float, float]:
    """(accuracy, forwards per answer) of the entropy-threshold rule through lopa_fast.generate (training goes on
    with the same model afterwards: the fused weight views stay trainable, `transformer._merge_as_views`)."""
    import lopa_fast

    correct = forwards = 0
    for p in problems:
        ids = torch.tensor(tok.encode(p.prompt).ids)
        out = lopa_fast.generate(model, ids, strategy="threshold", entropy_threshold=entropy_threshold,
                                 block_size=block, block_length=block, max_new_tokens=gen_len, temperature=0.0)
        correct += int(tasks.extract_answer(tok.decode(out.generated_ids, skip_special_tokens=True)) == p.answer)
        forwards += out.stats["forwards"]
    return correct / len(problems), forwards / len(problems)


def train(out: str | os.PathLike, log=print, resume: bool = False, teacher_model=None,
          trajectories: Trajectories | None = None, **overrides) -> dict:
    """Distil the teacher (`teacher` directory, or an already loaded `teacher_model`, trained in place) into a
    student (a full copy of it) and save it to `out` (HF layout + trajectories.pt + training_log.txt +
    train_args.json). `trajectories` replaces step 1 (tests). Returns a summary dict."""
    import lopa_fast

    a = run.options(DEFAULTS, overrides)
    tasks.check_task(a["task"])
    from lopa_fast.train.greedy import ALGS

    if a["traj_order"] not in ALGS:
        raise ValueError(f"certainty forcing: traj_order={a['traj_order']!r}; allowed: {', '.join(ALGS)}")
    if a["views"] not in VIEWS:
        raise ValueError(f"certainty forcing: views={a['views']!r}; allowed: {', '.join(VIEWS)}")
    for k in ("n_problems", "traj_batch", "batch", "steps", "eval_n", "eval_block", "view_block"):
        if isinstance(a[k], bool) or not isinstance(a[k], int) or a[k] < 1:
            raise ValueError(f"certainty forcing: {k}={a[k]!r}; expected an int >= 1")
    if not 0 < a["mask_t"] < 1 or a["temperature"] <= 0 or a["lam"] < 0:
        raise ValueError(f"certainty forcing: mask_t={a['mask_t']} (in (0, 1)), temperature={a['temperature']} "
                         f"(> 0), lam={a['lam']} (>= 0)")
    if a["gen_len"] % a["eval_block"]:
        raise ValueError(f"certainty forcing: eval_block={a['eval_block']} must divide gen_len={a['gen_len']}")
    torch.set_num_threads(a["threads"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    traj_path = out / TRAJ_FILE
    # resume: the training state if one was written, else (killed before the first checkpoint) the trajectories
    state = run.load_state(out, a) if resume and (out / run.RESUME_FILE).is_file() else None
    if resume and state is None and not traj_path.is_file():
        raise FileNotFoundError(f"resume: no training state {out / run.RESUME_FILE} and no {traj_path}")
    rl = run.RunLog(out, log, append=resume)
    emit = rl.emit
    tok_mod = tasks.TOKENIZERS[a["task"]]
    tok = tok_mod.build_tokenizer()
    model = teacher_model if teacher_model is not None else lopa_fast.load_model(a["teacher"], dtype=torch.float32)
    cfg = json.loads((Path(a["teacher"]) / "config.json").read_text()) if teacher_model is None else None
    if teacher_model is not None:
        from lopa_fast.train.d2f import hf_config

        c = model.config
        cfg = hf_config(c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size,
                        c.max_position_embeddings)
    dev = tasks.generate_task(a["task"], "dev", a["eval_n"], seed=0)
    if resume:
        traj = Trajectories(**torch.load(traj_path, weights_only=False))
    else:
        emit(f"# certainty forcing: {json.dumps(a, sort_keys=True)}")
        t_traj = time.time()
        problems = tasks.generate_task(a["task"], "train", a["n_problems"], seed=a["seed"])
        traj = trajectories or collect_trajectories(model, problems, tok, a["gen_len"], a["traj_batch"], log=log,
                                                    order=a["traj_order"])  # progress: console, not the log file
        torch.save(dict(prompts=traj.prompts, responses=traj.responses, answers=traj.answers, total=traj.total),
                   traj_path)
        emit(f"# trajectories: {traj.kept}/{traj.total} teacher answers correct (kept), one token per forward "
             f"({a['traj_order']} order), {time.time() - t_traj:.1f}s")
    # the entropy monitor: one seeded masked view of the first 32 kept trajectories
    val_idx = list(range(min(32, traj.kept)))
    val = batch_of(traj, val_idx)
    model.requires_grad_(True).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(0.9, 0.98), weight_decay=a["weight_decay"])
    start, spent, first = 0, 0.0, None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["torch_rng"])
        start, spent, first = state["step"], state["seconds"], state["first"]
        emit(f"# resumed at step {start} from {out / run.RESUME_FILE} ({spent:.1f}s trained before)")
    else:
        model.eval()
        h0 = masked_entropy(model, *val)
        model.train()
        first = h0
        emit(f"# params {n_params}; student = a full copy of the teacher; mean masked entropy before: {h0:.4f} nats "
             f"(first {len(val_idx)} trajectories, one seeded view)")
    t0 = time.time() - spent

    def checkpoint(next_step: int) -> None:
        run.save_state(out, dict(args=a, model=model.state_dict(), opt=opt.state_dict(), step=next_step,
                                 seconds=time.time() - t0, first=first, torch_rng=torch.get_rng_state()))

    last = dict(acc=None, fw=None, h=None)
    last_step = run.last_step(a)
    for step in range(start, last_step):
        g = torch.Generator().manual_seed(a["seed"] * 1_000_003 + step)
        index = torch.randint(traj.kept, (a["batch"],), generator=g).tolist()
        ids, plens, lens = batch_of(traj, index)
        lr = run.lr_at(step, a["steps"], a["lr"], a["warmup"], a["min_lr_frac"])
        loss, parts = certainty_forcing_loss(model, ids, plens, lens, g, a["lam"], a["temperature"], a["mask_t"],
                                             a["views"], a["view_block"])
        v = run.optimizer_step(model, opt, loss, lr)
        done = step == last_step - 1
        if step % 25 == 0 or done:
            ce2, h2 = parts["ce'"], parts["h'"]
            emit(f"step {step:5d} loss {v:.4f} ce {parts['ce']:.4f} ce' {ce2:.4f} h {parts['h']:.4f} h' {h2:.4f} "
                 f"lr {lr:.2e} t {time.time() - t0:7.1f}s")
        when = run.due(a, step, done)
        if when == "eval":
            model.eval()
            last["h"] = masked_entropy(model, *val)
            last["acc"], last["fw"] = decode_eval(model, tok, dev, a["gen_len"], a["entropy_threshold"],
                                                  a["eval_block"])
            model.train()
            emit(f"eval step {step + 1:5d} masked_entropy {last['h']:.4f} dev_exact_match {last['acc']:.4f} "
                 f"forwards/answer {last['fw']:.1f} (n={len(dev)}, entropy threshold {a['entropy_threshold']}, "
                 f"block {a['eval_block']}) t {time.time() - t0:7.1f}s")
            run.save(model, cfg, out, "lopa_fast.train.certainty_forcing", a, tok_mod.save_tokenizer)
        if when:
            checkpoint(step + 1)
    summary = {"params": n_params, "steps": last_step, "seconds": round(time.time() - t0, 1),
               "trajectories": f"{traj.kept}/{traj.total}", "masked_entropy_before": round(first, 4),
               "masked_entropy_after": None if last["h"] is None else round(last["h"], 4),
               "dev_exact_match": last["acc"], "forwards_per_answer": last["fw"]}
    return rl.finish(summary)


if __name__ == "__main__":
    run.main("lopa_fast.train.certainty_forcing", __doc__, DEFAULTS, train)
