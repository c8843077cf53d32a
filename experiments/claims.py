"""The paper's claims, checked against a run: computed from summary.json, never typed in.

Each claim is a dict ``{claim, paper, ours, rule, holds, executor}``:
- ``rule``: the test, fixed in advance (issue 17) and printed beside the number;
- ``holds``: True / False, or None when the run did not measure it (experiment not in
  the config) or a knee could not be bracketed and the bound it gives decides nothing;
- ``executor``: "simulated" (and the cost model) or "real + simulated".

The rules (not tuned to any run):
- Fig. 2, at the operating point: paged token states >= 96 % of the KV memory it holds;
  Orca (Max, Pow2, Oracle) token states between 20 % and 40 % of the pool (the paper:
  20.4-38.2 %, i.e. 60-80 % waste);
- Fig. 12, knee ratio at 0.5 s/token: paged / Orca (Oracle) >= 1.7, paged / Orca (Max)
  >= 2.7, paged / FasterTransformer-like static >= 5 (the paper: up to 22x). A ratio with
  an unbracketed knee is a bound: it holds only if the bound alone proves the rule;
- Fig. 13, ShareGPT: Orca (Max) = floor(kv_slots / max_model_len) batched requests (7.00
  for the paper's 15,728 slots and 2048 tokens), paged / Orca (Oracle) >= 2.0 and paged /
  Orca (Max) >= 3.5;
- simulator validation (when run): worst error over rates <= 10 % in sample and <= 20 %
  on each held-out workload (median of the repeats).
"""

from __future__ import annotations

import math
import re
from typing import Any

from experiments import paper_values as pv

KNEE_THRESHOLD = 0.5


def _sim(summary: dict[str, Any], name: str, cost_model: str) -> str:
    return f"{summary.get(name, {}).get('executor', 'simulated')} [{cost_model}]"


def _bound_holds(text: str, minimum: float) -> bool | None:
    """A ratio given as text: a number or a bound (">= x", "< x")."""
    m = re.fullmatch(r"\s*(>=|<)?\s*([0-9.]+)\s*", text or "")
    if not m:
        return None
    op, x = m.group(1), float(m.group(2))
    if op is None or op == ">=":
        return x >= minimum if op is None else (True if x >= minimum else None)
    return False if x <= minimum else None  # "< x" with x <= minimum disproves it


def claims(summary: dict[str, Any], cfg: Any) -> list[dict[str, Any]]:
    """The claims table of one run (see the module docstring)."""
    cm = cfg.server.cost_model
    out: list[dict[str, Any]] = []
    mw = summary.get("memory_waste")
    if mw:
        setup = mw.get("setup", {})
        where = f"at {setup.get('rate', float('nan')):.3g} req/s"
        if "operating_point" in mw:
            where += " (paged knee at 0.5 s/token)"
        v = mw["paged"]["token_of_allocated_pct"]
        out.append(
            dict(
                claim=f"Fig. 2: paged token states, % of the KV memory it holds, {where}",
                paper=f"{pv.FIG2['paged']['token_states_pct']}",
                ours=f"{v:.1f} ({mw['paged']['token_states_pct']:.1f} % of the pool,"
                f" {mw['paged']['free_pct']:.1f} % free)",
                rule=">= 96",
                holds=bool(v >= 96.0),
                executor=_sim(summary, "memory_waste", cm),
            )
        )
        for k in ("orca_max", "orca_pow2", "orca_oracle"):
            if k not in mw:
                continue
            v = mw[k]["token_states_pct"]
            out.append(
                dict(
                    claim=f"Fig. 2: {k} token states, % of the pool, {where}",
                    paper=f"{pv.FIG2[k]['token_states_pct']}",
                    ours=f"{v:.1f}",
                    rule="20 <= x <= 40",
                    holds=bool(20.0 <= v <= 40.0),
                    executor=_sim(summary, "memory_waste", cm),
                )
            )
    tv = summary.get("throughput_vs_rate")
    if tv:
        e = tv["spread_1.0"].get(f"knee@{KNEE_THRESHOLD}", {})
        knees = e.get("text") or {k: f"{v}" for k, v in e.get("rates", {}).items()}
        for name, minimum, paper in (
            ("paged/orca_oracle", 1.7, "1.7-2.7x"),
            ("paged/orca_max", 2.7, "2.7-8x"),
            ("paged/ft_static", 5.0, "up to 22x"),
        ):
            other = name.split("/")[1]
            if other not in knees or "paged" not in knees:
                continue
            text = e.get("ratio_text", {}).get(name)
            if text is None:  # grid mode: a ratio limited by the grid's step
                r = e["ratios"].get(name)
                text = "unknown" if r is None or math.isinf(r) else f"{r}"
            out.append(
                dict(
                    claim=f"Fig. 12: knee ratio {name} at {KNEE_THRESHOLD} s/token"
                    f" (knees {knees['paged']} / {knees[other]} req/s)",
                    paper=paper,
                    ours=text,
                    rule=f">= {minimum:g}" + ("" if tv.get("mode") == "search" else " (grid)"),
                    holds=_bound_holds(text, minimum),
                    executor=_sim(summary, "throughput_vs_rate", cm),
                )
            )
    br = summary.get("batched_requests", {}).get("sharegpt")
    if br:
        slots, mlen = cfg.server.pool_slots, cfg.server.max_model_len
        full = slots // mlen
        where = f"ShareGPT at {br['rate']:.3g} req/s"
        out.append(
            dict(
                claim=f"Fig. 13: Orca (Max) batched requests, {where}",
                paper=f"{pv.FIG13['sharegpt']['orca_max']:.2f}",
                ours=f"{br['orca_max']:.2f}",
                rule=f"= {full:.2f} (floor of {slots} / {mlen})",
                holds=bool(round(br["orca_max"], 2) == full),
                executor=_sim(summary, "batched_requests", cm),
            )
        )
        for name, minimum in (("paged/orca_oracle", 2.0), ("paged/orca_max", 3.5)):
            paper = pv.FIG13["sharegpt"]
            other = name.split("/")[1]
            out.append(
                dict(
                    claim=f"Fig. 13: batched requests {name}, {where}"
                    f" ({br['paged']:.2f} / {br[other]:.2f})",
                    paper=f"{paper['paged'] / paper[other]:.2f}",
                    ours=f"{br[name]:.2f}",
                    rule=f">= {minimum:g}",
                    holds=bool(br[name] >= minimum),
                    executor=_sim(summary, "batched_requests", cm),
                )
            )
    sv = summary.get("simulator_validation")
    if sv and "workloads" in sv:
        for wname, w in sv["workloads"].items():
            limit = 10.0 if w["in_sample"] else 20.0
            kind = "in sample" if w["in_sample"] else "held out"
            out.append(
                dict(
                    claim=f"simulator vs real engine, {wname} ({kind}), worst error over rates,"
                    f" median of {w['repeats']}",
                    paper="-",
                    ours=f"{w['median_error_pct']:.1f} %",
                    rule=f"<= {limit:g} %",
                    holds=bool(w["median_error_pct"] <= limit),
                    executor="real + simulated",
                )
            )
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The claims as a Markdown table (holds: yes / NO / n/a)."""
    lines = [
        "| claim | paper | ours | rule | holds | executor |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['claim']} | {r['paper']} | {r['ours']} | {r['rule']} | {_word(r['holds'])}"
            f" | {r['executor']} |"
        )
    return "\n".join(lines) + "\n"


def _word(holds: bool | None) -> str:
    return "n/a" if holds is None else "yes" if holds else "NO"


def print_claims(rows: list[dict[str, Any]]) -> None:
    print("\nclaims (rules fixed in experiments/claims.py):")
    w = max([len(r["claim"]) for r in rows] + [10])
    for r in rows:
        print(
            f"  {_word(r['holds']):>4}  {r['claim']:<{w}}  ours {r['ours']:<18}"
            f" rule {r['rule']:<12} paper {r['paper']}"
        )
    n_ok = sum(r["holds"] is True for r in rows)
    print(f"  {n_ok} of {len(rows)} claims hold")
