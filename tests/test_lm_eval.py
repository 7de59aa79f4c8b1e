"""The lm-eval-harness model `lopa_fast`: offline end to end on tiny custom tasks (YAML + local jsonl written here)
through `python -m lopa_fast lm-eval` (generate_until) and `lm_eval.simple_evaluate` (multiple choice, by the
masked-diffusion ELBO), the ELBO estimator against an exact enumeration, and the request / model-arg contracts.

lm-eval is a test dependency (requirements.txt): without it these tests fail, never skip."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from lm_eval.api.instance import Instance

import lopa_fast
from lopa_fast.assets import model_dir
from lopa_fast.lm_eval import (LopaFastLM, draw_masks, elbo_terms, greedy_matches, mask_counts, masked_logprobs,
                               mc_loglikelihood)
from lopa_fast.tasks import arith
from lopa_fast.testing import random_model, tiny_hf_config
from lopa_fast.request.text import answer_text, text_decoder

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
        capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = list(out.rglob("results_*.json"))
    stats_files = list(out.rglob("lopa_fast_stats_*.json"))
    assert len(results) == 1 and len(stats_files) == 1 and stats_files[0].parent == results[0].parent
    saved = json.loads(results[0].read_text())
    res = saved["results"]["arith_tiny"]
    assert res["exact_match,answer"] == pytest.approx(2 / 3)  # the metric is computed from our answers
    st = json.loads(stats_files[0].read_text())
    assert saved["lopa_fast"]["total"] == st["total"]  # the totals are in lm-eval's own result dict too
    assert results[0].stem.split("_", 1)[1] == stats_files[0].stem.rsplit("_", 1)[1]  # one run, one date
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
                               _req(context, until="####", max_gen_toks=30, do_sample=False)])
    assert texts[0] == want.split(" . 7 +")[0] == "4 * 6 = 24"  # tokenised stop: decoding ended early
    assert lm.records[0]["finish_reason"] == "stop" and lm.records[0]["forwards"] < full.stats["forwards"]
    assert lm.records[1]["generated_tokens"] == 13 and want.startswith(texts[1])  # max_gen_toks, cut
    assert texts[2] == want.split(" ####")[0] and texts[2].endswith("= 26 .")
    assert lm.totals()["requests"] == 3


def test_bad_requests(lm):
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


@pytest.mark.parametrize("args, match", [
    ({"mc_num": 0}, r"mc_num=0; allowed: an int >= 1"),
    ({"mc_num": "many"}, r"mc_num='many'; allowed: an int >= 1"),
    ({"mc_num": 12.5}, r"mc_num=12.5; allowed"),
    ({"mc_num": 100}, r"mc_num=100; allowed: a multiple of mc_batch_size=32 .*: 1, 2, 4, 5, 10, 20, 25, 50, 100"),
    ({"mc_num": 8, "mc_batch_size": 3}, r"mc_num=8; allowed: a multiple of mc_batch_size=3"),
    ({"mc_batch_size": 0}, r"mc_batch_size=0; allowed: an int >= 1 that divides mc_num"),
    ({"seed": -1}, r"seed=-1; allowed: an int >= 0"),
    ({"check_greedy": "maybe"}, r"check_greedy='maybe'; allowed: true or false"),
    ({"dtype": "float8"}, r"dtype='float8'; allowed: float32, bfloat16, float16"),
    ({"device": "gpu0"}, r"device='gpu0'; allowed: cpu, cuda, cuda:N"),
    ({"max_gen_toks": 0}, r"max_gen_toks=0; allowed: an int >= 1"),
])
def test_bad_model_args_name_the_value(args, match):
    with pytest.raises(lopa_fast.KnobError, match=match):
        LopaFastLM(**args)


# ---- loglikelihood: the masked-diffusion ELBO ------------------------------------------------------------------
def _ll(context, continuation):
    return Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)


def _exact_elbo(model, prompt, target):
    """The ELBO by enumeration, written independently of lopa_fast.lm_eval: every subset S of the continuation is
    masked in its own forward; ELBO = mean over l = 1..L of (L / l) * mean over |S| = l of sum_{j in S} log p_j.
    Also returns {S: sum_{j in S} log p_j} and {(S, j): log p_j}."""
    p, length = len(prompt), len(target)
    per_pos, sums = {}, {}
    for size in range(1, length + 1):
        for subset in itertools.combinations(range(length), size):
            seq = torch.tensor(prompt + target)
            seq[[p + j for j in subset]] = model.mask_token_id
            logp = model(seq[None])[0].float().log_softmax(-1)  # [n, V]: raw logits, by position
            for j in subset:  # Dream: position p + j is predicted by the raw logit one to its left; LLaDA: its own
                per_pos[subset, j] = float(logp[p + j - (1 if model.logits_shift else 0), target[j]])
            sums[subset] = sum(per_pos[subset, j] for j in subset)
    elbo = sum(length / size * sum(v for s, v in sums.items() if len(s) == size) / math.comb(length, size)
               for size in range(1, length + 1)) / length
    return elbo, sums, per_pos


@pytest.fixture(scope="module", params=["dream", "llada"])
def tiny(request):
    """A tiny random model of each family (Dream: shifted logits; LLaDA: unshifted), peaked enough that log p
    differs a lot between positions and masks."""
    return random_model(tiny_hf_config(request.param, vocab_size=32), seed=3, sharpen=6.0)


def test_elbo_estimator_expectation_is_the_exact_elbo(tiny):
    prompt, target = [5, 9, 12, 4], [7, 3, 20]
    exact, sums, per_pos = _exact_elbo(tiny, prompt, target)
    subsets = list(sums)
    masks = torch.tensor([[j in s for j in range(3)] for s in subsets])  # every mask, one row each
    logp = masked_logprobs(tiny, prompt, target, masks)  # one batched forward
    for r, s in enumerate(subsets):  # the right logit for each family, zero where unmasked
        want = [per_pos[s, j] if j in s else 0.0 for j in range(3)]
        assert logp[r].tolist() == pytest.approx(want, rel=1e-5, abs=1e-4)
    terms = elbo_terms(logp, masks)
    # the draw: l uniform in 1..L, then a uniform subset of size l -> P(S) = 1 / (L * C(L, |S|))
    weights = torch.tensor([1 / (3 * math.comb(3, len(s))) for s in subsets])
    assert float((weights * terms).sum()) == pytest.approx(exact, rel=1e-5)
    assert exact < -1.0  # not a vacuous check: the model is far from certain


@pytest.mark.parametrize("length", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("batch", [1, 2, 5, 8, 32])
def test_stratified_counts_are_uniform_per_row_and_spread(length, batch):
    by_k = torch.stack([mask_counts(k, length, batch) for k in range(1, length + 1)])  # [L, batch]
    assert by_k.min() >= 1 and by_k.max() <= length
    for i in range(batch):  # each row's count, over the uniform k, takes every value 1..L once: exactly uniform
        assert sorted(by_k[:, i].tolist()) == list(range(1, length + 1))
    for k in range(length):  # one batch spreads its counts: every value appears floor or ceil(batch / L) times
        seen = torch.bincount(by_k[k], minlength=length + 1)[1:]
        assert int(seen.max()) - int(seen.min()) <= 1 if batch >= length else int(seen.max()) == 1


def test_draw_masks_masks_the_drawn_count_uniformly():
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([draw_masks(3, 3, g) for _ in range(3000)])  # [9000, 3]
    counts = draws.sum(1)
    assert torch.bincount(counts, minlength=4)[1:].tolist() == [3000] * 3  # stratified: each size once per batch
    for size in (1, 2):  # every subset of a size equally likely (each ~1000 of 3000; 5 sigma is ~130)
        rows = draws[counts == size]
        freq = torch.unique(rows, dim=0, return_counts=True)[1]
        assert len(freq) == 3 and (freq - 1000).abs().max() < 130


def test_mc_estimate_converges_to_the_exact_elbo(tiny):
    prompt, target = [5, 9, 12, 4], [7, 3, 20]
    exact, sums, _ = _exact_elbo(tiny, prompt, target)
    terms = torch.tensor([3 / len(s) * v for s, v in sums.items()])
    weights = torch.tensor([1 / (3 * math.comb(3, len(s))) for s in sums])
    sd = float((weights * (terms - exact) ** 2).sum().sqrt())  # one sample's standard deviation
    n = 3072
    est = mc_loglikelihood(tiny, prompt, target, mc_num=n, batch_size=256, generator=torch.Generator().manual_seed(1))
    assert abs(est - exact) < 4 * sd / math.sqrt(n)  # seeded: deterministic; 4 sigma of plain (unstratified) MC
    again = mc_loglikelihood(tiny, prompt, target, mc_num=n, batch_size=256, generator=torch.Generator().manual_seed(1))
    assert again == est
    with pytest.raises(ValueError, match="mc_num=10 is not a multiple of batch_size=4"):
        mc_loglikelihood(tiny, prompt, target, mc_num=10, batch_size=4, generator=torch.Generator())


def test_greedy_check_is_llada_s_one_token_per_forward(tiny):
    prompt, length = [5, 9, 12, 4], 4
    seq = torch.tensor(prompt + [tiny.mask_token_id] * length)
    shift = 1 if tiny.logits_shift else 0
    open_pos = list(range(length))
    while open_pos:  # by hand: commit the most confident masked position's argmax, one per forward
        probs = tiny(seq[None])[0].float().softmax(-1)
        best = max(open_pos, key=lambda j: float(probs[4 + j - shift].max()))
        seq[4 + best] = int(probs[4 + best - shift].argmax())
        open_pos.remove(best)
    greedy = seq[4:].tolist()
    assert greedy_matches(tiny, prompt, greedy)
    for j in range(length):  # any other token anywhere: not greedy
        other = list(greedy)
        other[j] = (other[j] + 1) % (tiny.mask_token_id - 2)
        assert not greedy_matches(tiny, prompt, other)


@pytest.fixture(scope="module")
def ll_lm():
    return LopaFastLM(mc_num=8, seed=0, check_greedy=False)


def test_loglikelihood_on_the_embedded_model(ll_lm):
    p = arith.generate("test", 2, seed=0)
    reqs = [_ll(p[0].prompt, " " + p[0].solution), _ll(p[0].prompt, " " + p[1].solution), _ll("", p[0].prompt)]
    out = ll_lm.loglikelihood(reqs, disable_tqdm=True)
    assert out[0][0] > -3 and out[1][0] < -50  # the right worked solution is likely, another problem's is not
    assert ll_lm.loglikelihood(reqs[::-1], disable_tqdm=True) == out[::-1]  # seeded per request: order-free
    rolling = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(p[0].prompt,), idx=0)
    assert ll_lm.loglikelihood_rolling([rolling], disable_tqdm=True) == [out[2][0]]  # one window: prefix + text
    assert all(g is False for _, g in out)  # check_greedy=false
    ctx = lopa_fast.load_tokenizer(model_dir())(p[0].prompt + " " + p[0].solution.rsplit(" ", 1)[0])["input_ids"]
    answer = ll_lm.tok_encode(" " + str(p[0].answer), add_special_tokens=False)
    assert greedy_matches(ll_lm.model, ctx, answer)  # e.g. "... 5 + 9 = 14 . ####" -> "1 4"
    assert not greedy_matches(ll_lm.model, ctx, answer[::-1])


def test_loglikelihood_needs_a_diffusion_model():
    ar = LopaFastLM(pretrained=str(model_dir("ar-arith")))
    with pytest.raises(NotImplementedError, match="attention='causal'.*Supported on it: generate_until"):
        ar.loglikelihood([_ll("Tom has 7 pens .", " 7")])
    assert ar.loglikelihood([]) == []


MC_TASK = """task: arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_multiple_choice_task_through_simple_evaluate(ll_lm, tmp_path, monkeypatch):
    """lopa_fast.lm_eval.evaluate: lm_eval.simple_evaluate on the instance, results saved by lm-eval's tracker."""
    import datasets
    from lm_eval.tasks import TaskManager

    from lopa_fast.lm_eval import evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    probs = arith.generate("test", 4, seed=0)
    docs = [{"question": p.prompt, "choices": [q.solution for q in probs[:3]], "label": i}  # 3 choices: chance 1/3
            for i, p in enumerate(probs[:3])]
    docs.append({"question": probs[3].prompt, "choices": [probs[1].solution, probs[0].solution, probs[3].solution],
                 "label": 2})
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arith_mc.yaml").write_text(MC_TASK.format(data=data, cache=tmp_path / "hf"))
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    res = evaluate(ll_lm, ["arith_mc"], task_manager=tm, output_path=str(tmp_path / "out" / "mc.json"),
                   log_samples=True)
    assert res["results"]["arith_mc"]["acc,none"] == 1.0  # the right worked solution has a far higher ELBO
    assert res["lopa_fast"]["model_args"]["mc_num"] == 8 and res["lopa_fast"]["total"]["requests"] == 0
    (saved,) = (tmp_path / "out").glob("mc_*.json")  # where asked: a .json output path names the file
    date = saved.stem.split("_", 1)[1]
    assert json.loads(saved.read_text())["results"]["arith_mc"]["acc,none"] == 1.0
    samples = [json.loads(x) for x in (tmp_path / "out" / f"samples_arith_mc_{date}.jsonl").read_text().splitlines()]
    lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
    assert len(lls) == 4 and all(len(x) == 3 for x in lls)
    assert (tmp_path / "out" / f"lopa_fast_stats_{date}.json").is_file()


def test_simple_evaluate_by_name_fills_the_stats_and_runs_on_the_cpu_unasked(tmp_path, monkeypatch, recwarn):
    """Issue 35: `lm_eval.simple_evaluate(model="lopa_fast", ...)` by name records the totals in its result dict, and
    `python -m lopa_fast lm-eval` without --device runs on the CPU when CUDA is absent, without a 'cuda:0' warning."""
    import datasets
    import lm_eval
    from lm_eval.tasks import TaskManager

    from lopa_fast import lm_eval as lfe

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": QUESTIONS[0][0], "answer": QUESTIONS[0][1]}) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arith_tiny.yaml").write_text(TASK.format(data=data))
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    res = lm_eval.simple_evaluate(model="lopa_fast", model_args="strategy=lopa,block_size=8", tasks=["arith_tiny"],
                                  task_manager=tm, apply_chat_template=True)
    assert res["lopa_fast"] is not None and res["lopa_fast"]["total"]["requests"] == 1
    assert res["lopa_fast"]["total"]["forwards"] > 0 and res["config"]["lopa_fast"] == res["lopa_fast"]
    if torch.cuda.is_available():
        return
    recwarn.clear()
    assert lfe.main(["--model", "lopa_fast", "--model_args", "strategy=lopa,block_size=8", "--tasks", "arith_tiny",
                     "--include_path", str(tmp_path / "tasks"), "--apply_chat_template"]) == 0
    assert not [w for w in recwarn if "CUDA is not available" in str(w.message)]
    assert str(lfe.LopaFastLM.last._device) == "cpu"
