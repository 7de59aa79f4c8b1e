"""Issue 35: every strategy on every surface (APD's verifier on the CLI's generate / serve / eval and the lm-eval
model) and what operators expect (an access log line per request, /metrics in serve --help, a 413 that a client
writing its whole body first can read). The server runs in process (uvicorn in a thread, loopback) on the embedded
pair d2f-arith (drafter) / ar-arith (verifier)."""
from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request

import pytest
import torch

import lopa_fast
from lopa_fast import cli
from lopa_fast.assets import model_dir
from lopa_fast.errors import KnobError
from lopa_fast.server import create_app
from lopa_fast.server.limits import Limits
from lopa_fast.server.worker import Worker
from tests.test_server_limits import HANG_S, _call, _Server

PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . How many pens ? Answer :"
AR = str(model_dir("ar-arith"))
APD = dict(strategy="apd", apd_mixture_weight=0.7, kv_window=2, max_lookahead=13, max_new_tokens=16)


@pytest.fixture(scope="module")
def pair():
    m = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    return m, lopa_fast.load_tokenizer(model_dir()), lopa_fast.load_model(AR, dtype=torch.float32)


def _apd_flags():
    return ["--strategy", "apd", "--apd-mixture-weight", "0.7", "--kv-window", "2", "--max-lookahead", "13",
            "--max-new-tokens", "16"]


# ---- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_generate_runs_apd_with_a_verifier(pair, capsys):
    model, tok, ar = pair
    assert cli.main(["generate", "--prompt", PROMPT, *_apd_flags(), "--verifier", AR, "--json", "-q"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = lopa_fast.generate(model, tok(PROMPT)["input_ids"], verifier=ar, **APD)
    assert got["generated_ids"] == want.generated_ids and got["stats"]["strategy"] == "apd"
    assert got["stats"]["verifier_forwards"] == want.stats["verifier_forwards"] > 0


@pytest.mark.parametrize("argv,needle", [
    (_apd_flags(), "apd_mixture_weight=0.7 needs a verifier: pass --verifier DIR"),
    (["--strategy", "d2f", "--verifier", AR], "a verifier (--verifier DIR) applies to strategy='apd'"),
    ([*_apd_flags(), "--verifier", "/no/such/dir"], "--verifier /no/such/dir: not a directory"),
    (["--strategy", "apd", "--verifier", AR], "verifier= given but apd_mixture_weight=None"),
    ([*_apd_flags(), "--verifier", str(model_dir())], "cannot verify"),  # a Dream model: not a causal verifier
])
def test_cli_verifier_errors_are_one_line_exit_2(capsys, argv, needle):
    assert cli.main(["generate", "--prompt", PROMPT, *argv], exit_on_error=True) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_cli_serve_checks_its_verifier_at_start(capsys):
    with pytest.raises(KnobError, match="apd_mixture_weight=0.7 needs a verifier: pass serve --verifier DIR"):
        cli.main(["serve", "--port", "0", *_apd_flags()])
    with pytest.raises(cli.CLIError, match="cannot verify"):  # checked against the drafter before listening
        cli.main(["serve", "--port", "0", "--verifier", str(model_dir())])


def test_cli_eval_takes_a_verifier(tmp_path, capsys):
    import shutil

    ar = tmp_path / "my-verifier"
    shutil.copytree(AR, ar)
    md = tmp_path / "e.md"
    assert cli.main(["eval", "--task", "arith", "--n", "1", "--strategies", "apd-r0.7", "--verifier", str(ar),
                     "--out", str(md), "--no-progress", "-q"]) == 0
    row = next(ln for ln in md.read_text().splitlines() if ln.startswith("| apd-r0.7"))
    assert "unavailable" not in row and "%" in row, row
    with pytest.raises(cli.CLIError, match="--verifier /nope: not a directory"):
        cli.main(["eval", "--n", "1", "--verifier", "/nope"])


def test_help_lists_the_new_flags():
    subs = cli.build_parser()._subparsers._group_actions[0].choices
    serve = " ".join(subs["serve"].format_help().split())
    assert "/metrics" in serve and "--no-access-log" in serve and "--verifier DIR" in serve
    gen = " ".join(subs["generate"].format_help().split())
    for flag in ("--verifier DIR", "--max-length N", "--do-sample, --no-do-sample", "--n N"):
        assert flag in gen, flag
    assert "--typical-p" not in gen  # refused names are parsed (and refused) but not offered
    assert "--verifier DIR" in " ".join(subs["eval"].format_help().split())


# ---- the server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(pair):
    """(a server with the verifier, one without), both on the embedded model, small body cap."""
    model, tok, ar = pair
    out = []
    for verifier in (ar, None):
        worker = Worker(model, tok, limits=Limits(max_body_bytes=64 << 10, read_timeout_s=5.0), verifier=verifier)
        out.append((_Server(create_app(worker, model_id="d2f-arith", defaults={"max_new_tokens": 16}),
                            worker.limits), worker))
    yield out[0][0], out[1][0]
    for srv, worker in out:
        srv.close()
        worker.close()


def test_server_runs_apd_with_its_verifier(pair, servers):
    model, tok, ar = pair
    with_v, without = servers
    status, body = _call(with_v.url + "/v1/completions", {"prompt": PROMPT, **APD})
    assert status == 200, body
    want = lopa_fast.generate(model, tok(PROMPT)["input_ids"], verifier=ar, **APD)
    assert body["stats"]["strategy"] == "apd" and body["stats"]["verifier_forwards"] == want.stats["verifier_forwards"]
    # the leftright baseline (no apd_mixture_weight) runs without the server's verifier; other strategies too
    status, body = _call(with_v.url + "/v1/completions", {"prompt": PROMPT, "strategy": "apd", "max_tokens": 8})
    assert status == 200 and body["stats"]["strategy"] == "apd", body
    status, body = _call(without.url + "/v1/completions", {"prompt": PROMPT, **APD})
    assert status == 400 and body["error"]["param"] == "apd_mixture_weight", body
    assert "serve --verifier DIR (this server was started without one)" in body["error"]["message"]


def test_access_log_line_per_request(pair, servers, caplog):
    with_v, _ = servers
    with caplog.at_level(logging.INFO, logger="lopa_fast.server.access"):
        _call(with_v.url + "/health")
        _call(with_v.url + "/v1/completions", {"prompt": PROMPT, "frobnicate": 1})
    lines = [r.getMessage() for r in caplog.records if r.name == "lopa_fast.server.access"]
    assert any('"GET /health" 200' in ln and ln.endswith(" ms") for ln in lines), lines
    assert any('"POST /v1/completions" 400' in ln for ln in lines), lines
    model, tok, _ = pair
    worker = Worker(model, tok, batch=False)
    quiet = _Server(create_app(worker, model_id="m", defaults={}, access_log=False))
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lopa_fast.server.access"):
            _call(quiet.url + "/health")
        assert not [r for r in caplog.records if r.name == "lopa_fast.server.access"]
    finally:
        quiet.close()
        worker.close()


def test_413_is_readable_by_a_client_that_sends_its_whole_body_first(servers):
    """A body far over the cap (4 MiB against 64 KiB, more than the socket buffers hold): http.client and urllib write
    it all before reading; the server reads and discards it (bounded) and answers 413, never a connection reset."""
    srv, _ = servers
    big = json.dumps({"prompt": "pens " * (800 << 10)}).encode()
    assert len(big) > 4_000_000
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=HANG_S)
    try:
        conn.request("POST", "/v1/completions", body=big, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 413 and "--max-body-bytes" in json.loads(r.read())["error"]["message"]
    finally:
        conn.close()
    req = urllib.request.Request(srv.url + "/v1/completions", data=big, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=HANG_S)
    assert e.value.code == 413
    status, health = _call(srv.url + "/health")
    assert status == 200  # still serving


# ---- lm-eval ---------------------------------------------------------------------------------------------------
def test_lm_eval_model_takes_a_verifier(pair):
    from lm_eval.api.instance import Instance

    from lopa_fast.lm_eval import LopaFastLM

    model, tok, ar = pair
    with pytest.raises(KnobError, match="needs a verifier: pass model_args verifier=DIR"):
        LopaFastLM(**APD)
    lm = LopaFastLM(verifier=AR, device="cpu", **{k: v for k, v in APD.items() if k != "max_new_tokens"})
    req = Instance(request_type="generate_until", doc={}, arguments=(PROMPT, {"max_gen_toks": 16}), idx=0)
    (text,) = lm.generate_until([req], disable_tqdm=True)
    want = lopa_fast.generate(model, tok(PROMPT)["input_ids"], verifier=ar, **APD)
    assert lm.records[0]["strategy"] == "apd" and lm.records[0]["forwards"] == want.stats["forwards"]
    assert lm.summary()["model_args"]["verifier"] == AR
