"""The strategy registry (lopa_fast.strategies): a strategy registered from this file alone runs through
`generate` (both backends), a list of prompts and the server without a line of lopa_fast changed; what it does not
implement is refused naming it; the package compares no strategy name outside the strategies' own places, and its
import graph (function-local imports included) has no cycle."""
import ast
import dataclasses
import pathlib
import time

import pytest
import torch

import lopa_fast
from lopa_fast import strategies
from lopa_fast.errors import KnobError
from lopa_fast.decode.compiled import CompiledRounds, compile_wanted
from lopa_fast.decode.compiled_batch import BatchStep
from lopa_fast.output import GenerateOutput, finalize_stats
from lopa_fast.testing import random_model, tiny_hf_config
from tests.utils import emulated_capture

PACKAGE = pathlib.Path(lopa_fast.__file__).parent


def _left_to_right(model, prompt, cfg, on_round=None, *, rows_only: bool):
    """Left to right, one token per forward: the first masked position takes the argmax of its logits row
    (Dream's shift: the row before it). rows_only: the LM head on the one needed row (the "fast" variant)."""
    t0 = time.perf_counter()
    P, n, mask = prompt.numel(), cfg.max_new_tokens, cfg.mask_token_id
    x = torch.cat([prompt, prompt.new_full((n,), mask)])
    shift = 1 if model.logits_shift else 0
    stats = {"forwards": 0, "model_calls": 0}
    for i in range(P, P + n):
        if rows_only:
            row = model.forward_window(x[None], rows=torch.tensor([i - shift]))[0]
        else:
            row = model(x[None])[0, i - shift]
        stats["forwards"] += 1
        stats["model_calls"] += 1
        x[i] = int(row.float().argmax())
        if on_round is not None:
            on_round(x[P : i + 1].tolist(), {"round": stats["forwards"], "forwards": stats["forwards"],
                                             "canvas": x[P:].tolist(), "mask_token_id": mask})
        if cfg.eos_token_id is not None and int(x[i]) == cfg.eos_token_id:
            x[i + 1 :] = cfg.eos_token_id  # Dream pads after EOS
            break
    ids = x[P:].tolist()
    finalize_stats(stats, ids, cfg.eos_token_id, mask, time.perf_counter() - t0, steps_plus_one=False)
    return GenerateOutput(ids, stats)


def ltr_reference(model, prompt, cfg, on_round=None):
    return _left_to_right(model, prompt, cfg, on_round, rows_only=False)


def ltr_fast(model, prompt, cfg, on_round=None):
    return _left_to_right(model, prompt, cfg, on_round, rows_only=True)


class LtrDriver:
    """The test strategy's fast path on the package's engine, from this file alone: a driver of the one loop
    (lopa_fast.decode.driver: lopa_fast.decode.batch steps one request or many, sharing one forward per step) and,
    with compile, its step as a batched step of the compile layer (`batch_step`: a compiled_batch.BatchStep,
    compiled or captured per key by CompiledRounds, which knows no strategy)."""

    mode = "full"

    def __init__(self, model, prompt, cfg, cache=None):
        from lopa_fast.ops import _backend

        c = model.config
        self.model, self.cfg, self.P = model, cfg, prompt.numel()
        self.x = torch.cat([prompt, prompt.new_full((cfg.max_new_tokens,), cfg.mask_token_id)])
        self.L, self.i = self.x.numel(), self.P
        self.shift = 1 if model.logits_shift else 0
        self.attn_backend = _backend.resolve("branch_attention", None, prompt.device)
        self.cache = cache or tuple(torch.zeros(c.num_layers, 1, c.num_kv_heads, c.head_dim) for _ in range(2))
        self.stats = {"forwards": 0, "model_calls": 0}
        self.done = False
        self.compiled = CompiledRounds.for_model(model, cfg) if compile_wanted(cfg, "cpu") else None
        self.view = self.compiled.view() if self.compiled is not None else None
        self.st = {"x": self.x, "i": torch.tensor(self.i)}  # the compiled step's state (its own tensors)

    def use_cache(self, k, v):
        self.cache = (k, v)

    def begin(self, on_round=None):
        self.on_round, self.t0 = on_round, time.perf_counter()

    def next_bucket(self):
        return None if self.done or self.i >= self.L else (self.i,)

    def prepare(self, i):
        return {"i": i, "tokens": self.x[None].clone(), "rows": torch.tensor([i - self.shift])}

    def forward_args(self, w):
        return dict(tokens=w["tokens"], start=0, cache_k=self.cache[0], cache_v=self.cache[1], prefix_len=0,
                    win_lens=torch.tensor([self.L]), bids=None, rows=w["rows"])

    def finish(self, w, logits, k_win=None, v_win=None):
        self.x[w["i"]] = logits[0].float().argmax()
        self._count()

    def _count(self):
        self.stats["forwards"] += 1
        self.stats["model_calls"] += 1

    def batch_step(self, i):
        """compile=True: the step over a state of tensors (x, i), keyed by the length."""
        if self.compiled is None:
            return None
        fa = self.forward_args({"tokens": self.x[None], "rows": torch.tensor([0])})
        shift = self.shift

        def pre(st, T):
            return dict(fa, tokens=st["x"][None], rows=(st["i"] - shift).reshape(1)), None

        def post(st, T, ctx, logits, k_win, v_win):
            x = st["x"].index_put((st["i"].reshape(1),), logits[0].float().argmax().reshape(1))
            return {"x": x, "i": st["i"] + 1}, {"tok": x[st["i"]]}

        return BatchStep(self.compiled, ("ltr", self.L), (self.L,), f"ltr_{self.L}", ("ltr", self.L), pre, post,
                         self.mode, self.attn_backend, self.st, {"L": torch.tensor(self.L)}, self.view)

    def take(self, st, info):
        self.x = st["x"]
        self._count()

    def read_head(self):
        self.last = int(self.x[self.i])  # the step's one host read

    def after_round(self):
        self.i += 1
        if self.on_round is not None:
            self.on_round(self.x[self.P : self.i].tolist(), {"round": self.stats["forwards"]})
        if self.cfg.eos_token_id is not None and self.last == self.cfg.eos_token_id:
            self.x[self.i :] = self.cfg.eos_token_id
            self.done = True

    def result(self):
        ids = self.x[self.P :].tolist()
        if self.compiled is not None:
            self.stats.update(self.compiled.stats(self.view))
        finalize_stats(self.stats, ids, self.cfg.eos_token_id, self.cfg.mask_token_id, time.perf_counter() - self.t0,
                       steps_plus_one=False)
        return GenerateOutput(ids, self.stats)


LTR = strategies.Strategy(name="ltr", summary="left to right, one token per forward (a test strategy)",
                          reference=ltr_reference, fast=ltr_fast)
# the same strategy on the engine: a driver of the one loop, the compile layer (registered by the tests that use it)
LTR_ENGINE = dataclasses.replace(LTR, fast=strategies.SOLO, driver=LtrDriver, compile=True, compile_batches=True)


@pytest.fixture
def ltr():
    strategies.register(LTR)
    try:
        yield LTR
    finally:
        strategies.unregister("ltr")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_hf_config("dream"), seed=3, sharpen=6)


def test_registered_strategy_runs_on_both_backends_and_in_a_batch(ltr, model):
    ids = [5, 9, 2, 7]
    ref = lopa_fast.generate(model, ids, "ltr", "reference", max_new_tokens=6)
    fast = lopa_fast.generate(model, ids, "ltr", "fast", max_new_tokens=6)
    auto = lopa_fast.generate(model, ids, strategy="ltr", max_new_tokens=6)
    assert ref.generated_ids == fast.generated_ids == auto.generated_ids
    assert (ref.stats["backend"], fast.stats["backend"], auto.stats["backend"]) == ("reference", "fast", "fast")
    assert ref.stats["strategy"] == "ltr" and 1 <= fast.stats["forwards"] <= 6
    outs = lopa_fast.generate(model, [ids, [3, 4]], "ltr", "fast", max_new_tokens=6)
    assert outs[0].generated_ids == fast.generated_ids
    assert outs[1].generated_ids == lopa_fast.generate(model, [3, 4], "ltr", "fast", max_new_tokens=6).generated_ids
    seen = []
    lopa_fast.generate(model, ids, "ltr", "fast", max_new_tokens=6, on_round=lambda p, i: seen.append(len(p)))
    assert seen and seen == sorted(seen)


def test_registered_strategy_batches_and_compiles_on_the_engine(model, monkeypatch):
    """The test strategy with a driver and a compiled step (all in this file): a list of prompts shares one forward
    per step (equal to solo runs and the reference), and compile=True runs its step through the compile layer (the
    CUDA-graph path, emulated on the CPU as tests/test_compiled_round.py does) with the same tokens, solo and
    batched."""
    strategies.register(LTR_ENGINE)
    try:
        ps = [[5, 9, 2, 7], [3, 4], [8, 1, 6]]
        ref = [lopa_fast.generate(model, p, "ltr", "reference", max_new_tokens=6) for p in ps]
        outs = lopa_fast.generate(model, ps, "ltr", "fast", max_new_tokens=6)
        assert [o.generated_ids for o in outs] == [r.generated_ids for r in ref]
        assert all(o.stats["batched"] == 3 for o in outs)

        monkeypatch.setattr(CompiledRounds, "capture", staticmethod(emulated_capture))
        cr = CompiledRounds.for_model(model)
        monkeypatch.setattr(cr, "emulate_graphs", True)
        first = lopa_fast.generate(model, ps[0], "ltr", "fast", max_new_tokens=6, compile=True)
        again = lopa_fast.generate(model, ps[0], "ltr", "fast", max_new_tokens=6, compile=True)
        assert first.generated_ids == again.generated_ids == ref[0].generated_ids
        assert first.stats["compiled_graphs"] == 1 and again.stats["compiled_graphs"] == 0  # captured once, replayed
        assert first.stats["compiled_buckets"] == [(10, "x1")]  # a solo request: batch bucket 1
        both = lopa_fast.generate(model, ps, "ltr", "fast", max_new_tokens=6, compile=True)
        assert [o.generated_ids for o in both] == [r.generated_ids for r in ref]
        assert all(o.stats["batched"] == 3 for o in both)
        for key in [k for k in cr.fns if k[0] == "batch" and k[2][0] == "ltr"]:
            del cr.fns[key]
        for key in [k for k in cr.workspaces if k[0] == "batch" and k[1][0] == "ltr"]:
            del cr.workspaces[key]
    finally:
        strategies.unregister("ltr")


def test_what_a_strategy_does_not_implement_is_refused_naming_it(ltr, model):
    with pytest.raises(KnobError, match="compile=True: strategy='ltr' has no compiled path"):
        lopa_fast.generate(model, [1, 2], "ltr", max_new_tokens=4, compile=True)
    with pytest.raises(KnobError, match="distributed=True covers strategy 'd2f', 'lopa'; got strategy='ltr'"):
        lopa_fast.generate(model, [1, 2], "ltr", max_new_tokens=4, distributed=True)
    with pytest.raises(ValueError, match="steps=4 does not apply to strategy='ltr'; it is a knob of vanilla / thresh"):
        lopa_fast.generate(model, [1, 2], "ltr", max_new_tokens=4, steps=4)
    with pytest.raises(ValueError, match="verifier= applies to strategy='apd'"):
        lopa_fast.generate(model, [1, 2], "ltr", max_new_tokens=4, verifier=model)
    strategies.register(dataclasses.replace(LTR, fast=None), replace=True)
    with pytest.raises(ValueError, match="backend='fast' does not cover strategy='ltr'"):
        lopa_fast.generate(model, [1, 2], "ltr", "fast", max_new_tokens=4)
    assert lopa_fast.generate(model, [1, 2], "ltr", max_new_tokens=4).stats["backend"] == "reference"


def test_registry_refuses_bad_specs_and_unknown_names():
    with pytest.raises(KnobError, match=r"strategy='nope'; allowed: 'vanilla', 'threshold', 'd2f', 'lopa', 'apd'"):
        lopa_fast.GenerateConfig(strategy="nope").validate()
    with pytest.raises(ValueError, match="already registered"):
        strategies.register(dataclasses.replace(LTR, name="lopa"))
    with pytest.raises(ValueError, match="an identifier"):
        strategies.register(dataclasses.replace(LTR, name="left to right"))
    assert strategies.names()[:5] == ("vanilla", "threshold", "d2f", "lopa", "apd")


def test_registered_strategy_is_served(ltr):
    """The server's request path (protocol -> worker -> stream -> generate) takes the registered strategy; a
    request that needs a second model (apd's verifier) on a server started without one is a 400 naming the knob that
    asks for it (apd_mixture_weight); apd's verifier-free baseline is served."""
    from fastapi.testclient import TestClient

    from lopa_fast.assets import model_dir
    from lopa_fast.server.app import create_app
    from lopa_fast.server.worker import Worker

    model = lopa_fast.load_model(model_dir(), dtype=torch.float32)
    tok = lopa_fast.load_tokenizer(model_dir())
    worker = Worker(model, tok, concurrency=2)
    try:
        with TestClient(create_app(worker, model_id="m", defaults={"max_new_tokens": 8})) as http:
            prompt = "Lily has 3 apples ."
            r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "strategy": "ltr"})
            assert r.status_code == 200, r.text
            ids = tok(prompt)["input_ids"]
            want = lopa_fast.generate(model, ids, "ltr", max_new_tokens=8)
            assert r.json()["usage"]["forwards"] == want.stats["forwards"]
            r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "strategy": "apd",
                                                   "apd_mixture_weight": 0.7})
            assert r.status_code == 400 and r.json()["error"]["param"] == "apd_mixture_weight", r.text
    finally:
        worker.close()


# ---- the package's structure ------------------------------------------------------------------------------------
def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def _imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """The lopa_fast modules `name` imports anywhere in its body (function-local imports included)."""
    def owner(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name if pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for t in targets:
            if t.startswith("lopa_fast.") and (o := owner(t)) not in (None, name, "lopa_fast"):
                found.add(o)
    return found | _dynamic_imports(name, path, mods)


def _dynamic_imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """The lopa_fast modules a module may import by name at run time (importlib.import_module / __import__): in a
    module that calls either, every string naming a package module is an edge, and an f-string starting with
    "lopa_fast.<package>." an edge to every module of that package (the lazy loaders' tables and patterns)."""
    tree = ast.parse(path.read_text(), str(path))
    calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
             for n in ast.walk(tree) if isinstance(n, ast.Call)}
    if not calls & {"import_module", "__import__"}:
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in mods:
            found.add(node.value)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            if prefix.startswith("lopa_fast.") and prefix.endswith("."):
                found |= {m for m in mods if m.startswith(prefix)}
    return found - {name, "lopa_fast"}


def test_the_cycle_walk_sees_importlib_imports():
    """Imports by name count as edges: the backend dispatch loads lopa_fast.ops.cuda through importlib, and the
    lazy packages load their modules from tables (a cycle through them was invisible before)."""
    mods = _modules()
    assert "lopa_fast.ops.cuda" in _imports("lopa_fast.ops._backend", mods["lopa_fast.ops._backend"], mods)
    assert {"lopa_fast.server.app", "lopa_fast.server.worker"} <= _imports("lopa_fast.server",
                                                                           mods["lopa_fast.server"], mods)
    assert {"lopa_fast.api", "lopa_fast.output.stream"} <= _imports("lopa_fast", mods["lopa_fast"], mods)


def _with_parents(name: str, targets: set[str], mods: dict) -> set[str]:
    """Importing a.b.c runs the packages a and a.b first: each target's parent packages are edges too, except the
    importer's own ancestors (already running when it imports)."""
    own = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
    out = set(targets)
    for t in targets:
        out |= {t.rsplit(".", i)[0] for i in range(1, t.count("."))}
    return (out - own - {"lopa_fast"}) & mods.keys()


def test_import_graph_has_no_cycle():
    """No cycle, function-local, importlib and parent-package imports included (lopa_fast.distributed importing
    strategies.lopa.distributed runs the strategies package, whose lopa spec imported lopa_fast.distributed back)."""
    mods = _modules()
    graph = {m: _with_parents(m, _imports(m, p, mods), mods) for m, p in mods.items()}
    state: dict = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert len(graph) > 50  # the walk saw the package


def _module_level_imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """The lopa_fast modules `name` imports when it is imported: its imports outside function bodies (a function's
    imports run when it is called)."""
    found, todo = set(), list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _imports(name, _OneStatement(node), mods)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


class _OneStatement:
    """One import statement in the shape `_imports` reads (a path whose text is that statement)."""

    def __init__(self, node):
        self.name, self._text = "statement.py", ast.unparse(node)

    def read_text(self):
        return self._text


def _is_oracle(m: str) -> bool:
    return m.startswith("lopa_fast.reference.") or (m.startswith("lopa_fast.strategies.")
                                                    and m.rpartition(".")[2].startswith("reference"))


def _is_spec(m: str) -> bool:
    """The strategy definitions both backends read: the registry, the package and folder __init__s, spec.py, knobs.py
    (its GenerateConfig fields), blocks.py (importing a strategy folder's reference imports the strategies package, which registers every spec)."""
    return m in ("lopa_fast.strategies", "lopa_fast.strategies.registry", "lopa_fast.strategies.blocks") or (
        m.startswith("lopa_fast.strategies.") and (m.count(".") == 2 or m.endswith((".spec", ".knobs"))))


def test_the_reference_decoders_import_nothing_of_the_fast_path():
    """The reference decoders are an independent oracle. The oracle is lopa_fast/reference/ (the shared helpers and
    the op references) and each strategy folder's reference*.py. No module an oracle module reaches, directly or
    through what it imports (function-local and importlib imports included, as the cycle walk sees them; importing
    a module imports its parent packages), is a lopa_fast.decode, lopa_fast.ops or lopa_fast.kernels module or a
    strategy folder's fast part (driver.py, step.py, round.py, ...). A strategy's spec (its knobs and checks, read by
    both backends) may be reached: from it the walk follows the imports that run on import only, since a spec loads
    its fast driver inside the function the fast backend calls (APD's pair checks: in its spec)."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    refs = sorted(m for m in mods if _is_oracle(m))
    assert {"lopa_fast.strategies.apd.reference", "lopa_fast.strategies.lopa.reference_lopa",
            "lopa_fast.strategies.lopa.reference_d2f", "lopa_fast.strategies.threshold.reference",
            "lopa_fast.strategies.vanilla.reference", "lopa_fast.reference.ops"} <= set(refs)

    def edges(m: str) -> set[str]:
        parents = {m.rsplit(".", i)[0] for i in range(1, m.count("."))} - {"lopa_fast"}
        own = _module_level_imports(m, mods[m], mods) if _is_spec(m) else graph[m]
        return (own | parents) & mods.keys()

    def fast(m: str) -> bool:
        return m.startswith(("lopa_fast.decode", "lopa_fast.ops", "lopa_fast.kernels")) or (
            m.startswith("lopa_fast.strategies.") and not _is_spec(m) and not _is_oracle(m))

    offenders = []
    for ref in refs:
        seen, todo = set(), [ref]
        while todo:
            for n in edges(todo.pop()) - seen:
                seen.add(n)
                todo.append(n)
        offenders += [f"{ref} -> {m}" for m in sorted(seen) if fast(m)]
    assert "lopa_fast.strategies.apd.spec" in graph["lopa_fast.strategies.apd.reference"]
    assert fast("lopa_fast.strategies.lopa.driver") and fast("lopa_fast.strategies.vanilla.step")
    assert not offenders, "\n".join(offenders)


def test_importing_the_oracle_loads_nothing_of_the_fast_path():
    """The same rule, run: a fresh interpreter imports every reference decoder and lopa_fast.reference.ops, and no
    fast-path module (decode, ops, kernels, a strategy's driver / step / round) is loaded."""
    code = ("import sys, lopa_fast.strategies as s\n"
            "import lopa_fast.reference.ops, lopa_fast.reference.common\n"
            "for n in s.names(): s.get(n).load('reference')\n"
            "bad = [m for m in sys.modules if m.startswith(('lopa_fast.decode', 'lopa_fast.ops', 'lopa_fast.kernels'))"
            " or (m.startswith('lopa_fast.strategies.') and m.rpartition('.')[2] in"
            " ('driver', 'step', 'round', 'round_stats', 'distributed'))]\n"
            "print(sorted(bad)); assert not bad\n")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_strategy_name_is_compared_outside_the_strategies():
    """`cfg.strategy == "lopa"` and the like live in lopa_fast/strategies/ (and the reference decoders, each one
    strategy's oracle) only: everything else asks the registry."""
    names = set(strategies.names())
    allowed = (PACKAGE / "strategies", PACKAGE / "reference")  # each strategy's folder, the oracle's shared parts
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if any(a in path.parents for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = set()
            for s in sides:
                if isinstance(s, ast.Constant) and isinstance(s.value, str):
                    consts.add(s.value)
                elif isinstance(s, (ast.Tuple, ast.List, ast.Set)):
                    consts |= {e.value for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            about_strategy = any("strategy" in ast.unparse(s) or "name" in ast.unparse(s) for s in sides)
            if consts & names and about_strategy:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)
