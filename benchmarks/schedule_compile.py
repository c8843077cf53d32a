"""Compile cost and run time of the jitted ``schedule`` on the tests' tiny engine geometry.

    python benchmarks/schedule_compile.py [--repeats 3] [--calls 200] [--seqs 64]

For each memory policy (the paged pool without and with a host swap pool, the paged pool
with prefix caching, the counting policy) it lowers ``schedule`` as the engine jits it
(policy and limits static, state and lookahead traced), prints the StableHLO line count,
the CPU seconds (``time.process_time()``) of ``lowered.compile()`` for ``--repeats``
fresh compiles (a new jit and lowering each), and the wall time of one compiled call on
a state with every slot in decode (the common, no-preemption path; the best of 10
batches of ``--calls / 10``). With ``--seqs N``
(0: skip) it also runs ``pagedjax.scheduler.bench.bench`` at N sequences (a roomy and a
tight paged pool: the latter preempts every few steps) for the per-step run time of
schedule + update, the best of 3 runs.

The geometry is tests/test_engine.py's: 24 blocks of 4 tokens, 4 sequences of up to 64
tokens, a 16-token budget (the engine computes 64 host blocks for it). The XLA flags are
the test suite's (tests/conftest.py ``TEST_XLA_FLAGS``), set before JAX starts, or with
``--engine-flags`` XLA's defaults (what the engine runs with: use it for run times). JAX's
persistent compilation cache is not enabled here, so every compile is real.
"""

from __future__ import annotations

import os
import sys

# The test suite's flags (tests/conftest.py TEST_XLA_FLAGS): what the suite's compiles pay.
_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_multi_thread_eigen=false")
# --engine-flags: XLA's defaults instead, as the engine runs (for the run-time columns).
if "--engine-flags" not in sys.argv:
    os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), *_TEST_XLA_FLAGS)).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pagedjax.memory.paged_policy import PagedPolicy  # noqa: E402
from pagedjax.scheduler import (  # noqa: E402
    SchedulerLimits,
    add_requests,
    init_state,
    schedule,
    update,
)
from pagedjax.scheduler.bench import bench  # noqa: E402
from pagedjax.scheduler.counting_policy import CountingPolicy  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_SEQS, MAX_LEN, BUDGET, HOST_BLOCKS = 4, 24, 4, 64, 16, 64


def policies() -> dict:
    mb = MAX_LEN // BLOCK
    return {
        "paged": PagedPolicy(NUM_BLOCKS, BLOCK, MAX_SEQS, mb),
        "paged+swap": PagedPolicy(NUM_BLOCKS, BLOCK, MAX_SEQS, mb, num_host_blocks=HOST_BLOCKS),
        "paged+prefix+swap": PagedPolicy(
            NUM_BLOCKS, BLOCK, MAX_SEQS, mb, enable_prefix_caching=True,
            num_host_blocks=HOST_BLOCKS,
        ),  # fmt: skip
        "counting": CountingPolicy(MAX_SEQS, (NUM_BLOCKS - 1) * BLOCK, unit=BLOCK),
    }


def _decoding_state(policy, limits):
    """Every slot holds a 10-token request, prefilled (the next steps are decodes)."""
    n = MAX_SEQS
    ids = np.arange(n, dtype=np.int32)
    full = lambda v: np.full((n,), v, np.int32)  # noqa: E731
    state = add_requests(
        init_state(policy, n), ids, full(10), full(40), full(50), ids, np.ones((n,), bool)
    )
    none = np.zeros(n, bool)
    step = jax.jit(lambda s: update(policy, limits, *schedule(policy, limits, s), none))
    for _ in range(4):
        state = step(state)
    return state


def measure(name: str, policy, repeats: int, calls: int) -> dict:
    limits = SchedulerLimits(
        MAX_SEQS, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN
    )
    state = _decoding_state(policy, limits)
    la = np.zeros(MAX_SEQS, np.int32)
    cpu = []
    for _ in range(repeats):
        # A new jit and lowering each time: JAX caches a lowering's executable in memory.
        lowered = jax.jit(functools.partial(schedule, policy, limits)).lower(state, la)
        t0 = time.process_time()
        compiled = lowered.compile()
        cpu.append(time.process_time() - t0)
    lines = len(lowered.as_text().splitlines())
    jax.block_until_ready(compiled(state, la))
    # The best of 10 batches: on a shared machine the mean mostly measures the neighbours.
    per_batch = []
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(max(calls // 10, 1)):
            out = compiled(state, la)
        jax.block_until_ready(out)
        per_batch.append((time.perf_counter() - t0) / max(calls // 10, 1))
    us = min(per_batch) * 1e6
    cpu_s = " ".join(f"{c:.2f}" for c in cpu)
    print(f"{name:<18} {lines:>6} lines  compile CPU s: {cpu_s}  call: {us:.0f} us", flush=True)
    return dict(lines=lines, compile_cpu_s=cpu, call_us=us)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--seqs", type=int, default=0, help="bench.bench at N sequences (0: skip)")
    ap.add_argument("--only", nargs="*", help="policy names to measure")
    ap.add_argument("--engine-flags", action="store_true", help="XLA's default flags")
    a = ap.parse_args(argv)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"jax {jax.__version__}, XLA_FLAGS={flags!r}, load {' '.join(load)}")
    for name, policy in policies().items():
        if not a.only or name in a.only:
            measure(name, policy, a.repeats, a.calls)
    if a.seqs:
        n, bs = a.seqs, 16
        for name, blocks in (("roomy", n * 24 + 1), ("tight", n * 7 + 1 + n // 2)):
            policy = PagedPolicy(blocks, bs, n, 128, 0.01 if name == "roomy" else 0.0)
            cfg = SchedulerLimits(
                n, max_num_batched_tokens=max(2560, n * 100), max_num_seqs=n,
                max_model_len=128 * bs,
            )  # fmt: skip
            # The best of 3 runs (the compiled programs are reused): the machine is shared.
            runs = [bench(policy, cfg, n, 30) for _ in range(3)]
            d, lp, pre = min(r[0] for r in runs), min(r[1] for r in runs), runs[0][2]
            print(f"bench {n} seqs {name:<6} schedule+update: {d * 1e6:.0f} us/step dispatched,"
                  f" {lp * 1e6:.0f} us/step in a loop, {pre} preemptions", flush=True)  # fmt: skip
    with open("/proc/loadavg") as f:
        print("load after:", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
