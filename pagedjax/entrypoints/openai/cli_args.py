"""Command-line flags of the OpenAI-compatible server: vLLM's names (kebab-case of the
``LLM`` arguments), pagedjax's own flags marked as such, and refusals by feature name.
An engine flag left out is left out of ``LLM(...)`` too, so the server's defaults are
``LLM``'s (prefix caching on, K auto, ...), never a second copy of them.

``make_parser()`` builds the argparse parser (abbreviations off, so an unknown or
misspelt flag is an error rather than a guess); each of vLLM 0.32's server flags that
pagedjax does not implement (``vllm_flags.py``, generated from vLLM's parser) is refused
by name with the reason (``add_vllm_refusals``), not argparse's generic error.
``llm_kwargs(args)`` turns the parsed flags into ``LLM(...)`` keyword arguments;
``reject_unbuilt(args)`` raises SystemExit naming a flag value that cannot be served (a
negative --max-waiting-requests) instead of ignoring it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedjax.attention import KV_CACHE_DTYPES
from pagedjax.entrypoints.openai.limits import PAGEDJAX_ONLY_LIMITS, add_limit_args
from pagedjax.entrypoints.openai.output_flags import (
    add_output_args,
    check_output_args,
    output_llm_kwargs,
)
from pagedjax.entrypoints.openai.shutdown import add_shutdown_args
from pagedjax.entrypoints.openai.vllm_flags import VLLM_SERVER_FLAGS, VLLM_VERSION

# Flags vLLM 0.32 does not have (vllm_flags.py); the help text says so (docs/serving.md
# lists them; tests/test_vllm_recipes.py checks this list against vLLM's).
PAGEDJAX_ONLY = (
    "--swap-space",
    "--kv-offloading-disk-path",  # the disk tier under the host tier (kv_tiers.md)
    "--kv-offloading-disk-size",  # vLLM removed it in V1; here the paper's host swap pool (GiB)
    "--num-scheduler-steps",  # vLLM V0's multi-step; here the on-device K-step decode loop
    "--preemption-mode",  # vLLM V0's; here recompute or swap (the paper's)
    "--max-waiting-requests",  # older name of vLLM's --max-num-queued-reqs (limits.py)
    "--max-engine-restarts",
    *PAGEDJAX_ONLY_LIMITS,
    "--scheduling-mode",
    "--warmup",
    "--compilation-cache",
    "--data-parallel-routing",  # vLLM balances DP replicas by load only
    "--disable-log-requests",  # vLLM 0.32 has --enable-log-requests instead
    "--disable-frontend-multiprocessing",  # vLLM V0's; here the engine thread (debugging)
    "--lora-memory",  # adapter slots inside the KV budget or beside it (docs/lora.md)
    "--prefix-index",  # the prefix cache's host hint: hash chain or radix tree (kv_tiers.md)
    "--eviction-policy",  # which cached device block goes first: lru, lfu, cost (kv_tiers.md)
    "--pipeline-microbatches",  # micro-batches through the PP stages per step (parallelism.md)
)


def _own(text: str) -> str:
    return f"[pagedjax only] {text}"


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """The LLM arguments, vLLM's flag names."""
    if model_positional:
        p.add_argument("model", help="checkpoint directory (Hugging Face format) or preset name")
    else:
        p.add_argument(
            "--model",
            required=True,
            help="checkpoint directory (Hugging Face format) or preset name",
        )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default=None, choices=["auto", "dummy", "safetensors"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float,
                   default=None)  # fmt: skip
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV pool size in bytes (on CPU: else 4 GiB, at most a quarter of free memory"
        " rounded down to a power of two)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="automatic prefix caching (LLM's default: on, as vLLM)",
    )
    p.add_argument(
        "--preemption-mode",
        default=None,
        choices=["recompute", "swap"],
        help=_own("how a preempted group gives its KV blocks back (vLLM V0's flag)"),
    )
    p.add_argument("--max-logprobs", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    p.add_argument("--pipeline-microbatches", type=int, default=None,
                   help=_own("micro-batches in flight through the pipeline stages per step"))
    add_node_args(p)
    p.add_argument(
        "--data-parallel-routing",
        default=None,
        choices=["least_tokens", "prefix_affinity"],
        help=_own("how requests pick a data-parallel replica"),
    )
    p.add_argument(
        "--swap-space", type=float, default=None, help=_own("host swap pool per engine, GiB")
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory for prefix-cache blocks evicted from the device (the host"
        " tier, in the swap pool's allocator; docs/kv_tiers.md); 0 = off",
    )
    p.add_argument(
        "--prefix-index",
        choices=("hash", "radix"),
        default=None,
        help=_own("the prefix cache's host hint: chained block hashes or a radix tree"),
    )
    p.add_argument(
        "--eviction-policy",
        choices=("lru", "lfu", "cost"),
        default=None,
        help=_own("which free cached KV block a new allocation evicts: least recently"
                  " freed (default), least hit, or cheapest to recompute (docs/kv_tiers.md)"),
    )
    p.add_argument(
        "--kv-offloading-disk-path",
        default=None,
        help=_own("a directory for the disk tier under the host tier: prefix-cache blocks"
                  " in files that a restarted server reads (docs/kv_tiers.md)"),
    )
    p.add_argument(
        "--kv-offloading-disk-size",
        type=float,
        default=None,
        help=_own("GiB of block files the disk tier keeps (default 8)"),
    )
    p.add_argument(
        "--kv-offloading-backend",
        default=None,
        help="'native' (pagedjax's host tier); connectors such as 'lmcache' are refused",
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=_int_or_auto,
        default=None,
        help=_own(
            "decode iterations run in one on-device loop (K), or 'auto'; vLLM V0's name,"
            f" vLLM {VLLM_VERSION} has no such flag"
        ),
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's flag, its JAX meaning: nothing compiled ahead of time (--warmup none)"
        " and no fused K-step decode program (--num-scheduler-steps 1); docs/serving.md",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        choices=["auto", "reference", "native_cpu", "pallas"],
        help="attention implementation (vLLM's flag, pagedjax's backends)",
    )
    p.add_argument(
        "--scheduling-mode",
        default=None,
        choices=["default", "paper", "static"],
        help=_own("default (chunked prefill), paper (2023 vLLM rules) or static batching"),
    )
    p.add_argument("--watermark", type=float, default=None, help="fraction of blocks kept free")
    p.add_argument(
        "--warmup",
        default=None,
        choices=["auto", "all", "decode", "none"],
        help=_own("compile at start-up: auto = decode programs on an accelerator, none on CPU"),
    )
    p.add_argument(
        "--compilation-cache",
        default=None,
        help=_own("persistent compilation cache directory (LLM's compilation_cache)"),
    )
    # Accepted so the refusal can name the feature (reject_unbuilt).
    p.add_argument(
        "--quantization", "-q", default=None,
        help="weight quantization: awq, gptq, compressed-tensors, gguf, or in flight"
        " int8_per_channel_weight_only, fp8_per_tensor, fp8_per_channel, int4, nf4"
        " (default: the checkpoint's own; docs/quantization.md)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-config",
        "-sc",
        type=_json_object,
        default=None,
        help='speculative decoding, JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--enable-lora", action=argparse.BooleanOptionalAction, default=None,
        help="serve LoRA adapters (--lora-modules; requests name one as 'model'; docs/lora.md)",
    )  # fmt: skip
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters on the device at once (LLM's default: 1)")  # fmt: skip
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the largest adapter rank served (LLM's default: 16)")  # fmt: skip
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras)")  # fmt: skip
    p.add_argument("--lora-memory", choices=("unified", "static", "separate"), default=None,
                   help=_own("a fixed adapter table inside the KV budget (static, the"
                             " default), adapters paged in KV blocks (unified) or the"
                             " table beside the budget (separate: the ablation;"
                             " docs/lora.md)"))  # fmt: skip
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a directory whose files chat image_url parts may name as file:// URLs"
        " (default: none; docs/multimodal.md)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="hosts http(s) image URLs may name (default: any); redirects are then not"
        " followed",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_json_object,
        default=None,
        help='most images per prompt, JSON: \'{"image": 2}\' (default 999; LLaVA, Idefics3)',
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=list(KV_CACHE_DTYPES),
        help="KV pool storage: auto (model dtype), a float dtype, or 8-bit fp8 (= fp8_e4m3),"
        " fp8_e5m2, int8_per_token_head",
    )


def add_node_args(p: argparse.ArgumentParser) -> None:
    """vLLM's multi-node flags: TP and PP across nodes (engine/fronts/multinode.py)."""
    p.add_argument("--nnodes", "-n", type=int, default=1,
                   help="nodes serving one model together (TP x PP devices spread evenly);"
                   " run the same command on each, with its --node-rank")  # fmt: skip
    p.add_argument("--node-rank", "-r", type=int, default=0,
                   help="this node's rank, 0 .. nnodes - 1; node 0 serves HTTP")
    p.add_argument(
        "--master-addr", default=None,
        help="node 0's address (needed with --nnodes > 1): the JAX coordinator listens at"
        " --master-port, the nodes' control channel at the next port",
    )  # fmt: skip
    p.add_argument("--master-port", type=int, default=None,
                   help="the coordinator's port on node 0 (default 29501, vLLM's)")
    p.add_argument("--headless", action="store_true",
                   help="ranks > 0: run this node's share of the engine, no HTTP server")


def node_config(args: argparse.Namespace) -> Any:
    """The multi-node flags as a ``multinode.NodeConfig`` (None for one node);
    SystemExit naming an inconsistent combination."""
    from pagedjax.engine.fronts.multinode import NodeConfig

    try:
        node = NodeConfig(nnodes=args.nnodes, node_rank=args.node_rank,
                          master_addr=args.master_addr, master_port=args.master_port,
                          headless=args.headless)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if node.nnodes == 1:
        return None
    if args.disable_frontend_multiprocessing:
        raise SystemExit("error: --nnodes > 1 with --disable-frontend-multiprocessing: node"
                         " 0's engine runs in an engine core process (a lost node ends that"
                         " process, and the API process reports it)")  # fmt: skip
    if args.max_engine_restarts > 0:
        raise SystemExit("error: --max-engine-restarts with --nnodes > 1: a restarted engine"
                         " would need every node restarted too")  # fmt: skip
    return node


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients use as 'model' (default: --model); the first is reported",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (else $PAGEDJAX_API_KEY)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template, a file path or the template text (default: the tokenizer's)",
    )
    p.add_argument("--response-role", default="assistant")
    p.add_argument(
        "--lora-modules", nargs="+", type=_lora_module, default=None,
        help="LoRA adapters served by name (with --enable-lora): name=path, or JSON"
        ' \'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )  # fmt: skip
    add_limit_args(p)  # --max-num-queued-reqs, --request-timeout, body / field limits
    add_shutdown_args(p)  # --shutdown-timeout
    p.add_argument(
        "--max-engine-restarts", type=int, default=0,
        help=_own("restart a dead engine core process up to this many times (its requests"
                  " in flight fail); 0: /health and every request fail, for an orchestrator"
                  " to restart the server"),
    )  # fmt: skip
    p.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help=_own("step the engine in a thread of the server process, not in engine core"
                  " processes of its own (debugging; vLLM V0's name; docs/serving.md)"),
    )
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument(
        "--disable-log-requests", action="store_true", help=_own("no access log per request")
    )
    add_output_args(p)  # structured outputs, tool calling, reasoning (output_flags.py)


def make_parser(prog: str = "pagedjax.entrypoints.openai.api_server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="pagedjax's OpenAI-compatible server (vLLM's flags)",
        allow_abbrev=False,
    )
    add_engine_args(p)
    add_server_args(p)
    add_vllm_refusals(p)
    return p


# Why a vLLM flag is not implemented, by the first pattern its name contains (else the
# last entry's reason).
REFUSAL_REASONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("lora",), "only --enable-lora, --lora-modules, --max-loras, --max-lora-rank and"
     " --max-cpu-loras are built (docs/lora.md)"),
    (("trust-remote-code", "model-impl", "model-class-overrides", "runner", "convert"),
     "pagedjax runs its own model implementations (docs/model_families.md), never a"
     " checkpoint's code"),
    (("revision", "download-dir", "hf-token", "hf-overrides", "hf-config-path"),
     "models load from a local directory, a .gguf file or pagedjax's catalog, not from"
     " the Hugging Face Hub"),
    (("chunked-prefill",), "chunked prefill is always on in the default --scheduling-mode"
     " (paper and static turn it off)"),
    (("compilation-config", "optimization-level", "performance-mode"),
     "XLA compiles whole programs; pagedjax's compile options are --warmup,"
     " --compilation-cache and --enforce-eager"),
    (("scheduling-policy", "scheduler-cls", "async-scheduling"),
     "the scheduler is pagedjax's jitted one (--scheduling-mode; docs/scheduler.md)"),
    (("-mm-", "mm-", "media", "video", "language-model-only", "prompt-embeds"),
     "multimodal inputs and prompt embeddings are not built (text models only)"),
    (("cohere", "anthropic"), "the Cohere and Anthropic API front ends are not built"),
    (("tool", "reasoning"),
     "only --enable-auto-tool-choice, --tool-call-parser (hermes, llama3_json),"
     " --reasoning-parser (deepseek_r1, qwen3) and --structured-outputs-config are built:"
     " no parser plugins, tool servers or reasoning configs"),
    (("ssl",), "TLS is not built: put a TLS-terminating proxy in front"),
    (("cudagraph", "cuda-graph"), "CUDA graphs do not exist under XLA, which compiles whole"
     " programs (--enforce-eager has pagedjax's meaning: docs/serving.md)"),
    (("pipeline-parallel", "context-parallel", "dcp-", "cp-kv", "expert", "eplb", "ep-",
      "data-parallel-", "dp-", "distributed", "ray-",
      "all2all", "dbo", "ubatch", "api-server-count", "nccl", "custom-all-reduce",
      "hc-sp", "numa", "device-ids", "worker", "fault-tolerance"),
     "only tensor (--tensor-parallel-size), pipeline (--pipeline-parallel-size) and data"
     " (--data-parallel-size) parallelism are built, TP and PP across nodes with --nnodes,"
     " --node-rank, --master-addr, --master-port and --headless (docs/parallelism.md)"),
    (("mamba", "replayssm", "swa-"), "state-space (Mamba) models are not built"),
    (("kv-transfer", "kv-events", "ec-", "offload", "kv-sharing"),
     "KV transfer, events and offloading are not built (the host swap pool: --swap-space)"),
    (("sleep", "cumem"), "sleep mode and GPU memory pools are not built"),
    (("grpc", "uds", "middleware", "root-path", "allowed-", "allow-credentials", "h11-",
      "fastapi", "offline-docs", "access-log", "request-id-headers", "fingerprint",
      "scale-out", "tokens-only", "sse-", "tokenizer-info", "log-", "logging", "metrics",
      "traces", "nvtx", "jit-monitor", "server-load"),
     "this part of vLLM's server (transport, middleware, logging or metrics options) is"
     " not built; pagedjax's server is docs/serving.md's"),
    ((), "not implemented in pagedjax (docs/serving.md lists the flags that are)"),
)


# Each vLLM option string -> its flag's canonical long name (vllm_flags.py's first name).
CANONICAL = {s: names[0] for names in VLLM_SERVER_FLAGS for s in names}


def refusal_reason(flag: str) -> str:
    """Why the vLLM flag ``flag`` (any of its option strings) is refused
    (``REFUSAL_REASONS``, matched on its canonical name)."""
    flag = CANONICAL.get(flag, flag)
    for patterns, reason in REFUSAL_REASONS:
        if not patterns or any(pat in flag for pat in patterns):
            return reason
    raise AssertionError("REFUSAL_REASONS ends with a catch-all")


class _Refused(argparse.Action):
    """A vLLM flag pagedjax does not implement: an error naming it and why."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        flag = option_string or self.option_strings[0]
        name = flag if CANONICAL.get(flag, flag) == flag else f"{flag} ({CANONICAL[flag]})"
        parser.error(f"{name}, a vLLM {VLLM_VERSION} server flag, is not implemented by"
                     f" pagedjax: {refusal_reason(flag)}")  # fmt: skip


def add_vllm_refusals(p: argparse.ArgumentParser) -> list[str]:
    """Make each option string of vLLM's server (``vllm_flags.py``) that ``p`` does not
    have an error naming the flag and the reason, whatever values follow it. Returns
    the refused option strings."""
    have = {s for a in p._actions for s in a.option_strings}
    refused = [s for names in VLLM_SERVER_FLAGS for s in names if s not in have]
    for flag in refused:
        p.add_argument(flag, nargs="*", action=_Refused, default=argparse.SUPPRESS,
                       dest=f"refused{flag}", help=argparse.SUPPRESS)  # fmt: skip
    return refused


def reject_unbuilt(args: argparse.Namespace) -> None:
    """SystemExit naming a flag value that cannot be served. Every engine flag vLLM's
    recipe uses is built now (quantization, TP / DP, the 8-bit KV cache, speculation);
    combinations the engine does not support are refused by LLM with their names."""
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        n = args.max_waiting_requests
        raise SystemExit(f"error: --max-num-queued-reqs (--max-waiting-requests) must be >= 0,"
                         f" got {n}")  # fmt: skip
    check_output_args(args)
    node_config(args)  # the multi-node flags' combination
    for flag in ("max_engine_restarts", "shutdown_timeout"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 0")
    from pagedjax.entrypoints.openai.limits import ServerLimits

    try:
        ServerLimits.from_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


# Flags that map one to one onto LLM(...) keyword arguments (dest == keyword).
LLM_ARGS = (
    "model", "tokenizer", "dtype", "load_format", "seed", "block_size", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
    "num_gpu_blocks_override", "kv_cache_memory_bytes", "swap_space", "enable_prefix_caching",
    "kv_offloading_size", "kv_offloading_backend", "prefix_index", "eviction_policy",
    "kv_offloading_disk_path", "kv_offloading_disk_size",
    "preemption_mode", "tensor_parallel_size", "data_parallel_size", "data_parallel_routing",
    "pipeline_parallel_size", "pipeline_microbatches", "scheduling_mode", "watermark",
    "attention_backend", "max_logprobs", "num_scheduler_steps", "warmup", "compilation_cache",
    "kv_cache_dtype",
    "quantization",
    "speculative_config",
    "enforce_eager",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_memory",
    "limit_mm_per_prompt",
)  # fmt: skip


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from the parsed flags: only the flags given, so every
    default is LLM's own (one place to change a default; the server cannot drift)."""
    kwargs = {k: getattr(args, k) for k in LLM_ARGS if getattr(args, k) is not None}
    return kwargs | output_llm_kwargs(args)


def _lora_module(text: str) -> dict[str, str]:
    """One --lora-modules value: name=path, or vLLM's JSON object with "name", "path"
    and optionally "base_model_name"."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
        unknown = sorted(set(value) - {"name", "path", "base_model_name"}) if isinstance(
            value, dict) else None  # fmt: skip
        if unknown is None or unknown or not all(
            isinstance(value.get(k), str) and value.get(k) for k in ("name", "path")
        ):
            raise argparse.ArgumentTypeError(
                f'expected {{"name": ..., "path": ..., "base_model_name": ...}}, got {text!r}'
            )
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return {"name": name, "path": path}


def lora_requests(args: argparse.Namespace, engine: Any, served_names: list[str]) -> dict:
    """{name: LoRARequest} of --lora-modules (ids 1, 2, ... in order), each checkpoint
    read once against the engine's model (``engine.arch``, ``engine.config.lora``).
    ValueError naming the cause: modules without --enable-lora, a name given twice or
    equal to a served model name, a base_model_name not served, a bad adapter."""
    from pagedjax.lora import LoRARequest, llama_module_shapes, load_peft_adapter

    modules = args.lora_modules or []
    if not modules:
        return {}
    cfg = getattr(getattr(engine, "config", None), "lora", None)
    if cfg is None:
        raise ValueError("--lora-modules needs --enable-lora")
    out: dict[str, LoRARequest] = {}
    for i, m in enumerate(modules, start=1):
        name, path = m["name"], m["path"]
        if name in out or name in served_names:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice")
        base = m.get("base_model_name")
        if base is not None and base not in served_names:
            raise ValueError(f"--lora-modules {name!r}: base_model_name {base!r} is not a served"
                             f" model name ({served_names})")  # fmt: skip
        arch = engine.arch
        load_peft_adapter(path, llama_module_shapes(arch), arch.num_layers, cfg.max_lora_rank)
        out[name] = LoRARequest(name, i, path, base_model_name=base)
    return out


def describe(args: argparse.Namespace) -> str:
    return json.dumps({k: v for k, v in vars(args).items() if k != "api_key"}, default=str)


def _json_object(text: str) -> dict[str, Any]:
    """--speculative-config's value: a JSON object (its keys are checked by LLM)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
