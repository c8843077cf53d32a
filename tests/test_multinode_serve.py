"""`pagedjax serve` over several nodes (issue 38, item 2; pagedjax/engine/fronts/multinode.py).

Default tier, no JAX: vLLM's multi-node flags refused in inconsistent combinations with a
message naming them; the control channel on loopback (a follower whose engine
configuration differs is refused naming the field; a follower that disconnects is
reported by rank at once; a node 0 that disappears without "bye" is reported to the
follower, one that says "bye" is not).

Second tier: two processes on loopback, `pagedjax serve ... --nnodes 2 --node-rank 0
--master-addr 127.0.0.1 -pp 2` and the same with `--headless --node-rank 1` (one CPU
device each: stage 0 on node 0, stage 1 on node 1, activations over gloo), on
test_server.py's tiny llama and geometry. (a) The official ``openai`` client, streaming
and not, gets the text of a one-device offline ``LLM.generate``, also after the server
sat idle past several keep-alives. (b) The headless follower is SIGKILLed under a
streaming request: the stream ends with a 500 naming node rank 1, and /health fails,
within 10 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedjax.engine.fronts import multinode
from pagedjax.entrypoints.openai import cli_args
from tests.engine_helpers import wait_healthy
from tests.model_helpers import save_tiny_hf_model, save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny-chat"
# test_server.py's geometry (the one-device reference loads its compiled programs).
GEOMETRY = dict(dtype="float32", block_size=8, max_model_len=128, max_num_seqs=32,
                max_num_batched_tokens=64, num_gpu_blocks_override=600, seed=0)  # fmt: skip
PROMPTS = ["Hello, world", "The quick brown fox"]
TOKENS = 12


def port_pair() -> int:
    """A port p with p + 1 free too (the coordinator and the control channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
    raise RuntimeError("no free port pair")


# ------------------------------------------------------------------ flags (default tier)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--headless"], "--headless is for the nodes other than node 0"),
        (["-n", "2", "--master-addr", "h", "--headless"], "--headless on --node-rank 0"),
        (["-n", "2", "-r", "2", "--master-addr", "h", "--headless"],
         "--node-rank 2 is not one of the --nnodes 2 ranks (0 .. 1)"),
        (["-n", "2", "-r", "1", "--headless"], "--nnodes 2 needs --master-addr"),
        (["-n", "2", "-r", "1", "--master-addr", "h"], "--node-rank 1 needs --headless"),
        (["-n", "0"], "--nnodes must be >= 1, got 0"),
        (["--master-addr", "h"], "apply with --nnodes > 1 only"),
        (["-n", "2", "--master-addr", "h", "--master-port", "65535"], "--master-port must be"),
        (["-n", "2", "--master-addr", "h", "--max-engine-restarts", "1"],
         "--max-engine-restarts with --nnodes > 1"),
        (["-n", "2", "--master-addr", "h", "--disable-frontend-multiprocessing"],
         "--disable-frontend-multiprocessing"),
    ],
)  # fmt: skip
def test_inconsistent_node_flags_are_refused_by_name(flags, message):
    args = cli_args.make_parser().parse_args(["--model", "m", *flags])
    with pytest.raises(SystemExit) as e:
        cli_args.reject_unbuilt(args)
    assert message in str(e.value)


def test_node_flags_parse_and_what_several_nodes_refuse():
    from pagedjax.entrypoints.llm import engine_config

    args = cli_args.make_parser().parse_args(
        ["--model", "m", "-n", "2", "-r", "1", "--master-addr", "10.0.0.1", "--headless",
         "-pp", "2"])  # fmt: skip
    node = cli_args.node_config(args)
    assert (node.nnodes, node.node_rank, node.coordinator, node.control_port) == (
        2, 1, "10.0.0.1:29501", 29502)  # vLLM's default port
    assert cli_args.node_config(cli_args.make_parser().parse_args(["--model", "m"])) is None
    cfg = multinode.node_engine_config(
        engine_config("tiny-llama", pipeline_parallel_size=2), node)
    assert cfg.cache.swap_space == 0.0  # no host copies of other processes' blocks
    cases = {
        "data parallelism across nodes": dict(data_parallel_size=2, pipeline_parallel_size=2),
        "cannot be spread evenly over --nnodes 2": dict(tensor_parallel_size=3),
        "--enable-lora": dict(enable_lora=True, pipeline_parallel_size=2),
        "--preemption-mode swap": dict(preemption_mode="swap", pipeline_parallel_size=2),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message):
            multinode.node_engine_config(engine_config("tiny-llama", **kw), node)


# ------------------------------------------------------------------ control channel


def _pair(mine, theirs, port):
    """A LeaderWatch and a FollowerLink (node rank 1) built concurrently on loopback."""
    node0 = multinode.NodeConfig(2, 0, "127.0.0.1", port)
    node1 = multinode.NodeConfig(2, 1, "127.0.0.1", port, headless=True)
    got: dict = {}

    def follow():
        try:
            got["link"] = multinode.FollowerLink(node1, theirs, timeout_s=20)
        except RuntimeError as e:
            got["link_error"] = str(e)

    t = threading.Thread(target=follow)
    t.start()
    try:
        got["watch"] = multinode.LeaderWatch(node0, mine, timeout_s=20)
    except RuntimeError as e:
        got["watch_error"] = str(e)
    t.join(20)
    return got


def test_control_channel_refuses_a_different_configuration():
    from pagedjax.entrypoints.llm import engine_config

    a = multinode.fingerprint(engine_config("tiny-llama", pipeline_parallel_size=2), 20)
    b = multinode.fingerprint(
        engine_config("tiny-llama", pipeline_parallel_size=2, num_gpu_blocks_override=7), 20)
    got = _pair(a, b, port_pair())
    for key in ("watch_error", "link_error"):
        assert "node rank 1's engine configuration differs" in got[key], got
        assert "cache.num_gpu_blocks_override: None (node 0) vs 7" in got[key], got


def test_control_channel_reports_a_lost_node_by_rank():
    fp = {"model": "'m'"}
    got = _pair(fp, fp, port_pair())
    watch, link = got["watch"], got["link"]
    lost: list[tuple[float, str]] = []
    watch.start(lambda m: lost.append((time.monotonic(), m)))
    link.start(lambda m: None)
    time.sleep(1.2)  # a ping flows; nothing is lost
    assert not lost and watch.wait_lost(0) is None
    t0 = time.monotonic()
    link.close()  # as the kernel closes a killed process's sockets
    assert watch.wait_lost(5.0) is not None
    assert "node rank 1 (pid" in lost[0][1] and "connection closed" in lost[0][1]
    assert lost[0][0] - t0 < 2.0
    # Node 0 gone without "bye": the follower is told; after "bye" it is not.
    leader_lost: list[str] = []
    got = _pair(fp, fp, port_pair())
    got["link"].start(leader_lost.append)
    for p in got["watch"].peers.values():
        p.sock.close()
    deadline = time.monotonic() + 5
    while not leader_lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leader_lost and "closed the control connection without stopping" in leader_lost[0]
    got = _pair(fp, fp, port_pair())
    calm: list[str] = []
    got["link"].start(calm.append)
    got["watch"].close()
    for p in got["watch"].peers.values():
        p.sock.close()
    time.sleep(0.5)
    assert not calm and got["link"].bye


# ------------------------------------------------------------------ two processes (tier 2)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat_multinode")
    save_tiny_hf_model("llama", d)
    save_tiny_tokenizer(d)
    port, http = port_pair(), port_pair()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", PAGEDJAX_WARMUP="none")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()]
    common = [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", str(d), *flags,
              "-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--served-model-name", NAME]  # fmt: skip
    logs = [d / "node0.log", d / "node1.log"]
    procs = [
        subprocess.Popen([*common, "--node-rank", "0", "--port", str(http),
                          "--uvicorn-log-level", "warning", "--disable-log-requests"],
                         env=env, stdout=subprocess.DEVNULL, stderr=open(logs[0], "w")),
        subprocess.Popen([*common, "--node-rank", "1", "--headless"], env=env,
                         stdout=subprocess.DEVNULL, stderr=open(logs[1], "w")),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{http}"
    try:
        # The one-device reference while the nodes start (its programs are test_server.py's).
        from pagedjax import LLM, SamplingParams

        llm = LLM(model=str(d), **GEOMETRY)
        greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        wait_healthy(url, procs, 300, lambda: "\n".join(g.read_text()[-4000:] for g in logs))
        yield dict(url=url, want=want, leader=procs[0], follower=procs[1], logs=logs)
    finally:
        procs[0].send_signal(signal.SIGTERM)
        try:
            procs[0].wait(60)
        finally:
            for p in procs:
                p.kill()
                p.wait(10)


@pytest.mark.tier2
def test_openai_client_over_two_nodes_equals_one_device(two_nodes):
    from openai import OpenAI

    want = two_nodes["want"]
    client = OpenAI(api_key="unused", base_url=two_nodes["url"] + "/v1", timeout=120,
                    max_retries=0)  # fmt: skip
    kw = dict(model=NAME, max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    got = client.completions.create(prompt=PROMPTS, **kw)
    assert sorted((c.index, c.text) for c in got.choices) == list(enumerate(want))
    time.sleep(1.5)  # idle: node 0's core keeps node 1 alive with empty exchanges
    stream = client.completions.create(prompt=PROMPTS[1], stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream) == want[1]
    assert httpx.get(two_nodes["url"] + "/health", timeout=10).status_code == 200
    metrics = httpx.get(two_nodes["url"] + "/metrics", timeout=30).text  # node 0's engine
    assert 'pagedjax:request_success_total{finished_reason="length"' in metrics
    assert two_nodes["follower"].poll() is None


@pytest.mark.tier2
def test_killed_follower_fails_health_and_requests_naming_its_rank(two_nodes):
    """Last of the module's two-process tests: it kills node 1."""
    url, follower = two_nodes["url"], two_nodes["follower"]
    body = dict(model=NAME, prompt="doomed", max_tokens=110, ignore_eos=True, stream=True)
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break  # the request runs on both nodes
            follower.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            rest = list(lines)
        elapsed = time.monotonic() - t0
        errors = [json.loads(x[6:]) for x in rest if x.startswith('data: {"error"')]
        assert errors, rest
        err = errors[0]["error"]
        assert err["code"] == 500 and "node rank 1" in err["message"], err
        assert elapsed < 10, elapsed
        h = c.get("/health")
        assert h.status_code == 503 and "node rank 1" in h.text, h.text
        assert time.monotonic() - t0 < 10
