"""Baselines that pagedjax is measured against (kept in the repo so they actually run)."""

from pagedjax.baselines.contiguous import ContiguousEngine, ContiguousRun

__all__ = ["ContiguousEngine", "ContiguousRun"]
