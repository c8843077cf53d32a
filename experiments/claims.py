"""The paper's claims as one rule table, and their verdicts on a run (issue 34).

Contract: ``RULES`` is the only acceptance in the project. Every config's run
(``experiments/run.py``) and ``paper_repro/generate.py`` judge with it; nothing else
accepts or rejects a number. A rule is the paper's value (a number, or a range as its
two ends), numeric bounds ``lo`` / ``hi`` (two-sided wherever the paper gives a value)
and ``tolerance_why``: how far from the paper's value a reproduction may land and why
(how precisely the figure can be read, plus the simulator's validated error or the
part of the setup the paper does not publish). The tolerances were fixed in the commit
that added this table, before the runs that test it; changing one is a new commit
that says why.

``claims(summary, cfg)`` returns one row per rule the run measured, each with a
verdict (``holds`` True or False, never undecided: a knee bound that cannot prove a
rule fails it); ``not_run(summary, cfg)`` lists the rules the run did not measure and
why; ``sanity_checks(summary, cfg)`` holds identities of a policy (they cannot fail
unless the code is wrong, so they are not evidence for the paper and are kept apart).

Cost: pure dictionary reads, microseconds. Refusals: none; a malformed summary raises
KeyError naming the missing key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from experiments import paper_values as pv
from experiments.claims_measure import INF, Measured, measure


@dataclass(frozen=True)
class Rule:
    """One claim: the paper's value, the accepted interval [lo, hi], and why.

    ``spread_cap``: for claims measured on this machine's wall clock (the simulator's
    validation), the bound grows by the measured run-to-run spread of the real runs, at
    most by this many points (0: a fixed bound). Without repeats the spread is unknown
    and the bound does not grow.
    """

    key: str
    claim: str
    paper: float | tuple[float, float] | None
    lo: float
    hi: float
    tolerance_why: str
    experiment: str
    spread_cap: float = 0.0


# Relative tolerances, each a product of its parts (written out where used).
# Knee ratios: the search resolves each knee to 3 % (a ratio to ~6 %) and the simulator's
# validated step-time error is <= 10 % in sample; 1.06 x 1.10 = 1.166 -> 17 %.
KNEE_TOL = 0.17
# Memory shares: printed bar labels (0.05 points) and lengths drawn with the paper's
# means but an assumed spread (Fig. 11's std is not printed): the spread reruns at
# 0.75 / 1.25 moved Fig. 13's ratio by up to 14 % (opt13b, 2026-12-01: 2.24 / 2.46 vs
# 2.62); a token share of a reservation moves with the mean in-flight length -> 15 %.
SHARE_TOL = 0.15
# Fig. 13 ratios: the 14 % length-spread sensitivity above, plus 5 % for the operating
# point (the paper's 2 req/s on its A100 vs our paged knee at 0.5 s/token) -> 20 %.
FIG13_TOL = 0.20
# Fig. 15 savings (real engine, tiny random model): bar labels to 0.01 points, but the
# savings follow the prompt's share of a request's KV (synthetic Alpaca-like lengths)
# and, for beams, how fast beams diverge (a random model's logits, not OPT-13B's);
# neither is measured against the paper's setup, so the tolerance is an assumption: 30 %.
SHARING_TOL = 0.30
# S-LoRA's throughput ratios (Table 3, one run per point): the same S2 setting at 100
# adapters served 7.290 req/s in the 120-s table run and 7.742 in the 300-s Fig. 5 run,
# 6 % apart (paper_values.SLORA_S2_100_LONG_RUN); a ratio of two such runs is known to
# about that -> +-6 % of the value.
SLORA_TOL = 0.06


def _rel(key, claim, paper, tol, why, experiment, lo_floor=0.0, hi_ceil=INF) -> Rule:
    lo_p, hi_p = paper if isinstance(paper, tuple) else (paper, paper)
    lo = max(lo_floor, round(lo_p / (1 + tol), 3))
    hi = min(hi_ceil, round(hi_p * (1 + tol), 3))
    return Rule(key, claim, paper, lo, hi, why, experiment)


_F2 = pv.FIG2
_F13S, _F13A = pv.FIG13["sharegpt"], pv.FIG13["alpaca"]
_SH = (
    "bar label to 0.05 points; the share follows the mean in-flight length, which"
    " depends on the unpublished length spread (Fig. 13's ratio moved 14 % at spread"
    " 0.75 / 1.25): 15 % of the value"
)
_KN = (
    "knees resolved to 3 % each (ratio ~6 %) x the simulator's validated step-time"
    " error (<= 10 % in sample): the paper's range widened by 17 % at each end"
)
_13 = (
    "bar labels to 0.005; the unpublished length spread moved this ratio by up to 14 %"
    " (spread reruns 0.75 / 1.25) and the operating point may differ (paper: ShareGPT 2,"
    " Alpaca 30 req/s on its A100; ours: the config's rate or the paged knee): 20 % of"
    " the value"
)
_SL = (
    "S-LoRA's own run-to-run spread: its S2 setting at 100 adapters served 7.29 req/s in"
    " the 120-s table run and 7.74 in the 300-s Fig. 5 run (6 %); our rate is the"
    " server's capacity (all requests at once), S-LoRA's 10 req/s exceeded its ~8 req/s"
    " capacity, so both measure capacity: +-6 % of the value"
)
_15 = (
    "bar labels to 0.01 points (4-6 single-source); tiny random model and Alpaca-like"
    " synthetic lengths on the real engine: savings follow the prompt share and beam"
    " divergence, not validated against OPT-13B: an assumed 30 % of the value"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "fig2.paged",
        "Fig. 2: paged token states, % of the KV pool",
        _F2["paged"]["token_states_pct"],
        93.3,
        99.3,
        "printed 96.3 (0.05); the paper's denominator is the whole KV memory, so the"
        " share also counts free pool at the operating point, which the paper does not"
        " state: +-3 points (the paged waste floor is < 1 block per sequence, ~2 %)",
        "memory_waste",
    ),
    *(
        _rel(
            f"fig2.{k}",
            f"Fig. 2: {k} token states, % of the KV pool",
            _F2[k]["token_states_pct"],
            SHARE_TOL,
            _SH,
            "memory_waste",
        )
        for k in ("orca_max", "orca_pow2", "orca_oracle")
    ),
    _rel(
        "fig12.paged/orca_oracle",
        "Fig. 12: knee ratio paged / Orca (Oracle) at 0.5 s/token",
        pv.FIG12_RATIO_RANGES["paged/orca_oracle"],
        KNEE_TOL,
        _KN,
        "throughput_vs_rate",
    ),
    _rel(
        "fig12.paged/orca_max",
        "Fig. 12: knee ratio paged / Orca (Max) at 0.5 s/token",
        pv.FIG12_RATIO_RANGES["paged/orca_max"],
        KNEE_TOL,
        _KN,
        "throughput_vs_rate",
    ),
    _rel(
        "fig12.paged/ft_static",
        "Fig. 12: knee ratio paged / FasterTransformer-like static at 0.5 s/token",
        pv.FIG12_RATIO_RANGES["paged/ft_static"],
        KNEE_TOL,
        _KN + "; the lower end 2x is the abstract's 2-4x over FT and Orca, the upper"
        " end section 6.2's up to 22x",
        "throughput_vs_rate",
    ),
    *(
        _rel(
            f"fig13.{load}.paged/{k}",
            f"Fig. 13: batched requests paged / {k}, {load}",
            round(t["paged"] / t[k], 2),
            FIG13_TOL,
            _13,
            "batched_requests",
        )
        for load, t in (("sharegpt", _F13S), ("alpaca", _F13A))
        for k in ("orca_oracle", "orca_max")
    ),
    *(
        _rel(
            f"fig15.{mode}.{k}",
            f"Fig. 15: memory saved by sharing, {mode} {k} (%)",
            pv.FIG15[mode][k],
            SHARING_TOL,
            _15,
            "sharing",
        )
        for mode in ("parallel", "beam")
        for k in (2, 4, 6)
    ),
    *(
        Rule(
            f"fig16.prefix{n}",
            f"Fig. 16: throughput vLLM / Orca (Oracle), {n}-token shared prefix",
            r,
            round(r / (1 + KNEE_TOL), 3),
            round(r * (1 + KNEE_TOL), 3),
            _KN,
            "fig16",
        )
        for n, r in pv.FIG16.items()
    ),
    Rule(
        "fig17.paged/orca",
        "Fig. 17: chatbot request rate paged / each Orca variant",
        2.0,
        round(2.0 / (1 + KNEE_TOL), 3),
        round(2.0 * (1 + KNEE_TOL), 3),
        _KN,
        "chatbot",
    ),
    *(
        Rule(
            f"fig18.{load}",
            f"Fig. 18b: best block size, {load}",
            rng,
            rng[0],
            rng[1],
            "the paper's range as read from the curve (section 7.2); block sizes are powers"
            " of two, so no tolerance beyond the range: the best swept size must lie in it",
            "block_size",
        )
        for load, rng in (("sharegpt", (16.0, 128.0)), ("alpaca", (16.0, 32.0)))
    ),
    Rule(
        "fig19.comparable",
        "Fig. 19b: swap / recompute normalized latency, worst over block sizes 16-64",
        1.0,
        round(1 / 1.2, 3),
        1.2,
        "'comparable' (section 7.3), quantified by the paper's own 20 % (recompute within"
        " 20 % of swapping): either way at most 1.2x",
        "preemption",
    ),
    Rule(
        "fig19.small_blocks",
        "Fig. 19b: swap / recompute normalized latency at the smallest swept block size (<= 8)",
        None,
        1.0,
        INF,
        "one-sided: the paper gives no value, only that swapping is costlier at small"
        " blocks (many small copies); any ratio above 1 holds",
        "preemption",
    ),
    *(
        Rule(
            f"lora.{st}.2000/5",
            f"S-LoRA Table 3: throughput at 2,000 / 5 adapters, unified paging, {st}",
            round(pv.SLORA_TABLE3[st][2000] / pv.SLORA_TABLE3[st][5], 3),
            round(pv.SLORA_TABLE3[st][2000] / pv.SLORA_TABLE3[st][5] * (1 - SLORA_TOL), 3),
            round(pv.SLORA_TABLE3[st][2000] / pv.SLORA_TABLE3[st][5] * (1 + SLORA_TOL), 3),
            _SL,
            "lora",
        )
        for st in ("S1", "S2")
    ),
    Rule(
        "sim.in_sample",
        "simulator vs real engine, fit workload (in sample), worst error"
        " over rates (%), median over repeats",
        None,
        0.0,
        10.0,
        "no paper value; 10 % of normalized latency / throughput, plus the real runs'"
        " measured run-to-run spread (at most +5 points): an error within the real side's"
        " own noise cannot be resolved",
        "simulator_validation",
        spread_cap=5.0,
    ),
    Rule(
        "sim.held_out",
        "simulator vs real engine, each held-out workload, worst error"
        " over rates (%), median over repeats",
        None,
        0.0,
        20.0,
        "no paper value; 20 % (a profile extrapolated to other batch mixes), plus the"
        " measured run-to-run spread (at most +5 points)",
        "simulator_validation",
        spread_cap=5.0,
    ),
)
BY_KEY = {r.key: r for r in RULES}


def judge(rule: Rule, m: Measured) -> tuple[bool, str, float]:
    """(holds, verdict, the upper bound used). Holds only if everything the run shows
    lies in [lo, hi]; an interval that straddles a bound does not prove the claim."""
    hi = rule.hi + min(m.spread or 0.0, rule.spread_cap)
    if rule.lo <= m.lo and m.hi <= hi:
        return True, "holds", hi
    if m.hi < rule.lo or m.lo > hi:
        return False, "fails", hi
    return False, "fails (a bound that does not decide)", hi


def _fmt(x: float | tuple[float, float] | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, tuple):
        return f"{x[0]:g}-{x[1]:g}"
    return f"{x:g}"


def claims(summary: dict[str, Any], cfg: Any) -> list[dict[str, Any]]:
    """The claims table of one run: a row per measurement, each with a verdict."""
    rows = []
    for m in measure(summary, cfg):
        r = BY_KEY[m.key]
        holds, verdict, hi = judge(r, m)
        rows.append(dict(
            key=r.key, claim=f"{r.claim}, {m.where}",
            paper=list(r.paper) if isinstance(r.paper, tuple) else r.paper,
            lo=r.lo, hi=None if math.isinf(r.hi) else r.hi,
            bound_used=None if math.isinf(hi) else round(hi, 3),
            tolerance_why=r.tolerance_why, ours=m.ours, value=[m.lo, m.hi]
            if m.lo != m.hi else m.lo, spread=m.spread, holds=holds, verdict=verdict,
            executor=m.executor,
        ))  # fmt: skip
    return rows


def not_run(summary: dict[str, Any], cfg: Any) -> list[dict[str, str]]:
    """The rules this run did not measure, each with the reason."""
    seen = {m.key for m in measure(summary, cfg)}
    why = {
        "fig16": "no experiment compares vLLM with Orca (Oracle) on a shared prefix"
        " (shared_prefix measures prefix caching on / off on the real engine)",
    }
    out = []
    for r in RULES:
        if r.key in seen:
            continue
        if r.experiment in why:
            reason = why[r.experiment]
        elif r.experiment not in cfg.experiments:
            reason = f"{r.experiment} is not in this config's experiments"
        elif "status" in summary.get(r.experiment, {}):
            reason = summary[r.experiment]["status"]
        else:
            reason = "the run's settings do not cover it (e.g. a workload or size not swept)"
        out.append(dict(key=r.key, claim=r.claim, reason=reason))
    return out


def sanity_checks(summary: dict[str, Any], cfg: Any) -> list[dict[str, Any]]:
    """Identities of the policies and the accounting: they cannot fail unless the code
    is wrong, so they are checks of the code, not evidence for the paper."""
    out = []
    full = cfg.server.pool_slots // cfg.server.max_model_len
    for load, b in summary.get("batched_requests", {}).items():
        if isinstance(b, dict) and "orca_max" in b and load in pv.FIG13:
            out.append(dict(
                check=f"Fig. 13 Orca (Max) batched requests, {load} = floor({cfg.server.pool_slots}"
                f" / {cfg.server.max_model_len})", expected=float(full), ours=b["orca_max"],
                holds=bool(round(b["orca_max"], 2) == full),
            ))  # fmt: skip
    mw = summary.get("memory_waste", {})
    cats = ("token_states_pct", "reserved_pct", "internal_frag_pct", "external_frag_pct")
    # The image-chat variant (issue 37) is no claim, but the same accounting identity.
    for exp, label in (("memory_waste", "Fig. 2"), ("memory_waste_images", "Fig. 2 images")):
        part = summary.get(exp, {})
        for k in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
            if k in part and all(c in part[k] for c in cats):
                total = sum(part[k][c] for c in cats)
                out.append(
                    dict(
                        check=f"{label} {k}: categories sum to 100 %",
                        expected=100.0,
                        ours=round(total, 2),
                        holds=bool(abs(total - 100) <= 0.1),
                    )
                )
    if "external_only_pct" in mw.get("paged", {}):
        x = mw["paged"]["external_only_pct"]
        out.append(
            dict(
                check="Fig. 2 paged: no external fragmentation",
                expected=0.0,
                ours=x,
                holds=bool(abs(x) <= 0.01),
            )
        )
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The claims as a Markdown table."""
    lines = [
        "| claim | paper | ours | accepted | verdict | executor |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        hi = "inf" if r["bound_used"] is None else f"{r['bound_used']:g}"
        paper = _fmt(tuple(r["paper"]) if isinstance(r["paper"], list) else r["paper"])
        lines.append(
            f"| {r['claim']} | {paper} | {r['ours']} | [{r['lo']:g}, {hi}] |"
            f" {r['verdict']} | {r['executor']} |"
        )
    return "\n".join(lines) + "\n"


def rules_markdown() -> str:
    """The rule table itself: paper value, bounds and why (docs and reports)."""
    lines = ["| key | paper | lo | hi | tolerance, why |", "|---|---|---|---|---|"]
    for r in RULES:
        hi = "inf" if math.isinf(r.hi) else f"{r.hi:g}"
        extra = f" (+ spread, at most {r.spread_cap:g})" if r.spread_cap else ""
        lines.append(f"| {r.key} | {_fmt(r.paper)} | {r.lo:g} | {hi}{extra} | {r.tolerance_why} |")
    return "\n".join(lines) + "\n"


def print_claims(rows: list[dict[str, Any]], skipped: list[dict[str, str]] = ()) -> None:
    print("\nclaims (one rule table: experiments/claims.py):")
    w = max([len(r["claim"]) for r in rows] + [10])
    for r in rows:
        hi = "inf" if r["bound_used"] is None else f"{r['bound_used']:g}"
        paper = _fmt(tuple(r["paper"]) if isinstance(r["paper"], list) else r["paper"])
        word = "yes" if r["holds"] else "NO"
        print(
            f"  {word:>4}  {r['claim']:<{w}}  ours {r['ours']:<18}"
            f" accepted [{r['lo']:g}, {hi}] paper {paper}"
        )
    n_ok = sum(r["holds"] for r in rows)
    print(f"  {n_ok} of {len(rows)} measured claims hold; {len(skipped)} rules not run here")
