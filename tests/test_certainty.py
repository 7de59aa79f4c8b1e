"""The certainty-convergence curve (lopa_fast.train.certainty): per step of one-token-per-forward decoding, the share
of still-masked positions above the confidence threshold; one position fills per step."""
import pytest

from lopa_fast import tasks
from lopa_fast.assets import model_dir
from lopa_fast.train import certainty


def test_curve_on_the_embedded_model(tmp_path):
    import lopa_fast

    model = lopa_fast.load_model(model_dir(), dtype="float32")
    problems = tasks.generate("dev", 3, seed=0)
    c = certainty.certainty_curve(model, problems, tasks.build_tokenizer(), gen_len=32, threshold=0.9)
    assert len(c["share"]) == 32 and c["masked"][:3] == [32.0, 31.0, 30.0]  # one fill per forward
    assert all(s is None or 0.0 <= s <= 1.0 for s in c["share"]) and 0.0 <= c["accuracy"] <= 1.0
    assert c["confident"][0] <= c["masked"][0]
    md = certainty.table({"m": c})
    assert md.splitlines()[0].startswith("| step") and "accuracy" in md
    certainty.plot({"m": c}, tmp_path / "c.png", 0.9)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_refuses_bad_input(tmp_path, capsys):
    assert certainty.main([str(tmp_path), "--n", "2"]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert certainty.main([str(model_dir()), "--threshold", "1.5"]) == 2
