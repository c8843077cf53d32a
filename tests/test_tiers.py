"""tests/tiers.py names real tests: a renamed or deleted test must not leave a stale move
behind (it would silently stop moving anything, or move a new test of the old name)."""

import ast
import functools
from pathlib import Path

from tests.tiers import MOVES, START_FIRST, tier_of

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _names(path: Path) -> set[str]:
    """Module-level test functions and classes of a test module."""
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)} | {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def test_every_move_names_an_existing_test():
    wrong = []
    for key, (tier, why) in sorted(MOVES.items()):
        path, _, rest = key.partition("::")
        if tier not in ("tier2", "slow"):
            wrong.append(f"{key}: unknown tier {tier!r}")
        elif not why:
            wrong.append(f"{key}: say why it moved")
        elif not (ROOT / path).is_file():
            wrong.append(f"{key}: no such file")
        elif rest and rest.split("[")[0].split("::")[0] not in _names(ROOT / path):
            wrong.append(f"{key}: {path} has no {rest.split('[')[0]}")
    assert wrong == []


def test_the_most_specific_move_wins():
    key = "tests/test_model_parity.py::test_logits_match_transformers_fp32[mistral]"
    assert tier_of(key) == MOVES[key]
    assert tier_of("tests/test_model_parity.py::test_logits_match_transformers_fp32[llama]") is None
    assert tier_of("tests/kernels/test_bench.py::test_bench_tiny_interpret") == MOVES[
        "tests/kernels/test_bench.py"]
    # a prefix of a name is not a match
    assert tier_of("tests/test_engine.py::test_batched_greedy_equals_alone_x") is None


def test_modules_started_first_exist():
    assert [m for m in START_FIRST if not (ROOT / m).is_file()] == []
