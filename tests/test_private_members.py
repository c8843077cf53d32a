"""No module uses another module's private members (ast, no import).

A private member is a name with one leading underscore that some module of the walked
packages defines (a function, class, module variable, ``self._x`` attribute or class
field). Using one from another module (``obj._x``, ``from m import _x``) couples the two
files to each other's internals; the fix is a public method on the owner (the engine's
core: docs/architecture.md). NamedTuple's ``_replace``, ``_asdict``, ``_fields``,
``_make`` and dunders are public API. Third-party privates (e.g. jax's
``jitted._cache_size()``) are out of scope: no module here defines them.

The allow-list is empty and must stay so.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WALKED = ("pagedjax", "pallas_kernels", "experiments", "benchmarks", "examples")
PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
ALLOWED: set[tuple[str, str]] = set()  # (file relative to the repo, member): keep empty


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names this module defines: defs, classes, assigned names, arguments,
    class-body fields, and attributes stored on a method's first argument (self/cls)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in (n for n in ast.walk(cls) if isinstance(n, funcs)):
            if not fn.args.args:
                continue
            first = fn.args.args[0].arg
            for node in ast.walk(fn):
                stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                if stored and isinstance(node.value, ast.Name) and node.value.id == first:
                    names.add(node.attr)
    return {n for n in names if _private(n)}


def violations(root: Path = ROOT) -> list[str]:
    files = [p for top in WALKED for p in sorted((root / top).rglob("*.py"))]
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in files}
    own = {p: defined_privates(t) for p, t in trees.items()}
    everywhere = set().union(*own.values()) if own else set()
    bad = []
    for path, tree in trees.items():
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            used: list[str] = []
            if isinstance(node, ast.Attribute) and _private(node.attr):
                used = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                used = [a.name for a in node.names if _private(a.name)]
            for name in used:
                foreign = name in everywhere and name not in own[path]
                if (foreign or isinstance(node, ast.ImportFrom)) and (rel, name) not in ALLOWED:
                    bad.append(f"{rel}:{node.lineno}: {name}")
    return bad


def test_no_module_uses_another_modules_private_members():
    bad = violations()
    assert not bad, "private members used across modules:\n" + "\n".join(bad)
    assert not ALLOWED


def test_the_checker_finds_a_cross_module_private_use(tmp_path):
    pkg = tmp_path / "pagedjax"
    pkg.mkdir()
    (pkg / "owner.py").write_text(
        "class Engine:\n    def __init__(self):\n        self._queue = []\n"
        "def _helper():\n    return 1\n"
    )
    (pkg / "user.py").write_text(
        "from pagedjax.owner import _helper\n"
        "def f(engine):\n    t = engine._queue\n    return t._replace(a=1), engine.__dict__\n"
    )
    bad = violations(tmp_path)
    assert sorted(b.split(": ")[1] for b in bad) == ["_helper", "_queue"]
    assert all(b.startswith("pagedjax/user.py") for b in bad)
