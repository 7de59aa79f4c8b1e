"""`lopa_fast.generate`: input forms, backend dispatch, stats, and every bad-input case of the API, each
raising ValueError/TypeError naming the knob before any forward (checked with a stub that counts calls)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_reference_common import StubModel

import lopa_fast
from lopa_fast import strategies
from lopa_fast import api
from lopa_fast.output import GenerateOutput


def stub(shift=True):
    return StubModel(lambda c: (c.pos % 6, 0.95), shift=shift)


def ok_kwargs(strategy):
    return {"threshold": dict(threshold=0.9), "vanilla": dict(steps=4)}.get(strategy, {})


@pytest.mark.parametrize("strategy", ["vanilla", "threshold", "d2f", "lopa"])
def test_every_strategy_runs_and_reports_stats(strategy):
    out = lopa_fast.generate(stub(), [0, 1], strategy, max_new_tokens=4, block_size=4, **ok_kwargs(strategy))
    assert isinstance(out, GenerateOutput) and out.generated_ids == [2, 3, 4, 5]
    s = out.stats
    for key in ("forwards", "model_calls", "generated_tokens", "tokens_until_eos", "tpf", "tpf_until_eos",
                "upstream_steps", "seconds", "tokens_per_second", "hit_round_cap", "strategy", "backend"):
        assert key in s, key
    assert s["backend"] == "reference" and s["strategy"] == strategy
    assert s["tpf"] == s["generated_tokens"] / s["forwards"]


def test_input_forms_agree():
    outs = [
        lopa_fast.generate(stub(), ids, "d2f", max_new_tokens=4, block_size=4).generated_ids
        for ids in ([0, 1], torch.tensor([0, 1]), torch.tensor([[0, 1]]), torch.tensor([0, 1], dtype=torch.int32))
    ]
    assert all(o == outs[0] for o in outs)


def test_trace_only_when_asked():
    assert lopa_fast.generate(stub(), [0, 1], "lopa", max_new_tokens=4, block_size=4).trace is None
    out = lopa_fast.generate(stub(), [0, 1], "lopa", max_new_tokens=4, block_size=4, return_trace=True)
    assert out.trace and {"round", "branches", "winner", "accepted"} <= set(out.trace[0])


@pytest.mark.parametrize("strategy", ["vanilla", "threshold"])
@pytest.mark.parametrize("shift", [True, False])
def test_block_loop_traces_cover_every_position_once(strategy, shift):
    out = lopa_fast.generate(stub(shift), [0, 1], strategy, max_new_tokens=8, block_size=4, return_trace=True,
                             cache="prefix" if strategy == "threshold" else None, **ok_kwargs(strategy))
    filled = [q for r in out.trace for q, _ in r["accepted"]]
    assert sorted(filled) == list(range(8)) and len(out.trace) == out.stats["forwards"]
    assert all(out.generated_ids[q] == t for r in out.trace for q, t in r["accepted"])


def test_backend_dispatch(monkeypatch):
    calls = []

    def fake_fast(model, prompt, cfg):
        calls.append(cfg.strategy)
        return GenerateOutput([1], {"forwards": 1})

    # the registry names each strategy's implementations: lopa's fast one replaced, d2f's removed
    monkeypatch.setattr(strategies.registry, "_REGISTRY", dict(strategies.registry._REGISTRY))
    strategies.register(dataclasses.replace(strategies.get("lopa"), fast=fake_fast), replace=True)
    strategies.register(dataclasses.replace(strategies.get("d2f"), fast=None), replace=True)
    out = lopa_fast.generate(stub(), [0, 1], "lopa", "fast", max_new_tokens=4, block_size=4)
    assert calls == ["lopa"] and out.stats["backend"] == "fast"
    # auto runs the fast path for a model with the static forward; a duck-typed stub without one is not a
    # supported model: the reference runs (named in stats["fallback"])
    capable = stub()
    capable.forward_static = None
    out = lopa_fast.generate(capable, [0, 1], "lopa", "auto", max_new_tokens=4, block_size=4)
    assert out.stats["backend"] == "fast"
    out = lopa_fast.generate(stub(), [0, 1], "lopa", "auto", max_new_tokens=4, block_size=4)
    assert out.stats["backend"] == "reference" and "forward_static" in out.stats["fallback"]
    out = lopa_fast.generate(capable, [0, 1], "d2f", "auto", max_new_tokens=4, block_size=4)
    assert out.stats["backend"] == "reference"
    with pytest.raises(ValueError, match=r"backend='fast' does not cover strategy='d2f'.*covers: vanilla, threshold, lopa, apd\."):
        lopa_fast.generate(stub(), [0, 1], "d2f", "fast", max_new_tokens=4, block_size=4)


def test_config_object_and_export():
    cfg = lopa_fast.GenerateConfig(strategy="d2f", max_new_tokens=4, block_size=4)
    out = api.generate_with_config(stub(), [0, 1], cfg)
    assert out.generated_ids == [2, 3, 4, 5]
    bound = cfg.bind(stub())
    assert bound.mask_token_id == 7 and bound.eos_token_id == 6 and bound.max_rounds == 2 * 4 + 64
    assert lopa_fast.LopaConfig is lopa_fast.GenerateConfig


BAD = [
    # (strategy, kwargs, exception, message fragment)
    ("beam", {}, ValueError, "strategy='beam'"),
    ("lopa", dict(backend="gpu"), ValueError, "backend='gpu'"),
    ("lopa", dict(sampling_strategy="entropy"), ValueError, "sampling_strategy='entropy'"),
    ("lopa", dict(block_add_threshold=1.5), ValueError, "block_add_threshold=1.5"),
    ("lopa", dict(decoded_token_threshold=-0.1), ValueError, "decoded_token_threshold=-0.1"),
    ("lopa", dict(skip_threshold=2), ValueError, "skip_threshold=2"),
    ("lopa", dict(branch_topp=0), None, None),  # allowed: bottom max(1, 0) = 1 value
    ("lopa", dict(branch_topp=1.1), ValueError, "branch_topp=1.1"),
    ("lopa", dict(selection_conf_alpha=-1), ValueError, "selection_conf_alpha=-1"),
    ("lopa", dict(branching_factor=0), ValueError, "branching_factor=0"),
    ("lopa", dict(branching_factor=2.5), TypeError, "branching_factor=2.5"),
    ("lopa", dict(block_size=0), ValueError, "block_size=0"),
    ("lopa", dict(block_size=-4), ValueError, "block_size=-4"),
    ("lopa", dict(block_size=3, strict_length=True), ValueError, "multiple of block_size=3"),  # else cut (lengths)
    ("d2f", dict(max_new_tokens=0), ValueError, "max_new_tokens=0"),
    ("lopa", dict(temperature=-1.0), ValueError, "temperature=-1.0"),
    ("lopa", dict(top_p=1.5), ValueError, "top_p=1.5"),
    ("lopa", dict(top_k=0), None, None),  # HF's "off" (issue 35), as top_k=-1 is vLLM's
    ("lopa", dict(top_k=-2), ValueError, "top_k=-2"),
    ("lopa", dict(use_full_attention="yes"), TypeError, "use_full_attention='yes'"),
    ("lopa", dict(max_rounds=0), ValueError, "max_rounds=0"),
    ("lopa", dict(on_round_cap="ignore"), ValueError, "on_round_cap='ignore'"),
    ("lopa", dict(mask_token_id=99), ValueError, "mask_token_id=99"),
    ("lopa", dict(eos_token_id=7), ValueError, "eos_token_id=7 equals mask_token_id"),
    ("lopa", dict(threshold=0.9), ValueError, "threshold=0.9 does not apply to strategy='lopa'"),
    ("threshold", dict(threshold=1.2), ValueError, "threshold=1.2"),
    ("threshold", dict(entropy_threshold=-0.5), ValueError, "entropy_threshold=-0.5"),
    ("threshold", dict(factor=0.0), ValueError, "factor=0.0"),
    ("threshold", dict(factor=-1.0), ValueError, "factor=-1.0"),
    ("threshold", dict(threshold=0.9, factor=1.0), ValueError, "exactly one of"),
    ("threshold", dict(threshold=0.9, entropy_threshold=0.5), ValueError, "exactly one of"),
    ("threshold", dict(threshold=0.9, cache="full"), ValueError, "cache='full'"),
    ("threshold", dict(threshold=0.9, block_length=3, strict_length=True), ValueError, "block_length=3 must divide"),
    ("threshold", dict(threshold=0.9, block_length=2, steps=3), ValueError, "steps=3 must be a multiple"),
    ("vanilla", dict(remasking="lowest"), ValueError, "remasking='lowest'"),
    ("vanilla", dict(alg="greedy"), ValueError, "alg='greedy'"),
    ("vanilla", dict(cfg_scale=0.5), ValueError, "cfg_scale=0.5 is a LLaDA vanilla knob"),
    ("vanilla", dict(eps=1.5), ValueError, "eps=1.5"),
    ("vanilla", dict(steps=0), ValueError, "steps=0"),
]


@pytest.mark.parametrize("strategy,kw,exc,msg", BAD, ids=[f"{s}-{'-'.join(k)}" for s, k, _, _ in BAD])
def test_bad_knobs_raise_before_any_forward(strategy, kw, exc, msg):
    model = stub()
    kw = dict(kw)
    backend = kw.pop("backend", "reference")
    if exc is None:
        lopa_fast.generate(model, [0, 1], strategy, backend, max_new_tokens=4, block_size=4, **kw)
        return
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace("[", r"\[")):
        lopa_fast.generate(model, [0, 1], strategy, backend, **{"max_new_tokens": 4, "block_size": 4, **kw})
    assert model.calls == []


def test_family_specific_vanilla_knobs():
    llada = stub(shift=False)
    with pytest.raises(ValueError, match="alg='entropy' is a Dream vanilla knob, but the model is LLaDA"):
        lopa_fast.generate(llada, [0, 1], "vanilla", max_new_tokens=4, alg="entropy")
    with pytest.raises(ValueError, match="top_p=0.9"):
        lopa_fast.generate(llada, [0, 1], "vanilla", max_new_tokens=4, top_p=0.9)
    assert llada.calls == []


@pytest.mark.parametrize(
    "ids,exc,msg",
    [
        ([], ValueError, "empty"),
        (torch.tensor([], dtype=torch.long), ValueError, "empty"),
        ([0, 7, 1], ValueError, "mask token id 7"),
        (torch.tensor([[0, 1], [2, 3]]), ValueError, "batch size 2"),
        (torch.tensor([[[0, 1]]]), ValueError, r"shape \(1, 1, 2\)"),
        (torch.tensor([0.0, 1.0]), TypeError, "input_ids.dtype=torch.float32"),
        (torch.tensor([0, 1], device="meta"), ValueError, "input_ids.device=meta"),
        ([0, 99], ValueError, "token id 99"),
        ([0, -1], ValueError, "token id -1"),
        ([0, 1.5], TypeError, "only ints"),
        ("hello", TypeError, "str"),
        (list(range(6)) * 100, ValueError, "exceeds the model's max_position_embeddings=512"),
    ],
)
def test_bad_prompts_raise_before_any_forward(ids, exc, msg):
    model = stub()
    with pytest.raises(exc, match=msg):
        lopa_fast.generate(model, ids, "lopa", max_new_tokens=4, block_size=4)
    assert model.calls == []


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unknown keyword argument.*: branches"):
        lopa_fast.generate(stub(), [0, 1], "lopa", branches=3)


def test_causal_ar_model_rejected():
    from lopa_fast.testing import random_model, tiny_hf_config

    ar = random_model(tiny_hf_config("qwen2"))
    with pytest.raises(ValueError, match="causal AR"):
        lopa_fast.generate(ar, [1, 2], "lopa", max_new_tokens=4, block_size=4, mask_token_id=63)


@pytest.mark.parametrize("args, knobs", [
    ((), {}), (("d2f",), {}), (("d2f", "fast"), {}), (("d2f",), {"backend": "fast", "block_size": 4}),
    ((), {"strategy": "lopa", "verifier": None}), (("d2f",), {"strategy": "lopa"}), (("a", "b", "c"), {}),
    ((), {"model": 1}), (("d2f", "fast"), {"backend": "reference"}), ((), {"input_ids": [1]}),
])
def test_generate_binds_its_arguments_as_its_signature_does(args, knobs):
    """generate's direct mapping of (model, input_ids, strategy, backend, **knobs) gives Signature.bind's arguments,
    and a call bind refuses (a repeated argument, too many positionals) still raises bind's TypeError."""
    try:
        want = dict(api._SIGNATURE.bind("model", "ids", *args, **knobs).arguments)
    except TypeError as e:
        with pytest.raises(TypeError, match=str(e)):
            api._bound("model", "ids", args, knobs)
        return
    assert api._bound("model", "ids", args, knobs) == want
