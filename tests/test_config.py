"""The knobs live in one place: GenerateConfig's fields and defaults are generate's signature; validation
runs once per call."""
import dataclasses
import inspect

import pytest

import lopa_fast
from lopa_fast.config import GenerateConfig
from lopa_fast.testing import random_model, tiny_hf_config


def test_generate_signature_is_the_config():
    params = inspect.signature(lopa_fast.generate).parameters
    fields = dataclasses.fields(GenerateConfig)
    assert list(params)[:2] == ["model", "input_ids"]
    # the extras: APD's verifier model, the on_round hook, the tokenizer (text prompts and stops) and a TextStreamer-
    # style streamer, arguments beside the knobs (not in the config)
    assert list(params)[2:] == [f.name for f in fields] + ["verifier", "on_round", "tokenizer", "streamer"]
    assert params["verifier"].default is None and params["verifier"].kind == inspect.Parameter.KEYWORD_ONLY
    assert "verifier" not in {f.name for f in fields}
    for f in fields:
        p = params[f.name]
        assert p.default == f.default, f.name
        want = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name in ("strategy", "backend") else \
            inspect.Parameter.KEYWORD_ONLY
        assert p.kind == want, f.name


def test_positional_strategy_and_backend_bind_like_keywords(monkeypatch):
    seen = []
    monkeypatch.setattr(lopa_fast.api, "generate_with_config", lambda m, ids, cfg: seen.append(cfg))
    lopa_fast.generate(None, [1], "d2f", "fast", block_size=4, max_new_tokens=8)
    lopa_fast.generate(None, [1], strategy="d2f", backend="fast", block_size=4, max_new_tokens=8)
    assert seen[0] == seen[1] == GenerateConfig(strategy="d2f", backend="fast", block_size=4, max_new_tokens=8)


def test_validate_runs_once_per_call(monkeypatch):
    model = random_model(tiny_hf_config("dream"), seed=0)
    calls = []
    real = GenerateConfig.validate

    def counting(self, *args, **kw):  # validate(spec=None): the plan passes the spec it looked up
        calls.append(self.strategy)
        return real(self, *args, **kw)

    monkeypatch.setattr(GenerateConfig, "validate", counting)
    for backend in ("reference", "fast"):
        calls.clear()
        lopa_fast.generate(model, [1, 2, 3], "lopa", backend, block_size=4, max_new_tokens=8, branching_factor=2)
        assert calls == ["lopa"], backend


def test_a_bad_value_of_another_strategys_knob_is_refused_whatever_the_strategy():
    """D2F's / LoPA's knobs have defaults, so every request carries them: their values are checked for every strategy
    (`Strategy.check_values`), not only where they are read (a vanilla request with skip_threshold=5 is a typo)."""
    import pytest

    for strategy in ("vanilla", "threshold", "apd", "d2f", "lopa"):
        with pytest.raises(ValueError, match="skip_threshold=5.0"):
            GenerateConfig(strategy=strategy, skip_threshold=5.0).validate()
        with pytest.raises(TypeError, match="branching_factor='x'"):
            GenerateConfig(strategy=strategy, branching_factor="x").validate()
        with pytest.raises(ValueError, match="sampling_strategy"):
            GenerateConfig(strategy=strategy, sampling_strategy="nope").validate()


@pytest.mark.parametrize("changes", [
    dict(stop=[[1, 2], [3]]), dict(top_k=0), dict(top_k=-1), dict(max_new_tokens=16, eos_token_id=3),
    dict(stop=None, seed=7), dict(block_size=8, stop=((4,),)),
])
def test_replace_is_dataclasses_replace(changes):
    """GenerateConfig.replace (the instance dict copied, __post_init__ rerun) equals dataclasses.replace: the same
    fields, the same normalisations (stop lists -> hashable tuples, top_k 0 / -1 -> None), frozen; a name that is not
    a field is refused the same way."""
    import dataclasses

    base = GenerateConfig(strategy="lopa", block_size=4, stop=[[9, 9]])
    got, want = base.replace(**changes), dataclasses.replace(base, **changes)
    assert got == want and hash(got) == hash(want) and type(got) is type(want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.block_size = 2
    with pytest.raises(TypeError, match="nope"):
        base.replace(nope=1)
