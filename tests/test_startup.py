"""Start-up: few step programs, warm-up by default, the persistent compilation cache, and
engines built one after another in one process (issue 13)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from pagedjax import LLM, SamplingParams, compile_cache
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.engine.engine_stats import backend_compilations, engine_compilations
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.multi_step import loop_buckets
from pagedjax.engine.warmup import bucket_pairs, image_encoder_counts

ROOT = Path(__file__).resolve().parents[1]
MAX_STEP_PROGRAMS = 20  # one-step programs of a default engine (issue 13's bound)
MAX_LOOP_PROGRAMS = 8  # K-step decode loop programs


def test_default_engine_has_few_step_programs():
    """The default geometry (2,048-token budget, 256 sequences): one program per token
    bucket, and the decode loop's buckets; counted from the engine's own bucket lists."""
    engine = LLMEngine.from_config(
        EngineConfig(model=ModelConfig(model="tiny-llama", max_model_len=128), warmup="none")
    )
    steps = bucket_pairs(engine.token_buckets, engine.seq_buckets, "all")
    loops = loop_buckets(engine.seq_buckets)
    assert len({t for t, _ in steps}) == len(steps)  # S follows from T
    assert len(steps) <= MAX_STEP_PROGRAMS, steps
    assert len(loops) <= MAX_LOOP_PROGRAMS, loops
    # Every step a schedule can produce maps to one of them: rows never exceed tokens.
    for t, s in steps:
        assert s == min(t, engine.max_seqs)


def test_image_encoder_counts_cover_every_call_up_to_the_cache():
    """An encoder call takes 1..C tiles (C: the encoder cache's capacity), padded to a
    power of two: "all" warms every padded count, "decode" a lone image, "none" none."""
    for c in range(1, 40):
        counts = image_encoder_counts(c, "all")
        padded = {1 << max(0, (n - 1).bit_length()) for n in range(1, c + 1)}
        assert counts == sorted(padded)
    assert image_encoder_counts(9, "decode") == [1] and image_encoder_counts(9, "none") == []


@pytest.mark.tier2  # second tier (docs/testing.md): 30 s cold: the whole warm-up
def test_default_start_up_compiles_everything_generate_needs(monkeypatch):
    """warmup="auto" (the default) compiles every step program at start-up: a mixed
    workload afterwards (prefill, chunked prefill, decode, n > 1) compiles nothing."""
    monkeypatch.delenv("PAGEDJAX_WARMUP", raising=False)
    llm = LLM(model="tiny-llama", max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8,
              num_gpu_blocks_override=64)  # fmt: skip
    engine = llm.llm_engine
    assert engine.startup_compiles.requests > 0
    before = engine_compilations(engine.core, engine.multi_step)
    xla_before = backend_compilations()[0]
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 1, 33, 12, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (3, 9, 20, 1, 6, 12)]  # fmt: skip
    params[3] = SamplingParams(temperature=0.9, n=2, max_tokens=5, seed=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 20, 5, 6, 12]
    assert engine_compilations(engine.core, engine.multi_step) == before
    assert backend_compilations()[0] == xla_before


_CHILD = textwrap.dedent(
    """
    import json, sys
    from pagedjax import LLM, SamplingParams
    llm = LLM(model="tiny-llama", max_model_len=64, max_num_batched_tokens=32,
              max_num_seqs=4, num_gpu_blocks_override=32, warmup="all",
              compilation_cache=sys.argv[1])
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4,
                                                    ignore_eos=True), use_tqdm=False)
    c = llm.llm_engine.startup_compiles
    print(json.dumps(dict(requests=c.requests, hits=c.hits, written=c.written,
                          stored=c.stored, steps=len(llm.llm_engine.runner.programs),
                          tokens=list(out[0].outputs[0].token_ids))))
    """
)


def _child(cache_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PAGEDJAX_WARMUP="all")
    env.pop("PAGEDJAX_COMPILATION_CACHE", None)
    res = subprocess.run([sys.executable, "-c", _CHILD, str(cache_dir)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_a_new_process_loads_its_programs_from_the_persistent_cache(tmp_path):
    """The second process (same cache directory) compiles nothing: its step programs (the
    native CPU kernels' calls included) and the scheduler come from the program store
    without tracing, the other programs of its warm-up from the cache; outputs agree."""
    first = _child(tmp_path)
    assert first["requests"] > 0 and first["written"] > 0 and first["hits"] == 0
    assert first["stored"] == 0 and first["steps"] > 0
    assert any(tmp_path.iterdir())
    second = _child(tmp_path)
    # The step programs and the scheduler's (warmup._schedule_program) from the store.
    assert second["stored"] == first["steps"] + 1 == second["steps"] + 1
    assert second["requests"] == first["requests"] - second["stored"]
    assert second["hits"] == second["requests"] and second["written"] == 0
    assert second["tokens"] == first["tokens"]


def test_compile_cache_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_VAR, "off")
    assert compile_cache.resolve_cache_dir() is None
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "c"))
    assert compile_cache.resolve_cache_dir() == tmp_path / "c"
    assert compile_cache.resolve_cache_dir("off") is None
    assert compile_cache.resolve_cache_dir(False) is None
    assert compile_cache.resolve_cache_dir(tmp_path / "d") == tmp_path / "d"
    monkeypatch.delenv(compile_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_cache_dir() == tmp_path / "xdg" / "pagedjax" / "jax"
    previous = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable(tmp_path / "e") == tmp_path / "e"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "e")
        blocked = tmp_path / "file"
        blocked.write_text("not a directory")
        assert compile_cache.enable(blocked / "sub") is None  # reported, cache unchanged
    finally:
        compile_cache.enable(previous)


def _rss_mib() -> float:
    """Resident set size now (Linux /proc), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_five_engines_of_five_shapes_in_one_process(monkeypatch):
    """Engines of five model shapes, each warmed up (every step program) and deleted
    before the next, do not exhaust the process: its resident memory after the fifth is
    within 1.5x of that after the first plus 300 MiB (compiled code of deleted engines is
    released; before issue 13 a third warmed-up engine died with an LLVM section error)."""
    from pagedjax.model import preset_arch

    base = preset_arch("tiny-llama")
    rss = []
    for i in range(5):
        arch = dataclasses.replace(base, hidden_size=64 + 16 * i, num_layers=2 + i % 3,
                                   intermediate_size=128 + 32 * i)  # fmt: skip
        from pagedjax.engine.llm_engine import LLMEngine as Engine
        from pagedjax.model import random_params
        from pagedjax.tokenizer import ByteTokenizer

        cfg = EngineConfig(model=ModelConfig(model="tiny-llama", max_model_len=64),
                           warmup="all")  # fmt: skip
        cfg = dataclasses.replace(
            cfg,
            scheduler=dataclasses.replace(cfg.scheduler, max_num_batched_tokens=32,
                                          max_num_seqs=4),
            cache=dataclasses.replace(cfg.cache, num_gpu_blocks_override=32),
        )  # fmt: skip
        tok = ByteTokenizer(eos_token_id=arch.eos_token_id, bos_token_id=arch.bos_token_id)
        engine = Engine(arch, random_params(arch, seed=i), tok, cfg)
        engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
        del engine
        gc.collect()
        rss.append(_rss_mib())
    assert rss[-1] <= 1.5 * rss[0] + 300, rss
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
