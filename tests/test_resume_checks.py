"""Issue 28, finding 10: resume.pt is read with weights_only=True (a file that would run code when unpickled is
refused), and a corrupt or foreign one is one line naming the file (exit status 2 from a recipe's command line),
not a traceback; a real training state (model, AdamW state, torch RNG, counters) still loads."""
from __future__ import annotations

import os

import pytest
import torch

from lopa_fast.train import run


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _state(args: dict) -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return dict(args=args, model=model.state_dict(), opt=opt.state_dict(), step=7, ema=0.5, first_loss=1.0,
                dev_acc=None, seconds=1.5, torch_rng=torch.get_rng_state())


def test_a_real_state_loads(tmp_path):
    run.save_state(tmp_path, _state({"lr": 1e-3}))
    st = run.load_state(tmp_path, {"lr": 1e-3})
    assert st["step"] == 7 and st["opt"]["param_groups"][0]["betas"] == (0.9, 0.98)
    with pytest.raises(ValueError, match="differ"):  # a ResumeError is a ValueError, as before
        run.load_state(tmp_path, {"lr": 2e-3})


@pytest.mark.parametrize("content", [b"", b"not a zip at all", "code", "truncated", "list"])
def test_a_bad_resume_file_is_one_clear_error(tmp_path, content):
    path = tmp_path / run.RESUME_FILE
    if content == "code":
        torch.save({"args": {}, "model": {}, "opt": {}, "step": 0, "x": _Payload()}, path)
    elif content == "truncated":
        run.save_state(tmp_path, _state({}))
        path.write_bytes(path.read_bytes()[:200])
    elif content == "list":
        torch.save([1, 2], path)
    else:
        path.write_bytes(content)
    with pytest.raises(run.ResumeError, match="resume: .*resume.pt"):
        run.load_state(tmp_path, {})


def test_a_recipe_command_line_exits_2_on_a_bad_resume_file(tmp_path, capsys):
    (tmp_path / run.RESUME_FILE).write_bytes(b"garbage")

    def train(out, lr, resume):
        run.load_state(tmp_path, {"lr": lr})

    with pytest.raises(SystemExit) as e:
        run.main("lopa_fast.train.fake", "fake recipe", {"lr": 0.1}, train, ["--out", str(tmp_path), "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resume.pt is not a readable training state" in err
