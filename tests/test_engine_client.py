"""Engine clients: the EngineClient protocol, and the engine core in a process of its own
(``MPEngineClient``, the server's default).

On test_server.py's tiny llama and geometry (so no new compilation shapes: the core
process loads the programs from the session's persistent compilation cache): outputs
through the core process equal ``LLM.generate``'s RequestOutputs field for field (greedy
and a stop string; in the slow tier also logprobs, n > 1 seeded samples, token-id
prompts; prompt logprobs in the encoder's round trip), streamed outputs
grow towards them; an abandoned stream aborts the request in the core and frees its
blocks; /metrics reads the core; killing the core fails the request in flight with the
exit code, /health answers 503 and new requests 500 at once, and no process is left.
The slow tier serves ``pagedjax serve --data-parallel-size 2 --speculative-config ...``
in a subprocess (two core processes on two simulated CPU devices) and checks concurrent
greedy streams against a single engine, then that SIGTERM leaves no process behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.engine.core_client import MPEngineClient
from pagedjax.engine.core_process import OutputDecoder, OutputEncoder
from pagedjax.engine.fronts.data_parallel import DataParallelEngine, merge_counts, merge_stats
from pagedjax.engine.fronts.multihost import MultiHostEngine
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedjax.engine.protocol import ENGINE_CLIENT_MEMBERS, EngineClient, EngineDeadError
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.llm import engine_config
from pagedjax.entrypoints.openai.api_server import build_app
from pagedjax.entrypoints.openai.metrics import ServerMetrics
from tests.engine_helpers import free_port, wait_healthy, xla_flags_with_devices
from tests.model_helpers import save_tiny_hf_model, save_tiny_tokenizer
from tests.test_server import _serve

NAME = "tiny-chat"
# test_server.py's geometry: the same compiled programs.
GEOMETRY = dict(dtype="float32", block_size=8, max_model_len=128, max_num_seqs=32,
                max_num_batched_tokens=64, num_gpu_blocks_override=600, seed=0)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat_model_mp")
    save_tiny_hf_model("llama", d)
    save_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **GEOMETRY)


@dataclasses.dataclass
class MP:
    client: MPEngineClient
    engine: AsyncLLMEngine
    url: str
    server: Any
    thread: Any

    def call(self, fn):
        return self.engine.call_future(fn).result(timeout=120)


@pytest.fixture(scope="module")
def mp(model_dir):
    client = MPEngineClient(engine_config(model=str(model_dir), **GEOMETRY))
    metrics = ServerMetrics(NAME)
    engine = AsyncLLMEngine(client, stats=metrics)
    server, thread, url = _serve(build_app(engine, [NAME], metrics=metrics))
    yield MP(client, engine, url, server, thread)
    server.should_exit = True
    thread.join(30)
    pids = client.pids
    engine.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ the protocol


def test_every_engine_implements_the_protocol(llm, mp):
    assert isinstance(llm.llm_engine, LLMEngine) and isinstance(llm.llm_engine, EngineClient)
    assert isinstance(mp.client, EngineClient)
    # Classes not built here: every member is a method or property of the class or an
    # attribute its __init__ sets (MultiHostEngine forwards the rest to its engine).
    for cls in (LLMEngine, DataParallelEngine, MultiHostEngine, MPEngineClient):
        init = inspect.getsource(cls.__init__)
        for name in ENGINE_CLIENT_MEMBERS:
            assert (
                hasattr(cls, name) or f"self.{name}" in init
                or "__getattr__" in vars(cls)  # MultiHostEngine: its engine's
            ), (cls.__name__, name)  # fmt: skip
    with pytest.raises(AttributeError):
        AsyncLLMEngine.new_request_id  # noqa: B018 - removed (dead code)


def test_encoder_decoder_round_trip_with_stop_truncation():
    """The compact deltas rebuild the outputs exactly, also when a stop string cuts text
    that was already sent and when logprobs and prompt logprobs arrive late."""
    lp = {5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.0, 2, "b")}
    steps = [
        [RequestOutput("r", "p", [1, 2], None, [
            CompletionOutput(0, "ab", [5], -0.1, [lp]),
            CompletionOutput(1, "x", [7], -2.0, [lp])])],
        [RequestOutput("r", "p", [1, 2], [None, lp], [
            CompletionOutput(0, "abcd", [5, 7], -2.1, [lp, lp]),
            CompletionOutput(1, "xyz", [7, 5], -2.1, [lp, lp])])],
        [RequestOutput("r", "p", [1, 2], [None, lp], [
            CompletionOutput(0, "abc", [5, 7, 5], -2.2, [lp, lp, lp], "stop", "d"),
            CompletionOutput(1, "xyzw", [7, 5, 5], -2.2, [lp, lp, lp], "length")],
            finished=True)],
    ]  # fmt: skip
    # The structured-output backend and mask path travel with the request's head (issue 33).
    steps = [[dataclasses.replace(o, structured_output_backend="xgrammar",
                                  structured_output_path="device_fsm") for o in outs]
             for outs in steps]  # fmt: skip
    enc, dec = OutputEncoder(), OutputDecoder()
    for outs in steps:
        assert dec.decode(enc.encode(outs)) == outs
    assert not enc.sent and not dec.requests  # finished requests are forgotten


@pytest.mark.tier2  # second tier (docs/testing.md): 22 s cold
def test_client_side_detokenization_equals_in_process(llm):
    """The core's engine does not detokenize; the client's decoder detokenizes, matches
    stop strings (cutting tokens the core ran past them, e.g. in a K-step run), and its
    stop_samples calls end those samples in the engine: outputs equal the in-process
    engine's field for field, and the engine ends with every block free. Run on the
    in-process engine with detokenization switched off (no process: the same programs)."""
    engine = llm.llm_engine
    free = engine.num_free_blocks()
    free_text = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)
    texts = [c.text for c in llm.generate("a", free_text, use_tqdm=False)[0].outputs]
    stop = next(texts[0][i : i + 2] for i in range(3, len(texts[0]) - 1)
                if texts[0][i : i + 2].strip())  # fmt: skip
    greedy = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12,
                          ignore_eos=True), use_tqdm=False)[0].outputs[0].text  # fmt: skip
    gstop = next(greedy[i : i + 2] for i in range(1, len(greedy) - 1) if greedy[i : i + 2].strip())
    reqs = [
        ("Hello, world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        ("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, stop=[gstop])),
        ("a", dataclasses.replace(free_text, stop=[stop])),  # sample 0 stops, maybe not 1
    ]
    want = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
    assert want[1].outputs[0].finish_reason == "stop" == want[2].outputs[0].finish_reason
    enc, dec = OutputEncoder(), OutputDecoder(engine.tokenizer)
    engine.detokenize = False
    try:
        for i, (p, s) in enumerate(reqs):
            engine.add_request(f"d{i}", p, s)
            dec.expect(f"d{i}", s)
        live, final = {f"d{i}" for i in range(len(reqs))}, {}
        while engine.has_unfinished_requests():
            items = [it for it in enc.encode(engine.step()) if it[0] in live]
            for o in dec.decode(items):
                assert all(c.text == "" for c in o.outputs) or o.request_id in live
                if o.finished:
                    live.discard(o.request_id)
                    final[o.request_id] = o
            for rid, indices in dec.stops:
                engine.core.stop_samples(rid, indices)
                if rid not in engine.core.book.requests:
                    enc.forget([rid])
            dec.stops.clear()
    finally:
        engine.detokenize = True
    for i, w in enumerate(want):
        got = final[f"d{i}"]
        assert _without_metrics(got) == dataclasses.replace(
            _without_metrics(w), request_id=got.request_id
        )
    assert not enc.sent and not dec.requests
    assert engine.num_free_blocks() == free


def test_decoder_cuts_tokens_run_past_a_stop_string(llm):
    """One message carrying tokens past a stop string (a K-step run or accepted drafts
    in the core): ids, logprobs and the cumulative logprob are cut after the token that
    completed the string, and the core is asked to stop the sample. EOS on that very
    token wins over the string (vLLM's rule order); the string wins over length."""
    tok = llm.get_tokenizer()
    ids = tok.encode("abcdefgh", add_special_tokens=False)
    assert len(ids) >= 4
    stop = tok.decode(ids[:2])[-1]  # completed by the second token
    lps = [-0.5, -0.25, -1.0, -2.0]
    enc_lp = [((t, lp, 1, None),) for t, lp in zip(ids, lps, strict=False)]

    def item(finish=None, n=4):
        comp = (0, 0, ids[:n], 0, enc_lp[:n], 0, "", sum(lps[:n]), finish, None, lps[:n])
        return ("r", None, None, None, finish is not None, [comp])

    params = SamplingParams(temperature=0, max_tokens=4, stop=[stop], logprobs=0)
    dec = OutputDecoder(tok)
    dec.expect("r", params)
    (out,) = dec.decode([item()])
    c = out.outputs[0]
    assert out.finished and c.token_ids == ids[:2] and len(c.logprobs) == 2
    assert (c.finish_reason, c.stop_reason, c.cumulative_logprob) == ("stop", stop, -0.75)
    assert c.text == tok.decode(ids[:2])[:-1] and dec.stops == [("r", [0])]
    assert not dec.requests  # finished: later messages for "r" are the caller's to drop

    for finish, want in (("stop", ("stop", None)), ("length", ("stop", stop))):
        dec = OutputDecoder(tok)
        dec.expect("r", params)
        (out,) = dec.decode([item(finish, n=2)])
        c = out.outputs[0]
        assert (c.finish_reason, c.stop_reason) == want and c.token_ids == ids[:2]
        assert dec.stops == []  # the core finished it itself


def test_replica_merges():
    """What DataParallelEngine and MPEngineClient report over replicas: counts and
    counters summed, ratios averaged, the process-wide compilation count once."""
    a = dict(prefix_cache_hit_rate=0.5, xla_compilations=7, compilations=3, spec_rows=2)
    b = dict(prefix_cache_hit_rate=0.25, xla_compilations=9, compilations=4, spec_rows=5)
    assert merge_stats([a, b]) == dict(prefix_cache_hit_rate=0.375, xla_compilations=7,
                                       compilations=7, spec_rows=7)  # fmt: skip
    c = dict(running=1, waiting=2, swapped=0, slots_in_use=1)
    assert merge_counts([c, c]) == dict(running=2, waiting=4, swapped=0, slots_in_use=2)

    class Replica:
        def __init__(self, stats, counts):
            self.stats, self.request_counts = (lambda: stats), (lambda: counts)

    dp = object.__new__(DataParallelEngine)
    dp.replicas = [Replica(a, c), Replica(b, c)]
    assert dp.stats() == merge_stats([a, b]) and dp.request_counts() == merge_counts([c, c])


# ------------------------------------------------------------------ outputs


def _requests(llm, full: bool) -> list[tuple[Any, SamplingParams]]:
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = llm.generate("The quick brown fox", greedy, use_tqdm=False)[0].outputs[0].text
    stop = next(ref[i : i + 2] for i in range(1, len(ref) - 1) if ref[i : i + 2].strip())
    reqs = [
        ("Hello, world", greedy),
        ("The quick brown fox", SamplingParams(temperature=0, max_tokens=10, stop=[stop])),
    ]
    if not full:  # test_server.py's programs only
        return reqs
    ids = llm.get_tokenizer().encode("Hello, world")
    return [
        ("Hello, world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                        logprobs=2)),
        reqs[1],
        ("a", SamplingParams(temperature=1.0, seed=1234, n=3, max_tokens=8, ignore_eos=True)),
        ({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6,
                                                  ignore_eos=True)),
    ]  # fmt: skip


def _without_metrics(o: RequestOutput) -> RequestOutput:
    return dataclasses.replace(o, metrics=None)


@pytest.mark.parametrize(
    "full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["greedy-stop", "all"]
)
def test_outputs_equal_in_process(llm, mp, full):
    """greedy-stop (default tier): greedy and a stop string. all (slow: compiles its own
    programs twice, ~85 s on a loaded 2-core box): logprobs, n = 3 seeded, token ids."""
    reqs = _requests(llm, full)
    want = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
    assert want[1].outputs[0].finish_reason == "stop"  # the stop string is met

    async def run(i: int, prompt, params) -> list[RequestOutput]:
        return [o async for o in mp.engine.generate(prompt, params, f"eq-{i}")]

    async def main():
        return await asyncio.gather(*(run(i, p, s) for i, (p, s) in enumerate(reqs)))

    for w, streamed in zip(want, asyncio.run(main()), strict=True):
        last = streamed[-1]
        assert last.finished and last.metrics.first_token_time is not None
        assert _without_metrics(last) == dataclasses.replace(
            _without_metrics(w), request_id=last.request_id
        )
        for o in streamed:  # streamed outputs grow towards the final one
            for c, f in zip(o.outputs, last.outputs, strict=True):
                assert f.token_ids[: len(c.token_ids)] == c.token_ids
                assert (c.logprobs or []) == (f.logprobs or [])[: len(c.logprobs or [])]


def test_abandoned_stream_aborts_in_the_core(mp):
    async def main():
        gen = mp.engine.generate("leave", SamplingParams(max_tokens=100, ignore_eos=True), "ab")
        got = [await gen.__anext__() for _ in range(2)]
        await gen.aclose()  # aborts
        return got

    assert not asyncio.run(main())[-1].finished
    deadline = time.monotonic() + 60
    while True:
        snap = mp.call(lambda e: e.snapshot())
        if snap["counts"]["running"] + snap["counts"]["waiting"] == 0:
            break
        assert time.monotonic() < deadline, snap
        time.sleep(0.05)
    assert snap["free"] == snap["usable"] and snap["counts"]["slots_in_use"] == 0
    assert not mp.call(lambda e: e.has_unfinished_requests())


def test_idle_core_does_not_spin(mp):
    """With no request the core blocks on its connection (core_process.CoreLoop.run): over
    one idle second its process (every thread: the loop and XLA's pool) uses a few ms of
    CPU at most. A poll with a zero timeout, or a step loop that runs while idle, would
    use most of the second; on a 2-core box that CPU is taken from the API process."""
    mp.call(lambda e: e.snapshot())  # a round trip: anything queued before has run
    assert not mp.call(lambda e: e.has_unfinished_requests())
    core = psutil.Process(mp.client.pids[0])
    time.sleep(0.2)  # the reply sent, the loop back in recv
    before = core.cpu_times()
    time.sleep(1.0)
    after = core.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    assert used < 0.1, f"idle engine core used {used:.3f} CPU s in 1 s"


@pytest.mark.tier2  # second tier (docs/testing.md): 18 s cold; outputs_equal_in_process stays
def test_http_streams_and_metrics_through_the_core(mp, llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = llm.generate("Hello, world", greedy, use_tqdm=False)
    body = dict(model=NAME, prompt="Hello, world", max_tokens=10, temperature=0,
                ignore_eos=True, stream=True)  # fmt: skip

    async def one(c: httpx.AsyncClient) -> str:
        text = ""
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=mp.url, timeout=120) as c:
            return await asyncio.gather(*(one(c) for _ in range(8)))

    assert set(asyncio.run(main())) == {want[0].outputs[0].text}
    metrics = httpx.get(mp.url + "/metrics", timeout=60).text
    assert 'pagedjax:request_success_total{finished_reason="length",model_name="tiny-chat"}' in (
        metrics
    )
    assert "pagedjax:kv_cache_usage_perc" in metrics
    # The core compiled its programs (warm-up at least): the gauge reads the core's count.
    (line,) = [ln for ln in metrics.splitlines() if ln.startswith("pagedjax:engine_compilations")]
    assert float(line.rsplit(" ", 1)[1]) > 0
    # Iterations since start: at least one per token of the 8 streams' 10 (they batch).
    (line,) = [ln for ln in metrics.splitlines() if ln.startswith("pagedjax:engine_steps")]
    assert 10 <= float(line.rsplit(" ", 1)[1])


def test_killed_core_fails_requests_promptly(mp):
    """Last of the module's tests on ``mp``: it kills the core."""
    (pid,) = mp.client.pids

    async def main():
        async with httpx.AsyncClient(base_url=mp.url, timeout=60) as c:
            assert (await c.get("/health")).status_code == 200
            body = dict(model=NAME, prompt="doomed", max_tokens=120, ignore_eos=True,
                        stream=True)  # fmt: skip
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # the request is running in the core
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                rest = [line async for line in lines]
            elapsed = time.monotonic() - t0
            errors = [json.loads(x[6:]) for x in rest if x.startswith('data: {"error"')]
            assert errors and errors[0]["error"]["code"] == 500, rest
            assert "exit code -9 (SIGKILL)" in errors[0]["error"]["message"]
            assert elapsed < 10
            h = await c.get("/health")
            assert h.status_code == 503 and "exit code -9" in h.text
            r = await c.post("/v1/completions", json={"prompt": "later", "max_tokens": 2})
            assert r.status_code == 500 and "died with exit code -9" in r.text

    asyncio.run(main())
    assert not mp.engine.is_healthy
    with pytest.raises(EngineDeadError):
        mp.client.step()


# ------------------------------------------------------------------ data parallel


@pytest.mark.slow
def test_serve_data_parallel_2_with_ngram_speculation(model_dir, llm, tmp_path):
    """`pagedjax serve --data-parallel-size 2 --speculative-config ngram`: two core
    processes (one simulated CPU device each); concurrent greedy streams equal a single
    engine's outputs and speculation ran; SIGTERM leaves no process behind."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(2),
               JAX_PLATFORMS="cpu")  # fmt: skip
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", str(model_dir), *flags,
         "--port", str(port), "--served-model-name", NAME, "--data-parallel-size", "2",
         "--speculative-config", spec, "--uvicorn-log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], 600, lambda: (tmp_path / "server.log").read_text())
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # the core processes (and multiprocessing's helpers)
        prompts = [f"{w} {w} {w} and {i}" for i, w in enumerate(
            ["abc abc", "hello hello", "the fox the fox", "one two one two"] * 4)]  # fmt: skip
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]

        async def one(c: httpx.AsyncClient, prompt: str) -> str:
            body = dict(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                        ignore_eos=True, stream=True)  # fmt: skip
            text = ""
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                return await asyncio.gather(*(one(c, p) for p in prompts))

        assert asyncio.run(main()) == want
        metrics = httpx.get(url + "/metrics", timeout=60).text
        drafts = [ln for ln in metrics.splitlines()
                  if ln.startswith("pagedjax:spec_decode_num_draft_tokens_total")]  # fmt: skip
        assert drafts and float(drafts[0].split()[-1]) > 0  # speculation ran
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    time.sleep(0.5)
    assert not [p for p in children if p.is_running() and _not_zombie(p.pid)]
