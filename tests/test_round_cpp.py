"""The C++ CPU twin of the fast round's bookkeeping (csrc/round_cpu.cpp: `round_prepare`, `round_update`)
against its plain-PyTorch reference, `lopa_fast.decode.round.round_step`: every round of a grid of requests is
run both ways from the same state, and every state field, the head and the trace facts must be equal
(bitwise: integer logic, and the float decisions are made from the same fp32 values in the same order).
The end-to-end parity grid (tests/test_fast_parity.py) runs the fast decoder on both rounds (the C++ twin, the CPU
default, and the torch round, LOPA_FAST_CPP=0). The ops' interface is generated from ONE description
(lopa_fast.contracts.ROUND_CPP_OPS): the built op's schema, the generated header and the build key follow it."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

import lopa_fast
from lopa_fast.contracts import ROUND_CPP_OPS, ROUND_OUT_FIELDS
from lopa_fast.decode import round as rnd
from lopa_fast.ops import _cpp
from lopa_fast.testing import random_model, tiny_hf_config


@pytest.fixture(scope="module")
def models():
    return {
        "dream": random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=0, sharpen=6),
        "llada": random_model(tiny_hf_config("llada", vocab_size=64, num_kv_heads=4), seed=3, sharpen=6),
    }


@pytest.fixture(scope="module")
def built():
    assert _cpp.round_ops(), "the C++ round ops must build on the CI machine (gcc + ninja are installed)"


def _same(a, b, name):
    if a is None or b is None:
        assert a is None and b is None, name
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), (name, a, b)


def _checked(rounds: list):
    """round_step_cpp that also runs round_step on a copy of the same state and compares everything."""
    cpp_step, torch_step = rnd.round_step_cpp, rnd.round_step

    def step(model, st, T, geo, cfg, Nb, Rb, prefix_len, P, L, tables):
        st_t = {k: v.clone() for k, v in st.items()}
        st_t, info_t = torch_step(model, st_t, T, geo, cfg, Nb, Rb, prefix_len=prefix_len)
        st_c, info_c = cpp_step(model, st, T, geo, cfg, Nb, Rb, prefix_len, P, L, tables)
        for f in ROUND_OUT_FIELDS:
            a, b = st_t[f], st_c[f]
            if f in ("cache_k", "cache_v"):  # row Lb is the trash row (masked commits land there in any order)
                a, b = a[:, :-1], b[:, :-1]
            if f == "last_logit" and not geo.shift:  # never read without the shift (kept as it was)
                continue
            _same(a, b, f)
        for f in ("winner", "acc", "tok", "wpos", "score", "look_pos"):
            _same(info_t[f], info_c[f], f)
        rounds.append(int(st_c["head"][1]))
        return st_c, info_c

    return step


def _configs(n: int, seed: int = 0) -> list[dict]:
    grid = list(itertools.product(
        ("dream", "llada"), (1, 2, 5), (True, False), (4, 8), ("default", "margin", "neg_entropy"),
        (0.0, 0.5), ((0.1, 0.95, 0.9), (0.3, 0.5, 0.95), (0.0, 0.0, 0.99)), (False, True),
    ))  # fmt: skip
    random.Random(seed).shuffle(grid)
    out = []
    for model, k, full, bs, strat, alpha, (add, act, skip), trace in grid[:n]:
        out.append(dict(model=model, branching_factor=k, use_full_attention=full, block_size=bs, sampling_strategy=strat,
                        selection_conf_alpha=alpha, block_add_threshold=add, decoded_token_threshold=act,
                        skip_threshold=skip, return_trace=trace))  # fmt: skip
    return out


@pytest.mark.parametrize("case", _configs(14), ids=lambda c: "-".join(str(v) for v in c.values()))
def test_cpp_round_equals_torch_round(case, models, built, monkeypatch):
    case = dict(case)
    model = models[case.pop("model")]
    rounds: list = []
    monkeypatch.setattr(rnd, "round_step_cpp", _checked(rounds))
    g = torch.Generator().manual_seed(case["block_size"])
    for P in (3, 17):
        prompt = torch.randint(0, 60, (P,), generator=g)
        out = lopa_fast.generate(model, prompt, "lopa", "fast", max_new_tokens=24, eos_token_id=5, **case)
        assert out.stats["forwards"] > 0
    assert len(rounds) > 2  # the subject: rounds ran through the compared step


def test_cpp_round_with_stop_sequences(models, built, monkeypatch):
    """The C++ head leaves the stop flag to Python: both rounds agree and decoding ends where the torch one does."""
    rounds: list = []
    monkeypatch.setattr(rnd, "round_step_cpp", _checked(rounds))
    model = models["dream"]
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(4))
    free = lopa_fast.generate(model, prompt, "lopa", "fast", max_new_tokens=32, block_size=4, branching_factor=2)
    stop = [free.generated_ids[5:7]]
    out = lopa_fast.generate(model, prompt, "lopa", "fast", max_new_tokens=32, block_size=4, branching_factor=2,
                             stop=stop)  # fmt: skip
    ref = lopa_fast.generate(model, prompt, "lopa", "reference", max_new_tokens=32, block_size=4, branching_factor=2,
                             stop=stop)  # fmt: skip
    assert rounds and out.generated_ids == ref.generated_ids and out.stats["forwards"] == ref.stats["forwards"]
    assert out.stats["finish_reason"] == "stop"


def test_round_ops_switch(monkeypatch, built):
    monkeypatch.setenv("LOPA_FAST_CPP", "0")
    assert not _cpp.round_ops()
    monkeypatch.setenv("LOPA_FAST_CPP", "1")
    assert _cpp.round_ops()


def test_built_ops_take_the_described_arguments(built):
    """The registered ops' schemas (generated) list ROUND_CPP_OPS' arguments, names and order, and the generated
    header gives the C++ side a field per argument."""
    kinds = {"tensors": "List[Tensor]", "tensor": "Tensor", "mut_tensor": "Tensor", "int": "int", "bool": "bool",
             "float": "float"}  # fmt: skip
    header = _cpp.header()
    for op, args in ROUND_CPP_OPS.items():
        schema = getattr(torch.ops.lopa_fast_cpp, op).default._schema
        assert [(a.name, str(a.type)) for a in schema.arguments] == [(n, kinds[k]) for n, k in args], op
        assert [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments] == \
            [k == "mut_tensor" for _, k in args], op  # cache_k / cache_v are written in place
        for name, _ in args:
            assert f" {name};" in header, (op, name)


def test_one_line_adds_an_argument(monkeypatch, tmp_path):
    """An argument added to the description reaches the generated header (struct field, entry parameter, schema)
    and changes the build key, so a stale build of the old interface is never loaded; a call must then pass it."""
    monkeypatch.setenv("LOPA_FAST_CACHE_DIR", str(tmp_path))
    before, key = _cpp.header(), _cpp.build_dir()
    ops = dict(ROUND_CPP_OPS, round_update=ROUND_CPP_OPS["round_update"] + (("new_knob", "float"),))
    monkeypatch.setattr(_cpp, "ROUND_CPP_OPS", ops)
    after = _cpp.header()
    assert "double new_knob;" in after and "double new_knob)" in after and "float new_knob)" in after
    assert "new_knob" not in before and _cpp.build_dir() != key
    with pytest.raises(TypeError, match=r"missing arguments \['new_knob'\], unexpected \['old_knob'\]"):
        _cpp.call("round_update", **{n: None for n, _ in ROUND_CPP_OPS["round_update"]}, old_knob=1.0)
