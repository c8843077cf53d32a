"""Run the paper's experiments from a config and write CSV, PNG and summary.json.

    python experiments/run.py --config llama7b.yaml [--out DIR] [--set key=value ...]
    python experiments/run.py --list

A bare config name resolves under configs/. The whole config is validated (unknown keys
and bad values name the key) before any work starts. Results go to
``results/<config>-<timestamp>/`` unless --out is given: one CSV and PNG per experiment,
summary.json (experiment name -> its numbers) and run_info.json (executor, timings).
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` and `pagedjax` importable
    sys.path.insert(0, str(ROOT))

from experiments.compile_flags import skip_expensive_llvm_passes  # noqa: E402

skip_expensive_llvm_passes()  # before JAX starts its backend (compile_flags.py says why)

from experiments.config import EXPERIMENTS, ExperimentConfig  # noqa: E402
from pagedjax.config import ConfigError, load_yaml  # noqa: E402

CONFIG_DIR = ROOT / "configs"


def resolve_config(name: str) -> Path:
    """A path as given if it exists, else configs/NAME (adding .yaml if missing)."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"config not found: {name} (looked in {CONFIG_DIR})")


# Experiments that always run the real engine on a small model (no simulated variant).
REAL_ONLY = {"engine_throughput", "shared_prefix", "sharing"}


def resolve_executor(cfg: ExperimentConfig) -> tuple[str, str]:
    """(executor, reason). auto: real on a GPU, simulated on CPU (models too large)."""
    import jax

    platform = jax.default_backend()
    if cfg.executor != "auto":
        return cfg.executor, f"set in the config (device: {platform})"
    if platform == "gpu":
        return "real", "auto: a GPU is present"
    if set(cfg.experiments) <= REAL_ONLY:
        return (
            "real",
            f"auto: every experiment here runs the real engine on a small model ({platform})",
        )
    return "simulated", (
        f"auto: no GPU ({platform}); {cfg.server.model} at trace scale is too large for this"
        " machine, so trace experiments use the simulated executor"
    )


def _progress():
    try:
        from tqdm.auto import tqdm

        return tqdm
    except ImportError:  # tqdm is a dependency; keep running without bars if it is absent
        return lambda it, **_: it


def print_table(tables: list[tuple[str, list[tuple[str, str, str]]]]) -> None:
    w = max([len(r[0]) for _, rows in tables for r in rows] + [20])
    print(f"\n{'experiment':<22} {'metric':<{w}} {'ours':>12} {'paper':>10}")
    print("-" * (w + 48))
    for exp, rows in tables:
        for metric, ours, paper in rows:
            print(f"{exp:<22} {metric:<{w}} {ours:>12} {paper:>10}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a YAML file, or a name under configs/")
    ap.add_argument("--out", help="output directory (default results/<config>-<timestamp>/)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted path; value parsed as YAML)",
    )
    ap.add_argument("--list", action="store_true", help="list configs and experiments")
    a = ap.parse_args(argv)
    if a.list:
        print("configs:", ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))))
        print("experiments:", ", ".join(EXPERIMENTS))
        return 0
    if not a.config:
        ap.error("--config is required (or --list)")
    try:
        path = resolve_config(a.config)
        # The shorthand: --set kv_cache_dtype=fp8 is the server's kv_cache_dtype.
        sets = [f"server.{o}" if o.startswith("kv_cache_dtype=") else o for o in a.set]
        cfg = load_yaml(ExperimentConfig, path, sets)
        modules = {e: importlib.import_module(f"experiments.{e}") for e in cfg.experiments}
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import jax

    # Reruns (and the tests after a first run) reuse compiled simulators.
    # PAGEDJAX_JAX_CACHE points it elsewhere (an empty directory times a fresh machine).
    cache = os.environ.get("PAGEDJAX_JAX_CACHE") or str(ROOT / "results" / ".jax_cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else ROOT / "results" / f"{path.stem}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    executor, why = resolve_executor(cfg)
    print(f"config {path} -> {out}\nexecutor: {executor} ({why})")

    from experiments.common import dump_json

    progress = _progress()
    summary: dict[str, Any] = {}
    info: dict[str, Any] = {
        "config": str(path),
        "overrides": a.set,
        "executor": executor,
        "executor_reason": why,
        "cost_model": cfg.server.cost_model,  # of simulated rows, unless a row names another
        "seconds": {},
        # Other jobs on the machine inflate wall times: the load is part of each timing.
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    tables = []
    t_all = time.perf_counter()
    failed = []
    for name in progress(cfg.experiments, desc="experiments"):
        t0 = time.perf_counter()
        try:
            summary[name] = modules[name].run(cfg, out, progress, **_extra(modules[name], executor))
            tables.append((name, modules[name].table(summary[name])))
        except Exception as e:  # noqa: BLE001 - recorded, the other experiments still run
            import traceback

            traceback.print_exc()
            failed.append(name)
            summary[name] = {"status": f"failed: {type(e).__name__}: {e}"}
            tables.append((name, [("status", summary[name]["status"][:60], "")]))
        info["seconds"][name] = round(time.perf_counter() - t0, 1)
        dump_json(out / "summary.json", summary)  # written as we go: partial runs keep data
    info["seconds"]["total"] = round(time.perf_counter() - t_all, 1)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    info["user_cpu_s"] = round(ru.ru_utime, 1)
    info["system_cpu_s"] = round(ru.ru_stime, 1)
    from experiments.claims import claims, markdown_table, not_run, print_claims, sanity_checks
    from experiments.report import machine_info, write_report

    info["machine"] = machine_info()
    summary["claims"] = claims(summary, cfg)
    summary["claims_not_run"] = not_run(summary, cfg)
    summary["sanity_checks"] = sanity_checks(summary, cfg)
    (out / "claims.md").write_text(
        f"# Claims: {path.name}\n\nRules: experiments/claims.py (one table for every"
        " config).\n\n" + markdown_table(summary["claims"])
    )
    dump_json(out / "summary.json", summary)
    dump_json(out / "run_info.json", info)
    print_table(tables)
    print(
        f"\nwrote {out}/summary.json; times (s): {info['seconds']}; user CPU"
        f" {info['user_cpu_s']} s; load average at start {info['load_average_at_start']},"
        f" at end {info['machine']['load_average_1_5_15']}"
    )
    print_claims(summary["claims"], summary["claims_not_run"])
    report = write_report(out, cfg, summary, info, tables, summary["claims"])
    if failed:
        print(f"experiments that failed (see above and summary.json): {failed}", file=sys.stderr)
    print(f"\nreport: {report}")  # last line: the report's path
    return 1 if failed else 0


def _extra(module: Any, executor: str) -> dict[str, Any]:
    """Pass the resolved executor to experiments that take one."""
    import inspect

    return {"executor": executor} if "executor" in inspect.signature(module.run).parameters else {}


if __name__ == "__main__":
    sys.exit(main())
