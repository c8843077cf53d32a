"""Device state has one owner: only ``DeviceState``'s own methods assign its fields.

``DeviceState`` (pagedjax/engine/device_state.py) holds the scheduler state, the KV pool,
the token buffer and the host swap pool; the model programs take them donated, so a
caller that kept an old reference would hold a deleted buffer. Every change therefore
goes through a method of it (``run_program``, ``run_loop``, ``with_tokens``,
``schedule``, ``update``...). This test walks the AST of the package, the experiments and
the benchmarks and fails on an assignment to one of those fields of an object that is
the device state, written the ways the code names it: ``dev.<field>``,
``<anything>.device.<field>`` (``core.device.kv``, ``engine.device.state``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"state", "kv", "tokens", "host_kv"}
OWNER = ROOT / "pagedjax" / "engine" / "device_state.py"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, ast.Tuple | ast.List) else [t]
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _is_device(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id == "dev"
    return isinstance(expr, ast.Attribute) and expr.attr == "device"


def outside_assignments(root: Path = ROOT) -> list[str]:
    found = []
    for top in ("pagedjax", "experiments", "benchmarks", "examples"):
        for path in sorted((root / top).rglob("*.py")):
            if path == OWNER:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                for t in _targets(node):
                    if isinstance(t, ast.Starred):
                        t = t.value
                    if isinstance(t, ast.Attribute) and t.attr in FIELDS and _is_device(t.value):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(t)}")
    return found


def test_no_assignment_to_device_state_fields_outside_its_methods():
    assert outside_assignments() == []


def test_the_walk_finds_an_outside_assignment(tmp_path):
    """The check itself: a module that assigns the pool from outside is reported."""
    pkg = tmp_path / "pagedjax" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "device_state.py").write_text("class DeviceState:\n    def f(self): self.kv = 1\n")
    (pkg / "bad.py").write_text(
        "def step(core, dev):\n    dev.kv, dev.tokens = 1, 2\n    core.device.state = 3\n"
    )
    for top in ("experiments", "benchmarks", "examples"):
        (tmp_path / top).mkdir()
    got = outside_assignments(tmp_path)
    assert [g.split(": ")[1] for g in got] == ["dev.kv", "dev.tokens", "core.device.state"]
