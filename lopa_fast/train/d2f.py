"""Recipe: a small D2F-style block-diffusion model (Dream / Qwen2 architecture) for the embedded task.

    python -m lopa_fast.train.d2f --out lopa_fast/assets/d2f-arith             # the shipped model
    python -m lopa_fast.train.d2f --out /tmp/x --steps 20 --hidden 32 --layers 1  # a smoke run

What it does and why, with the measurements: docs/training.md.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from lopa_fast import tasks
from lopa_fast.models.config import parse_config
from lopa_fast.models.loading import build_model
from lopa_fast.models.tiny import tiny_hf_config
from lopa_fast.train import run
from lopa_fast.train.data import block_ids_for, make_batch

MODES = ("block_causal", "full_pipe", "full_uniform", "full_prefix", "full_equation", "full_policy")
# the views whose loss can take soft targets (full attention: every visible token conditions every target)
SOFT_MODES = ("full_pipe", "full_uniform", "full_prefix", "full_equation", "full_policy")
# the view of each step, cycled. "prefix" (default): half of the steps are left-to-right prefix states;
# "three": the first stage of the shipped model (block_causal, full_pipe, full_uniform in turn).
SCHEDULES = {
    "prefix": ("block_causal", "full_prefix", "full_pipe", "full_prefix", "full_uniform", "full_prefix"),
    "three": ("block_causal", "full_pipe", "full_uniform"),
    # the arith-var teacher's later stages: more equation results with their operands in view
    "equation": ("block_causal", "full_equation", "full_pipe", "full_prefix", "full_uniform", "full_equation"),
    # half of the steps in vanilla decoding's view (scattered masks over the whole region)
    "uniform": ("block_causal", "full_uniform", "full_prefix", "full_uniform", "full_pipe", "full_uniform"),
    # two thirds in vanilla decoding's view
    "uniform2": ("block_causal", "full_uniform", "full_uniform", "full_prefix", "full_uniform", "full_uniform"),
    # half of the steps on the states the model's own entropy-order decode visits
    "policy": ("block_causal", "full_policy", "full_uniform", "full_policy", "full_prefix", "full_policy",
               "full_pipe", "full_policy"),
    # a plain masked-diffusion model in LLaDA's / Dream's pre-training regime (issue 27's base teacher): full
    # attention over prompt + region, one ratio t ~ U(0,1) per sequence, no block-causal or pipelined views
    "mdm": ("full_uniform",),
}
EQ_TOKEN = "="  # the token after which full_equation cuts (the same id in both tasks' vocabularies)

DEFAULTS = dict(
    hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, block_size=8, gen_len=32, variant="v2",
    batch=64, steps=2000, lr=2e-3, min_lr_frac=0.05, warmup=100, weight_decay=0.01, seed=0,
    eval_every=250, eval_n=100, threads=1, init_from="", stop_at=0, schedule="prefix",
    task="arith", max_positions=128, ckpt_every=100, soft_targets=0, policy_pool=64, policy_every=50,
)
def hf_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
              max_positions: int = 128, kind: str = "dream") -> dict:
    """The config.json of a recipe's model: models.tiny's layout of `kind` (Dream; "qwen2": the AR drafter, no mask
    token) with the task tokenizer's special ids."""
    cfg = tiny_hf_config(kind, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         max_position_embeddings=max_positions, mask_token_id=tasks.MASK_ID,
                         eos_token_id=tasks.EOS_ID, bos_token_id=tasks.BOS_ID)
    return {**cfg, "torch_dtype": "float32"}


def init_model(cfg: dict, seed: int):
    """Build the model from `cfg` with a seeded GPT-style init (N(0, 0.02); residual outputs scaled
    by 1/sqrt(2 * layers); biases 0; norms 1)."""
    model = build_model(parse_config(cfg))
    g = torch.Generator().manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * cfg["num_hidden_layers"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = resid_std if ("o_proj" in name or "down_proj" in name) else 0.02
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.float().train().requires_grad_(True)


def load_grown(model, prev) -> list[str]:
    """Copy `prev`'s weights into `model` (same architecture; `model` may have a larger vocabulary and more
    positions): equal shapes are copied, the embedding / output rows of `prev`'s vocabulary are copied into the
    first rows (the new rows keep `model`'s init, because the grown tokenizer keeps the old ids, see
    tasks/tokenizer_var.py). `model` may also be deeper: its extra layers (after `prev`'s) start as exact
    identities (their o_proj and down_proj zeroed, so the residual stream passes through them unchanged and the
    grown model computes what `prev` did). Returns the names of the grown tensors (and of the zeroed ones)."""
    from lopa_fast.errors import CheckpointError

    grown, mine = [], model.state_dict()
    n_prev, n_mine = prev.config.num_layers, model.config.num_layers
    for i in range(n_prev, n_mine):
        for name in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            mine[name].zero_()
            grown.append(name)
    for name, w in prev.state_dict().items():
        if name not in mine:
            raise CheckpointError(f"init_from: tensor {name} is not in the model (a different architecture)", key=name)
        t = mine[name]
        if t.shape == w.shape:
            t.copy_(w)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")) and t.shape[1:] == w.shape[1:] \
                and t.shape[0] > w.shape[0]:
            t[: w.shape[0]].copy_(w)
            grown.append(name)
        else:
            raise CheckpointError(f"init_from: a different architecture than the options: tensor {name} has shape "
                                  f"{tuple(w.shape)}, the options give {tuple(t.shape)}", key=name)
    return grown


@functools.cache
def _eq_id() -> int:
    return tasks.vocab()[EQ_TOKEN]


def corrupt(batch, mode: str, block_size: int, gen_len: int, g: torch.Generator, order: torch.Tensor | None = None):
    """Mask a clean batch for one training view (full_equation finds "=" by its id in the task vocabulary).

    order: [B, gen_len] region offsets in a decoder's visiting order (`greedy.fill_orders`), needed by
    "full_policy", which keeps the first k ~ U{0..gen_len-1} of them visible and masks the rest.
    Returns (noisy ids [B, n], loss positions bool [B, n] (masked generated positions), win_lens [B],
    block_ids [B, n]).
    """
    if mode not in MODES:
        raise ValueError(f"corrupt: mode={mode!r}; allowed: {MODES}")
    if mode == "full_policy" and (order is None or tuple(order.shape) != (batch.ids.shape[0], gen_len)):
        raise ValueError(f"corrupt: full_policy needs order [B, gen_len]; got "
                         f"{None if order is None else tuple(order.shape)}")
    ids = batch.ids
    B, n = ids.shape
    K = gen_len // block_size
    bids = block_ids_for(batch.prompt_lens, n, block_size)  # [B, n]
    j = torch.arange(n)[None, :]
    in_gen = (j >= batch.prompt_lens[:, None]) & (j < batch.lens[:, None])
    lens = batch.lens.clone()
    if mode == "full_uniform":
        ratio = torch.rand(B, 1, generator=g).expand(B, n)
    elif mode == "full_policy":
        k = torch.randint(0, gen_len, (B, 1), generator=g)  # visible: the first k positions of the order
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(gen_len).expand(B, gen_len).contiguous())
        region = torch.full((B, n), gen_len, dtype=torch.long)  # non-region positions: never visible by rank
        region[torch.arange(B)[:, None], batch.prompt_lens[:, None] + torch.arange(gen_len)[None, :]] = rank
        ratio = (region >= k).float()  # 1 = masked (when in the region)
    elif mode in ("full_prefix", "full_equation"):
        cut = (torch.rand(B, 1, generator=g) * gen_len).long()
        if mode == "full_equation":
            is_eq = (ids == _eq_id()) & in_gen
            pick = torch.rand(B, n, generator=g).masked_fill(~is_eq, -1.0).argmax(1, keepdim=True)  # a random "="
            cut = torch.where(is_eq.any(1, keepdim=True), pick + 1 - batch.prompt_lens[:, None], cut)
        t = 0.5 + 0.5 * torch.rand(B, 1, generator=g)
        ratio = torch.where(j - batch.prompt_lens[:, None] >= cut, t, torch.zeros(()))
    else:
        r = torch.rand(B, K, generator=g).sort(dim=1).values  # increasing per block
        r = torch.cat([torch.zeros(B, 1), r, torch.ones(B, 1)], dim=1)  # block 0 = prompt; tail
        ratio = r.gather(1, bids.clamp(max=K + 1))
        if mode == "full_pipe":
            k = torch.randint(1, K + 1, (B,), generator=g)
            lens = batch.prompt_lens + k * block_size
            in_gen = in_gen & (j < lens[:, None])
    masked = (torch.rand(B, n, generator=g) < ratio) & in_gen
    # at least one loss position per row: mask a random generated position when none was drawn
    none = ~masked.any(1)
    if none.any():
        span = (lens - batch.prompt_lens)[none]
        off = (torch.rand(int(none.sum()), generator=g) * span).long()
        masked[none.nonzero()[:, 0], (batch.prompt_lens[none] + off)] = True
    noisy = torch.where(masked, torch.full_like(ids, tasks.MASK_ID), ids)
    return noisy, masked, lens, bids


def loss_on(model, batch, mode: str, block_size: int, gen_len: int, g: torch.Generator,
            order: torch.Tensor | None = None, soft_problems=None) -> torch.Tensor:
    """Mean cross-entropy at the masked positions (logit at j - 1 predicts j): of the clean tokens, or, with
    `soft_problems` (the batch's arith-var problems) in a SOFT_MODES view, of the exact posterior marginals given
    the visible tokens (`train.posterior.soft_targets`; the same objective without the label's sampling noise)."""
    noisy, masked, lens, bids = corrupt(batch, mode, block_size, gen_len, g, order)
    attn = "block_causal" if mode == "block_causal" else "full"
    logits = model(noisy, mask=attn, block_ids=bids if attn == "block_causal" else None, win_lens=lens)
    b, p = masked.nonzero(as_tuple=True)
    pred = logits[b, p - 1].float()
    if soft_problems is None or mode not in SOFT_MODES:
        return F.cross_entropy(pred, batch.ids[b, p])
    from lopa_fast.train.posterior import soft_targets

    target, valid = soft_targets(soft_problems, noisy, masked, batch.prompt_lens, lens, gen_len, pred.shape[-1])
    if not valid.all():  # a clean batch's own masks always agree with its rendering
        raise RuntimeError(f"loss_on: {int((~valid).sum())} soft targets without an agreeing rendering")
    return -(target * pred.log_softmax(-1)).sum(-1).mean()


def policy_problems(a: dict, step: int) -> list:
    """The `policy_pool` train problems of the pool built at `step` (seeded by it: a resumed run regenerates them)."""
    return tasks.generate_task(a["task"], "train", a["policy_pool"], seed=a["seed"] * 1_000_003 + step + 500_009,
                               variant=a["variant"])


def policy_pool(model, a: dict, tok, step: int) -> tuple[list, torch.Tensor]:
    """`policy_pool` train problems (seeded by `step`) and the order the model's entropy-order decode visits
    their regions in, teacher-forced (`greedy.fill_orders`; policy_pool x gen_len forwards without gradients).

    Why: vanilla decoding visits the lowest-entropy position of the whole region first, so its states are
    neither left-to-right prefixes nor uniform scatters (EOS tail first, then far tokens); the arith-var teacher
    wrote 33 of 48 dev solutions off every valid rendering in that order, 21 of them first at a position the
    visible tokens had already determined (train.diagnose --posterior)."""
    from lopa_fast.train.greedy import fill_orders

    problems = policy_problems(a, step)
    model.eval()
    orders = torch.cat([fill_orders(model, make_batch(problems[i:i + 64], tok, a["gen_len"]), a["gen_len"])
                        for i in range(0, len(problems), 64)])
    model.train()
    return problems, orders


def prepare(out, a: dict, log, resume: bool) -> tuple:
    """The d2f and ar recipes' start: threads, the output directory, the resumed state (`resume`), the training log
    (a continued run, --init-from or --resume, appends to it) and the task tokenizer. Returns (out Path, state or
    None, run.RunLog, tokenizer module, tokenizer)."""
    torch.set_num_threads(a["threads"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = run.load_state(out, a) if resume else None
    rl = run.RunLog(out, log, append=bool(a["init_from"]) or resume)
    tok_mod = tasks.TOKENIZERS[a["task"]]
    return out, state, rl, tok_mod, tok_mod.build_tokenizer()


def build(config_of, tok, a: dict, state, out: Path, emit, recipe: str) -> tuple:
    """The d2f and ar recipes' model: the config.json (`config_of`: this module's or train.ar's hf_config), the
    seeded model (grown from --init-from on a fresh run, `load_grown`), its AdamW optimiser, then run.begin (the
    resumed state restored, or the header logged). Returns (cfg, model, opt, n_params, run.begin's counters)."""
    cfg = config_of(tok.get_vocab_size(), a["hidden"], a["layers"], a["heads"], a["kv_heads"], a["intermediate"],
                    a["max_positions"])
    longest_prompt = 40  # both tasks' prompts are <= 32 tokens with bos (docs/tasks.md); 8 to spare
    if longest_prompt + a["gen_len"] > a["max_positions"]:
        raise ValueError(f"train: max_positions={a['max_positions']} < {longest_prompt} (prompt) + gen_len="
                         f"{a['gen_len']}")
    model = init_model(cfg, a["seed"])
    grown = None  # the tensors --init-from grew (its header line names them)
    if a["init_from"] and state is None:
        import lopa_fast

        grown = load_grown(model, lopa_fast.load_model(a["init_from"], dtype=torch.float32))
        model.requires_grad_(True).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(0.9, 0.98), weight_decay=a["weight_decay"])
    counters = run.begin(state, model, opt, out, emit, recipe, a, grown, cfg["vocab_size"], n_params)
    return cfg, model, opt, n_params, counters


def train(out: str | os.PathLike, log=print, resume: bool = False, **overrides) -> dict:
    """Train and save to `out` (HF layout: config.json, model.safetensors, tokenizer files,
    training_log.txt, train_args.json). Returns a summary dict.

    Every `ckpt_every` steps (and at every eval) the training state (model, optimiser, next step, loss EMA,
    the torch RNG) goes to out/resume.pt; `resume=True` continues from it with the same options. Each step's
    data and masks are seeded by the step number, so a resumed run is the uninterrupted run (tested)."""
    a = run.options(DEFAULTS, overrides)
    if a["schedule"] not in SCHEDULES:
        raise ValueError(f"train: schedule={a['schedule']!r}; allowed: {sorted(SCHEDULES)}")
    if a["gen_len"] % a["block_size"]:
        raise ValueError(f"train: gen_len={a['gen_len']} must be a multiple of block_size={a['block_size']}")
    tasks.check_task(a["task"])
    if a["soft_targets"] not in (0, 1):
        raise ValueError(f"train: soft_targets={a['soft_targets']}; allowed: 0, 1")
    if a["soft_targets"] and a["task"] != "arith-var":
        raise ValueError(f"train: soft_targets=1 needs task arith-var (the task whose renderings are enumerable); "
                         f"got task={a['task']!r}")
    if a["policy_pool"] < 1 or a["policy_every"] < 1:
        raise ValueError(f"train: policy_pool={a['policy_pool']}, policy_every={a['policy_every']}; expected >= 1")
    if a["ckpt_every"] < 0:
        raise ValueError(f"train: ckpt_every={a['ckpt_every']}; expected >= 0 (0: only at evals and the end)")
    from lopa_fast.train.greedy import accuracy

    out, state, rl, tok_mod, tok = prepare(out, a, log, resume)
    emit = rl.emit
    # the dev problems (and a check of the task/variant pair) before any work
    dev = tasks.generate_task(a["task"], "dev", a["eval_n"], seed=0, variant=a["variant"])
    cfg, model, opt, n_params, (start, *trace, spent) = build(hf_config, tok, a, state, out, emit, "d2f")

    # "full_policy": (problems, their visiting orders, epoch), rebuilt every policy_every steps from the weights at the
    # epoch's first policy step. A resumed run takes the pool's orders from the checkpoint (the problems are seeded by
    # the epoch), so it is the uninterrupted run wherever it was stopped.
    pool = None
    if state is not None and "policy_orders" in state:
        epoch = int(state["policy_epoch"])
        pool = (policy_problems(a, epoch * a["policy_every"]), state["policy_orders"], epoch)

    def evaluate(step: int) -> float:
        acc, texts = accuracy(model, dev, tok, a["gen_len"])
        emit(f"eval step {step + 1:5d} dev_exact_match {acc:.4f} (n={len(dev)}, one token per forward) "
             f"t {steps.seconds():7.1f}s sample: {tasks.join_digits(texts[0])!r}")
        return acc

    def save() -> None:
        run.save(model, cfg, out, "lopa_fast.train.d2f", a, tok_mod.save_tokenizer)

    def extra() -> dict | None:  # the checkpoint's policy pool
        return None if pool is None else {"policy_orders": pool[1], "policy_epoch": pool[2]}

    steps = run.Steps(a, out, model, opt, emit, spent, *trace, evaluate, save, extra)
    for step in range(start, steps.last_step):
        mode = SCHEDULES[a["schedule"]][step % len(SCHEDULES[a["schedule"]])]
        g = torch.Generator().manual_seed(a["seed"] * 1_000_003 + step)
        order = None
        if mode == "full_policy":
            epoch = step // a["policy_every"]  # a new pool at the first policy step of every policy_every steps
            if pool is None or pool[2] != epoch:
                pool = (*policy_pool(model, a, tok, epoch * a["policy_every"]), epoch)
                emit(f"# step {step}: policy pool of {len(pool[0])} problems (entropy order of the weights at step "
                     f"{step})")
            pick = torch.randint(len(pool[0]), (a["batch"],), generator=g)
            problems = [pool[0][i] for i in pick.tolist()]
            order = pool[1][pick]
        else:
            problems = tasks.generate_task(a["task"], "train", a["batch"], seed=a["seed"] * 1_000_003 + step,
                                           variant=a["variant"])
        batch = make_batch(problems, tok, a["gen_len"])
        loss = loss_on(model, batch, mode, a["block_size"], a["gen_len"], g, order,
                       problems if a["soft_targets"] else None)
        steps.update(step, loss, f"mode {mode:12s} ")
    return rl.finish(steps.summary(n_params))


if __name__ == "__main__":
    run.main("lopa_fast.train.d2f", __doc__, DEFAULTS, train)
