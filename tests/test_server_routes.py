"""The server's routes users of vLLM / OpenAI expect (issue 42): GET /v1/models/{id}, OpenAI-shaped 404 / 405 bodies,
/tokenize and /detokenize, /version, and the time-to-first-token and queue-time histograms in /metrics. One in-process
server on the embedded model, called over HTTP."""
from __future__ import annotations

import re
import socket
import threading
import time

import pytest

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.server import create_app
from lopa_fast.server.limits import Limits
from lopa_fast.server.worker import Worker
from lopa_fast.tasks.evaluate import GEN_LEN, ROWS
from tests.utils import http_call

PROMPT = "Tom has 7 pens . He buys 4 bags with 6 pens in each . How many pens ? Answer :"
DEFAULTS = dict(ROWS["lopa-k4"], max_new_tokens=GEN_LEN, temperature=0.0)
MODEL_ID = "d2f-arith"
HANG_S = 60  # hang guard only


@pytest.fixture(scope="module")
def url():
    import uvicorn

    from lopa_fast.server import uvicorn_config

    model, tok = lopa_fast.load_model(model_dir()), lopa_fast.load_tokenizer(model_dir())
    worker = Worker(model, tok)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = uvicorn_config(create_app(worker, model_id=MODEL_ID, defaults=DEFAULTS), host="127.0.0.1", port=port,
                         limits=Limits(), log_level="warning")
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(HANG_S)
    worker.close(timeout=HANG_S)


def _call(url, body=None, method=None):
    return http_call(url, body, method=method, timeout=HANG_S)


def test_models_by_id(url):
    status, body = _call(f"{url}/v1/models/{MODEL_ID}")
    assert status == 200 and body["id"] == MODEL_ID and body["object"] == "model"
    status, body = _call(f"{url}/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "model_not_found" and "gpt-4" in body["error"]["message"]


def test_404_and_405_are_openai_error_objects(url):
    status, body = _call(f"{url}/v1/embeddings", {"input": "x"})
    assert status == 404 and set(body) == {"error"} and body["error"]["code"] == "not_found", body
    assert "/v1/embeddings" in body["error"]["message"]
    status, body = _call(f"{url}/v1/completions", method="GET")
    assert status == 405 and set(body) == {"error"} and body["error"]["code"] == "method_not_allowed", body


def test_tokenize_and_detokenize(url):
    tok = lopa_fast.load_tokenizer(model_dir())
    status, body = _call(f"{url}/tokenize", {"prompt": PROMPT})
    assert status == 200 and body["tokens"] == tok(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128
    status, chat = _call(f"{url}/tokenize", {"messages": [{"role": "user", "content": PROMPT}]})
    assert status == 200 and tok.decode(chat["tokens"], skip_special_tokens=True).count("Answer :") == 1
    status, back = _call(f"{url}/detokenize", {"tokens": tok(PROMPT, add_special_tokens=False)["input_ids"]})
    assert status == 200 and back["prompt"].replace(" ", "") == PROMPT.replace(" ", "")
    for route, bad, field in (("tokenize", {"prompt": ""}, "prompt"), ("tokenize", {"text": "x"}, "text"),
                              ("detokenize", {"tokens": [10**9]}, "tokens"), ("detokenize", {"tokens": "x"}, "tokens")):
        status, body = _call(f"{url}/{route}", bad)
        assert status == 400 and body["error"]["param"] == field, (route, bad, body)


def test_version(url):
    status, body = _call(f"{url}/version")
    assert status == 200 and body == {"version": lopa_fast.__version__}


def test_metrics_have_time_to_first_token_and_queue_time(url):
    status, _ = _call(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 16})
    assert status == 200
    status, text = _call(f"{url}/metrics")
    ttft = re.search(r'^lopa_fast_time_to_first_token_seconds_count\{endpoint="completions"\} (\S+)$', text, re.M)
    queue = re.search(r"^lopa_fast_queue_seconds_count (\S+)$", text, re.M)
    assert ttft is not None and float(ttft.group(1)) >= 1, text
    assert queue is not None and float(queue.group(1)) >= 1, text


def test_a_list_of_prompts_gets_one_choice_each(url):
    other = "Mia has 6 shells . She loses 1 shells . How many shells ? Answer :"
    status, body = _call(f"{url}/v1/completions", {"prompt": [PROMPT, other], "max_tokens": 32})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1], body
    for i, p in enumerate((PROMPT, other)):  # each choice is what the prompt gets alone
        status, alone = _call(f"{url}/v1/completions", {"prompt": p, "max_tokens": 32})
        assert body["choices"][i]["text"] == alone["choices"][0]["text"]
    assert body["usage"]["forwards"] == sum(s["forwards"] for s in body["stats"])


def test_n_samples_at_positive_temperature(url):
    req = {"prompt": PROMPT, "max_tokens": 16, "temperature": 3.0, "seed": 11, "n": 3}
    status, body = _call(f"{url}/v1/completions", req)
    assert status == 200 and len(body["choices"]) == 3, body
    for j, c in enumerate(body["choices"]):  # choice j: seed + j
        status, alone = _call(f"{url}/v1/completions", {**req, "n": 1, "seed": 11 + j})
        assert c["text"] == alone["choices"][0]["text"] and c["index"] == j
    status, chat = _call(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                        "max_tokens": 16, "temperature": 3.0, "n": 2})
    assert status == 200 and len(chat["choices"]) == 2
    for bad, field in (({"n": 2}, "n"), ({"n": 2, "temperature": 1.0, "stream": True}, "stream"),
                       ({"n": 17, "temperature": 1.0}, "n")):
        status, body = _call(f"{url}/v1/completions", {"prompt": PROMPT, **bad})
        assert status == 400 and body["error"]["param"] == field, (bad, body)


def test_readme_openai_client_block_runs_verbatim(url, capsys):
    """The README's Serving section's Python block (the openai client), run with only its base_url pointed at this
    test's server (the README's is the default port 8000)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Serving (OpenAI-compatible)\n"):]
    section = section[: section.index("\n## ", 1)]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert code.count("http://127.0.0.1:8000/v1") == 1
    code = code.replace("http://127.0.0.1:8000/v1", f"{url}/v1")  # the only change
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert "#### 26" in out, out  # 7 + 4 * 6 - 5, in the chat answer and the streamed completion


def test_the_docs_table_names_these_tests():
    """docs/serve.md's table of the conventions users expect: each row names a test of this file."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    names = re.findall(r"^\| [^|]+ \| [^|]+ \| `(test_\w+)` \|$", text, re.M)
    assert len(names) == 8 and all(callable(globals().get(n)) for n in names), names
