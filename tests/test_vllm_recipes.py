"""vLLM's recipes run verbatim with ``vllm`` replaced by ``pagedjax`` (issue 31, part 6).

The server recipe ``python -m pagedjax.entrypoints.openai.api_server --model DIR --port
8000 --max-model-len 8192 --gpu-memory-utilization 0.9 --enforce-eager`` (a free port for
8000) serves a completion, also with ``--tensor-parallel-size 2`` on two simulated CPU
devices; the Python API ``LLM(model=DIR, tensor_parallel_size=1, max_model_len=8192,
quantization=None)`` generates, and with ``quantization="fp8"`` (vLLM 0.32's deprecated
alias of ``fp8_per_tensor``). DIR is a tiny random Llama written with transformers' own
classes, ``max_position_embeddings`` 8192. Every flag of vLLM 0.32's server
(``vllm_flags.py``) is either implemented or refused by name with a reason.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.entrypoints.openai import cli_args
from pagedjax.entrypoints.openai.vllm_flags import VLLM_SERVER_FLAGS
from pagedjax.model.quant.weight import QuantizedWeight
from tests.engine_helpers import free_port, wait_healthy, xla_flags_with_devices

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--max-model-len", "8192", "--gpu-memory-utilization", "0.9", "--enforce-eager"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (1 layer, 4 query / 2 KV heads: TP 2 splits it) that takes 8192
    positions, saved by transformers; its KV pool at 256 slots x 8192 tokens is 256 MiB."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    d = tmp_path_factory.mktemp("llama8k")
    model.save_pretrained(str(d))
    return d


def _serve_one_completion(model_dir: Path, extra: list[str], devices: int = 1) -> None:
    """Start the recipe's server in a subprocess, wait for /health, one completion."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    if devices > 1:
        env["XLA_FLAGS"] = xla_flags_with_devices(devices)
    cmd = [sys.executable, "-m", "pagedjax.entrypoints.openai.api_server",
           "--model", str(model_dir), "--port", str(port), *RECIPE, *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # On failure: stop the server, then its stderr (a pipe: readable once it exited).
        wait_healthy(url, [proc], 300, lambda: (proc.kill(), proc.communicate()[1][-3000:])[1])
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": str(model_dir), "prompt": "Hello, world", "max_tokens": 8,
            "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.tier2  # a server subprocess that compiles: 146 s on the loaded 2-core box
def test_server_recipe_verbatim(model_dir):
    _serve_one_completion(model_dir, [])


@pytest.mark.tier2  # as above, on two simulated CPU devices (128 s there)
def test_server_recipe_tensor_parallel_2(model_dir):
    _serve_one_completion(model_dir, ["--tensor-parallel-size", "2"], devices=2)


def _quantized(llm: LLM) -> list[QuantizedWeight]:
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    return [x for x in jax.tree.leaves(llm.llm_engine.params, is_leaf=is_q) if is_q(x)]


@pytest.mark.tier2  # second tier (docs/testing.md): 24 s cold; the flag-list test stays
def test_python_api_recipe_and_fp8(model_dir, caplog):
    """LLM(model=DIR, tensor_parallel_size=1, max_model_len=8192, quantization=None) and
    quantization="fp8": the alias runs fp8_per_tensor in flight, with vLLM's warning."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model=str(model_dir), tensor_parallel_size=1, max_model_len=8192,
              quantization=None)  # fmt: skip
    out = llm.generate(["Hello, world"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not _quantized(llm)
    del llm
    with caplog.at_level(logging.WARNING, logger="pagedjax.model.quant.methods"):
        fp8 = LLM(model=str(model_dir), tensor_parallel_size=1, max_model_len=8192,
                  quantization="fp8")  # fmt: skip
    assert any("'fp8' is deprecated" in r.getMessage() and "fp8_per_tensor" in r.getMessage()
               for r in caplog.records), caplog.text  # fmt: skip
    quantized = _quantized(fp8)
    assert quantized and all(x.fmt == "fp8_per_tensor" and x.is_float for x in quantized)
    out = fp8.generate(["Hello, world"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_enforce_eager_means_no_warmup_and_no_k_step_program(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=64, num_gpu_blocks_override=16,
              enforce_eager=True, warmup="auto", num_scheduler_steps="auto")  # fmt: skip
    engine = llm.llm_engine
    assert engine.config.warmup == "none" and engine.multi_step.num_steps == 1
    assert not engine.multi_step.enabled
    with pytest.raises(ValueError, match="enforce_eager=True.*warmup='all'"):
        LLM(model=str(model_dir), enforce_eager=True, warmup="all")
    with pytest.raises(ValueError, match="enforce_eager=True.*num_scheduler_steps=8"):
        LLM(model=str(model_dir), enforce_eager=True, num_scheduler_steps=8)


def test_every_vllm_server_flag_is_implemented_or_refused_by_name(capsys):
    p = cli_args.make_parser()
    refused = {s for a in p._actions if isinstance(a, cli_args._Refused)
               for s in a.option_strings}  # fmt: skip
    have = {s for a in p._actions for s in a.option_strings} - refused
    vllm = {s for names in VLLM_SERVER_FLAGS for s in names}
    assert vllm <= have | refused and not refused & have
    # The recipe's flags are implemented; pagedjax's own are exactly those vLLM lacks.
    for flag in ("--model", "--port", "--max-model-len", "--gpu-memory-utilization",
                 "--enforce-eager", "--tensor-parallel-size", "--quantization"):  # fmt: skip
        assert flag in have and flag in vllm, flag
    own = {s for s in have if s.startswith("--") and s not in vllm} - {"--help"}
    assert own == set(cli_args.PAGEDJAX_ONLY)
    assert "--num-scheduler-steps" not in vllm  # pagedjax's own: its help says so
    help_text = " ".join(p.format_help().split())
    assert "[pagedjax only] decode iterations" in help_text and "vLLM 0.32.0 has no" in help_text
    # A refusal names the flag (and its canonical name for an alias) and the reason.
    cases = {
        ("--fully-sharded-loras",): "--fully-sharded-loras, a vLLM 0.32.0 server flag, is not"
        " implemented by pagedjax: only --enable-lora, --lora-modules",
        ("--trust-remote-code",): "never a checkpoint's code",
        ("-dpa", "h"): "-dpa (--data-parallel-address), a vLLM 0.32.0 server flag",
        ("--ssl-keyfile", "k.pem"): "TLS is not built",
        ("--compilation-config", '{"level": 3}'): "pagedjax's compile options",
    }
    for extra, msg in cases.items():
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--model", "m", *extra])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):  # not a vLLM flag at all: argparse's own error
        p.parse_args(["--model", "m", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    # Flags pagedjax implements keep working, the recipe's included.
    args = p.parse_args(["--model", "m", "--port", "8000", *RECIPE, "-sc", '{"method": "ngram"}'])
    kw = cli_args.llm_kwargs(args)
    assert kw["enforce_eager"] is True and kw["max_model_len"] == 8192
    assert kw["gpu_memory_utilization"] == 0.9 and kw["speculative_config"] == {"method": "ngram"}
    assert cli_args.llm_kwargs(p.parse_args(["--model", "m", "-pp", "2"]))[
        "pipeline_parallel_size"] == 2  # implemented now (docs/parallelism.md)
    assert not any(k.startswith("refused") for k in vars(args))
