"""No class in pagedjax keeps a second name for one of its methods (issue 30: "no alias
attributes"; e.g. ``abort = abort_request``): one name per operation, so a reader, the
engine-client protocol and its implementations agree on what to call."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedjax

ROOT = Path(pagedjax.__file__).parent


def method_aliases(source: str) -> list[str]:
    """``Class.name = method`` assignments in a class body, as "Class.name = method"."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        methods = {n.name for n in cls.body if isinstance(n, defs)}
        for node in cls.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                if node.value.id in methods:
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                    found += [f"{cls.name}.{n} = {node.value.id}" for n in names]
    return found


def test_the_check_sees_an_alias():
    assert method_aliases("class C:\n    def f(self): ...\n    g = f\n") == ["C.g = f"]


def test_no_class_aliases_a_method():
    found = [
        f"{path.relative_to(ROOT.parent)}: {alias}"
        for path in sorted(ROOT.rglob("*.py"))
        for alias in method_aliases(path.read_text())
    ]
    assert not found, found
