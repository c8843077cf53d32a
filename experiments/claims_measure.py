"""What a run's summary.json shows for each claim of experiments/claims.py.

``measure(summary, cfg)`` reads every measured number a rule judges and returns it as
an interval (a number is an interval of equal ends; a knee bound such as ">= 64" has an
open end) with its text and, for measurements on this machine's wall clock, the real
runs' run-to-run spread. It judges nothing: the rules and verdicts live in claims.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from experiments import paper_values as pv

KNEE_THRESHOLD = 0.5
INF = math.inf


@dataclass(frozen=True)
class Measured:
    """What a run shows for one rule: an interval [lo, hi] (equal ends for a number; a
    knee bound gives an open end), its text, and the run-to-run spread if repeated."""

    key: str
    where: str
    lo: float
    hi: float
    ours: str
    executor: str
    spread: float | None = None


def _sim(summary: dict[str, Any], name: str, cost_model: str) -> str:
    return f"{summary.get(name, {}).get('executor', 'simulated')} [{cost_model}]"


def parse_bound(text: str) -> tuple[float, float]:
    """A ratio as text -> the interval it proves: "2.5" -> (2.5, 2.5), ">= 7" -> (7, inf),
    "< 1.5" -> (0, 1.5); anything else ("unknown", "inf") proves nothing: (0, inf)."""
    m = re.fullmatch(r"\s*(>=|<)?\s*([0-9.]+)\s*", text or "")
    if not m:
        return (0.0, INF)
    x = float(m.group(2))
    return {None: (x, x), ">=": (x, INF), "<": (0.0, x)}[m.group(1)]


def _point(key, where, x, text, executor, spread=None) -> Measured:
    return Measured(key, where, float(x), float(x), text, executor, spread)


def measure(summary: dict[str, Any], cfg: Any) -> list[Measured]:
    """Every rule's measurement that this run's summary holds (see module docstring)."""
    cm = cfg.server.cost_model
    out: list[Measured] = []
    mw = summary.get("memory_waste")
    if mw and "paged" in mw:
        where = f"at {mw.get('setup', {}).get('rate', float('nan')):.3g} req/s"
        if "operating_point" in mw:
            where += " (paged knee at 0.5 s/token)"
        ex = _sim(summary, "memory_waste", cm)
        p = mw["paged"]
        out.append(
            _point(
                "fig2.paged",
                where,
                p["token_states_pct"],
                f"{p['token_states_pct']:.1f} ({p['token_of_allocated_pct']:.1f} % of"
                f" allocated, {p['free_pct']:.1f} % free)",
                ex,
            )
        )
        for k in ("orca_max", "orca_pow2", "orca_oracle"):
            if k in mw:
                v = mw[k]["token_states_pct"]
                out.append(_point(f"fig2.{k}", where, v, f"{v:.1f}", ex))
    tv = summary.get("throughput_vs_rate")
    if tv and "spread_1.0" in tv:
        e = tv["spread_1.0"].get(f"knee@{KNEE_THRESHOLD}", {})
        knees = e.get("text") or {k: f"{v}" for k, v in e.get("rates", {}).items()}
        for name in ("paged/orca_oracle", "paged/orca_max", "paged/ft_static"):
            other = name.split("/")[1]
            if other not in knees or "paged" not in knees:
                continue
            text = e.get("ratio_text", {}).get(name)
            if text is None:  # grid mode: a number (or inf: a knee under the grid)
                r = e.get("ratios", {}).get(name)
                text = "unknown" if r is None or math.isinf(r) else f"{r}"
            lo, hi = parse_bound(text)
            how = "searched" if tv.get("mode") == "search" else "grid"
            out.append(
                Measured(
                    f"fig12.{name}",
                    f"knees {knees['paged']} / {knees[other]} req/s ({how})",
                    lo,
                    hi,
                    text,
                    _sim(summary, "throughput_vs_rate", cm),
                )
            )
    br = summary.get("batched_requests", {})
    for load in ("sharegpt", "alpaca"):
        b = br.get(load)
        if not b:
            continue
        for k in ("orca_oracle", "orca_max"):
            out.append(
                _point(
                    f"fig13.{load}.paged/{k}",
                    f"at {b['rate']:.3g} req/s ({b['paged']:.2f} / {b[k]:.2f})",
                    b[f"paged/{k}"],
                    f"{b[f'paged/{k}']:.2f}",
                    _sim(summary, "batched_requests", cm),
                )
            )
    sh = summary.get("sharing", {})
    for mode in ("parallel", "beam"):
        for k, v in sh.get(mode, {}).items():
            if int(k) in pv.FIG15[mode]:
                out.append(
                    _point(
                        f"fig15.{mode}.{k}",
                        f"steady window ({sh['model']})",
                        v["steady_saved_pct"],
                        f"{v['steady_saved_pct']:.1f} (whole run {v['saved_pct']:.1f})",
                        "real",
                    )
                )
    bs = summary.get("block_size", {})
    for load in ("sharegpt", "alpaca"):
        if isinstance(bs.get(load), dict):
            v = bs[load]
            lat = ", ".join(f"{b}: {x:.4f}" for b, x in v["norm_latency"].items())
            out.append(
                _point(
                    f"fig18.{load}",
                    f"at {v['rate']:g} req/s (s/token {lat})",
                    v["best_block_size"],
                    str(v["best_block_size"]),
                    _sim(summary, "block_size", cm),
                )
            )
    pre = summary.get("preemption", {})
    if pre.get("recompute") and pre.get("swap"):
        ratio = {
            int(b): pre["swap"][b]["norm_latency"] / pre["recompute"][b]["norm_latency"]
            for b in pre["recompute"]
            if b in pre["swap"]
        }
        mid = {b: r for b, r in ratio.items() if 16 <= b <= 64}
        ex = _sim(summary, "preemption", cm)
        if mid:
            txt = ", ".join(f"{b}: {r:.3f}" for b, r in mid.items())
            out.append(
                Measured(
                    "fig19.comparable",
                    f"block sizes {sorted(mid)}",
                    min(mid.values()),
                    max(mid.values()),
                    txt,
                    ex,
                )
            )
        small = min(ratio)
        if small <= 8:
            out.append(
                _point(
                    "fig19.small_blocks",
                    f"block size {small}",
                    ratio[small],
                    f"{ratio[small]:.3f}",
                    ex,
                )
            )
    cb = summary.get("chatbot", {}).get(f"knee@{KNEE_THRESHOLD}")
    if cb:
        for name, text in cb["ratio_text"].items():
            other = name.split("/")[1]
            lo, hi = parse_bound(text)
            out.append(Measured("fig17.paged/orca", f"vs {other} (knees {cb['text']['paged']}"
                                f" / {cb['text'][other]} req/s)", lo, hi, text,
                                _sim(summary, "chatbot", cm)))  # fmt: skip
    lo = summary.get("lora", {})
    for st in ("S1", "S2"):
        per = lo.get("rank_sets", {}).get(st, {})
        if "unified_2000_over_5" in per:
            u = per["unified"]
            r = per["unified_2000_over_5"]
            out.append(_point(
                f"lora.{st}.2000/5",
                f"{lo['setup']['model']} on {lo['setup']['gpu']}, ranks {per['ranks']}"
                f" ({u['2000']['requests_per_s']:.2f} / {u['5']['requests_per_s']:.2f} req/s)",
                r, f"{r:.3f}", lo.get("executor", "simulated"),
            ))  # fmt: skip
    sv = summary.get("simulator_validation", {})
    for wname, w in sv.get("workloads", {}).items():
        key = "sim.in_sample" if w["in_sample"] else "sim.held_out"
        spread = w.get("real_spread_pct")
        sp = "unknown" if spread is None else f"{spread:.1f}"
        out.append(
            _point(
                key,
                f"{wname}, median of {w['repeats']}",
                w["median_error_pct"],
                f"{w['median_error_pct']:.1f} (real run-to-run spread {sp})",
                "real + simulated",
                spread,
            )
        )
    return out
