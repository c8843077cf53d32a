"""KV blocks saved by sharing: parallel sampling and beam search (the paper's Fig. 15).

    python benchmarks/sharing_memory.py [--quick] [--num-requests 32] [--concurrency 8]

Runs Alpaca-like requests (``pagedjax.workloads.sample_lengths("alpaca")`` lengths,
random prompt ids; pairs over --max-model-len skipped) through the real engine on a small
random model (the ``tiny-llama`` preset, random weights: the saving depends on lengths
and on how beams diverge, not on model quality): parallel sampling with n = 2, 4, 6
(temperature 1, seeded) and beam search with width 2, 4, 6 (temperature 0). Every
request generates exactly its sampled output length (ignore_eos, as the paper's runs).
Block size 16 as the paper; prefix caching off, so the only sharing is within a request;
the pool and slots hold everything, so nothing is preempted (checked).

Load: a closed loop with --concurrency requests in flight (the next one starts when one
finishes; beam search through ``concurrency_limit``), a stand-in for the paper's 1-hour
Poisson serving run that fits a few CPU minutes. The saving is
``LLMEngine.stats()["blocks_saved_by_sharing"]``: per engine step, 1 - blocks referenced
/ blocks the live sequences would hold without sharing (sum of ceil(len / 16)), averaged
over steps ("whole run"). "steady" averages only the steps while requests were still
waiting to be added, i.e. without the final drain, where the few longest requests run
alone and dominate a short run's average (a 1-hour trace has almost no drain). The
paper's Fig. 15 values (OPT-13B, Alpaca; /work/shared/paper_notes.md) are printed beside
ours: expect the trend, not the digits. The last line is ``beam6_saved_pct: <steady>``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import jax
import numpy as np

from pagedjax import LLM, BeamSearchParams, SamplingParams
from pagedjax.engine.beams import beam_search
from pagedjax.machine import cpu_model
from pagedjax.workloads import sample_lengths

# Fig. 15 [FIG], OPT-13B on Alpaca (paper_notes.md).
PAPER = {
    ("parallel", 2): 6.09,
    ("parallel", 4): 8.53,
    ("parallel", 6): 9.79,
    ("beam", 2): 37.56,
    ("beam", 4): 53.13,
    ("beam", 6): 55.16,
}


def workload(n: int, max_len: int, max_out: int | None, seed: int) -> list[tuple[list, int]]:
    """n (prompt ids, output length) pairs, Alpaca-like; pairs longer than max_len are
    skipped (the next pairs are taken), outputs capped at max_out when given."""
    rng = np.random.default_rng(seed)
    prompts, outputs = sample_lengths("alpaca", 4 * n + 64, seed)
    out = []
    for pl, ol in zip(prompts.tolist(), outputs.tolist(), strict=True):
        ol = min(ol, max_out) if max_out is not None else ol
        if pl + ol <= max_len:
            out.append((rng.integers(3, 512, pl).tolist(), ol))
        if len(out) == n:
            return out
    raise ValueError(f"too few Alpaca-like pairs fit max_model_len={max_len}")


class StepLog:
    """Wraps the engine's step and add_request: per step, the step's sharing saving (the
    term ``stats()`` averages) and whether requests were still to be added then."""

    def __init__(self, engine, num_requests: int):
        self.engine, self.total, self.added = engine, num_requests, 0
        self.saved: list[float] = []
        self.backlog: list[bool] = []
        self._step, self._add = engine.step, engine.add_request
        engine.step, engine.add_request = self.step, self.add_request

    def add_request(self, *args, **kwargs):
        self._add(*args, **kwargs)
        self.added += 1

    def step(self):
        e = self.engine
        s0, n0 = e.core.sharing.saved_frac_sum, e.core.sharing.steps
        out = self._step()
        if e.core.sharing.steps > n0:
            self.saved.append(e.core.sharing.saved_frac_sum - s0)
            self.backlog.append(self.added < self.total)
        return out

    def close(self) -> None:
        del self.engine.step, self.engine.add_request  # back to the class's methods


def run_parallel(llm: LLM, reqs, n: int, conc: int) -> dict:
    """Closed loop: conc requests in flight, the next added when one finishes."""
    engine = llm.llm_engine
    engine.reset_stats()
    pre0, steps0 = engine.num_preemptions, engine.num_steps
    log = StepLog(engine, len(reqs))
    todo = list(enumerate(reqs))
    live: set[str] = set()
    try:
        while todo or live:
            while todo and len(live) < conc:
                i, (p, o) = todo.pop(0)
                sp = SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=o, ignore_eos=True)
                engine.add_request(f"par{n}-{i}", p, sp)
                live.add(f"par{n}-{i}")
            for out in engine.step():
                if out.finished:
                    assert all(len(c.token_ids) == reqs[int(out.request_id.split("-")[1])][1]
                               for c in out.outputs)  # fmt: skip
                    live.discard(out.request_id)
    finally:
        log.close()
    return _measure(engine, log, pre0, steps0)


def run_beam(llm: LLM, reqs, k: int, conc: int) -> dict:
    engine = llm.llm_engine
    engine.reset_stats()
    pre0, steps0 = engine.num_preemptions, engine.num_steps
    log = StepLog(engine, len(reqs))
    params = [BeamSearchParams(beam_width=k, max_tokens=o, ignore_eos=True) for _, o in reqs]
    try:
        outs = beam_search(engine, [p for p, _ in reqs], params, concurrency_limit=conc)
    finally:
        log.close()
    for out, (p, o) in zip(outs, reqs, strict=True):
        assert all(len(s.tokens) == len(p) + o for s in out.sequences)
    return _measure(engine, log, pre0, steps0)


def _measure(engine, log: StepLog, pre0: int, steps0: int) -> dict:
    st = engine.stats()
    assert engine.num_free_blocks() == engine.num_usable_blocks()  # every block returned
    assert abs(np.mean(log.saved) - st["blocks_saved_by_sharing"]) < 1e-9
    steady = [v for v, b in zip(log.saved, log.backlog, strict=True) if b]
    return dict(
        saved=100 * st["blocks_saved_by_sharing"],
        steady=100 * float(np.mean(steady)) if steady else float("nan"),
        steady_steps=len(steady),
        steps=engine.num_steps - steps0,
        preemptions=engine.num_preemptions - pre0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny setting (smoke test)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n_req, max_len, max_out = args.num_requests, args.max_model_len, None
    conc = args.concurrency
    if args.quick:
        n_req, max_len, max_out, conc = 4, 128, 24, 2
    seqs = args.max_num_seqs
    block = 16
    llm = LLM(
        model="tiny-llama",
        dtype="float32",
        block_size=block,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=256,
        # Enough for every slot at max_model_len: nothing is ever preempted.
        num_gpu_blocks_override=1 + seqs * -(-max_len // block),
        watermark=0.0,
        seed=args.seed,
        enable_prefix_caching=False,  # Fig. 15 measures sample / beam sharing alone
    )
    reqs = workload(n_req, max_len, max_out, args.seed)
    p_mean = np.mean([len(p) for p, _ in reqs])
    o_mean = np.mean([o for _, o in reqs])
    print(f"# sharing_memory.py  {datetime.date.today()}  {platform.node()} ({cpu_model()},"
          f" {os.cpu_count()} cores)  jax {jax.__version__}")  # fmt: skip
    print(
        f"# tiny-llama (random weights, float32), block size {block}, max_num_seqs {seqs},"
        f" {n_req} Alpaca-like requests, {conc} in flight (mean prompt {p_mean:.1f}, mean output"
        f" {o_mean:.1f} tokens; paper: 19.31 / 58.45 over a 1-hour trace"
        + (f"; outputs capped at {max_out}" if max_out else "")
        + "), ignore_eos"
    )
    rows = []
    t_all = time.perf_counter()
    for mode, widths in (("parallel", (2, 4, 6)), ("beam", (2, 4, 6))):
        for w in widths:
            t0 = time.perf_counter()
            run = run_parallel if mode == "parallel" else run_beam
            r = run(llm, reqs, w, conc)
            r["seconds"] = time.perf_counter() - t0
            rows.append((mode, w, r))
    label = {"parallel": "parallel sampling n=", "beam": "beam search width="}
    print()
    print(f"| {'setting':<22} | saved, whole run | saved, steady | paper Fig. 15 | steps"
          " (steady) | preemptions | seconds |")  # fmt: skip
    print(f"|{'-' * 24}|-----------------:|--------------:|--------------:|--------------:|"
          "------------:|--------:|")  # fmt: skip
    for mode, w, r in rows:
        print(
            f"| {label[mode] + str(w):<22} | {r['saved']:15.2f}% | {r['steady']:12.2f}% |"
            f" {PAPER[(mode, w)]:12.2f}% | {r['steps']:5d} ({r['steady_steps']:4d}) |"
            f" {r['preemptions']:11d} | {r['seconds']:7.1f} |"
        )
    print(f"# total {time.perf_counter() - t_all:.1f} s (first runs include compilation)")
    assert all(r["preemptions"] == 0 for _, _, r in rows)
    print(f"beam6_saved_pct: {rows[-1][2]['steady']:.2f}")


if __name__ == "__main__":
    main()
