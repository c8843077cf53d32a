"""One report per run: report.md and report.html in the run directory.

Contents: the claims table (experiments/claims.py), every experiment's table and figure,
the executor of each number (simulated with its cost model, or real), the resolved
config, the machine (CPU, load, accelerator), software versions and the run's times.
Written from the same summary that summary.json holds; nothing is typed in.

The HTML is the Markdown rendered by markdown-it-py (a dependency of flax's rich, listed
in pyproject.toml); figures are referenced by file name, so the directory is
self-contained.
"""

from __future__ import annotations

import dataclasses
import html
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from experiments.claims import markdown_table

ROOT = Path(__file__).resolve().parents[1]


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    """CPU, load, accelerator and versions: what the numbers were measured on."""
    import jax
    import numpy as np

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    devices = [f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()]
    return {
        "host": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "jax_devices": devices,
        "versions": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "numpy": np.__version__,
            "pagedjax_commit": _git_commit(),
        },
    }


def _executor_of(name: str, summary: dict[str, Any], info: dict[str, Any]) -> str:
    ex = summary.get("executor", info.get("executor", "?"))
    if str(ex).startswith("simulated"):
        return f"simulated, cost model {summary.get('cost_model', info.get('cost_model'))}"
    return str(ex)


def write_report(
    out: Path,
    cfg: Any,
    summary: dict[str, Any],
    info: dict[str, Any],
    tables: list[tuple[str, list[tuple[str, str, str]]]],
    claims: list[dict[str, Any]],
) -> Path:
    """Write report.md and report.html into ``out``; returns the HTML's path."""
    alloc = getattr(cfg, "time_allocation_s", {})  # configs may state none
    md = [
        f"# Run report: {cfg.name}",
        "",
        f"`python experiments/run.py --config {Path(info['config']).name}"
        + "".join(f" --set '{o}'" for o in info.get("overrides", []))
        + "`",
        "",
        f"Finished {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; wall time"
        f" {info['seconds'].get('total')} s, user CPU {info.get('user_cpu_s')} s, load average"
        f" {info.get('load_average_at_start')} at start (1 / 5 / 15 min; other jobs inflate"
        " wall times);"
        f" executor: {info['executor']} ({info['executor_reason']}).",
        "",
        "## Claims",
        "",
        "One rule table for every config (experiments/claims.py: the paper's value,"
        " the accepted interval and why), judged on this run's summary.json. A knee"
        " bound that does not decide a rule fails it.",
        "",
        markdown_table(claims),
        "Not run in this config: "
        + (
            "; ".join(f"{x['key']} ({x['reason']})" for x in summary.get("claims_not_run", []))
            or "none"
        )
        + ".",
        "",
        "Sanity checks (identities of the policies: checks of the code, not evidence): "
        + (
            ", ".join(
                f"{c['check']}: {'ok' if c['holds'] else 'BROKEN'}"
                for c in summary.get("sanity_checks", [])
            )
            or "none"
        )
        + ".",
        "",
        "Time per part (s, took / allocated on an idle box): "
        + ", ".join(
            f"{k} {v}" + (f" / {a:g}" if (a := alloc.get(k)) else "")
            for k, v in info["seconds"].items()
        )
        + (
            f"; total allocated {sum(alloc.values()):g}"
            if alloc
            else ""
        )
        + f" (load average at start {info.get('load_average_at_start')}).",
        "",
        "## Results by experiment",
        "",
    ]
    for name, rows in tables:
        s = summary.get(name, {})
        md += [
            f"### {name}",
            "",
            f"Executor: {_executor_of(name, s, info)}; {info['seconds'].get(name)} s.",
            "",
        ]
        if rows:
            md += ["| metric | ours | paper |", "|---|---|---|"]
            md += [f"| {m} | {o} | {p} |" for m, o, p in rows]
            md.append("")
        png = out / f"{name}.png"
        if png.exists():
            md += [f"![{name}]({png.name})", ""]
        csv = out / f"{name}.csv"
        if csv.exists():
            md += [f"Data: [{csv.name}]({csv.name}).", ""]
    m = info.get("machine", {})
    md += [
        "## Machine and versions",
        "",
        "```",
        yaml.safe_dump(m, sort_keys=False).rstrip(),
        "```",
        "",
        "## Config (resolved, after --set overrides)",
        "",
        "```yaml",
        yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False).rstrip(),
        "```",
        "",
    ]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    path = out / "report.html"
    path.write_text(_html(text, f"Run report: {cfg.name}"))
    return path


def _html(markdown: str, title: str) -> str:
    try:
        from markdown_it import MarkdownIt

        body = MarkdownIt("commonmark").enable("table").render(markdown)
    except ImportError:  # still a readable page without the renderer
        body = f"<pre>{html.escape(markdown)}</pre>"
    style = (
        "body{font-family:sans-serif;max-width:72em;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;"
        "font-size:90%}img{max-width:100%}pre{background:#f6f6f6;padding:.5em}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{style}</style></head><body>\n{body}</body></html>\n"
    )
