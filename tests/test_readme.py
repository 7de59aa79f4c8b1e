"""The README's quick start, run verbatim: its Python block loads a Dream checkpoint with a D2F LoRA adapter,
tokenises a chat prompt and decodes with LoPA. Here the two placeholder paths (and nothing else) are replaced by a
tiny Dream checkpoint and a PEFT LoRA adapter written in the real layout (config.json + model.safetensors +
tokenizer files; adapter_config.json + adapter_model.safetensors). And the prompts the README and docs/ send to the
embedded model: the curl request, run as the server runs it, and every task prompt they quote, each answered right."""
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

import lopa_fast
from lopa_fast import tasks
from lopa_fast.assets import model_dir
from lopa_fast.models import save_checkpoint
from lopa_fast.testing import random_model, tiny_hf_config

README = Path(__file__).resolve().parents[1] / "README.md"
BASE_PLACEHOLDER = "path/to/Dream-v0-Instruct-7B"
LORA_PLACEHOLDER = "path/to/D2F_Dream_Instruct_7B_Lora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def quick_start_block() -> str:
    """The ```python block of the README's "Quick start on your own checkpoint" section."""
    text = README.read_text()
    section = text[text.index("## Quick start on your own checkpoint"):]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the quick start section holds one Python block"
    return blocks[0]


def write_tiny_dream(d: Path) -> None:
    """A tiny Dream checkpoint whose ids match the embedded tokenizer (65 tokens; eos/pad 0, mask 1, bos 2)."""
    hf = tiny_hf_config("dream", vocab_size=65, mask_token_id=1, eos_token_id=0, pad_token_id=0, bos_token_id=2,
                        max_position_embeddings=512)
    save_checkpoint(random_model(hf, seed=3, sharpen=8), d, hf)  # peaked: multi-token rounds, lookahead wins
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the embedded model's tokenizer (same vocabulary)
        shutil.copy(Path(model_dir()) / name, d / name)


def write_lora(d: Path, base: Path) -> None:
    """A PEFT LoRA adapter for `base` in D2F's layout (every attention and MLP projection)."""
    model = lopa_fast.load_model(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, mod in model.named_modules():
        if name.split(".")[-1] in TARGETS:
            out_f, in_f = mod.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = 0.1 * torch.randn(4, in_f, generator=g)
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.1 * torch.randn(out_f, 4, generator=g)
    d.mkdir()
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
        "target_modules": TARGETS, "use_rslora": False, "base_model_name_or_path": "Dream-org/Dream-v0-Instruct-7B"}))


def test_readme_quick_start_runs_verbatim(tmp_path, capsys):
    code = quick_start_block()
    for needle in ("lopa_fast.load_model(", "lora=", "lopa_fast.load_tokenizer(", "lopa_fast.generate(",
                   'strategy="lopa"'):
        assert needle in code, needle
    base, lora = tmp_path / "Dream-v0-Instruct-7B", tmp_path / "D2F_Dream_Instruct_7B_Lora"
    write_tiny_dream(base)
    write_lora(lora, base)
    assert code.count(BASE_PLACEHOLDER) == 1 and code.count(LORA_PLACEHOLDER) == 1
    code = code.replace(BASE_PLACEHOLDER, str(base)).replace(LORA_PLACEHOLDER, str(lora))  # the only change

    ns: dict = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), ns)

    out, model = ns["out"], ns["model"]
    st = out.stats
    assert st["strategy"] == "lopa" and st["max_new_tokens"] == 256
    assert st["finish_reason"] in ("stop", "length") and 1 <= st["forwards"] < 256 and st["lookahead_wins"] > 0
    assert len(out.generated_ids) == 256
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"{st['finish_reason']} {st['tpf']} {st['forwards']}"
    assert model.dtype == torch.float32  # load_model default on CPU (bfloat16 on CUDA)
    plain = lopa_fast.load_model(base, dtype=model.dtype, device=model.device)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[q], plain.state_dict()[q])  # the adapter was merged


# ---- the prompts README.md and docs/ send to the embedded model: each one it answers --------------------------------
DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]
# a word problem in the embedded task's phrasing, as the docs quote it
TASK_PROMPT = re.compile(r'"((?:[A-Z][a-z]+) has \d+ [^"]*?\?(?: Answer :)?)"')
FIRST_TEST_PROBLEM = tasks.generate("test", 1, seed=0)[0]
# the answer of every task prompt quoted in the docs (a new one needs its answer here)
ANSWERS = {
    FIRST_TEST_PROBLEM.prompt: FIRST_TEST_PROBLEM.answer,
    "Tom has 7 pens . He buys 4 bags with 6 pens in each . He gives away 5 pens . How many pens does Tom have now ? "
    "Answer :": 26,  # 7 + 4 * 6 - 5
}


def docs_task_prompts() -> dict[str, list[str]]:
    """{prompt with its " Answer :" (what the embedded chat template appends): the docs quoting it}."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for p in TASK_PROMPT.findall(doc.read_text()):
            full = p if p.endswith(" Answer :") else p + " Answer :"
            found.setdefault(full, []).append(doc.name)
    return found


def test_readme_curl_prompt_is_answered(capsys):
    """The README's curl request, run as `serve` runs it on the embedded model (its preset lopa-k4, then the body's
    knobs) through `generate`: the task's first held-out problem, answered right with LoPA k=4."""
    import json as _json

    from lopa_fast import cli

    text = README.read_text()
    body = _json.loads(re.search(r"curl -s localhost:8000/v1/completions .*?-d '(\{.*?\})'", text, re.S).group(1))
    prompt = body.pop("prompt")
    assert prompt == FIRST_TEST_PROBLEM.prompt  # tasks.generate("test", 1, seed=0)[0].prompt
    argv = ["generate", "-q", "--json", "--prompt", prompt, "--preset", cli.EMBEDDED_PRESET]
    for knob, value in body.items():  # the body's knobs override the server's defaults
        argv += [f"--{knob.replace('_', '-')}", str(value)]
    assert cli.main(argv) == 0
    out = _json.loads(capsys.readouterr().out)
    assert tasks.extract_answer(out["text"]) == FIRST_TEST_PROBLEM.answer, out["text"]
    assert out["stats"]["strategy"] == "lopa" and out["stats"]["finish_reason"] == "stop"


def test_docs_task_prompts_are_answered():
    """Every task prompt README.md and docs/*.md send to the embedded model (d2f-arith) is one it answers right."""
    from lopa_fast import cli
    from lopa_fast.tasks.evaluate import answer_text

    found = docs_task_prompts()
    assert FIRST_TEST_PROBLEM.prompt in found and len(found) >= 2, found
    unknown = {p: docs for p, docs in found.items() if p not in ANSWERS}
    assert not unknown, f"task prompts in the docs without their answer in ANSWERS: {unknown}"
    model, tok = lopa_fast.load_model(model_dir()), lopa_fast.load_tokenizer(model_dir())
    knobs = cli.preset_knobs(cli.EMBEDDED_PRESET)  # what `generate` / `serve` run on the embedded model
    for prompt, docs in found.items():
        out = lopa_fast.generate(model, tok(prompt)["input_ids"], **knobs)
        text = answer_text(tok, out.generated_ids)
        assert tasks.extract_answer(text) == ANSWERS[prompt], (docs, prompt, text)


# ---- the README's streaming block and offline lm-eval recipe, verbatim on the embedded model (issue 42) -------------
def section_blocks(title: str, lang: str) -> list[str]:
    """The ```lang blocks of the README section `## title`."""
    text = README.read_text()
    section = text[text.index(f"## {title}\n"):]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def test_readme_streaming_block_runs_verbatim(capsys):
    (code,) = section_blocks("Streaming", "python")
    assert "lopa_fast.stream(" in code and "model_dir()" in code
    ns: dict = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), ns)
    s = ns["s"]
    printed = capsys.readouterr().out
    assert s.text in printed and tasks.extract_answer(s.text) == 26, printed  # 7 + 4 * 6 - 5
    assert printed.splitlines()[-1] == f"{s.result.stats['tpf']} {s.result.stats['finish_reason']}"
    assert s.result.stats["strategy"] == "lopa" and s.result.stats["max_new_tokens"] == 32  # the model's own length


def test_readme_offline_lm_eval_recipe_runs_verbatim(tmp_path):
    """The lm-eval section's offline recipe (the second ```bash block), run by bash in an empty directory with this
    interpreter first on PATH: it scores every problem right (it scored 0 when the chat template doubled the
    `Answer :` cue)."""
    import os
    import subprocess
    import sys

    blocks = section_blocks("lm-evaluation-harness", "bash")
    recipe = next(b for b in blocks if "arith_tiny.yaml" in b)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (results,) = (tmp_path / "my_tasks" / "results").rglob("results_*.json")
    res = json.loads(results.read_text())["results"]["arith_tiny"]
    assert res["exact_match,answer"] == 1.0, res
    # a data file that is not where the YAML says: one line naming the working directory, exit 2
    (tmp_path / "my_tasks" / "data.jsonl").unlink()
    last = recipe.strip().splitlines()
    cmd = "cd my_tasks && " + "\n".join(last[last.index(next(x for x in last if x.startswith("HF_DATASETS"))):])
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    errors = [x for x in r.stderr.splitlines() if "error" in x.lower()]
    assert r.returncode == 2 and len(errors) == 1 and "working directory" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
