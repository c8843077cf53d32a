"""Imports run one way: the layer table below, checked on the import graph (ast, no import).

Every import statement counts, wherever it is: module level, inside a function, under
``if TYPE_CHECKING:``, and ``importlib.import_module("literal")``. A circle needed only
for type hints still means two modules share a concept that belongs in a third
(docs/architecture.md). Two rules:

1. A module may import a module of its own package (cycles aside) or of a package in a
   strictly lower layer; never one of a higher layer, nor another package of its own layer.
2. No import cycle among modules (a package's ``__init__`` counts as a module: a
   submodule importing a name from its own package's ``__init__``, which imports the
   submodule, is a cycle).

A new package gets a row here before its first merge; a package the table does not know
fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top first. Packages on one row may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("examples",),  # runnable ablation examples (README)
    ("experiments",),  # the paper's experiments (run.py)
    ("benchmarks",),  # scripts; experiments reuse some of their loops (sharing.py)
    ("pagedjax.tools",),  # tools over the engine (bench, EAGLE head training)
    ("pagedjax",),  # the top-level facade (__init__: lazy exports), gpu_check
    ("pagedjax.entrypoints", "pagedjax.eval"),  # LLM, async engine, OpenAI server; quality
    ("pagedjax.engine", "pagedjax.baselines"),  # the engine core; the contiguous-KV engine
    ("pagedjax.simulator",),  # trace simulation, cost models, the paper's named systems
    ("pagedjax.scheduler",),
    ("pagedjax.structured",),  # grammar backends for structured outputs (host masks)
    ("pagedjax.lora",),  # adapter requests, PEFT checkpoints, slot table (the delta op is model's)
    ("pagedjax.model", "pagedjax.sampling"),
    ("pagedjax.attention",),  # backends, KV write / copy
    ("pagedjax.memory",),
    ("pagedjax.native_build",),  # compiles the native CPU kernels (attention, matmul)
    ("pagedjax.workloads", "pagedjax.config", "pagedjax.tokenizer", "pagedjax.machine",
     "pagedjax.compile_cache"),  # fmt: skip
    ("pagedjax.gguf_file",),  # GGUF's header, metadata and tensor table (numpy only)
    ("pallas_kernels",),  # the leaf: imports nothing from pagedjax (pallas_kernels.triton too)
]
WALKED = ("pagedjax", "pallas_kernels", "experiments", "benchmarks", "examples")


def _rank() -> dict[str, int]:
    return {pkg: len(LAYERS) - i for i, row in enumerate(LAYERS) for pkg in row}


def package_of(module: str, ranks: dict[str, int]) -> str | None:
    """The longest layer-table entry that is ``module`` or a parent of it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in ranks:
            return name
    return None


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for top in WALKED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ``known`` that ``name`` (at ``path``) imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        # The deepest known module that target names (a.b.c where c is a function -> a.b).
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in known:
                found.add(cand)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                add(sub if sub in known else mod)
        elif isinstance(node, ast.Call):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    add(arg.value)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    ranks = _rank()
    bad = []
    for src, targets in sorted(graph.items()):
        p = package_of(src, ranks)
        if p is None:
            bad.append(f"{src}: its package has no row in LAYERS")
            continue
        for dst in sorted(targets):
            q = package_of(dst, ranks)
            if q is None or q == p:
                continue
            if ranks[q] >= ranks[p]:
                where = "the same layer" if ranks[q] == ranks[p] else "a higher layer"
                bad.append(f"{src} imports {dst} ({q}: {where} than {p})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_imports_follow_the_layers():
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layer table:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_pallas_kernels_imports_nothing_from_pagedjax():
    graph = import_graph()
    bad = [f"{m} -> {d}" for m, ds in graph.items() if m.startswith("pallas_kernels")
           for d in ds if d.split(".")[0] != "pallas_kernels"]  # fmt: skip
    assert not bad, bad


def test_the_checker_sees_what_it_must(tmp_path):
    """The checker itself: an upward import, a TYPE_CHECKING circle, a function-local and
    an importlib import are all found; the real tree gives it something to look at."""
    pkg = tmp_path / "pagedjax"
    for sub in ("memory", "engine", "scheduler"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "memory" / "pool.py").write_text("def f():\n    from pagedjax.engine import a\n")
    (pkg / "engine" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedjax.engine.b import X\n"
    )
    (pkg / "engine" / "b.py").write_text("from pagedjax.engine.a import Y\n")
    (pkg / "scheduler" / "s.py").write_text(
        "import importlib\nm = importlib.import_module('pagedjax.engine.b')\n"
    )
    graph = import_graph(tmp_path)
    assert "pagedjax.engine.a" in graph["pagedjax.memory.pool"]
    assert "pagedjax.engine.b" in graph["pagedjax.scheduler.s"]
    bad = layer_violations(graph)
    assert any(b.startswith("pagedjax.memory.pool imports") for b in bad)
    assert any(b.startswith("pagedjax.scheduler.s imports") for b in bad)
    assert ["pagedjax.engine.a", "pagedjax.engine.b"] in cycles(graph)
    real = import_graph()
    assert len(real) > 100 and "pagedjax.attention" in real["pagedjax.model.layers"]


def test_engine_files_stay_under_500_lines():
    """One concept per file: a reader holds one engine file at a time (issue 14)."""
    long = {p.name: n for p in sorted((ROOT / "pagedjax" / "engine").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}  # fmt: skip
    assert not long, long
