"""Fig. 16 analogue (real executor): prompts sharing a few-shot prefix, prefix caching
off vs on.

The paper serves LLaMA-13B on WMT16 En->De with a shared 1-shot (80-token) or 5-shot
(341-token) prefix and reports vLLM's throughput over Orca (Oracle): 1.67x / 3.58x.
Here a small model (random weights) serves the same prompt structure on this machine:
prefix + a sentence-length suffix, Poisson arrivals, ``ignore_eos`` outputs of the
drawn lengths. Every (prefix, rate) run draws its own prefix, and both engines see the
same prompts, so the caching engine starts each run cold: its first requests compute the
prefix, later ones reuse its blocks. Reported per run: prefill tokens computed (all
tokens the steps computed minus the sampled tokens fed back, so recomputes count),
prefill tokens saved, the cache's hit rate, output tokens/s and normalized latency.
The comparison is caching on vs off on the same engine, not vLLM vs Orca, so the
paper's ratio is printed beside it as context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from experiments.common import save_fig, write_csv
from experiments.config import ExperimentConfig, SharedPrefixSettings
from experiments.paper_values import FIG16
from experiments.real_serving import metrics, serve, warm_up
from pagedjax.workloads import Workload

LABEL = "real"


def make_llm(s: SharedPrefixSettings, caching: bool) -> Any:
    from pagedjax import LLM

    return LLM(
        model=s.model,
        load_format="dummy",
        max_model_len=s.max_model_len,
        num_gpu_blocks_override=s.num_gpu_blocks,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        enable_prefix_caching=caching,
        seed=s.seed,
    )


def make_requests(
    s: SharedPrefixSettings, prefix_len: int, rate: float, seed: int, vocab: int
) -> tuple[Workload, list[list[int]]]:
    """One run's trace: Poisson arrivals, prompts = shared prefix + own suffix."""
    rng = np.random.default_rng(seed)
    n = s.num_requests

    def lengths(mean: int) -> np.ndarray:
        return rng.integers(max(1, mean // 2), max(1, 3 * mean // 2) + 1, n)

    prefix = rng.integers(1, vocab, prefix_len).tolist()
    suffix, out = lengths(s.sentence_tokens), lengths(s.output_tokens)
    prompts = [prefix + rng.integers(1, vocab, int(k)).tolist() for k in suffix]
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    arrival -= arrival[0]
    w = Workload(arrival, np.array([len(p) for p in prompts], np.int32), out.astype(np.int32))
    return w, prompts


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.shared_prefix
    try:
        llms = {mode: make_llm(s, mode == "on") for mode in ("off", "on")}
    except Exception as e:  # noqa: BLE001 - report, do not fake numbers
        return {"executor": LABEL, "status": f"not available: {type(e).__name__}: {e}"}
    vocab = min(llms["off"].llm_engine.arch.vocab_size, 32000)
    summary: dict[str, Any] = {"executor": LABEL, "model": s.model, "warmup": {}, "runs": {}}
    for mode, llm in llms.items():
        if not s.warmup:
            summary["warmup"][mode] = "off: throughput includes compilations"
            continue
        info = warm_up(llm)
        # Compiles schedule/update and the prefix-cache programs (attach, register).
        w, prompts = make_requests(s, max(s.prefix_tokens), 100.0, s.seed + 99, vocab)
        serve(llm, w.head(4), prompts=prompts[:4])
        summary["warmup"][mode] = info
    rows = []
    runs = [(p, r) for p in s.prefix_tokens for r in s.rates]
    for i, (p, rate) in enumerate(progress(runs, desc="shared prefix", leave=False)):
        w, prompts = make_requests(s, p, rate, s.seed + i, vocab)
        res: dict[str, Any] = {}
        for mode, llm in llms.items():
            eng = llm.llm_engine
            eng.reset_stats()
            r = serve(llm, w, prompts=prompts)
            m = metrics(w, r)
            st = eng.stats()
            # Tokens computed = sum of q over steps (prefill rows + decode rows); each
            # request feeds output_len - 1 sampled tokens back, the rest is prefill
            # (recomputes after preemption included).
            fed = float(r["steps"][:, :2].sum()) if len(r["steps"]) else 0.0
            computed = fed - float((w.output_len - 1).sum())
            res[mode] = dict(
                prefill_tokens=int(w.prompt_len.sum()),
                prefill_computed=int(computed),
                hit_tokens=int(st["prefix_cache_hit_tokens"]),
                hit_rate=round(st["prefix_cache_hit_rate"], 4),
                throughput_tok_s=round(m["throughput_tok_s"], 2),
                norm_latency=round(m["norm_latency_s_per_token"], 5),
                ttft_p50_s=round(m["ttft_p50_s"], 4),
            )
            rows.append(dict(executor=LABEL, prefix=p, rate=rate, caching=mode, **res[mode]))
        off, on = res["off"], res["on"]
        res["prefill_saved_pct"] = round(
            100.0 * (1.0 - on["prefill_computed"] / max(off["prefill_computed"], 1)), 2
        )
        res["throughput_on_over_off"] = round(
            on["throughput_tok_s"] / max(off["throughput_tok_s"], 1e-9), 3
        )
        res["paper_vllm_over_oracle"] = FIG16.get(p)
        summary["runs"][f"prefix={p},rate={rate}"] = res
    write_csv(out / "shared_prefix.csv", rows)
    _plot(summary, out / "shared_prefix.png")
    return summary


def _plot(summary: dict[str, Any], path: Path) -> None:
    keys = list(summary["runs"])
    x = np.arange(len(keys))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for k, mode in enumerate(("off", "on")):
        comp = [summary["runs"][key][mode]["prefill_computed"] for key in keys]
        tput = [summary["runs"][key][mode]["throughput_tok_s"] for key in keys]
        a.bar(x + 0.4 * k, comp, 0.4, label=f"caching {mode}")
        b.bar(x + 0.4 * k, tput, 0.4, label=f"caching {mode}")
    for ax, ylabel in ((a, "prefill tokens computed"), (b, "output tokens/s (this CPU)")):
        ax.set_xticks(x + 0.2, [k.replace(",", "\n") for k in keys], fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(f"Fig. 16 analogue: shared prefix, {summary['model']} ({LABEL})")
    save_fig(fig, path, simulated=False)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "status" in summary:
        return [("shared_prefix", summary["status"][:40], "")]
    rows = []
    for key, r in summary["runs"].items():
        paper = r["paper_vllm_over_oracle"]
        rows.append((f"prefill saved {key} (real)", f"{r['prefill_saved_pct']:.1f}%", ""))
        rows.append(
            (
                f"tok/s caching on/off {key} (real)",
                f"{r['throughput_on_over_off']:.2f}x",
                f"vLLM/Oracle {paper}x" if paper else "",
            )
        )
    return rows
