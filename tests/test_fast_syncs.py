"""Host syncs of the fast decoder: at most one small device-to-host read per round.

`count_host_syncs` patches Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / nonzero /
cpu / numpy globally while generate runs; the decoder marks each round with `round_scope`, so reads made
by the round's device work (the model forward included) are attributed to it.
"""
import pytest
import torch

import lopa_fast
from lopa_fast.decode import count_host_syncs
from lopa_fast.testing import random_model, tiny_hf_config


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream", vocab_size=64), seed=0, sharpen=6)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("full", [True, False])
def test_one_host_read_per_round(model, k, full):
    prompt = torch.randint(0, 60, (11,), generator=torch.Generator().manual_seed(3))
    kw = dict(branching_factor=k, block_size=8, max_new_tokens=48, skip_threshold=0.7, use_full_attention=full)
    with count_host_syncs() as c:
        out = lopa_fast.generate(model, prompt, "lopa", "fast", **kw)
    fw = out.stats["forwards"]
    # every round with a forward plus the final (terminating) check
    assert len(c.per_round) == fw + 1
    assert max(c.per_round) == 1, c.per_round
    assert out.stats["host_reads"] == fw + 1
    assert out.stats["host_reads_per_round"] == pytest.approx((fw + 1) / fw)


def test_counter_sees_reads(model):
    """The counter can fail: a deliberate .item() inside a round scope is counted."""
    from lopa_fast.decode.syncs import round_scope

    t = torch.ones(3)
    with count_host_syncs() as c:
        with round_scope():
            t.sum().item()
            bool(t.any())
            t.nonzero()
            t.tolist()
    assert c.per_round == [4]
    assert torch.Tensor.item is not None and torch.ones(1).item() == 1.0  # patches are undone


def test_counter_not_reentrant():
    with count_host_syncs():
        with pytest.raises(RuntimeError, match="re-entrant"):
            with count_host_syncs():
                pass
