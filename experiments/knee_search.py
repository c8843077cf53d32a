"""Knee search: the highest request rate whose latency stays under a threshold, found by
bracketing and bisection on the rate instead of read off a fixed grid.

Contract. ``find_knees(probe, thresholds, ...)`` calls ``probe(rates)`` (a list of request
rates, req/s) and expects one mean normalized latency (s/token) per rate. The latency is
assumed to rise with the rate (the experiments use common random numbers: every rate
replays the same requests on a rescaled arrival pattern, so the curve is close to
monotone). For each threshold it returns a ``Knee``:

- bracketed: ``lo`` (highest probed rate with latency <= threshold below ``hi``) and
  ``hi`` (lowest probed rate with latency > threshold), refined until
  ``hi / lo <= 1 + resolution``; the knee is reported as ``lo`` (a rate actually
  measured to meet the threshold), so it is at most ``resolution`` below the true
  crossing of the probed curve.
- unbracketed: the search reached ``rate_max`` with the latency still under the
  threshold (``bound = ">="``: the knee is at least ``lo``) or ``rate_min`` still above
  it (``bound = "<"``: the knee is below ``hi``). Such a knee is a bound, and a ratio
  with it is a bound too (``ratio_text``), never a number.

Cost. Probes are what cost (each is a whole simulated trace). Bracketing moves by
``growth`` per probe from ``start``; bisection is geometric (the rate axis is read on a
log scale) and halves log(hi / lo) per probe, so a bracket of ratio 2 needs
ceil(log2(ln 2 / ln(1 + resolution))) probes: 5 at 3 %. All unresolved thresholds
propose their midpoint in the same round, so one ``probe`` call gets up to
``len(thresholds)`` rates: a caller that can run several traces at once batches them.
Rates already probed are never probed again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Knee:
    """The knee of one latency curve at one threshold (req/s).

    lo: highest probed rate with latency <= threshold below ``hi`` (None: none found).
    hi: lowest probed rate with latency > threshold (None: none found).
    bound: "" when bracketed; ">=" (knee >= lo, never exceeded up to rate_max) or "<"
        (knee < hi, exceeded down to rate_min).
    """

    threshold: float
    lo: float | None
    hi: float | None
    bound: str = ""

    @property
    def bracketed(self) -> bool:
        return self.bound == ""

    @property
    def rate(self) -> float | None:
        """The knee as a number when bracketed (the measured ``lo``), else None."""
        return self.lo if self.bracketed else None

    def text(self) -> str:
        """'2.83' when bracketed, '>= 16' or '< 0.25' when a bound."""
        if self.bound == ">=":
            return f">= {self.lo:.3g}"
        if self.bound == "<":
            return f"< {self.hi:.3g}"
        return f"{self.lo:.3g}"

    def to_json(self) -> dict[str, object]:
        return {
            "threshold": self.threshold,
            "knee": self.rate,
            "text": self.text(),
            "bracket": [self.lo, self.hi],
            "bound": self.bound,
        }


def ratio_text(num: Knee, den: Knee) -> tuple[float | None, str]:
    """(ratio, text) of two knees. A number only when both are bracketed; otherwise the
    bound that the probes prove (e.g. ">= 4.1" when the numerator never exceeded the
    threshold), or "unknown" when they prove nothing."""
    if num.bracketed and den.bracketed:
        r = num.lo / den.lo
        return r, f"{r:.2f}"
    # Lower bound: numerator >= num.lo, denominator < den.hi.
    if num.lo is not None and den.hi is not None and (num.bound in ("", ">=")):
        if den.bound in ("", "<") and den.hi > 0:
            return None, f">= {num.lo / den.hi:.2f}"
    if num.hi is not None and den.lo is not None and num.bound in ("", "<"):
        if den.bound in ("", ">="):
            return None, f"< {num.hi / den.lo:.2f}"
    return None, "unknown"


@dataclass
class KneeSearch:
    """The outcome: the knees per threshold and every probed (rate, latency)."""

    knees: dict[float, Knee]
    probes: list[tuple[float, float]] = field(default_factory=list)
    rounds: int = 0

    def curve(self) -> tuple[list[float], list[float]]:
        """The probed points sorted by rate."""
        pts = sorted(self.probes)
        return [r for r, _ in pts], [v for _, v in pts]


def _knee_from(points: dict[float, float], th: float) -> tuple[float | None, float | None]:
    """(lo, hi) of a threshold from the probes: hi = lowest rate above it, lo = highest
    rate under it below hi (a noisy dip past hi does not count)."""
    over = [r for r, v in points.items() if not v <= th]  # NaN counts as over
    hi = min(over) if over else None
    under = [r for r, v in points.items() if v <= th and (hi is None or r < hi)]
    lo = max(under) if under else None
    return lo, hi


def find_knees(
    probe: Callable[[list[float]], Sequence[float]],
    thresholds: Sequence[float],
    *,
    start: float,
    rate_min: float,
    rate_max: float,
    resolution: float = 0.03,
    growth: float = 2.0,
    max_rounds: int = 40,
) -> KneeSearch:
    """Bracket then bisect the knee of every threshold (see the module docstring).

    start: the first rate probed; rate_min / rate_max: the search never leaves
    [rate_min, rate_max]; growth: the bracketing step factor (> 1); resolution: stop when
    hi / lo <= 1 + resolution (> 0); max_rounds: a safety cap on probe calls.
    """
    if not thresholds:
        raise ValueError("thresholds must not be empty")
    if not 0 < rate_min <= start <= rate_max:
        raise ValueError(
            f"need 0 < rate_min <= start <= rate_max, got {rate_min}, {start}, {rate_max}"
        )
    if not growth > 1:
        raise ValueError(f"growth must be > 1, got {growth}")
    if not resolution > 0:
        raise ValueError(f"resolution must be > 0, got {resolution}")
    ths = sorted(set(float(t) for t in thresholds))
    points: dict[float, float] = {}
    rounds = 0

    def run(rates: list[float]) -> int:
        nonlocal rounds
        new = sorted({round(r, 6) for r in rates} - set(points))
        if not new:
            return 0
        vals = list(probe(new))
        if len(vals) != len(new):
            raise ValueError(f"probe returned {len(vals)} values for {len(new)} rates")
        points.update(zip(new, (float(v) for v in vals), strict=True))
        rounds += 1
        return len(new)

    run([start])
    while rounds < max_rounds:
        proposals = []
        for th in ths:
            lo, hi = _knee_from(points, th)
            if hi is None:  # never exceeded: go up (unless at the cap)
                top = max(points)
                if top < rate_max:
                    proposals.append(min(top * growth, rate_max))
            elif lo is None:  # exceeded everywhere probed: go down
                bottom = min(points)
                if bottom > rate_min:
                    proposals.append(max(bottom / growth, rate_min))
            elif hi / lo > 1 + resolution:
                proposals.append(math.sqrt(lo * hi))
        if not proposals or not run(proposals):  # nothing left, or only repeats
            break
    knees = {}
    for th in ths:
        lo, hi = _knee_from(points, th)
        bound = ">=" if hi is None else "<" if lo is None else ""
        knees[th] = Knee(th, lo, hi, bound)
    return KneeSearch(knees, sorted(points.items()), rounds)
