"""Counts test functions per test module (AST: no import, no collection), for
docs/testing.md's before/after table. A test function is a module-level or class-level
``def test_*`` (async too), and a module-level ``TestCase = SomeMachine.TestCase``
assignment (a hypothesis state machine) counts as one.

    python .ci/count_tests.py            # "module count" lines and a total
    python .ci/count_tests.py --markdown # the same as a markdown table
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tests"


def count(path: Path) -> int:
    tree = ast.parse(path.read_text())
    n = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            n += 1
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            n += sum(
                isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) and b.name.startswith("test")
                for b in node.body
            )
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.startswith("Test") for t in node.targets
        ):
            n += 1
    return n


def main() -> None:
    rows = [(str(p.relative_to(ROOT.parent)), count(p)) for p in sorted(ROOT.rglob("test_*.py"))]
    if "--markdown" in sys.argv:
        print("| module | test functions |\n|---|---:|")
        for name, n in rows:
            print(f"| {name} | {n} |")
        print(f"| **total** | **{sum(n for _, n in rows)}** |")
    else:
        for name, n in rows:
            print(f"{name} {n}")
        print(f"total {sum(n for _, n in rows)}")


if __name__ == "__main__":
    main()
