"""One process of a two-process run on localhost (tests/test_multihost.py starts two).

    python tests/multihost_case.py PROCESS_ID PORT [--die-after N | --pp2 | --pp2-mb2]

Each process sees 2 CPU devices; after ``multihost.initialize`` the mesh spans all 4, and
TP 4 runs across both processes (CPU collectives over gloo). Process 0 leads: it adds the
mixed workload of tests/parallel_cases.py (swap off: multi-process engines preempt by
recompute) through ``MultiHostEngine``, process 1 follows. After ``shutdown`` the leader
runs the same workload on one local device and prints one JSON line comparing them.
``--die-after N``: the follower kills itself (SIGKILL) after N steps, so the leader's
failure path can be timed. ``--pp2``: pipeline parallelism across the processes instead
(PP 2 x TP 2 on tests/pipeline_cases.py's 4-layer Llama: stage 0 on process 0's devices,
stage 1 on process 1's, the activations passed between them by ``ppermute`` over gloo).
``--pp2-mb2``: the same with ``pipeline_microbatches=2``.
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
    mb = 2 if "--pp2-mb2" in sys.argv else 1
    pp2 = "--pp2" in sys.argv or mb > 1
    if pp2:
        import pipeline_cases as ppc

        build = lambda n: ppc.engine(4, pp=2 if n > 1 else 1, tp=2 if n > 1 else 1,  # noqa: E731
                                     swap_space=0.0, mb=mb if n > 1 else 1)
    else:
        build = lambda n: pc.engine("tiny-llama-tp", n, swap_space=0.0)  # noqa: E731
    eng = multihost.MultiHostEngine(build(4))
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
    ref, _ = pc.drain(build(1), pc.workload(eng.arch.vocab_size))
    stats = eng.stats()
    stages = None
    if pp2:  # each stage's devices belong to one process
        stages = [sorted({d.process_index for d in row.flat})
                  for row in eng.placement.pipeline.tp.mesh.devices]  # fmt: skip
    print(json.dumps({"process": 0, "equal": outs == ref, "outs": outs, "ref": ref,
                      "stage_processes": stages,
                      "preemptions": stats["preemptions_recompute"],
                      "prefix_hits": stats["prefix_cache_hit_tokens"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
