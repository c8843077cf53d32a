"""Time schedule + update per step with 256 running sequences (decode phase).

    python -m pagedjax.scheduler.bench [--seqs 256] [--steps 50]

Prints the time per step for each (memory policy, mode): dispatched once per step from
Python (as the engine does), and K steps inside one ``lax.fori_loop`` (as the simulator
and a multi-step decode loop do). A tight pool row adds preemption pressure.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.scheduler import SchedulerLimits, add_requests, init_state, schedule, update
from pagedjax.scheduler.counting_policy import CountingPolicy


def _running_state(policy, cfg: SchedulerLimits, seqs: int, prompt: int, out: int):
    """``seqs`` requests of ``prompt`` tokens (max_tokens ``out``), prefilled."""
    ids = jnp.arange(seqs, dtype=jnp.int32)
    full = lambda v: jnp.full((seqs,), v, jnp.int32)
    state = add_requests(
        init_state(policy, cfg.max_seqs),
        ids,
        full(prompt),
        full(out),
        full(prompt + out),
        ids,
        jnp.ones((seqs,), bool),
    )
    step = jax.jit(_step, static_argnums=(0, 1))
    while True:  # prefill until every sequence runs
        state = step(policy, cfg, state)
        if int(jnp.sum(state.num_computed >= prompt)) == seqs:
            return state


def _step(policy, cfg, state):
    state, batch = schedule(policy, cfg, state)
    return update(policy, cfg, state, batch, jnp.zeros((cfg.max_seqs,), bool))


def _loop(policy, cfg, state, k: int):
    return lax.fori_loop(0, k, lambda _, s: _step(policy, cfg, s), state)


def bench(policy, cfg, seqs: int, steps: int, prompt: int = 100) -> tuple[float, float, int]:
    state = _running_state(policy, cfg, seqs, prompt, out=10_000)
    step = jax.jit(_step, static_argnums=(0, 1))
    s = jax.block_until_ready(step(policy, cfg, state))  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        s = step(policy, cfg, s)
    jax.block_until_ready(s)
    per_dispatch = (time.perf_counter() - t0) / steps
    loop = jax.jit(_loop, static_argnums=(0, 1, 3))
    jax.block_until_ready(loop(policy, cfg, state, steps))
    t0 = time.perf_counter()
    s2 = jax.block_until_ready(loop(policy, cfg, state, steps))
    per_loop = (time.perf_counter() - t0) / steps
    return per_dispatch, per_loop, int(jnp.sum(s2.num_preemptions))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    n = a.seqs
    bs = 16
    roomy = (n * 24) + 1  # blocks: every sequence can grow past 300 tokens
    tight = n * 7 + 1 + n // 2  # 100-token prompts (7 blocks) fill it: decodes preempt
    rows = [
        ("counting", CountingPolicy(n, (roomy - 1) * bs, unit=bs), "default"),
        ("paged", PagedPolicy(roomy, bs, n, 128, 0.01), "default"),
        ("paged", PagedPolicy(roomy, bs, n, 128, 0.01), "paper"),
        ("paged tight", PagedPolicy(tight, bs, n, 128, 0.0), "default"),
    ]
    print(f"schedule+update per step, {n} running sequences, {jax.devices()[0].platform}")
    print(f"{'policy':<12} {'mode':<8} {'dispatch/step':>14} {'in-loop/step':>13} preempt")
    for name, policy, mode in rows:
        cfg = SchedulerLimits(
            n,
            max_num_batched_tokens=max(2560, n * 100),
            max_num_seqs=n,
            max_model_len=128 * bs,
            mode=mode,
        )
        d, lp, pre = bench(policy, cfg, n, a.steps)
        print(f"{name:<12} {mode:<8} {d * 1e3:>11.3f} ms {lp * 1e3:>10.3f} ms {pre:>7}")


if __name__ == "__main__":
    main()
