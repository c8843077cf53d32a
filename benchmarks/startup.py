"""Start-up cost of pagedjax: cold and warm start, programs compiled, compile time vs depth.

    python benchmarks/startup.py [--out startup.json]        # issue 13's measurements
    python benchmarks/startup.py --quick                     # smoke run (tiny model)
    python benchmarks/startup.py --parts depth --depth-models llama-34m-8l llama-34m-32l

Every measurement runs in a fresh process (``out_of_box.run_child``); the clock starts when
the process is spawned, so interpreter start, imports and weight loading count.

Parts (``--parts``; default all four, ``--quick``: cold warm depth):

- ``cold``: for each model of ``--models`` (default ``llama-34m-8l``, issue 13's 8-layer
  random Llama, and ``smollm2-135m-shape``, SmolLM2-135M's 30-layer architecture with
  random weights), ``LLM(model=dir, dtype="float32", max_model_len=512, **ready_kwargs)``
  with an empty JAX compilation cache: seconds to ready, and every XLA compilation during
  construction by function name (count, total, mean, max). ``--ready-kwargs`` (JSON,
  default ``{"warmup": "all"}``: today that compiles every step program at start-up; pass
  ``{}`` once the default does) are the only keywords beyond the three above.
- ``warm``: the same again in a second process on the cache directory the cold run filled:
  seconds to ready, persistent-cache hits, compilations that still ran.
- ``depth``: the compile time of one step program at two depths (``--depth-models``,
  default ``llama-34m-8l`` and ``llama-34m-32l``, the same shape at 8 and 32 layers;
  random weights via ``load_format="dummy"``, ``warmup="none"``): one request (16-token
  prompt, 1 output token) after start-up; the longest compilation whose function name
  contains "step" is the step program. Reported: both times and their ratio (issue 13's
  target: <= 1.3).
- ``throughput``: issue 13's defaults-only run on ``llama-34m-8l``: ``LLM(model=dir,
  dtype="float32", max_model_len=512)``, a 4-request warm-up ``generate``, then 200
  ShareGPT-like requests (``out_of_box.make_requests``); start-up, the 200-request time,
  output tok/s and the compilations during that ``generate`` (target: 0).
  ``--throughput-also KWARGS_JSON`` adds a column with those ``LLM`` keywords (e.g.
  ``'{"warmup": "all"}'``, today's fully warmed engine) in the same run, side by side.

The children's JAX cache settings (``JAX_COMPILATION_CACHE_DIR`` pointing at a fresh
directory per model, ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``,
``JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0``, so that every program is kept) come from
the environment; ``--cache-env-var`` adds names of other variables to point at the same
directory (e.g. the engine's own, once it has one). Compilations are counted with
``jax.monitoring`` (XLA backend compilations, a persistent-cache retrieval included) and,
where the engine reports one, ``llm.llm_engine.stats()["compilations"]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import out_of_box  # noqa: E402  (the sibling module, also when run from elsewhere)

PARTS = ("cold", "warm", "depth", "throughput")
QUICK_ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16)  # few buckets: seconds


def cache_env(cache_dir: Path, extra_vars: list[str]) -> dict[str, str]:
    names = ("JAX_COMPILATION_CACHE_DIR", "PAGEDJAX_COMPILATION_CACHE", *extra_vars)
    env = {v: str(cache_dir) for v in names}
    env.update(
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return out_of_box.child_env(env)


def by_name(compiles: list[list]) -> list[tuple[str, int, float, float]]:
    """(function name, count, total s, max s), most total time first."""
    groups: dict[str, list[float]] = defaultdict(list)
    for name, sec in compiles:
        groups[name].append(sec)
    rows = [(n, len(s), sum(s), max(s)) for n, s in groups.items()]
    return sorted(rows, key=lambda r: -r[2])


def start_summary(res: dict[str, Any]) -> dict[str, Any]:
    comp = res["compiles"].get("construct", [])
    hits = res.get("cache", {}).get("construct", {}).get("cache_hits", 0)
    steps = [s for n, s in comp if "step" in n or "loop" in n]
    return dict(
        ready_s=res["t_constructed"] - res["t_spawn"],
        import_s=res["t_imported"] - res["t_spawn"],
        compilations=len(comp),
        compile_s=sum(s for _, s in comp),
        cache_hits=hits,
        step_programs=len(steps),
        step_compile_mean_s=sum(steps) / len(steps) if steps else None,
        engine_compilations=res.get("stats_constructed", {}).get("compilations"),
        jax_compilation_cache_dir=res.get("jax_compilation_cache_dir"),
        by_name=by_name(comp),
    )


def _f(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny models, small engine")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=None)
    ap.add_argument("--models", nargs="+", choices=sorted(out_of_box.MODELS), default=None)
    ap.add_argument("--depth-models", nargs=2, choices=sorted(out_of_box.MODELS), default=None)
    ap.add_argument(
        "--ready-kwargs",
        type=json.loads,
        default=None,
        help='LLM keywords of the cold/warm runs (JSON; default {"warmup": "all"})',
    )
    ap.add_argument(
        "--throughput-also",
        type=json.loads,
        action="append",
        default=[],
        help="LLM keywords (JSON) of another throughput column",
    )
    ap.add_argument("--num-requests", type=int, default=None, help="default 200 (quick: 8)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 512 (quick: 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cache-env-var",
        action="append",
        default=[],
        help="more variables to point at the fresh compilation cache",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="keep specs, logs, caches here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    q = args.quick
    parts = args.parts or (["cold", "warm", "depth"] if q else list(PARTS))
    models = args.models or (["tiny-llama-2l"] if q else ["llama-34m-8l", "smollm2-135m-shape"])
    depth_models = args.depth_models or (
        ["tiny-llama-2l", "tiny-llama-8l"] if q else ["llama-34m-8l", "llama-34m-32l"]
    )
    ready_kwargs = args.ready_kwargs if args.ready_kwargs is not None else {"warmup": "all"}
    if q:  # a smoke run: few buckets, so warmup="all" compiles a handful of programs
        ready_kwargs = {**QUICK_ENGINE, **ready_kwargs}
    max_len = args.max_model_len or (128 if q else 512)
    n_req = args.num_requests or (8 if q else 200)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="startup-"))
    work.mkdir(parents=True, exist_ok=True)
    load = lambda: " ".join(f"{x:.1f}" for x in os.getloadavg())  # noqa: E731
    print(
        f"{os.cpu_count()} cpus, load average {load()}; parts {' '.join(parts)}; work dir {work}",
        flush=True,
    )
    report: dict[str, Any] = dict(parts=parts, ready_kwargs=ready_kwargs, load_start=load())

    def child(label: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        print(f"  {label} ... ", end="", flush=True)
        res = out_of_box.run_child(
            sys.executable, dict(spec, side="pagedjax"), env, work, args.timeout, label
        )
        print(f"{res['wall_s']:.1f} s (load {load()})", flush=True)
        return res

    # ---- cold and warm start
    starts: dict[str, dict[str, Any]] = {}
    for name in models if {"cold", "warm"} & set(parts) else []:
        mdir = out_of_box.ensure_model(name, seed=args.seed)
        env = cache_env(work / f"jax_cache-{name}", args.cache_env_var)
        spec = dict(
            model=str(mdir),
            dtype="float32",
            max_model_len=max_len,
            llm_kwargs=ready_kwargs,
            phases=[],
        )
        for kind in ("cold", "warm"):
            if kind in parts:
                res = child(f"{kind}-{name}", spec, env)
                starts[f"{kind} {name}"] = start_summary(res)
    if starts:
        shown = ", ".join(f"{k}={v!r}" for k, v in ready_kwargs.items())
        print(f"\nstart-up to ready, LLM(..., {shown}):")
        print(
            "| run | ready (s) | imports (s) | XLA compilations | compile s | cache hits |"
            " step programs | mean s per step program | engine compilations |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for key, s in starts.items():
            print(
                f"| {key} | {_f(s['ready_s'])} | {_f(s['import_s'])} | {s['compilations']} |"
                f" {_f(s['compile_s'])} | {s['cache_hits']} | {s['step_programs']} |"
                f" {_f(s['step_compile_mean_s'], '.2f')} | {_f(s['engine_compilations'])} |"
            )
        for key, s in starts.items():
            top = ", ".join(f"{n} x{c} {t:.1f} s (max {m:.1f})" for n, c, t, m in s["by_name"][:6])
            print(f"  {key}: {top}")
        report["starts"] = starts

    # ---- compile time of one step program vs depth
    if "depth" in parts:
        depth: dict[str, Any] = {}
        for name in depth_models:
            mdir = out_of_box.ensure_model(name, weights=False, seed=args.seed)
            spec = dict(
                model=str(mdir),
                dtype="float32",
                max_model_len=max_len,
                llm_kwargs=dict(load_format="dummy", warmup="none"),
                phases=["probe"],
            )
            res = child(
                f"depth-{name}",
                spec,
                cache_env(work / f"jax_cache-depth-{name}", args.cache_env_var),
            )
            comp = res["compiles"].get("probe", [])
            steps = [(s, n) for n, s in comp if "step" in n] or [(s, n) for n, s in comp]
            sec, fun = max(steps) if steps else (None, None)
            layers = out_of_box.MODELS[name]["num_hidden_layers"]
            depth[name] = dict(
                layers=layers,
                step_compile_s=sec,
                function=fun,
                probe_compilations=len(comp),
                probe_compile_s=sum(s for _, s in comp),
            )
        a, b = (depth[n] for n in depth_models)
        ratio = (
            b["step_compile_s"] / a["step_compile_s"]
            if a["step_compile_s"] and b["step_compile_s"]
            else None
        )
        print("\ncompile time of one step program vs depth (first request's prefill step):")
        print(
            "| model | layers | step program compile (s) | function | compilations in the"
            " request | their total (s) |"
        )
        print("|---|---|---|---|---|---|")
        for name, d in depth.items():
            print(
                f"| {name} | {d['layers']} | {_f(d['step_compile_s'], '.2f')} | {d['function']} |"
                f" {d['probe_compilations']} | {_f(d['probe_compile_s'])} |"
            )
        print(f"ratio {b['layers']} / {a['layers']} layers: {_f(ratio, '.2f')} (target <= 1.3)")
        report["depth"] = dict(models=depth, ratio=ratio)

    # ---- the defaults-only throughput run of issue 13's table
    if "throughput" in parts:
        name = "tiny-llama-2l" if q else "llama-34m-8l"
        mdir = out_of_box.ensure_model(name, seed=args.seed)
        reqs = out_of_box.make_requests(n_req, max_len, out_of_box.model_vocab(mdir), args.seed)
        (work / "requests.json").write_text(json.dumps(reqs))
        columns = [("defaults", {})] + [(json.dumps(k), k) for k in args.throughput_also]
        tp: dict[str, Any] = {}
        for col, kwargs in columns:
            spec = dict(
                model=str(mdir),
                dtype="float32",
                max_model_len=max_len,
                llm_kwargs=kwargs,
                requests=str(work / "requests.json"),
                phases=["warmup", "timed"],
            )
            label = "throughput-" + "".join(c if c.isalnum() else "_" for c in col)
            res = child(label, spec, cache_env(work / f"jax_cache-{label}", args.cache_env_var))
            if res["timed_out_tokens"] != res["timed_expected_tokens"]:
                raise RuntimeError(
                    f"{col}: {res['timed_out_tokens']} output tokens, expected"
                    f" {res['timed_expected_tokens']}"
                )
            before = res.get("stats_warmup", {}).get("compilations")
            after = res.get("stats_timed", {}).get("compilations")
            tp[col] = dict(
                startup_s=res["t_constructed"] - res["t_spawn"],
                warmup_call_s=res["warmup_s"],
                timed_s=res["timed_s"],
                out_tokens=res["timed_out_tokens"],
                out_tok_s=res["timed_out_tokens"] / res["timed_s"],
                xla_compilations_timed=len(res["compiles"].get("timed", [])),
                engine_compilations_timed=(after - before) if None not in (before, after) else None,
                load_after=load(),
            )
        print(
            f"\ndefaults-only run ({name}, {n_req} requests, {sum(reqs['output_lens'])} output"
            f" tokens, after a {len(reqs['warmup_prompts'])}-request warm-up call):"
        )
        print(
            "| LLM keywords | start-up (s) | warm-up call (s) | timed (s) | output tok/s |"
            " XLA compilations in timed generate | engine compilations in it |"
        )
        print("|---|---|---|---|---|---|---|")
        for col, t in tp.items():
            print(
                f"| {col} | {_f(t['startup_s'])} | {_f(t['warmup_call_s'])} |"
                f" {_f(t['timed_s'])} | {_f(t['out_tok_s'])} | {t['xla_compilations_timed']} |"
                f" {_f(t['engine_compilations_timed'])} |"
            )
        report["throughput"] = tp

    report["load_end"] = load()
    print(f"load average at the end: {report['load_end']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    headline = next((s["ready_s"] for k, s in starts.items() if k.startswith("cold")), None)
    print(f"cold_start_s: {_f(headline, '.2f')}")
    return report


if __name__ == "__main__":
    main()
