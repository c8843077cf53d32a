"""One process of a two-process run on localhost (tests/test_multihost.py starts two).

    python tests/multihost_case.py PROCESS_ID PORT [--die-after N]

Each process sees 2 CPU devices; after ``multihost.initialize`` the mesh spans all 4, and
TP 4 runs across both processes (CPU collectives over gloo). Process 0 leads: it adds the
mixed workload of tests/parallel_cases.py (swap off: multi-process engines preempt by
recompute) through ``MultiHostEngine``, process 1 follows. After ``shutdown`` the leader
runs the same workload on one local device and prints one JSON line comparing them.
``--die-after N``: the follower kills itself (SIGKILL) after N steps, so the leader's
failure path can be timed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# Two simulated devices, after the parent's flags (tests/conftest.py's compile flags).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("PAGEDJAX_WARMUP", "none")

from pagedjax.engine.fronts import multihost  # noqa: E402


def main() -> None:
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    die_after = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--die-after" else None
    multihost.initialize(f"localhost:{port}", 2, pid, heartbeat_timeout_s=5)
    import jax

    sys.path.insert(0, os.path.dirname(__file__))
    import parallel_cases as pc

    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    eng = multihost.MultiHostEngine(pc.engine("tiny-llama-tp", 4, swap_space=0.0))
    if pid != 0:
        if die_after is not None:
            eng.follow(max_steps=die_after)
            print(json.dumps({"dying_at": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        steps = eng.follow()
        print(json.dumps({"process": pid, "steps": steps}), flush=True)
        return
    outs, _ = pc.drain(eng, pc.workload(eng.arch.vocab_size))
    eng.shutdown()
    ref, _ = pc.drain(pc.engine("tiny-llama-tp", 1, swap_space=0.0),
                      pc.workload(eng.arch.vocab_size))  # fmt: skip
    stats = eng.stats()
    print(json.dumps({"process": 0, "equal": outs == ref, "outs": outs, "ref": ref,
                      "preemptions": stats["preemptions_recompute"],
                      "prefix_hits": stats["prefix_cache_hit_tokens"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
