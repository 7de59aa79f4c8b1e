"""Fuzzing (issue 17): configs, knobs and prompts, valid and not. The contract: either a result whose stats are
consistent with its tokens, or one of the package's documented exception types whose message names the
offending value. Bounded and derandomized for CI (a few seconds)."""
import json
import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import lopa_fast  # noqa: E402
from lopa_fast.errors import LopaError  # noqa: E402
from lopa_fast.models.config import parse_config  # noqa: E402
from lopa_fast.testing import random_model, tiny_hf_config  # noqa: E402

FUZZ = settings(deadline=None, derandomize=True, max_examples=60, database=None,
                suppress_health_check=list(HealthCheck))
_MODEL = random_model(tiny_hf_config("dream", vocab_size=32, num_layers=1, hidden_size=16, intermediate_size=32,
                                     max_position_embeddings=96), seed=0, sharpen=4.0)
DOCUMENTED = (LopaError, ValueError, TypeError)  # LopaError subclasses; knob TypeErrors stay plain TypeError

WEIRD = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-3, 40), max_size=3), st.dictionaries(st.text(max_size=2), st.none(), max_size=1),
)


def _names_value(msg: str, value) -> bool:
    if isinstance(value, float) and value != value:
        return "nan" in msg.lower()
    return repr(value) in msg or str(value) in msg


# ---- config.json ------------------------------------------------------------------------------------------
CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
               "mask_token_id", "eos_token_id", "bos_token_id", "head_dim"]


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=WEIRD)
def test_fuzz_config_values(key, value):
    cfg = tiny_hf_config("dream")
    cfg[key] = value
    try:
        mc = parse_config(json.loads(json.dumps(cfg)), source="config.json")
    except lopa_fast.ConfigError as e:
        assert e.key in (key, "num_attention_heads", "num_key_value_heads", "head_dim") and "config.json" in str(e)
        return
    except (ValueError,) as e:  # json.dumps of nan / inf is allowed; other ValueErrors must be ours
        raise AssertionError(f"{key}={value!r}: undocumented {type(e).__name__}: {e}") from e
    # accepted: the parsed numbers are sane
    assert mc.vocab_size > 0 and mc.hidden_size > 0 and mc.num_layers > 0 and mc.num_heads % mc.num_kv_heads == 0
    assert mc.rope_theta > 0 and 0 < mc.rms_norm_eps < 1
    for i in (mc.mask_token_id, mc.eos_token_id, mc.bos_token_id):
        assert i is None or 0 <= i < mc.vocab_size


# ---- knobs and prompts ------------------------------------------------------------------------------------
KNOBS = {
    "max_new_tokens": st.one_of(st.integers(-2, 40), st.just(10**6), st.just(2**64)),
    "block_size": st.one_of(st.integers(-1, 9), st.just(10**30)),
    "branching_factor": st.one_of(st.integers(0, 5), st.just(10**30)),
    "temperature": st.one_of(st.just(0.0), st.floats(-1, 2), st.just(float("nan")), st.just(1e-44)),
    "skip_threshold": st.one_of(st.floats(-0.5, 1.5), st.just(float("inf"))),
    "seed": st.one_of(st.none(), st.integers(-1, 10), st.just(2**64)),
    "top_k": st.one_of(st.none(), st.integers(-1, 40)),
    "mask_token_id": st.one_of(st.none(), st.integers(-1, 40), st.just(2**70)),
    "max_rounds": st.one_of(st.none(), st.integers(0, 4)),
}


@FUZZ
@given(
    strategy=st.sampled_from(["lopa", "d2f", "threshold", "vanilla"]),
    prompt=st.lists(st.one_of(st.integers(0, 40), st.just(2**70), st.just(-1)), min_size=0, max_size=5),
    knobs=st.fixed_dictionaries({}, optional=KNOBS),
)
def test_fuzz_generate(strategy, prompt, knobs):
    kw = dict(knobs)
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("block_size", 4)
    if strategy == "threshold":
        kw["threshold"] = 0.9
    if strategy == "vanilla":
        kw.pop("branching_factor", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = lopa_fast.generate(_MODEL, prompt, strategy, **kw)
    except DOCUMENTED as e:
        msg = str(e)
        named = any(_names_value(msg, v) for v in list(kw.values()) + [prompt] + prompt) or any(k in msg for k in kw)
        assert named or "input_ids" in msg or "prompt" in msg, f"{type(e).__name__} names nothing: {msg}"
        return
    # a result: stats consistent with the tokens
    ids, s = out.generated_ids, out.stats
    assert s["generated_tokens"] == len(ids) and all(0 <= t < 32 for t in ids)
    assert s["masks_left"] == sum(1 for t in ids if t == (kw.get("mask_token_id") or _MODEL.mask_token_id))
    assert 1 <= s["forwards"] <= (kw.get("max_rounds") or 2 * kw["max_new_tokens"] + 64)
    assert s["tpf"] == pytest.approx(len(ids) / s["forwards"])
    assert s["tokens_until_eos"] <= len(ids)
    if not s["hit_round_cap"] and strategy != "vanilla":
        assert s["masks_left"] == 0 or strategy == "threshold"


@FUZZ
@given(nan_at=st.integers(0, 31), strategy=st.sampled_from(["lopa", "d2f", "threshold", "vanilla"]),
       temperature=st.sampled_from([0.0, 0.5]))
def test_fuzz_nonfinite_head_rows(nan_at, strategy, temperature):
    """A NaN head row: either the guard names the round / position / strategy, or no read row was touched."""
    model = random_model(tiny_hf_config("dream", vocab_size=32, num_layers=1, hidden_size=16, intermediate_size=32,
                                        max_position_embeddings=96), seed=0, sharpen=4.0)
    with torch.no_grad():
        model.head_weight()[nan_at] = float("nan")
    kw = dict(threshold=0.9) if strategy == "threshold" else {}
    with pytest.raises(lopa_fast.NonFiniteLogitsError) as ei:
        lopa_fast.generate(model, [3, 4], strategy, max_new_tokens=8, block_size=4, temperature=temperature, seed=0, **kw)
    e = ei.value
    # (threshold at T > 0 samples every window row, the prompt rows included, so any position may be named)
    assert e.strategy == strategy and e.round >= 1 and 0 <= e.position < 10 and f"round {e.round}" in str(e)
