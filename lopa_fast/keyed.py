"""The keyed sampler: every random draw is a pure function of (seed, stream, step, branch, position, vocab id).

A batched fast round cannot replay the reference's draw-for-draw order from one global generator (the
reference samples branch by branch, block by block). The keyed sampler removes the order: the noise of a
draw comes from a counter-based hash of its key, so the reference decoders and the fast ones, on CPU and on
CUDA, eager or compiled, draw the same numbers for the same seed whatever the order, batching or padding.

Hash: splitmix64 (Steele, Lea, Flood 2014; the finaliser of java.util.SplittableRandom) on int64 tensors with
torch ops only (multiplication wraps mod 2**64 on CPU and CUDA; `>>` on int64 is arithmetic, so every shift
is masked to make it logical). A key folds its fields one at a time: h <- mix(h + (field + 1) * GOLDEN).
Uniforms: the top 53 bits of the hash, (m + 0.5) / 2**53, in the open interval (0, 1), float64.

Draws (all sync-free, all on the logits' device):
  categorical(probs [N, V], keys [N])      inverse CDF: the first id whose float64 cumulative probability
                                           reaches U * (row total), one U per row; two backends with
                                           bitwise-equal probs pick the same id
  gumbel_argmax(logits [N, V], T, keys)    LLaDA's formula argmax exp(l) / E**T in float64, keyed
  uniform(keys [N])                        one U per key (random remasking, Dream's `origin` reveal)
  top_n_race(weights [N], n, keys)         sampling n of N without replacement with probability
                                           proportional to weights (the n largest weights / E)

Streams keep the draws of one step apart: TOKEN (the token choice), REMASK (LLaDA random remasking),
REVEAL (Dream `origin`), ORDER (Dream alg_temp > 0). Steps count forwards (1-based: the step's forward);
branch is the slot of a LoPA round (lookaheads in rank order, the anchor last), 0 elsewhere; position is
the absolute sequence position that the draw decides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN, REMASK, REVEAL, ORDER = 0, 1, 2, 3

_U64 = 1 << 64


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


GOLDEN = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)
_LOW = {k: (1 << (64 - k)) - 1 for k in (11, 27, 30, 31)}  # masks that make `>>` logical
_INV53 = 2.0**-53


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & _LOW[k]


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _fold(h: torch.Tensor, c) -> torch.Tensor:
    """h folded with c: an int64 tensor field (its key term (field + 1) * GOLDEN is formed here) or an int, the
    term itself."""
    return _mix(h + (c + 1) * GOLDEN) if isinstance(c, torch.Tensor) else _mix(h + c)


# Under torch.compile the hash's wrapping int64 arithmetic runs as opaque ops (`lopa_fast::keyed_*`): the graph
# calls the eager ATen ops instead of fusing them into generated C++, where a wrapping int64 multiply or add is
# signed overflow (undefined behaviour): a compiled vanilla step (Dream, alg_temp > 0, 20 positions) hashed the
# last 4 positions (the vectorised loop's tail) to other keys than eager (torch 2.13, CPU). Eager calls the ops
# directly (the op dispatch cost ~60% more per key() on CPU); a CUDA-graph capture records the eager ops.
@torch.library.custom_op("lopa_fast::keyed_mix", mutates_args=(), schema="(Tensor z) -> Tensor")
def _mix_op(z):
    return _mix(z)


@torch.library.custom_op("lopa_fast::keyed_fold", mutates_args=(), schema="(Tensor h, Tensor field) -> Tensor")
def _fold_op(h, field):
    return _fold(h, field)


@torch.library.custom_op("lopa_fast::keyed_fold_const", mutates_args=(), schema="(Tensor h, int c) -> Tensor")
def _fold_const_op(h, c):
    return _fold(h, c)


@_mix_op.register_fake
def _(z):
    return torch.empty_like(z)


@_fold_op.register_fake
def _(h, field):
    return h.new_empty(torch.broadcast_shapes(h.shape, field.shape))


@_fold_const_op.register_fake
def _(h, c):
    return torch.empty_like(h)


def mix(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on an int64 tensor (elementwise, wrapping arithmetic; opaque under compile)."""
    return torch.ops.lopa_fast.keyed_mix(z) if torch.compiler.is_compiling() else _mix(z)


def fold(h: torch.Tensor, field) -> torch.Tensor:
    """h [*] int64 with one more key field (int or int64 tensor broadcasting with h) folded in (opaque under
    compile)."""
    c = field if isinstance(field, torch.Tensor) else _s64(((int(field) + 1) * GOLDEN) % _U64)
    if not torch.compiler.is_compiling():
        return _fold(h, c)
    if isinstance(c, torch.Tensor):
        return torch.ops.lopa_fast.keyed_fold(h, c)
    return torch.ops.lopa_fast.keyed_fold_const(h, c)


def key(seed, stream: int, step, branch, pos) -> torch.Tensor:
    """The int64 key of the draws at (seed, stream, step, branch, pos); seed, step and branch an int or an
    int64 tensor (on pos's device); the result broadcasts them (pos is usually [N])."""
    pos = torch.as_tensor(pos, dtype=torch.long)
    if isinstance(seed, torch.Tensor):  # a device 0-d seed (the fast round's tables): no host read
        h = torch.zeros_like(pos) + seed.to(torch.long)
    else:
        h = torch.full_like(pos, _s64(int(seed) % _U64))
    for f in (stream, step, branch):
        h = fold(h, f.to(torch.long) if isinstance(f, torch.Tensor) else int(f))
    return fold(h, pos)


def uniform_of(h: torch.Tensor) -> torch.Tensor:
    """Hashes [*] int64 -> uniforms in (0, 1), float64, from the top 53 bits."""
    return (_shr(h, 11).to(torch.float64) + 0.5) * _INV53


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per key: keys [N] int64 -> [N] float64."""
    return uniform_of(mix(keys))


def row_exponentials(keys: torch.Tensor, V: int) -> torch.Tensor:
    """Exp(1) noise E = -log U per (key, vocab id): keys [N] int64 -> [N, V] float64 (all > 0).

    Through the opaque op `lopa_fast::keyed_row_exponentials`, so a torch.compile'd graph runs these eager ops
    instead of fusing them: Inductor's fused log differed from eager by an ulp (4e-16, enough to move a Gumbel
    argmax), and fused into the argmax that follows (LLaDA's sampler, APD's draft) it segfaulted on CPU with one
    intra-op thread (torch 2.13, tests/test_compiled_steps.py). Eager (and a CUDA-graph capture) runs the ops."""
    if torch.compiler.is_compiling():
        return torch.ops.lopa_fast.keyed_row_exponentials(keys, V)
    return _row_exponentials_eager(keys, V)


@torch.library.custom_op("lopa_fast::keyed_row_exponentials", mutates_args=(), schema="(Tensor keys, int V) -> Tensor")
def _row_exponentials(keys, V):
    return _row_exponentials_eager(keys, V)


def _row_exponentials_eager(keys: torch.Tensor, V: int) -> torch.Tensor:
    v = torch.arange(V, device=keys.device, dtype=torch.long)
    return -torch.log(uniform_of(fold(keys[:, None], v[None, :])))


@torch.library.custom_op("lopa_fast::keyed_exponentials", mutates_args=(), schema="(Tensor keys) -> Tensor")
def _exponentials(keys):  # Exp(1) noise -log U per key (top_n_race), opaque for the reason above
    return -torch.log(uniform(keys))


@_exponentials.register_fake
def _(keys):
    return keys.new_empty(keys.shape, dtype=torch.float64)


@_row_exponentials.register_fake
def _(keys, V):
    return keys.new_empty((keys.shape[0], V), dtype=torch.float64)


def categorical(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """x0 [N] ~ Categorical(probs[n]) per row, probs [N, V] (zeros allowed), keys [N]: inverse-CDF sampling with
    ONE uniform per row, x0 = the first id whose float64 cumulative probability reaches u * (row total) (the
    total absorbs rounding; an id of probability 0 is never drawn). One hash per row instead of one per
    (row, vocab id): the race over V ids cost more than the 4096-id LM head of the benchmark's mid model."""
    c = probs.to(torch.float64).cumsum(-1)
    t = uniform(keys)[:, None] * c[:, -1:]
    return (c < t).sum(-1).clamp(max=probs.shape[-1] - 1)


def gumbel_argmax(logits: torch.Tensor, temperature, keys: torch.Tensor) -> torch.Tensor:
    """LLaDA's sampler, keyed: argmax exp(l) / E**T in float64 (E = -log U); T = 0: argmax of the logits.
    temperature: a float, or a 0-d float64 tensor (a compiled step's runtime input; T > 0 then, its compile key
    says so)."""
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        return torch.argmax(logits, dim=-1)
    l64 = logits.to(torch.float64)
    return torch.argmax(l64.exp() / knob_pow(row_exponentials(keys, l64.shape[-1]), temperature), dim=-1)


def knob_pow(x: torch.Tensor, t) -> torch.Tensor:
    """x ** t, t a float or a 0-d tensor (a runtime knob), bitwise as `x ** python_float`: torch's pow by a scalar
    takes exact shortcuts (0.5: sqrt, 2: x * x, 3: x * x * x, 1: x) that pow by a tensor does not (it rounds
    differently there); a tensor t takes the same shortcuts with `where` (no host read)."""
    if not isinstance(t, torch.Tensor):
        return x**t
    out = torch.where(t == 2, x * x, x.pow(t))
    out = torch.where(t == 3, x * x * x, out)
    out = torch.where(t == 0.5, x.sqrt(), out)
    return torch.where(t == 1, x, out)


def top_n_race(weights: torch.Tensor, n, keys: torch.Tensor) -> torch.Tensor:
    """Bool [N]: n entries drawn without replacement with probability proportional to weights [N] (>= 0),
    the n largest weights / E (n: int or 0-d long tensor, <= the count of positive weights; no host read)."""
    noise = torch.ops.lopa_fast.keyed_exponentials(keys) if torch.compiler.is_compiling() else -torch.log(uniform(keys))
    race = weights.to(torch.float64) / noise
    order = torch.sort(race, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return rank < n


@dataclass(frozen=True)
class KeyedNoise:
    """The keyed noise of one request (seed resolved): `keys(stream, step, branch, pos)` -> int64 keys."""

    seed: int

    def keys(self, stream: int, step, branch, pos) -> torch.Tensor:
        return key(self.seed, stream, step, branch, pos)


def resolve_seed(seed: int | None) -> int:
    """The request's seed: `seed`, or (None) one draw from torch's global generator (so torch.manual_seed
    makes an unseeded keyed run reproducible, as it does an upstream one)."""
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**62, (), dtype=torch.long))


def needs_draws(cfg) -> bool:
    """Whether a bound config draws random numbers at all (T > 0, LLaDA random remasking, Dream's `origin`
    reveal, Dream alg_temp > 0); a request that draws none ignores the sampler."""
    return bool(
        cfg.temperature > 0 or getattr(cfg, "remasking", None) == "random"
        or getattr(cfg, "alg", None) == "origin"  # Dream vanilla's random reveal (alg is vanilla's knob alone)
        or (getattr(cfg, "alg_temp", None) or 0) > 0
    )


def request_noise(cfg, device) -> "KeyedNoise | torch.Generator | None":
    """The noise source of one request: KeyedNoise (sampler="keyed"; seed resolved only when the request
    draws), else upstream's: a torch.Generator seeded with cfg.seed, or None (the global generator)."""
    if getattr(cfg, "sampler", "keyed") == "upstream":
        if cfg.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(int(cfg.seed))
        return g
    return KeyedNoise(resolve_seed(cfg.seed) if needs_draws(cfg) else 0)
