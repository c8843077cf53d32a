"""Ablation (b): a scheduling priority of our own, plugged into the jitted scheduler.

    python examples/custom_priority.py [--tiny]

A priority is a function ``(state, config) -> tuple of int32[max_seqs]`` sort keys over
the scheduler's state arrays (lower runs first; ties by arrival). It runs inside the
jitted ``schedule``, so it must be jax code and hashable (a module-level function is).
Here: shortest prompt first, against FCFS, on the same synthetic ShareGPT-like load in
the simulator (chunked-prefill mode: the paper's mode is FCFS only). Simulated numbers.
"""

from __future__ import annotations

import argparse
import dataclasses

import pagedjax as pj


def shortest_prompt_first(state, config):
    """Requests with shorter prompts go first (and are preempted last)."""
    del config
    return (state.prompt_len,)


def main(tiny: bool = False) -> dict:
    w = pj.make_workload("sharegpt", rate=2.0 if tiny else 3.0, duration_s=30 if tiny else 300,
                         seed=0)  # fmt: skip
    policy, paper_cfg = pj.build_system("paged")
    out = {}
    for name, priority in (("fcfs", "fcfs"), ("shortest_prompt", shortest_prompt_first)):
        cfg = dataclasses.replace(paper_cfg, mode="default", priority=priority)
        out[name] = pj.simulate_system((policy, cfg), w).metrics()
        m = out[name]
        print(f"{name:<16} mean latency {m['mean_latency_s']:7.2f} s, TTFT"
              f" {m['mean_ttft_s']:6.2f} s, {m['finished']} finished (simulated)")  # fmt: skip
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="30 s of load (CI)")
    main(ap.parse_args().tiny)
