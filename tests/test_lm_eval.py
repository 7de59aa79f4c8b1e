"""The lm-eval-harness model `lopa_fast`: offline end to end on a tiny custom task (YAML + local jsonl written here)
through `python -m lopa_fast lm-eval`, and its generate_until / loglikelihood contract in process.

lm-eval is a test dependency (requirements.txt): without it these tests fail, never skip."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from lm_eval.api.instance import Instance

import lopa_fast
from lopa_fast.lm_eval import LopaFastLM
from lopa_fast.text import answer_text, text_decoder

QUESTIONS = [  # through the chat template the embedded model answers the first two right, the third wrong (25)
    ("Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . How many pens does Tom have now ?",
     "26"),
    ("Tom has 9 pens . He buys 2 bags with 8 pens in each . He gives away 6 pens . How many pens does Tom have now ?",
     "19"),
    ("Tom has 23 pens . He buys 4 bags with 6 pens in each . He gives away 17 pens . How many pens does Tom have now ?",
     "30"),
]
TASK = """task: arith_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|endoftext|>"]
  max_gen_toks: 30
  do_sample: false
filter_list:
  - name: answer
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def lm():
    return LopaFastLM(strategy="lopa", block_size=8)


def _req(context, **gen_kwargs):
    return Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs), idx=0)


def test_lm_eval_offline_end_to_end(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arith_tiny.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run(
        [sys.executable, "-m", "lopa_fast", "lm-eval", "--model", "lopa_fast", "--model_args",
         "strategy=lopa,branching_factor=4,block_size=8", "--tasks", "arith_tiny", "--include_path",
         str(tmp_path / "tasks"), "--output_path", str(out), "--apply_chat_template", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = list(out.rglob("results_*.json"))
    stats_files = list(out.rglob("lopa_fast_stats_*.json"))
    assert len(results) == 1 and len(stats_files) == 1 and stats_files[0].parent == results[0].parent
    res = json.loads(results[0].read_text())["results"]["arith_tiny"]
    assert res["exact_match,answer"] == pytest.approx(2 / 3)  # the metric is computed from our answers
    st = json.loads(stats_files[0].read_text())
    total, reqs = st["total"], st["requests"]
    assert total["requests"] == len(reqs) == 3
    assert total["forwards"] == sum(q["forwards"] for q in reqs) > 0
    assert total["tpf"] == pytest.approx(total["generated_tokens"] / total["forwards"]) and total["tpf"] > 1
    assert all(q["finish_reason"] == "stop" and q["strategy"] == "lopa" for q in reqs)  # until: the EOS string
    assert f"TPF {total['tpf']:.2f}" in r.stdout and "exact_match" in r.stdout


def test_generate_until_uses_the_stop_mechanism(lm):
    context = QUESTIONS[0][0] + " Answer :"
    ids = lm.tok(context)["input_ids"]
    full = lopa_fast.generate(lm.model, ids, strategy="lopa", block_size=8, max_new_tokens=30)
    want = answer_text(full, text_decoder(lm.tok), lm.model.eos_token_id)
    lm.records.clear()
    texts = lm.generate_until([_req(context, until=[". 7 +"], max_gen_toks=30), _req(context, max_gen_toks=13),
                               _req(context, until="####", max_gen_toks=30, do_sample=False)])  # fmt: skip
    assert texts[0] == want.split(" . 7 +")[0] == "4 * 6 = 24"  # tokenised stop: decoding ended early
    assert lm.records[0]["finish_reason"] == "stop" and lm.records[0]["forwards"] < full.stats["forwards"]
    assert lm.records[1]["generated_tokens"] == 13 and want.startswith(texts[1])  # max_gen_toks, cut
    assert texts[2] == want.split(" ####")[0] and texts[2].endswith("= 26 .")
    assert lm.totals()["requests"] == 3


def test_unsupported_and_bad_requests(lm):
    with pytest.raises(NotImplementedError, match="loglikelihood requests are not supported"):
        lm.loglikelihood([])
    with pytest.raises(NotImplementedError, match="not supported"):
        lm.loglikelihood_rolling([])
    with pytest.raises(lopa_fast.KnobError, match="empty"):
        lm.generate_until([_req("   ")])
    with pytest.warns(UserWarning, match="'Zorg'"):
        lm.generate_until([_req("Zorg has 7 pens . Answer :", max_gen_toks=8)])
    with pytest.raises(TypeError, match="unknown"):
        LopaFastLM(frobnicate=1)
    with pytest.warns(RuntimeWarning, match="ignored"):
        lm.request_knobs({"max_gen_toks": 8, "repetition_penalty": 1.1})
    assert lm.request_knobs({"do_sample": True, "temperature": 0.7, "until": "x"}) == (
        {"strategy": "lopa", "block_size": 8, "max_new_tokens": 256, "temperature": 0.7}, ["x"])
    assert lm.apply_chat_template([{"role": "user", "content": "Tom"}]) == "<|beginoftext|>Tom Answer :"
    lm.chat_applied = False
