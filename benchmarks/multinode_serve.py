"""`pagedjax serve` over two nodes on this machine (loopback, one CPU device each): start-up
time, a request's text, and what happens when a node dies (docs/serving.md, "Several
nodes"). Each mode starts both processes afresh and prints what it measured.

    python benchmarks/multinode_serve.py MODE [server flags, e.g. -pp 2 or -tp 2]

MODE: ``shutdown`` (SIGTERM to node 0 after a request: both exit codes and the time),
``idlekill`` (SIGKILL node 1 while idle: time until /health fails, its message, a later
request's answer), ``flightkill`` (SIGKILL node 1 under a streaming request: time until
the stream's error event, the event), ``hang`` (SIGSTOP node 1 under a streaming
request: a hung host, whose sockets stay open; time until the stream's error event),
``leaderkill`` (SIGKILL node 0's API process: time
until node 1 exits, its exit code), ``mismatch`` (node 1 with another
--num-gpu-blocks-override: both refuse to start; exit codes). The model is a tiny random
Llama (tests/model_helpers.py) in a temporary directory, test_server.py's geometry.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.model_helpers import save_tiny_hf_model, save_tiny_tokenizer  # noqa: E402
from tests.test_multinode_serve import GEOMETRY, port_pair  # noqa: E402

MODES = ("shutdown", "idlekill", "flightkill", "hang", "leaderkill", "mismatch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=MODES)
    args, flags = ap.parse_known_args()
    tmp = Path(tempfile.mkdtemp(prefix="pagedjax_multinode_"))
    save_tiny_hf_model("llama", tmp)
    save_tiny_tokenizer(tmp)
    port, http = port_pair(), port_pair()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.setdefault("PAGEDJAX_WARMUP", "none")
    common = [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", str(tmp),
              *[f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()], "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--served-model-name", "m", *flags]  # fmt: skip
    other = ["--num-gpu-blocks-override", "500"] if args.mode == "mismatch" else []
    t0 = time.monotonic()
    p0 = subprocess.Popen([*common, "--node-rank", "0", "--port", str(http),
                           "--uvicorn-log-level", "warning"],
                          env=env, stderr=open(tmp / "node0.log", "w"))  # fmt: skip
    p1 = subprocess.Popen([*common, *other, "--node-rank", "1", "--headless"], env=env,
                          stderr=open(tmp / "node1.log", "w"))  # fmt: skip
    print(f"logs: {tmp}/node0.log, node1.log", flush=True)
    url = f"http://127.0.0.1:{http}"
    try:
        if args.mode == "mismatch":
            codes = p0.wait(600), p1.wait(600)
            print(f"exit codes {codes} after {time.monotonic() - t0:.1f} s")
            for log in ("node0.log", "node1.log"):
                last = [ln for ln in (tmp / log).read_text().splitlines() if "differs" in ln]
                print(f"{log}: {last[-1] if last else '(no message)'}")
            return
        _run(args.mode, url, p0, p1, t0)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()


def _run(mode: str, url: str, p0: subprocess.Popen, p1: subprocess.Popen, t0: float) -> None:
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if p0.poll() is not None or p1.poll() is not None:
            raise SystemExit("a node exited during start-up (see the logs)")
        time.sleep(0.2)
    print(f"healthy after {time.monotonic() - t0:.1f} s", flush=True)
    body = dict(model="m", prompt=["Hello, world", "The quick brown fox"], max_tokens=12,
                temperature=0, ignore_eos=True)  # fmt: skip
    t = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    print(f"first request {time.monotonic() - t:.1f} s (compiles):",
          [c["text"] for c in r.json()["choices"]], flush=True)  # fmt: skip
    t = time.monotonic()
    httpx.post(url + "/v1/completions", json=dict(model="m", prompt="x", max_tokens=110,
                                                  temperature=0, ignore_eos=True), timeout=600)
    print(f"110 tokens in {time.monotonic() - t:.2f} s", flush=True)
    time.sleep(3)  # idle: keep-alive exchanges
    if mode == "shutdown":
        p0.send_signal(signal.SIGTERM)
        t = time.monotonic()
        print(f"exit codes {p0.wait(60)}, {p1.wait(60)} {time.monotonic() - t:.2f} s after SIGTERM")
    elif mode == "idlekill":
        p1.send_signal(signal.SIGKILL)
        t = time.monotonic()
        while (h := httpx.get(url + "/health", timeout=5)).status_code == 200:
            time.sleep(0.05)
        print(f"/health {h.status_code} {time.monotonic() - t:.2f} s after the kill: {h.text}")
        r = httpx.post(url + "/v1/completions", json=dict(model="m", prompt="x", max_tokens=3))
        print(f"a later request: {r.status_code}")
        p0.send_signal(signal.SIGTERM)
        print(f"node 0 exit code {p0.wait(60)}")
    elif mode in ("flightkill", "hang"):
        stream = dict(model="m", prompt="doomed", max_tokens=110, ignore_eos=True, stream=True)
        with httpx.Client(base_url=url, timeout=60) as c, c.stream(
            "POST", "/v1/completions", json=stream
        ) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            p1.send_signal(signal.SIGSTOP if mode == "hang" else signal.SIGKILL)
            t = time.monotonic()
            rest = list(lines)
        errors = [x for x in rest if x.startswith('data: {"error"')]
        print(f"stream ended {time.monotonic() - t:.2f} s after the {mode}: {errors[:1]}")
        p0.send_signal(signal.SIGTERM)
        print(f"node 0 exit code {p0.wait(60)}")
    elif mode == "leaderkill":
        p0.send_signal(signal.SIGKILL)
        t = time.monotonic()
        code = p1.wait(60)
        print(f"node 1 exit code {code} {time.monotonic() - t:.2f} s after node 0 was killed")


if __name__ == "__main__":
    main()
