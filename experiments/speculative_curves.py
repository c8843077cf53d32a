"""Fig. 12 with speculative decoding: normalized latency (s/token) vs request rate for
the paged (vLLM-style) system without speculation and with it at the acceptance the
real engine measured (docs/speculative_decoding.md), simulated.

    python experiments/speculative_curves.py --config llama7b.yaml [--out DIR]
        [--rates 0.5 1 2 ...] [--duration S] [--gpu H100-80GB] [--dataset alpaca]
        [--slots 256]

Inputs, never fitted to an outcome: each setting is k and the *mean accepted length*
(tokens per speculating row and step, the bonus token included) that
``benchmarks/speculative.py`` measured on SmolLM2-135M (CPU); the simulator draws the
accepted drafts from the first-rejection model with that mean
(``SpecModel.from_mean_accepted``). The draft's cost: 0 for n-gram (a host-side
lookup), and for the EAGLE head a fraction of the target's decode step equal to the
head's weight bytes over the target's (one decoder layer, the 2h -> h fc and a full LM
head, from the server model's geometry). The baseline is ``SpecModel.none()`` (k = 0
through the same compiled loop: identical to the plain simulation, tested), so every
curve costs one compilation. Simulator approximations: pagedjax/simulator/speculative.py.

Workload and server: the config's ``server`` and ``throughput_vs_rate`` dataset, trace
length and seed (the ShareGPT-like trace of Fig. 12, common random numbers across
rates). Knees are read off the grid (highest swept rate with latency <= threshold), so
they are known to the grid's step; a setting's sweep stops after its first rate above
the largest threshold (the rest explode further), and a run stops early once its latency
provably exceeds ``throughput_vs_rate.search.stop_latency`` (its value is then that
lower bound, marked ``*``). Writes speculative_curves.csv / .png / .json into
results/speculative_curves-<config>-<timestamp>/ (ignored by git) unless --out is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` and `pagedjax` importable
    sys.path.insert(0, str(ROOT))
from experiments.compile_flags import skip_expensive_llvm_passes  # noqa: E402

skip_expensive_llvm_passes()  # as run.py, before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from experiments.common import (  # noqa: E402
    SIM_LABEL,
    cost_model,
    dump_json,
    latency_metrics,
    run_sim,
    save_fig,
    write_csv,
)
from experiments.config import ExperimentConfig, ServerSettings  # noqa: E402
from pagedjax.simulator.cost_model import model_geometry  # noqa: E402
from pagedjax.simulator.speculative import SpecModel  # noqa: E402

DEFAULT_RATES = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)
# Contexts of the per-step gain table (tokens): Alpaca-like and ShareGPT-like scales.
GAIN_CONTEXTS = (64, 512)
SOURCE = "docs/speculative_decoding.md, Measured (SmolLM2-135M, CPU, benchmarks/speculative.py)"


@dataclass(frozen=True)
class Setting:
    """One curve. mean_len: tokens per speculating row and step (1 + accepted drafts),
    the measured input; acceptance: the engine's accepted / proposed, for the record.
    draft: "ngram" (no draft cost) or "eagle" (cost fraction from the geometry). A draft
    tree: k its depth, nodes the draft tokens verified per row and step (measured: the
    engine's drafts per step at batch 1), width its branches (the EAGLE tree's head rows
    per draft step; 1 for an n-gram trie, drafted on the host)."""

    name: str
    label: str
    k: int
    mean_len: float
    acceptance: float | None
    draft: str
    source: str
    nodes: int | None = None
    width: int = 1

    def model(self, server: ServerSettings) -> SpecModel:
        if self.k == 0:
            return SpecModel.none()
        f = eagle_cost_fraction(server.model) if self.draft == "eagle" else 0.0
        return SpecModel.from_mean_accepted(self.k, self.mean_len - 1, draft_cost_fraction=f,
                                            nodes=self.nodes, draft_width=self.width)


SETTINGS = (
    Setting("none", "no speculation", 0, 1.0, None, "none", "-"),
    Setting("ngram_copy", "n-gram, copy (k=4, 3.67 tok/step)", 4, 3.67, 0.667, "ngram",
            f"{SOURCE}: copy, batch 1, ngram"),
    Setting("ngram_chat", "n-gram, chat (k=4, 2.00 tok/step)", 4, 2.00, 0.25, "ngram",
            f"{SOURCE}: chat, batch 1, ngram"),
    Setting("ngram_chat_b8", "n-gram, chat (k=4, 1.60 tok/step)", 4, 1.60, 0.158, "ngram",
            f"{SOURCE}: chat, batch 8, ngram"),
    Setting("eagle", "EAGLE head (k=2, 1.36 tok/step)", 2, 1.36, 0.179, "eagle",
            f"{SOURCE}: chat, batch 1 and 8, eagle k = 2"),
    # Draft trees against their chains, one run (2026-12-05, chat, batch 1, 4 prompts,
    # 64 tokens, 3 rounds, load 1.8; "Ninth session"): nodes = drafts verified per step.
    Setting("ngram_chat_run9", "n-gram chain, chat (k=4, 1.78 tok/step)", 4, 1.78, 0.204,
            "ngram", f"{SOURCE}: ninth session, chat, batch 1, ngram"),
    Setting("ngram_tree_chat", "n-gram tree, chat (depth 4, 6 nodes, 1.95)", 4, 1.95, 0.151,
            "ngram", f"{SOURCE}: ninth session, chat, batch 1, ngramtree (6.3 drafts/step)",
            nodes=6),
    Setting("eagle_k4_chat", "EAGLE chain (k=4, 1.52 tok/step)", 4, 1.52, 0.132, "eagle",
            f"{SOURCE}: ninth session, chat, batch 1, eagle k = 4"),
    Setting("eagle_tree_chat", "EAGLE tree (3 x 4 nodes, 1.68)", 4, 1.68, 0.057, "eagle",
            f"{SOURCE}: ninth session, chat, batch 1, eagletree", nodes=12, width=3),
    Setting("eagle_dyntree_chat", "EAGLE-2 dynamic tree (3 x 4, 1.75)", 4, 1.75, 0.063,
            "eagle", f"{SOURCE}: ninth session, chat, batch 1, eagledyntree", nodes=12,
            width=3),
)  # fmt: skip


def eagle_cost_fraction(model: str) -> float:
    """An EAGLE-1 head's step cost as a fraction of the target's decode step, taken as
    its weight bytes over the target's (one decoder layer of the target's shape, the
    2h -> h fc over [feature, embedding], a full-vocabulary LM head; the engine's head
    truncates its vocabulary, so this is an upper estimate). Computed, not measured."""
    g = model_geometry(model)
    head = g.layer_matmul_params + 2 * g.hidden * g.hidden + g.lm_head_params
    return head * g.bytes_per_param / g.step_weight_bytes


def curves(
    server: ServerSettings,
    dataset: str,
    rates: list[float],
    duration_s: float,
    seed: int,
    settings: list[Setting],
    thresholds: list[float],
    stop_latency: float = math.inf,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """One row per (setting, rate run): the setup and ``latency_metrics`` plus the mean
    batch (time-weighted scheduled rows in the steady window). A setting stops after its
    first rate above max(thresholds)."""
    rows = []
    for s in settings:
        model = s.model(server)
        for rate in sorted(rates):
            if progress:
                progress(s.name, rate)
            (r,) = run_sim(
                "paged", server, [(dataset, rate, duration_s, seed, 1.0)],
                stop_latency=stop_latency, speculative=model,
            )  # fmt: skip
            m = latency_metrics(r)
            rows.append(
                dict(
                    executor=SIM_LABEL,
                    cost_model=server.cost_model,
                    system="paged",
                    setting=s.name,
                    k=s.k,
                    mean_accepted_len=s.mean_len,
                    model_mean_accepted_len=round(1 + model.mean_accepted, 4),
                    draft_cost_fraction=round(model.draft_cost_fraction, 4),
                    dataset=dataset,
                    rate=rate,
                    duration_s=duration_s,
                    seed=seed,
                    mean_batch=round(float(r.result.win_batched), 2),
                    **m,
                )
            )
            if m["norm_latency_s_per_token"] > max(thresholds):
                break
    return rows


def step_gain(
    server: ServerSettings, setting: Setting, batch_sizes: list[int], context: int
) -> list[float]:
    """The cost model's per-step view, no queueing: for a decode-only step of B rows of
    ``context`` tokens each, tokens per second with speculation over without, i.e.
    mean_len x t_plain(B) / (t_verify(B) + t_draft(B)). The same functions the
    simulation loop calls (``batch_work``, ``verify_work``, ``draft_time``), on batches
    padded to max(batch_sizes) rows so that one compiled function serves every B."""
    width = max(batch_sizes)
    fn = _step_times(cost_model(server), width)
    params = setting.model(server).params()
    out = []
    for b in batch_sizes:
        t0, t1 = fn(params, jnp.int32(b), jnp.int32(context))
        out.append(setting.mean_len * float(t0) / float(t1))
    return out


@functools.cache
def _step_times(cm: Any, width: int) -> Any:
    """jitted (params, rows, context) -> (plain step s, speculative step s incl. draft)."""
    from pagedjax.scheduler import ScheduledBatch
    from pagedjax.simulator import speculative as spec_mode
    from pagedjax.simulator.simulate import batch_work

    def times(params: Any, rows: Any, context: Any) -> tuple[Any, Any]:
        live = jnp.arange(width) < rows
        batch = ScheduledBatch(
            seq_ids=jnp.where(live, jnp.arange(width, dtype=jnp.int32), -1),
            q_lens=live.astype(jnp.int32), start_pos=jnp.where(live, context, 0),
            emits=live, num_seqs=rows, num_tokens=rows, preempted=~live, rejected=~live,
        )  # fmt: skip
        plain = batch_work(None, batch)
        spec = cm(*spec_mode.verify_work(params, batch, plain))
        return cm(*plain), spec + spec_mode.draft_time(params, batch, cm)

    return jax.jit(times)


def knees(rows: list[dict[str, Any]], threshold: float, rates: list[float]) -> dict[str, str]:
    """Grid knee per setting: the highest swept rate whose latency is <= threshold and
    below every rate that exceeded it; ">= top" when no swept rate exceeded it."""
    out = {}
    for name in dict.fromkeys(r["setting"] for r in rows):
        pts = [(r["rate"], r["norm_latency_s_per_token"]) for r in rows if r["setting"] == name]
        over = [x for x, v in pts if not v <= threshold]
        hi = min(over) if over else None
        ok = [x for x, v in pts if v <= threshold and (hi is None or x < hi)]
        if hi is None:
            out[name] = f">= {max(rates):g}"
        else:
            out[name] = f"{max(ok):g}" if ok else f"< {hi:g}"
    return out


def table(rows: list[dict[str, Any]], rates: list[float], thresholds: list[float]) -> list[str]:
    """The side-by-side text table: latency per rate and setting, mean batch, knees."""
    names = list(dict.fromkeys(r["setting"] for r in rows))
    by = {(r["setting"], r["rate"]): r for r in rows}
    w = max(12, *(len(n) for n in names))
    lines = [
        "normalized latency (s/token) [mean batch]; * = a run stopped early (lower bound); "
        "- = not run (past the knee)",
        f"{'rate req/s':>10} " + " ".join(f"{n:>{w + 8}}" for n in names),
    ]
    for rate in sorted(rates):
        cells = []
        for n in names:
            r = by.get((n, rate))
            if r is None:
                cells.append(f"{'-':>{w + 8}}")
                continue
            star = "*" if r["stopped_early"] else ""
            cells.append(f"{r['norm_latency_s_per_token']:.4f}{star} [{r['mean_batch']:.1f}]"
                         .rjust(w + 8))  # fmt: skip
        lines.append(f"{rate:>10g} " + " ".join(cells))
    for th in thresholds:
        k = knees(rows, th, rates)
        lines.append(f"{'knee@' + f'{th:g}':>10} " + " ".join(f"{k[n]:>{w + 8}}" for n in names))
    return lines


def plot(rows: list[dict[str, Any]], settings: list[Setting], path: Path, title: str) -> None:
    """Latency vs rate per setting (linear, then log: the low-load gap is the point),
    thresholds dotted; third panel: the gain, latency without / with, at each rate both
    ran (a ratio with an early-stopped run is a bound: hollow marker)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    base = {r["rate"]: r for r in rows if r["setting"] == "none"}
    for s in settings:
        mine = [r for r in rows if r["setting"] == s.name]
        if not mine:
            continue
        x = [r["rate"] for r in mine]
        y = [r["norm_latency_s_per_token"] for r in mine]
        style = "k-o" if s.k == 0 else "-o"
        for ax in axes[:2]:
            ax.plot(x, [min(v, 1.15) for v in y], style, label=s.label, ms=3, lw=1)
        both = [r for r in mine if r["rate"] in base]
        gain = [base[r["rate"]]["norm_latency_s_per_token"] / r["norm_latency_s_per_token"]
                for r in both]  # fmt: skip
        line = axes[2].plot([r["rate"] for r in both], gain, style, label=s.label, ms=3, lw=1)
        bound = [(r["rate"], g) for r, g in zip(both, gain, strict=True)
                 if r["stopped_early"] or base[r["rate"]]["stopped_early"]]  # fmt: skip
        if bound:
            bx, by = zip(*bound, strict=True)
            axes[2].plot(bx, by, "o", mfc="white", color=line[0].get_color(), ms=6)
    for th in (0.2, 0.5):
        for ax in axes[:2]:
            ax.axhline(th, color="k", lw=0.5, ls=":")
    axes[0].set_ylim(0, 1.2)
    axes[1].set_yscale("log")
    axes[1].set_title("same, log latency", fontsize=8)
    axes[2].set_yscale("log")
    axes[2].set_title("gain: latency without / with speculation", fontsize=8)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("normalized latency (s/token)")
    axes[1].set_ylabel("normalized latency (s/token)")
    axes[2].set_ylabel("latency ratio (> 1: speculation faster)")
    axes[0].set_title(title, fontsize=7)
    save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a YAML file, or a name under configs/")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES))
    ap.add_argument("--duration", type=float, help="trace seconds (default: the config's"
                    " throughput_vs_rate.duration_s)")  # fmt: skip
    ap.add_argument("--gpu", help="the server's GPU instead of the config's (e.g. H100-80GB;"
                    " the KV pool stays the config's kv_slots)")  # fmt: skip
    ap.add_argument(
        "--dataset",
        choices=["sharegpt", "alpaca"],
        help="the workload (default: throughput_vs_rate.dataset)",
    )
    ap.add_argument("--slots", type=int, help="scheduler rows (the running cap; default:"
                    " throughput_vs_rate.slots or server.slots)")  # fmt: skip
    ap.add_argument("--settings", nargs="+", choices=[x.name for x in SETTINGS],
                    help="the curves to draw (default: all; 'none', the baseline, always)")
    a = ap.parse_args(argv)
    chosen = [x for x in SETTINGS if a.settings is None or x.name in (*a.settings, "none")]
    from experiments.run import resolve_config
    from pagedjax.config import ConfigError, load_yaml

    try:
        path = resolve_config(a.config)
        cfg = load_yaml(ExperimentConfig, path, [])
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if any(r <= 0 for r in a.rates):
        print("error: --rates must be positive", file=sys.stderr)
        return 2
    tv = cfg.throughput_vs_rate
    server = cfg.server if tv.slots is None else dataclasses.replace(cfg.server, slots=tv.slots)
    if a.gpu or a.slots:
        try:
            server = dataclasses.replace(
                server, gpu=a.gpu or server.gpu, slots=a.slots or server.slots
            )
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    duration = a.duration or tv.duration_s
    dataset = a.dataset or tv.dataset
    stop = tv.search.stop_latency if tv.search is not None else math.inf
    thresholds = sorted(tv.thresholds)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else ROOT / "results" / f"speculative_curves-{path.stem}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    load0 = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    rows = curves(
        server, dataset, a.rates, duration, tv.seed, chosen, thresholds, stop,
        progress=lambda n, r: print(f"  {n} @ {r:g} req/s", file=sys.stderr, flush=True),
    )  # fmt: skip
    secs = time.perf_counter() - t0
    load1 = [round(x, 2) for x in os.getloadavg()]
    head = (
        f"{SIM_LABEL.upper()}: {server.model} on {server.gpu} ({server.cost_model}), paged,"
        f" {dataset} {duration:g}-s traces, seed {tv.seed}; KV {server.pool_slots} slots,"
        f" {server.slots} scheduler rows"
    )
    lines = table(rows, a.rates, thresholds)
    print(head)
    for s in chosen:
        m = s.model(server)
        print(
            f"  {s.name}: k={s.k}, measured {s.mean_len:.2f} tok/step"
            + (f" (acceptance {s.acceptance})" if s.acceptance is not None else "")
            + f", model per-draft rate -> mean {1 + m.mean_accepted:.2f} tok/step,"
            f" draft cost {m.draft_cost_fraction:.3f} x decode step; source: {s.source}"
        )
    print("\n".join(lines))
    gain_b = [1, 4, 16, 32, 64, 128, 256]
    gains = {
        ctx: {s.name: step_gain(server, s, gain_b, ctx) for s in chosen if s.k}
        for ctx in GAIN_CONTEXTS
    }
    for ctx, g in gains.items():
        print(f"per-step gain, cost model only (no queueing): a decode-only step of B rows x"
              f" {ctx} tokens of context, tokens/s with / without speculation")  # fmt: skip
        print(f"{'B':>10} " + " ".join(f"{n:>14}" for n in g))
        for i, b in enumerate(gain_b):
            print(f"{b:>10} " + " ".join(f"{v[i]:>14.2f}" for v in g.values()))
    print(f"{secs:.0f} s; load average {load0} at start, {load1} at end")
    write_csv(out / "speculative_curves.csv", rows)
    plot(rows, chosen, out / "speculative_curves.png", head)
    dump_json(
        out / "speculative_curves.json",
        {
            "setup": head,
            "command": "python experiments/speculative_curves.py " + " ".join(sys.argv[1:]),
            "settings": [s.__dict__ | {"model": repr(s.model(server))} for s in chosen],
            "table": lines,
            "step_gain": {"batch_sizes": gain_b, "by_context": gains},
            "knees": {f"{th:g}": knees(rows, th, a.rates) for th in thresholds},
            "seconds": round(secs, 1),
            "load_average_start_end": [load0, load1],
        },
    )
    print(f"wrote {out}")
    return 0


def use_persistent_cache() -> None:
    """As run.py: reruns reuse the compiled simulator (results/.jax_cache, or
    $PAGEDJAX_JAX_CACHE). Only when run as a script: a test calling ``main`` keeps its
    process's JAX settings."""
    import jax

    cache = os.environ.get("PAGEDJAX_JAX_CACHE") or str(ROOT / "results" / ".jax_cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


if __name__ == "__main__":
    use_persistent_cache()
    sys.exit(main())
