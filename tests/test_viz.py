"""lopa_fast.viz: the fill order of a traced decode as a matplotlib PNG and as a terminal view."""
import pytest
import torch

import lopa_fast
from lopa_fast import tasks
from lopa_fast.tasks.evaluate import ROWS, load_default, prompt_ids
from lopa_fast.viz import fill_order_png, fill_order_text, fill_rounds
from tests.utils import png_size


@pytest.fixture(scope="module")
def traces():
    model, tok, _ = load_default()
    ids = torch.tensor(prompt_ids(tok, tasks.generate("test", 1, seed=0)[0]))
    out = {}
    for row in ("d2f", "lopa-k4", "threshold"):
        o = lopa_fast.generate(model, ids, max_new_tokens=32, return_trace=True, **ROWS[row])
        out[row] = (o.trace, tok.convert_ids_to_tokens(o.generated_ids))
    return out


def test_fill_rounds_reads_rounds_and_lookahead_wins():
    trace = [
        {"round": 1, "accepted": [[0, 5], [1, 6]], "branches": [{"lookahead": None}], "winner": 0},
        {"round": 2, "accepted": [[2, 7], [4, 9]], "branches": [{"lookahead": None}, {"lookahead": 4}], "winner": 1},
        {"round": 3, "accepted": [[3, 8], [2, 1]]},  # a position is credited to the round that first filled it
    ]
    assert fill_rounds(trace) == ([1, 1, 2, 3, 2], {4})
    assert fill_rounds(trace, 7)[0] == [1, 1, 2, 3, 2, 0, 0]
    text = fill_order_text(trace, ["a", "b", "c", "d", "eee"])
    assert text.splitlines() == ["tokens: a b c d eee", "round:  1 1 2 3  2*"]
    with pytest.raises(ValueError, match="return_trace=True"):
        fill_rounds([])


def test_png_has_the_asked_size_and_differs_between_traces(traces, tmp_path):
    from PIL import Image

    a = fill_order_png(traces["d2f"][0], tmp_path / "a.png", tokens=traces["d2f"][1], width=640, height=200)
    b = fill_order_png(traces["lopa-k4"][0], tmp_path / "b.png", tokens=traces["lopa-k4"][1], width=640, height=200)
    c = fill_order_png(traces["threshold"][0], tmp_path / "c.png", tokens=traces["threshold"][1], width=640,
                       height=200)
    assert png_size(a) == png_size(b) == png_size(c) == (640, 200)
    pix = [list(Image.open(p).convert("RGB").getdata()) for p in (a, b, c)]
    assert len(set(pix[0])) > 10  # a heatmap was drawn, not a blank canvas
    # this confident model fills each block of 8 in one round under d2f and lopa (identical traces); threshold
    # needs an extra round in block 2, so its picture differs
    assert fill_rounds(traces["d2f"][0]) == fill_rounds(traces["lopa-k4"][0]) != fill_rounds(traces["threshold"][0])
    assert pix[0] != pix[2]
    # a lookahead win is drawn (same rounds, one winning lookahead)
    plain = [{"round": 1, "accepted": [[i, 0] for i in range(4)], "branches": [{"lookahead": None}], "winner": 0}]
    won = [dict(plain[0], branches=[{"lookahead": None}, {"lookahead": 3}], winner=1)]
    d, e = fill_order_png(plain, tmp_path / "d.png"), fill_order_png(won, tmp_path / "e.png")
    assert png_size(d) == png_size(e) == (800, 220)
    assert list(Image.open(d).convert("RGB").getdata()) != list(Image.open(e).convert("RGB").getdata())
    # the same trace draws the same pixels (deterministic rendering)
    again = fill_order_png(traces["d2f"][0], tmp_path / "a2.png", tokens=traces["d2f"][1], width=640, height=200)
    assert list(Image.open(again).convert("RGB").getdata()) == pix[0]


def test_terminal_view_of_a_real_lopa_trace(traces):
    trace, toks = traces["lopa-k4"]
    rounds, look = fill_rounds(trace, len(toks))
    assert all(r >= 1 for r in rounds) and max(rounds) == len(trace)
    top, bot = fill_order_text(trace, toks).splitlines()
    assert top.startswith("tokens:") and bot.startswith("round:") and len(top) == len(bot)
    assert bot.count("*") == len(look)
