"""A request's second model (APD's verifier, `generate(..., verifier=)`): refused for a strategy that takes none,
required when the knob that asks for it is set, and the (model, verifier) pair checked before any forward through
the strategy's spec (`check_models`; APD's: lopa_fast.strategies.apd.spec.check_apd_pair)."""
from __future__ import annotations

import torch

from lopa_fast import strategies
from lopa_fast.config import GenerateConfig
from lopa_fast.errors import KnobError


def _takers() -> str:
    """The strategies that take a verifier, as `strategy='apd'` / ... for messages."""
    return " / ".join(f"strategy={n!r}" for n in strategies.names() if strategies.get(n).takes_verifier)


def check_verifier_taken(cfg: GenerateConfig, verifier, spec=None) -> None:
    """Refuse verifier= for a strategy that takes none (naming those that do). spec: the strategy's spec when the
    caller holds it (else looked up)."""
    spec = spec if spec is not None else strategies.get(cfg.strategy)
    if verifier is not None and not spec.takes_verifier:
        raise ValueError(f"verifier= applies to {_takers()} (the AR model that verifies drafts); "
                         f"strategy={cfg.strategy!r}")


def check_verifier_given(cfg: GenerateConfig, given: bool, how: str = "verifier=") -> None:
    """The surfaces that load a verifier from a path (CLI --verifier, serve --verifier, lm-eval's verifier=): a
    KnobError naming the knob when `cfg` needs a verifier and none was given (`how`: how to give one there), or
    naming `verifier` when one was given to a strategy that takes none."""
    spec = strategies.get(cfg.strategy)
    if given and not spec.takes_verifier:
        raise KnobError(f"a verifier ({how}) applies to {_takers()} (the AR model that verifies drafts); "
                        f"strategy={cfg.strategy!r}", knob="verifier", value=cfg.strategy)
    if not given and spec.uses_verifier(cfg):
        name = spec.verifier_knob
        raise KnobError(f"{name}={getattr(cfg, name)!r} needs a verifier: pass {how} (a causal AR qwen2 model whose "
                        "vocabulary is a prefix of the drafter's, e.g. the embedded lopa_fast/assets/ar-arith for "
                        f"d2f-arith), or leave {name} unset for the verifier-free baseline of "
                        f"strategy={cfg.strategy!r}",
                        knob=name, value=getattr(cfg, name))


def check_verifier_fits(model, verifier, tokenizer=None, verifier_tokenizer=None) -> None:
    """A verifier loaded once for many requests (serve --verifier, lm-eval's verifier=): checked against the drafter
    at start (the check every request's pair passes: its strategy's check_models, with both tokenizers when given)."""
    name = next(n for n in strategies.names() if strategies.get(n).takes_verifier)
    spec = strategies.get(name)
    cfg = GenerateConfig(strategy=name, **({spec.verifier_knob: 0.5} if spec.verifier_knob else {})).validate()
    cfg = cfg.resolve(model)
    spec.load("check_models")(model, verifier, cfg, tokenizer=tokenizer, verifier_tokenizer=verifier_tokenizer)


def check_pair(model, verifier, ids: torch.Tensor, cfg: GenerateConfig, spec=None) -> None:
    """A strategy that takes a verifier: the (model, verifier) pair checked before any forward (its spec's
    check_models), and the prompt + generation within the verifier's positions. ids: the prompt [P]; spec: the
    strategy's spec when the caller holds it (else looked up)."""
    spec = spec if spec is not None else strategies.get(cfg.strategy)
    if not spec.takes_verifier:
        return
    spec.load("check_models")(model, verifier, cfg)
    if verifier is not None and verifier.config.max_position_embeddings < ids.numel() + cfg.max_new_tokens:
        raise ValueError(
            f"prompt length {ids.numel()} + max_new_tokens {cfg.max_new_tokens} exceeds the verifier's "
            f"max_position_embeddings={verifier.config.max_position_embeddings}"
        )
