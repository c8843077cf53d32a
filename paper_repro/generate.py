"""Regenerate paper_repro/README.md from a results directory of experiments/run.py.

    python paper_repro/generate.py --results results/opt13b-<timestamp> [--engine DIR]

One row per paper figure/table: the command, our number, the paper's, real or simulated.
Numbers are read from summary.json; nothing here is typed in by hand except the paper's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import paper_values as pv  # noqa: E402
from experiments.claims import (  # noqa: E402
    BY_KEY,
    claims,
    markdown_table,
    not_run,
    sanity_checks,
)
from experiments.claims_measure import KNEE_THRESHOLD  # noqa: E402


def _accepted(key: str) -> str:
    """The rule's accepted interval, as the claims table (the only acceptance) states it."""
    r = BY_KEY[key]
    hi = "inf" if r.hi == float("inf") else f"{r.hi:g}"
    spread = f" + spread (at most {r.spread_cap:g})" if r.spread_cap else ""
    return f"; accepted [{r.lo:g}, {hi}]{spread} (experiments/claims.py)"


def judge_again(s: dict, info: dict) -> tuple[list, list, list] | None:
    """The run judged by the current rule table (the same one run.py uses): claims,
    rules not run, sanity checks. None when the run's config cannot be loaded."""
    from experiments.config import ExperimentConfig
    from pagedjax.config import ConfigError, load_yaml

    try:
        cfg = load_yaml(ExperimentConfig, Path(info["config"]), info.get("overrides", []))
    except (KeyError, OSError, ConfigError):
        return None
    return claims(s, cfg), not_run(s, cfg), sanity_checks(s, cfg)


def rows(s: dict, cmd: str) -> list[tuple[str, str, str, str, str]]:
    out = []
    if "memory_waste" in s:
        m = s["memory_waste"]
        for k in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
            out.append(
                (
                    f"Fig. 2 token states, {k} (% of pool)",
                    cmd,
                    f"{m[k]['token_states_pct']:.1f}",
                    f"{pv.FIG2[k]['token_states_pct']}",
                    "simulated",
                )
            )
        out.append(
            (
                "Fig. 2 token states, paged (% of allocated memory; the claim is on the pool)",
                cmd,
                f"{m['paged']['token_of_allocated_pct']:.1f}",
                "96.3",
                "simulated",
            )
        )
    if "batched_requests" in s:
        br = s["batched_requests"]
        subs = [(br.get("cost_model", "roofline"), br)] + [
            (k[11:], v) for k, v in br.items() if k.startswith("cost_model=")
        ]
        for cm, sub in subs:
            for load, paper in pv.FIG13.items():
                if load not in sub:
                    continue
                b = sub[load]
                for k in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
                    out.append(
                        (
                            f"Fig. 13 batched requests, {load}, {k} [{cm}]",
                            cmd,
                            f"{b[k]:.2f}",
                            f"{paper[k]:.2f}",
                            "simulated",
                        )
                    )
                for k in ("orca_oracle", "orca_max"):
                    out.append(
                        (
                            f"Fig. 13 ratio paged/{k}, {load} [{cm}]",
                            cmd,
                            f"{b[f'paged/{k}']:.2f}",
                            f"{paper['paged'] / paper[k]:.2f}",
                            "simulated",
                        )
                    )
    if "throughput_vs_rate" in s:
        tv = s["throughput_vs_rate"]
        subs = [(tv.get("cost_model", "roofline"), tv)] + [
            (k[11:], v) for k, v in tv.items() if k.startswith("cost_model=")
        ]
        for cm, sub in subs:
            t = sub["spread_1.0"]
            for th in ("0.2", "0.5", "1.0"):
                e = t.get(f"knee@{th}")
                if not e:
                    continue
                # Searched knees carry text ("2.83", ">= 64"); grid knees are numbers.
                texts = e.get("text") or e["rates"]
                how = "searched" if "text" in e else "grid"
                knees = ", ".join(f"{k} {v}" for k, v in texts.items())
                out.append(
                    (
                        f"Fig. 12a knees (req/s, {how}) @ {th} s/token [{cm}]",
                        cmd,
                        knees,
                        "-",
                        "simulated",
                    )
                )
                for name, (lo, hi) in pv.FIG12_RATIO_RANGES.items():
                    ratio = e.get("ratio_text", {}).get(name, e["ratios"].get(name))
                    if ratio is not None:
                        acc = _accepted(f"fig12.{name}") if float(th) == KNEE_THRESHOLD else ""
                        out.append(
                            (
                                f"Fig. 12a knee ratio {name} @ {th} s/token [{cm}]",
                                cmd,
                                f"{ratio}",
                                f"{pv.format_ratio_range(lo, hi)}{acc}",
                                "simulated",
                            )
                        )
    if "block_size" in s:
        for k, v in s["block_size"].items():
            if isinstance(v, dict) and "best_block_size" in v:
                out.append(
                    (
                        f"Fig. 18b best block size, {k}",
                        cmd,
                        str(v["best_block_size"]),
                        pv.FIG18B,
                        "simulated",
                    )
                )
    if "preemption" in s:
        pre = s["preemption"]
        for mode in ("recompute", "swap"):
            p = pre.get(mode) or {}
            if not isinstance(p, dict) or not p:
                continue
            nl = ", ".join(f"{b}: {v['norm_latency']:.3f}" for b, v in p.items())
            out.append(
                (
                    f"Fig. 19b {mode} normalized latency (s/token) by block size",
                    cmd,
                    nl,
                    pv.FIG19B,
                    "simulated",
                )
            )
    if "ablations" in s and "status" not in s["ablations"]:
        ab = s["ablations"]
        for x, v in ab.items():
            if isinstance(v, dict):
                out.append(
                    (
                        f"ablation {x} @ {ab['rate']:.3g} req/s: s/token, batched, token %",
                        cmd,
                        f"{v['norm_latency_s_per_token']} / {v['avg_batched']} /"
                        f" {v['token_states_pct']}",
                        "- (not in the paper)",
                        "simulated",
                    )
                )
    if "chatbot" in s and "status" not in s["chatbot"]:
        e = s["chatbot"]["knee@0.5"]
        out.append(
            (
                "Fig. 17 chatbot knees @ 0.5 s/token (req/s)",
                cmd,
                ", ".join(f"{k} {v}" for k, v in e["text"].items()),
                "-",
                "simulated",
            )
        )
        if s["chatbot"].get("kv_footprint_ratio"):
            fp = s["chatbot"]["kv_footprint_ratio"]
            out.append(
                (
                    "Fig. 17 KV footprint ratio, equal pools (paged pool / Orca's usable"
                    f" pool: {s['chatbot'].get('orca_pool_factor', 1.0):.3f})",
                    cmd,
                    ", ".join(f"{k} {v:.2f}" for k, v in fp.items()),
                    "-",
                    "simulated",
                )
            )
    if "engine_throughput" in s:
        e = s["engine_throughput"]
        val = e.get("status") or ", ".join(
            f"{r} req/s: {m['throughput_tok_s']:.0f} tok/s" for r, m in e["rates"].items()
        )
        out.append(("engine throughput (scaled-down model, this CPU)", cmd, val, "-", "real"))
    if "sharing" in s:
        sh = s["sharing"]
        if "status" in sh:
            out.append(("Fig. 15 memory saved by sharing", cmd, sh["status"], "-", "real"))
        for mode, what in (("parallel", "parallel sampling n="), ("beam", "beam search width=")):
            for k, v in sh.get(mode, {}).items():
                paper = v["paper_pct"]
                out.append(
                    (
                        f"Fig. 15 memory saved, {what}{k} (steady; whole run)",
                        cmd,
                        f"{v['steady_saved_pct']:.1f}% ({v['saved_pct']:.1f}%)",
                        f"{paper:.2f}%" if paper is not None else "-",
                        f"real ({sh['model']}, Alpaca-like, this CPU)",
                    )
                )
    if "shared_prefix" in s:
        sp = s["shared_prefix"]
        if "status" in sp:
            out.append(("Fig. 16 shared prefix", cmd, sp["status"], "-", "real"))
        for key, r in sp.get("runs", {}).items():
            paper = r["paper_vllm_over_oracle"]
            out.append(
                (
                    f"Fig. 16 analogue {key}: prefill tokens saved by prefix caching",
                    cmd,
                    f"{r['prefill_saved_pct']:.1f}% (hit rate {r['on']['hit_rate']:.2f})",
                    "-",
                    f"real ({sp['model']}, this CPU)",
                )
            )
            out.append(
                (
                    f"Fig. 16 analogue {key}: throughput caching on / off",
                    cmd,
                    f"{r['throughput_on_over_off']:.2f}x",
                    f"vLLM / Orca (Oracle) {paper}x (a different comparison)" if paper else "-",
                    f"real ({sp['model']}, this CPU)",
                )
            )
    if "simulator_validation" in s and "workloads" in s["simulator_validation"]:
        for name, w in s["simulator_validation"]["workloads"].items():
            kind = "in sample" if w["in_sample"] else "held out"
            out.append(
                (
                    f"simulator vs real, {name} ({kind}): worst error over rates, median of"
                    f" {w['repeats']} (by repeat)",
                    cmd,
                    f"{w['median_error_pct']} % ({', '.join(map(str, w['error_pct_by_repeat']))})",
                    _accepted("sim.in_sample" if w["in_sample"] else "sim.held_out"),
                    "real + simulated",
                )
            )
    if "simulator_validation" in s:
        v = s["simulator_validation"]
        out.append(
            (
                "simulator vs real, max error % (norm. latency and tok/s, all rates)",
                cmd,
                v.get("status") or str(v["max_error_pct"]),
                "-",
                "real + simulated",
            )
        )
        for r, m in v.get("rates", {}).items():
            out.append(
                (
                    f"simulator vs real @ {r} req/s: norm. latency real / sim (s/token)",
                    cmd,
                    f"{m['real_norm_latency']:.4f} / {m['simulated_norm_latency']:.4f}"
                    f" (tok/s {m['real_tok_s']:.1f} / {m['simulated_tok_s']:.1f})",
                    "-",
                    "real + simulated",
                )
            )
    return out


def _cost_model(info: dict, summary: dict) -> str:
    """The step-time model of a run's simulated rows: run_info.json says it; older runs
    said it only in experiments that ran under several (their ``cost_model`` key)."""
    if "cost_model" in info:
        return info["cost_model"]
    for v in summary.values():
        if isinstance(v, dict) and "cost_model" in v:
            return v["cost_model"]
    return "roofline"  # the only model before cost models were named


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="+", required=True, help="results directories")
    ap.add_argument("--out", default=str(ROOT / "paper_repro" / "README.md"))
    ap.add_argument(
        "--machine",
        default=None,
        help="where the results were measured (default: this machine's CPU count and load)",
    )
    ap.add_argument("--note", action="append", default=[], help="extra line(s) for the header")
    a = ap.parse_args()
    table = []
    stamps = []
    claim_sections: list[str] = []
    seen: dict[str, int] = {}
    for d in a.results:
        d = Path(d)
        s = json.loads((d / "summary.json").read_text())
        info = (
            json.loads((d / "run_info.json").read_text()) if (d / "run_info.json").exists() else {}
        )
        cfg = Path(info.get("config", d.name)).name
        seen[cfg] = seen.get(cfg, 0) + 1
        again = f" (repeat {seen[cfg]}: {Path(d).name})" if seen[cfg] > 1 else ""
        sets = "".join(f" --set '{o}'" for o in info.get("overrides", []))
        cm = _cost_model(info, s)
        judged = judge_again(s, info)
        if judged is not None:
            rows_, skipped, checks = judged
            n_ok = sum(r["holds"] for r in rows_)
            claim_sections += [
                f"## Claims: `{cfg}`{again}",
                "",
                "Judged here by the rule table of experiments/claims.py (the only acceptance;"
                f" the run's own verdicts agree when the table is unchanged): {n_ok} of"
                f" {len(rows_)} measured claims hold.",
                "",
                markdown_table(rows_),
                "Not run in this config: "
                + ("; ".join(f"{x['key']} ({x['reason']})" for x in skipped) or "none")
                + ".",
                "",
                "Sanity checks (identities of the policies, not evidence): "
                + ", ".join(f"{c['check']}: {'ok' if c['holds'] else 'BROKEN'}" for c in checks)
                + ".",
                "",
            ]
        table += [
            (f"{fig} [{cm}]" if kind == "simulated" and "[" not in fig else fig, *rest, kind)
            for fig, *rest, kind in rows(
                s, f"`python experiments/run.py --config {cfg}{sets}`{again}"
            )
        ]
        secs = info.get("seconds", {}).get("total")
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime((d / "summary.json").stat().st_mtime))
        stamps.append(f"- `{cfg}`: {d.name}, finished {when} UTC, run time {secs} s")
    machine = a.machine or (
        f"{platform.machine()} Linux, {os.cpu_count()} CPU cores (shared with other jobs,"
        f" load average {os.getloadavg()[0]:.1f} at generation), no GPU"
    )
    lines = [
        "# Paper reproduction table",
        "",
        "Generated by `python paper_repro/generate.py --results DIR ...` from the",
        "summary.json files of `experiments/run.py`; do not edit by hand. Simulated rows come",
        "from the jitted simulator with an A100-40GB cost model named in brackets (no GPU was",
        "used); see",
        "docs/experiments.md for the setup, definitions and why numbers differ from the paper.",
        "Cost models: [roofline] = A100-40GB roofline with default efficiencies; [vllm2023] =",
        "the roofline calibrated to 2023 vLLM from an independent anchor (not Fig. 12/13),",
        "with vLLM 0.1.2's host cost per sequence measured on its own code (a lower bound).",
        "",
        f"Machine: {machine}.",
        *stamps,
        *a.note,
        "",
        "| figure / table | command | ours | paper | real or simulated |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a_} | {b} | {c} | {d_} | {e} |" for a_, b, c, d_, e in table]
    if claim_sections:
        lines += ["", *claim_sections]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out} ({len(table)} rows)")


if __name__ == "__main__":
    main()
