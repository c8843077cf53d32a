"""The host's cost per sequence per step of 2023 vLLM (v0.1.2), measured on its own code.

An anchor for the ``vllm2023`` cost model that the paper's figures do not give: vLLM 0.1.x
did its per-step host work one sequence (group) at a time in Python, while the GPU
waited. Per step: the scheduler (block manager per sequence, a SequenceGroupMetadata per
group), the worker's input preparation (Python lists per sequence, then tensors), the
sampler's per-group loop (one multinomial and ``.tolist()`` / ``.item()`` per group: each
a GPU sync on the real system), ``scheduler.update``, incremental detokenization (the
output's tokens joined again every step), stop checks, a ``RequestOutput`` per group, and
in the API server, the ``AsyncLLMEngine`` waking each request's coroutine.

This script runs that code, unmodified, from vLLM 0.1.2's sdist (downloaded from PyPI and
checked against its sha256), with the GPU model replaced by nothing: hidden states are
random and the vocabulary is tiny (``--vocab``), so the sampler's tensor work is negligible
and what is timed is the host's Python and torch-dispatch work. N sequences decode at once
(prompts of ``--prompt-len`` tokens, random sampling at temperature 1 as vLLM's 2023
serving benchmark sent, ``ignore_eos``); the time per step is measured at several N and
fitted as a + c N. ``c`` is the per-sequence cost; ``a`` the per-step constant.

What it leaves out, so ``c`` is a lower bound for the 2023 GPU system: the GPU syncs'
latency (each ``.item()`` waits for a device-to-host copy), the host-to-device copies of
the input tensors, the API server's ``await request.is_disconnected()`` per output, and
Python 3.8-3.10's slower interpreter (this runs on the venv's Python, 3.11 here).

The tokenizer is a byte-level BPE like OPT's (OPT's own files are not reachable here):
``--tokenizer-json`` (default: the first tokenizer in pagedjax's cache, sorted by name;
SmolLM2's where only it was cached). With the 64-token vocabulary the sampled ids are
SmolLM2's special tokens and single characters, so detokenization runs on 1-character
tokens: its per-token cost is a floor. transformers 4.31,
which vLLM 0.1.2 ran with, gave fast tokenizers no ``added_tokens_encoder``, so vLLM took
its fast path (``convert_tokens_to_string`` of the whole output every step); the tokenizer
is wrapped to hide that attribute from today's transformers (``--slow-detok`` keeps it).

Run it with a Python that has torch and transformers (pagedjax itself is not needed):

    /work/vllm311/bin/python experiments/vllm2023_host_cost.py [--mode server]

Output: a table of ms per step by N and the fit, and a last line ``seq_overhead_us: C``.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import hashlib
import os
import sys
import tarfile
import time
import types
import urllib.request
from pathlib import Path

SDIST_URL = (
    "https://files.pythonhosted.org/packages/f9/ed/"
    "1e4625f290e24c1381aeeb66620b32755b17f2894a4227fb49fb20fa0ec9/vllm-0.1.2.tar.gz"
)
SDIST_SHA256 = "6fff59a918ec822c3d7a9060c3af5604a1bbf26ec4db15656678768019aefad7"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedjax"


def fetch_sdist() -> Path:
    """vLLM 0.1.2's source tree, unpacked under the cache (downloaded once)."""
    tgz = CACHE / "vllm-0.1.2.tar.gz"
    if not tgz.exists():
        tgz.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(SDIST_URL, timeout=60) as r:
            data = r.read()
        tgz.write_bytes(data)
    digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{tgz}: sha256 {digest} != PyPI's {SDIST_SHA256}")
    root = CACHE / "vllm-0.1.2"
    if not (root / "vllm").is_dir():
        with tarfile.open(tgz) as t:
            t.extractall(CACHE, filter="data")
    return root


class _Stub(types.ModuleType):
    """A module whose every attribute is a placeholder class (compiled kernels, xformers,
    ray: imported by modules this script loads, never called)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def load_vllm(root: Path) -> types.SimpleNamespace:
    """Import vLLM 0.1.2's host modules from ``root`` without its package __init__ (which
    would load the GPU model code and ray)."""
    import torch

    for name in (
        "xformers",
        "xformers.ops",
        "ray",
        "vllm.cache_ops",
        "vllm.attention_ops",
        "vllm.activation_ops",
        "vllm.layernorm_ops",
        "vllm.pos_encoding_ops",
        "vllm.model_executor.model_loader",
    ):
        sys.modules.setdefault(name, _Stub(name))
    pkg = types.ModuleType("vllm")
    pkg.__path__ = [str(root / "vllm")]
    sys.modules["vllm"] = pkg
    # The worker builds its inputs with torch.cuda.*Tensor; on the CPU: torch's own.
    torch.cuda.LongTensor = torch.LongTensor
    torch.cuda.IntTensor = torch.IntTensor
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig
    from vllm.core.scheduler import Scheduler
    from vllm.engine.async_llm_engine import AsyncLLMEngine
    from vllm.engine.llm_engine import LLMEngine
    from vllm.model_executor.layers import sampler as sampler_module
    from vllm.model_executor.layers.sampler import Sampler
    from vllm.sampling_params import SamplingParams
    from vllm.utils import Counter
    from vllm.worker.worker import Worker

    # At one GPU the tensor-parallel gather returns its input (it needs no process group).
    sampler_module.gather_from_tensor_model_parallel_region = lambda logits: logits
    return types.SimpleNamespace(
        CacheConfig=CacheConfig,
        ParallelConfig=ParallelConfig,
        SchedulerConfig=SchedulerConfig,
        Scheduler=Scheduler,
        AsyncLLMEngine=AsyncLLMEngine,
        LLMEngine=LLMEngine,
        Sampler=Sampler,
        SamplingParams=SamplingParams,
        Counter=Counter,
        Worker=Worker,
    )


class Tokenizer2023:
    """A fast tokenizer as transformers 4.31 presented it to vLLM 0.1.2: no
    ``added_tokens_encoder`` attribute, so detokenize_incrementally takes its fast path."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name: str):
        if name == "added_tokens_encoder":
            raise AttributeError(name)
        return getattr(self._tok, name)


def make_tokenizer(path: str | None, slow_detok: bool):
    from transformers import PreTrainedTokenizerFast

    if path is None:
        found = sorted(glob.glob(str(CACHE / "tokenizers" / "*.json")))
        if not found:
            raise SystemExit("no tokenizer JSON cached; pass --tokenizer-json")
        path = found[0]
    import json

    from tokenizers import Tokenizer

    doc = json.loads(Path(path).read_text())
    # pagedjax's cache wraps tokenizer.json's text under "backend"; a plain file is its own.
    backend = doc["backend"] if "backend" in doc else json.dumps(doc)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend))
    return tok if slow_detok else Tokenizer2023(tok)


class HostOnlyWorker:
    """vLLM 0.1.2's Worker.execute_model without the model: its own _prepare_inputs, then
    its own Sampler on random hidden states of a tiny vocabulary."""

    def __init__(self, v, block_size: int, vocab: int, hidden: int = 8) -> None:
        import torch

        self.torch = torch
        self.block_size = block_size
        self.hidden = hidden
        self.prepare = v.Worker._prepare_inputs
        self.sampler = v.Sampler(vocab)
        self.embedding = torch.randn(vocab, hidden)

    def execute_model(
        self, seq_group_metadata_list, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy
    ):
        torch = self.torch
        with torch.inference_mode():
            tokens, _positions, meta = self.prepare(self, seq_group_metadata_list)
            hidden = torch.randn(tokens.shape[0], self.hidden)
            return self.sampler(self.embedding, hidden, meta)


def make_engine(v, tokenizer, a):
    """An LLMEngine of vLLM 0.1.2 with the paper's scheduler settings and the worker above."""
    eng = v.LLMEngine.__new__(v.LLMEngine)
    eng.cache_config = v.CacheConfig(
        block_size=a.block_size, gpu_memory_utilization=0.9, swap_space=4
    )
    eng.cache_config.num_gpu_blocks = a.kv_slots // a.block_size
    eng.cache_config.num_cpu_blocks = 4096 * 16 // a.block_size
    eng.scheduler_config = v.SchedulerConfig(a.max_batched_tokens, 256, 2048)
    eng.parallel_config = v.ParallelConfig(1, 1, False)
    eng.log_stats = not a.no_log_stats
    eng.tokenizer = tokenizer
    eng.seq_counter = v.Counter()
    eng.workers = [HostOnlyWorker(v, a.block_size, a.vocab)]
    eng.scheduler = v.Scheduler(eng.scheduler_config, eng.cache_config, eng.log_stats)
    return eng


def serving_params(v):
    """vLLM's 2023 serving benchmark's request: temperature 1, top_p 1, ignore_eos (and
    outputs that never finish while timed)."""
    return v.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=100_000, ignore_eos=True)


def random_prompt(a, rng) -> list[int]:
    return [int(x) for x in rng.integers(100, 20_000, a.prompt_len)]


def add_requests(v, eng, n: int, a, rng) -> None:
    for i in range(n):
        eng.add_request(f"r{i}", None, serving_params(v), prompt_token_ids=random_prompt(a, rng))


def time_engine(v, tokenizer, a, n: int, rng) -> float:
    """Seconds per decode step of LLMEngine.step with n sequences decoding."""
    eng = make_engine(v, tokenizer, a)
    add_requests(v, eng, n, a, rng)
    while eng.scheduler.waiting:  # the prompts (not timed)
        eng.step()
    for _ in range(a.warmup_steps):
        eng.step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    assert len(eng.scheduler.running) == n, "every sequence must still be decoding"
    times.sort()
    return times[len(times) // 2]


def time_server(v, tokenizer, a, n: int, rng) -> float:
    """Seconds per decode step through AsyncLLMEngine with n concurrent generate() callers
    (the API server's non-streaming loop, without its is_disconnected check)."""
    eng = v.AsyncLLMEngine.__new__(v.AsyncLLMEngine)
    eng.worker_use_ray = eng.engine_use_ray = False
    eng.log_requests = False
    eng.engine = make_engine(v, tokenizer, a)
    eng.request_outputs, eng.request_events = {}, {}
    eng.is_engine_running, eng.kicking_request_id = False, None
    params = serving_params(v)
    total = a.warmup_steps + a.steps + 1
    stamps: list[float] = []
    running: list[int] = []  # sequences decoding at the last timed step

    async def client(i: int) -> None:
        prompt = random_prompt(a, rng)
        final = None
        async for out in eng.generate(None, params, f"r{i}", prompt_token_ids=prompt):
            final = out
            if i == 0:
                stamps.append(time.perf_counter())
                if len(stamps) >= total:
                    running.append(len(eng.engine.scheduler.running))
                    break
        return final

    async def main() -> None:
        tasks = [asyncio.create_task(client(i)) for i in range(n)]
        await tasks[0]
        # Abort every request first: a surviving generate() would keep stepping the
        # engine until the sequences hit max_seq_len (thousands of untimed steps).
        for i in range(n):
            await eng.abort(f"r{i}")
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)

    asyncio.run(main())
    assert running == [n], f"{running} of {n} decoding: the pool is too small (preemption)"
    gaps = sorted(
        b - c
        for b, c in zip(stamps[a.warmup_steps + 1 :], stamps[a.warmup_steps : -1], strict=True)
    )
    return gaps[len(gaps) // 2]


def fit(ns: list[int], secs: list[float]) -> tuple[float, float]:
    import numpy as np

    c, a0 = np.polyfit(np.asarray(ns, float), np.asarray(secs, float), 1)
    return float(a0), float(c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["engine", "server"], default="server")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--prompt-len", type=int, default=19, help="tokens (Alpaca's mean: 19.3)")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument(
        "--steps",
        type=int,
        default=40,
        help="timed steps; outputs grow from warmup+1 to warmup+steps tokens",
    )
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-slots", type=int, default=15728, help="OPT-13B on an A100-40GB")
    ap.add_argument("--max-batched-tokens", type=int, default=2560)
    ap.add_argument(
        "--no-log-stats",
        action="store_true",
        help="the server's default logs stats; this turns them off",
    )
    ap.add_argument("--tokenizer-json")
    ap.add_argument(
        "--slow-detok",
        action="store_true",
        help="keep today's added_tokens_encoder (vLLM's slow detokenize loop)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="per N; the median is kept")
    a = ap.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    v = load_vllm(fetch_sdist())
    tokenizer = make_tokenizer(a.tokenizer_json, a.slow_detok)
    rng = np.random.default_rng(0)
    timer = time_server if a.mode == "server" else time_engine
    print(
        f"vLLM 0.1.2 host path, mode {a.mode}, Python {sys.version.split()[0]}, torch "
        f"{torch.__version__}, prompt {a.prompt_len} tokens, outputs "
        f"{a.warmup_steps + 1}-{a.warmup_steps + a.steps} tokens while timed, "
        f"{'slow' if a.slow_detok else 'fast (2023)'} detokenize, "
        f"log_stats {not a.no_log_stats}, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    ns, secs = [], []
    print("| running sequences | ms per step (median of repeats) | repeats, ms |")
    print("|---|---|---|")
    for n in a.batch_sizes:
        rep = [timer(v, tokenizer, a, n, rng) for _ in range(a.repeats)]
        med = sorted(rep)[len(rep) // 2]
        ns.append(n)
        secs.append(med)
        print(
            f"| {n} | {1e3 * med:.3f} | {' / '.join(f'{1e3 * r:.3f}' for r in rep)} |", flush=True
        )
    a0, c = fit(ns, secs)
    resid = max(abs(s - (a0 + c * n)) / s for n, s in zip(ns, secs, strict=True))
    print(
        f"fit: {1e3 * a0:.3f} ms + {1e6 * c:.1f} us x sequences (worst relative residual "
        f"{100 * resid:.1f} %); load {os.getloadavg()[0]:.2f}"
    )
    print(f"seq_overhead_us: {1e6 * c:.1f}")


if __name__ == "__main__":
    main()
