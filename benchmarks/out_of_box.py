"""What a new user meets: the shared parts of ``vs_vllm_cpu.py`` and ``startup.py``.

- ``MODELS`` / ``ensure_model``: random-weight Llama checkpoints written once with
  transformers' ``save_pretrained`` into a cache directory (``~/.cache/pagedjax/bench_models``,
  ``PAGEDJAX_BENCH_MODELS`` moves it), with a word-level tokenizer both pagedjax and vLLM load
  offline (``tokenizer.json`` + ``tokenizer_config.json``); a directory is rebuilt only
  when its recorded spec differs.
- ``make_requests``: the ShareGPT-like request set of ``throughput_vs_hf.py`` (lengths from
  ``make_workload("sharegpt")`` scaled to the context, random prompt ids, fixed seed; each
  request generates exactly its own output length with ``ignore_eos``), plus a separate
  4-request warm-up set, as token ids, written to JSON so that every engine, in whatever
  Python, gets the very same requests.
- ``run_child``: runs one engine in a fresh process (``python out_of_box.py <spec.json>``)
  and returns what it measured; the start-up clock starts just before the process is
  spawned, so interpreter start and imports count, as they do for a user.

The child half (``child_main``) imports only the standard library at module level, so the
same file runs in pagedjax's venv and in vLLM's Python 3.11 venv (which has no pagedjax).
Everything an engine is given is in the spec: the model directory, ``max_model_len``,
``dtype`` and, only where a caller asks for it, extra ``LLM`` keywords; the defaults-only
runs pass none. vLLM spawns its engine core process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL_ROOT_ENV = "PAGEDJAX_BENCH_MODELS"
SPEC_FILE = "pagedjax_bench_model.json"  # in a model directory: the spec it was built from

# Llama shapes (HF LlamaConfig values). llama-34m-8l is issue 13's model: 33.7M parameters,
# 8 layers, head_dim 64 (a size vLLM's CPU attention supports). llama-34m-32l is the same
# at 32 layers (the compile-time-vs-depth check). smollm2-135m-shape is SmolLM2-135M's
# architecture with random weights (no download). tiny-llama is for smoke runs.
_LLAMA = dict(
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    hidden_act="silu",
    tie_word_embeddings=False,
)
MODELS: dict[str, dict[str, Any]] = {
    "llama-34m-8l": dict(
        _LLAMA,
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1376,
        max_position_embeddings=512,
    ),
    "llama-34m-32l": dict(
        _LLAMA,
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1376,
        max_position_embeddings=512,
    ),
    "smollm2-135m-shape": dict(
        _LLAMA,
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "tiny-llama-2l": dict(
        _LLAMA,
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
    ),
    "tiny-llama-8l": dict(
        _LLAMA,
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
    ),
}


def model_root() -> Path:
    env = os.environ.get(MODEL_ROOT_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagedjax" / "bench_models"


def num_parameters(spec: dict[str, Any]) -> int:
    """Parameters of a Llama of this spec (embeddings counted once when tied)."""
    v, h, i = spec["vocab_size"], spec["hidden_size"], spec["intermediate_size"]
    hd = h // spec["num_attention_heads"]
    kv = spec["num_key_value_heads"] * hd
    layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    return v * h * (1 if spec["tie_word_embeddings"] else 2) + spec["num_hidden_layers"] * layer + h


def ensure_model(
    name: str, *, weights: bool = True, root: Path | None = None, seed: int = 0
) -> Path:
    """The directory of model ``name`` (built on first use; needs torch + transformers).

    weights=False writes config.json and the tokenizer only (for ``load_format="dummy"``,
    where only the program shapes matter). A directory whose recorded spec differs is
    rebuilt; it is written to a temporary sibling and renamed, so an interrupted build
    never leaves a half-written model behind.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    spec = dict(MODELS[name], seed=seed, weights=weights)
    root = root or model_root()
    out = root / (name if weights else f"{name}-config-only")
    marker = out / SPEC_FILE
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # keep the scripts' output to tables
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=root))
    try:
        cfg_kwargs = {k: v for k, v in spec.items() if k not in ("seed", "weights")}
        cfg = transformers.LlamaConfig(**cfg_kwargs, torch_dtype="float32")
        if weights:
            torch.manual_seed(seed)
            transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(tmp))
        else:
            cfg.save_pretrained(str(tmp))
        write_tokenizer(tmp, spec["vocab_size"])
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of exactly ``vocab_size`` ids: <unk> 0, <s> 1, </s> 2, then
    "t3" ... (whitespace-separated words). Written as tokenizer.json plus a
    tokenizer_config.json naming ``PreTrainedTokenizerFast``, which every transformers
    version loads from local files (vLLM's AutoTokenizer included). Prompts are token ids,
    so the tokenizer only detokenizes outputs, identically on both sides."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=1 << 30,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "special_tokens_map.json").write_text(
        json.dumps(dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"))
    )


def model_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_requests(
    num_requests: int, max_model_len: int, vocab_size: int, seed: int = 0, num_warmup: int = 4
) -> dict[str, list]:
    """The timed requests and the warm-up requests, as token ids (needs pagedjax, numpy).

    Timed: exactly ``throughput_vs_hf.py``'s set (its 200 requests at context 512 have
    8,105 prompt and 15,842 output tokens). Warm-up: ``num_warmup`` requests drawn with
    seed + 1 (other ids and lengths, so the timed run finds nothing of them in a prefix
    cache). Prompt ids avoid 0-2 (pad, bos, eos).
    """
    import math

    import numpy as np

    from pagedjax.workloads import make_workload

    def draw(n: int, s: int) -> tuple[list[list[int]], list[int]]:
        if n == 0:
            return [], []
        wl = make_workload("sharegpt", math.inf, num_requests=n, seed=s)
        wl = wl.scale_to_context(max_model_len)
        rng = np.random.default_rng(s)
        prompts = [rng.integers(3, vocab_size, size=int(k)).tolist() for k in wl.prompt_len]
        return prompts, [int(k) for k in wl.output_len]

    prompts, outs = draw(num_requests, seed)
    w_prompts, w_outs = draw(num_warmup, seed + 1)
    return dict(
        prompts=prompts, output_lens=outs, warmup_prompts=w_prompts, warmup_output_lens=w_outs
    )


# ----------------------------------------------------------------------------- parent side


def run_child(
    python: str | Path,
    spec: dict[str, Any],
    env: dict[str, str],
    workdir: Path,
    timeout_s: float,
    label: str,
    script: Path | None = None,
) -> dict[str, Any]:
    """Runs one engine (``spec["side"]``) in a fresh process of ``python``; returns its
    result dict plus ``wall_s`` (spawn to exit). The child's stdout/stderr go to
    ``workdir/<label>.log`` (vLLM logs a lot). ``script`` (default: this module) is run
    as ``python script SPEC.json``; it must write ``spec["result"]`` as JSON.

    The child writes its result file before it tears its engine down; a child still alive
    60 s after that (a hung shutdown) is killed with its process group, and its result
    stands. Raises RuntimeError with the log's tail when the child fails or times out.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = workdir / f"{label}.result.json"
    log_path = workdir / f"{label}.log"
    result_path.unlink(missing_ok=True)
    spec = dict(spec, result=str(result_path))
    spec_path = workdir / f"{label}.spec.json"
    spec["t_spawn"] = time.time()  # the clock starts here: interpreter start counts
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(python), str(script or Path(__file__).resolve()), str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
        )
        rc, done_at = None, None
        while rc is None:
            rc = proc.poll()
            if rc is not None:
                break
            now = time.monotonic()
            if done_at is None and result_path.is_file():
                done_at = now
            late = done_at is not None and now - done_at > 60
            if late or now - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if not late:
                    raise RuntimeError(
                        f"{label}: timed out after {timeout_s:.0f} s\n" + _tail(log_path)
                    )
                break
            time.sleep(0.2)
    wall = time.monotonic() - t0
    if not result_path.is_file():
        raise RuntimeError(f"{label}: exit status {rc}, no result\n" + _tail(log_path))
    result = json.loads(result_path.read_text())
    result["wall_s"] = wall
    result["log"] = str(log_path)
    return result


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return f"--- last of {path} ---\n{text[-chars:]}"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment, offline, plus ``extra``; PYTHONPATH keeps this checkout's
    pagedjax first (a worktree measures its own code)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------ child side


class _CompileLog:
    """XLA backend compilations and persistent-cache hits/misses, by phase, from
    ``jax.monitoring`` (public API): each compile as (function name, seconds)."""

    def __init__(self) -> None:
        import jax

        self.phase = "import"
        self.compiles: dict[str, list[tuple[str, float]]] = {}
        self.cache: dict[str, dict[str, int]] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            name = str(kw.get("fun_name", "?"))
            self.compiles.setdefault(self.phase, []).append((name, float(duration)))

    def _on_event(self, event: str, **_: Any) -> None:
        for key in ("cache_hits", "cache_misses"):
            if event == f"/jax/compilation_cache/{key}":
                d = self.cache.setdefault(self.phase, {})
                d[key] = d.get(key, 0) + 1


def _requests(spec: dict[str, Any]) -> dict[str, list]:
    return json.loads(Path(spec["requests"]).read_text())


def _child_pagedjax(spec: dict[str, Any], res: dict[str, Any]) -> None:
    log = _CompileLog()  # imports jax first: its own import is part of the start-up
    from pagedjax import LLM, SamplingParams

    res["t_imported"] = time.time()
    engine_kwargs = dict(dtype=spec["dtype"], max_model_len=spec["max_model_len"])
    engine_kwargs.update(spec.get("llm_kwargs", {}))
    log.phase = "construct"
    llm = LLM(model=spec["model"], **engine_kwargs)
    res["t_constructed"] = time.time()
    engine = llm.llm_engine

    def stats() -> dict[str, Any]:  # whatever the engine reports (names change)
        fn = getattr(engine, "stats", None)
        return dict(fn()) if callable(fn) else {}

    import jax

    res["jax_compilation_cache_dir"] = jax.config.jax_compilation_cache_dir
    res["stats_constructed"] = stats()

    def run(prompts: list, outs: list, phase: str) -> None:
        log.phase = phase
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in outs]
        t = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        res[f"{phase}_s"] = time.perf_counter() - t
        res[f"{phase}_out_tokens"] = sum(len(o.outputs[0].token_ids) for o in got)
        res[f"stats_{phase}"] = stats()

    _run_phases(spec, res, run)
    res["compiles"] = log.compiles
    res["cache"] = log.cache


def _child_vllm(spec: dict[str, Any], res: dict[str, Any]) -> None:
    import vllm

    res["t_imported"] = time.time()
    res["vllm_version"] = vllm.__version__
    engine_kwargs = dict(dtype=spec["dtype"], max_model_len=spec["max_model_len"])
    engine_kwargs.update(spec.get("llm_kwargs", {}))
    llm = vllm.LLM(model=spec["model"], **engine_kwargs)
    res["t_constructed"] = time.time()

    def run(prompts: list, outs: list, phase: str) -> None:
        params = [vllm.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in outs]
        t = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        res[f"{phase}_s"] = time.perf_counter() - t
        res[f"{phase}_out_tokens"] = sum(len(o.outputs[0].token_ids) for o in got)

    _run_phases(spec, res, run)


def _run_phases(spec: dict[str, Any], res: dict[str, Any], run: Any) -> None:
    """Phases in order: "warmup" (the warm-up requests), "timed" (the timed requests),
    "probe" (one request: a 16-token prompt, one output token)."""
    reqs = _requests(spec) if spec.get("requests") else {}
    for phase in spec.get("phases", []):
        if phase == "warmup":
            run(reqs["warmup_prompts"], reqs["warmup_output_lens"], "warmup")
            res["t_warm"] = time.time()
        elif phase == "timed":
            run(reqs["prompts"], reqs["output_lens"], "timed")
            res["timed_expected_tokens"] = sum(reqs["output_lens"])
        elif phase == "probe":
            run([list(range(3, 19))], [1], "probe")
        else:
            raise ValueError(f"unknown phase {phase!r}")


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res: dict[str, Any] = dict(
        side=spec["side"], t_spawn=spec["t_spawn"], python=sys.version.split()[0]
    )
    {"pagedjax": _child_pagedjax, "vllm": _child_vllm}[spec["side"]](spec, res)
    res["t_done"] = time.time()
    tmp = Path(spec["result"] + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(spec["result"])  # atomic: the parent never reads half a file
    sys.stdout.flush()
    # vLLM's engine core and pagedjax's XLA threads shut down by themselves; the parent
    # kills a child that hangs there (its result is already written).


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json  (a child of vs_vllm_cpu.py / startup.py)")
    child_main(sys.argv[1])
