"""CPU seconds per output token: the engine core process against offline ``LLM.generate``.

    PYTHONPATH=. python benchmarks/core_cpu.py                     # SmolLM2-135M, float32
    PYTHONPATH=. python benchmarks/core_cpu.py --model tiny-llama --num-prompts 16
    PYTHONPATH=. python benchmarks/core_cpu.py --profile /tmp/p   # cProfile: /tmp/p, /tmp/p.offline

Why (issue 30): with the server's workload (random 128 in / 64 out, 64 requests at once,
SmolLM2-135M float32) the engine core process used 55 CPU s where offline ``LLM.generate``
used 34 CPU s for the same 4,096 output tokens, and the API process 1 CPU s. This script
reproduces that without HTTP or vLLM's client, in one invocation so both see the same
machine: on a shared box CPU seconds (user + system of the process, all its threads) are
comparable where wall time is not.

- offline: ``LLM(model, dtype, max_model_len, kv_cache_memory_bytes)`` in this process, one
  untimed ``generate`` of the requests, then the timed one; CPU seconds of this process.
- core: the server's path without HTTP: ``AsyncLLMEngine(MPEngineClient(config))`` on the
  same EngineConfig, one untimed round, then the timed round: ``--num-prompts`` asyncio
  tasks, task i calling ``generate`` after ``i * --arrival-ms`` (0: all at once, as
  ``LLM.generate``; a few ms: requests trickle in as they do through the HTTP server).
  CPU seconds of the core process (``/proc/<pid>/stat``) and of this process.

``--burn-duty f`` adds a process busy a fraction f of every 10 ms (both runs, or the core's
only with ``--burn-core-only``: as vLLM's client and the API process share the cores with
the server's core and not with offline ``LLM.generate``).

Both get the same token-id prompts (seeded random ids, ``--input-len`` each), greedy,
``ignore_eos``, ``max_tokens=--output-len``. Each side's engine iterations are recorded by a
step observer (in the core process, installed by wrapping ``run_core``): steps, tokens,
and the token positions the compiled buckets padded them to. Printed: one line per run and
the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

OBSERVE_ENV = "PAGEDJAX_BENCH_CORE_STEPS"  # the core's step records go to this file
PROFILE_ENV = "PAGEDJAX_BENCH_CORE_PROFILE"  # cProfile of the core's loop to this file


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _step_summary(records: list[tuple]) -> dict[str, Any]:
    """records: (num_tokens, num_seqs, padded tokens T, padded seqs S, perf_counter when the
    step ended) per iteration; gaps: ms between consecutive step ends, by bucket."""
    a = np.asarray([r[:4] for r in records], np.int64).reshape(-1, 4)
    ends = np.asarray([r[4] for r in records], np.float64)
    gaps: dict[str, list[float]] = {}
    for i in range(1, len(records)):
        gaps.setdefault(f"{a[i, 2]}x{a[i, 3]}", []).append(1000 * (ends[i] - ends[i - 1]))
    return dict(
        gap_ms={k: [round(float(np.median(v)), 1), len(v)] for k, v in sorted(gaps.items())},
        steps=len(a), computed_tokens=int(a[:, 0].sum()), padded_tokens=int(a[:, 2].sum()),
        prefill_steps=int((a[:, 0] > a[:, 1]).sum()),
        buckets=sorted({(int(t), int(s)) for t, s in a[:, 2:]}),
    )  # fmt: skip


def _observer(engine: Any, sink: list) -> Any:
    from pagedjax.engine.buckets import pick, seqs_for_tokens

    def observe(rec: Any) -> None:
        t = pick(engine.token_buckets, max(rec.num_tokens, 1))
        sink.append((rec.num_tokens, rec.num_seqs, t, seqs_for_tokens(engine.seq_buckets, t),
                     time.perf_counter()))

    return observe


def observed_core(*args: Any, **kwargs: Any) -> None:
    """``core_process.run_core`` with a step observer (and cProfile with PROFILE_ENV) on
    its engine; the records are written when the loop ends (the client's "stop")."""
    from pagedjax.engine import core_process

    run = core_process.CoreLoop.run

    def run_observed(self: Any) -> int:
        records: list = []
        engine = self.engine
        engine.add_step_observer(_observer(engine, records))
        reset = engine.reset_stats

        def reset_stats() -> None:  # the driver's mark: the timed round starts
            records.clear()
            reset()

        engine.reset_stats = reset_stats
        prof = cProfile.Profile() if os.environ.get(PROFILE_ENV) else None
        code = run(self) if prof is None else prof.runcall(run, self)
        if prof is not None:
            prof.dump_stats(os.environ[PROFILE_ENV])
        Path(os.environ[OBSERVE_ENV]).write_text(json.dumps(records))
        return code

    core_process.CoreLoop.run = run_observed  # type: ignore[method-assign]
    core_process.run_core(*args, **kwargs)


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    # Ids from the middle of the vocabulary: no special tokens at the low end.
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, input_len).tolist()}
            for _ in range(n)]  # fmt: skip


def run_offline(args: argparse.Namespace, kv: dict) -> tuple[dict, list]:
    from pagedjax import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, **kv)
    engine = llm.llm_engine
    vocab = engine.arch.vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    warm_sp = SamplingParams(max_tokens=args.warm_output_len, ignore_eos=True, temperature=0.0)
    llm.generate(make_prompts(args.num_prompts, args.input_len, vocab, args.seed + 1), warm_sp,
                 use_tqdm=False)  # fmt: skip
    records: list = []
    engine.add_step_observer(_observer(engine, records))
    prof = cProfile.Profile() if args.profile else None
    t, cpu = time.perf_counter(), time.process_time()
    if prof is None:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        outs = prof.runcall(llm.generate, prompts, sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    if prof is not None:
        prof.dump_stats(f"{args.profile}.offline")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = dict(cpu_s=cpu, wall_s=wall, tokens=tokens, **_step_summary(records))
    ids = [o.outputs[0].token_ids for o in outs]
    del llm, engine
    return res, ids


async def _drive(engine: Any, prompts: list, sp: Any, gap_s: float, tag: str) -> list:
    async def one(i: int, prompt: dict) -> list[int]:
        await asyncio.sleep(i * gap_s)
        last = None
        async for out in engine.generate(prompt, sp, f"{tag}-{i}"):
            last = out
        return list(last.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def run_core(args: argparse.Namespace, kv: dict, steps_file: str) -> tuple[dict, list]:
    from pagedjax import SamplingParams
    from pagedjax.engine import core_client
    from pagedjax.engine.core_client import MPEngineClient
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.llm import engine_config

    core_client.run_core = observed_core  # the spawned core runs it (a module function)
    config = engine_config(args.model, dtype=args.dtype, max_model_len=args.max_model_len, **kv)
    client = MPEngineClient(config)
    pid = client.pids[0]
    engine = AsyncLLMEngine(client)
    vocab = client.vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    gap = args.arrival_ms / 1000
    warm = make_prompts(args.num_prompts, args.input_len, vocab, args.seed + 1)
    warm_sp = SamplingParams(max_tokens=args.warm_output_len, ignore_eos=True, temperature=0.0)
    asyncio.run(_drive(engine, warm, warm_sp, gap, "warm"))
    engine.call_future(lambda c: c.reset_stats()).result()  # the core drops its records
    c0, a0, t0 = _proc_cpu_s(pid), time.process_time(), time.perf_counter()
    ids = asyncio.run(_drive(engine, prompts, sp, gap, "timed"))
    wall = time.perf_counter() - t0
    cpu, api = _proc_cpu_s(pid) - c0, time.process_time() - a0
    idle0 = _proc_cpu_s(pid)
    time.sleep(1.0)
    idle = _proc_cpu_s(pid) - idle0
    engine.shutdown()
    records = json.loads(Path(steps_file).read_text())
    res = dict(cpu_s=cpu, api_cpu_s=api, idle_cpu_s_per_s=idle, wall_s=wall,
               tokens=sum(len(x) for x in ids), **_step_summary(records))  # fmt: skip
    return res, ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warm-output-len", type=int, default=16, help="untimed rounds' tokens")
    ap.add_argument("--arrival-ms", type=float, default=0.0, help="gap between requests")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--profile", default=None, help="cProfile the core's loop to this file")
    ap.add_argument(
        "--burn-duty",
        type=float,
        default=0.0,
        help="a competing process busy this fraction of each 10 ms (both runs)",
    )
    ap.add_argument("--burn-core-only", action="store_true", help="the burner in the core run only")
    args = ap.parse_args(argv)
    kv = {"kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}
    load0 = os.getloadavg()
    steps_file = tempfile.mktemp(suffix=".json", prefix="core-steps-")
    os.environ[OBSERVE_ENV] = steps_file
    if args.profile:
        os.environ[PROFILE_ENV] = str(Path(args.profile).resolve())
    results: dict[str, Any] = {}
    offline_ids = None
    burner = None

    def start_burner() -> Any:  # another process on the cores, as the HTTP client and API are
        busy, rest = 0.01 * args.burn_duty, 0.01 * (1 - args.burn_duty)
        code = (f"import time\nwhile True:\n t = time.perf_counter() + {busy}\n"
                f" while time.perf_counter() < t: pass\n time.sleep({rest})")  # fmt: skip
        return subprocess.Popen([sys.executable, "-c", code])

    if args.burn_duty > 0 and not args.burn_core_only:
        burner = start_burner()
    if not args.skip_offline:
        results["offline"], offline_ids = run_offline(args, kv)
    if args.burn_duty > 0 and args.burn_core_only:  # as the HTTP client shares the server's
        burner = start_burner()
    try:
        results["core"], core_ids = run_core(args, kv, steps_file)
    finally:
        if burner is not None:
            burner.kill()
    load1 = os.getloadavg()
    for name, r in results.items():
        per = 1000 * r["cpu_s"] / max(r["tokens"], 1)
        extra = (f", API process {r['api_cpu_s']:.1f} CPU s, idle core "
                 f"{r['idle_cpu_s_per_s']:.3f} CPU s/s" if name == "core" else "")  # fmt: skip
        print(f"{name:8s} {r['cpu_s']:6.1f} CPU s for {r['tokens']} tokens = {per:.2f} ms/token;"
              f" wall {r['wall_s']:.1f} s; {r['steps']} steps ({r['prefill_steps']} with prefill),"
              f" {r['computed_tokens']} tokens computed in {r['padded_tokens']} padded"
              f" positions{extra}")  # fmt: skip
        print(f"         buckets (T, S): {r['buckets']}")
        print(f"         median ms between step ends, by bucket [ms, steps]: {r['gap_ms']}")
    if offline_ids is not None:
        print(f"outputs equal: {offline_ids == core_ids}")
        ratio = results["core"]["cpu_s"] / max(results["offline"]["cpu_s"], 1e-9)
        print(f"core / offline CPU s: {ratio:.2f}")
    print(f"load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(json.dumps(results, default=str))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
