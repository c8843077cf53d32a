"""Configuration as dataclasses, loadable from YAML, with unknown keys rejected.

Each section validates its own values in ``__post_init__`` and names the offending key
(``cache.block_size``) in the error. ``load_dataclass`` is generic, so experiment
configs reuse it for their own sections.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _is_pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run.

    model: a local Hugging Face directory, a ``.gguf`` file, a catalog name (a real model
        fetched once, e.g. ``smollm2-135m-instruct``) or a preset name (``llama-2-7b``).
    load_format: ``auto`` (weights from the directory), ``dummy`` (random weights from
        the config alone, as vLLM's), ``safetensors``.
    max_model_len: the longest prompt + output; None takes the model's own limit.
    quantization: the weights' quantization method (vLLM's ``--quantization``): None
        takes the checkpoint's own (config.json's quantization_config), else "awq",
        "gptq", "compressed-tensors", "gguf" (a GGUF file kept packed) or an in-flight
        mode ("int8_per_channel_weight_only", "fp8_per_tensor", "fp8_per_channel",
        "int4", "nf4"); docs/quantization.md.
    """

    model: str = "tiny-llama"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_format: Literal["auto", "dummy", "safetensors"] = "auto"
    max_model_len: int | None = None
    tokenizer: str | None = None
    seed: int = 0
    quantization: str | None = None

    def __post_init__(self) -> None:
        _check(bool(self.model), "model.model", "must name a directory or a preset")
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            "model.max_model_len",
            f"must be >= 1, got {self.max_model_len}",
        )


# The KV pool's storage names (pagedjax.attention.kv_quant.KV_CACHE_DTYPES says the same;
# tests/test_kv_quant_engine.py checks the two agree).
CACHE_DTYPES = (
    "auto", "float32", "bfloat16", "float16",
    "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head",
)  # fmt: skip


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    On a GPU the number of blocks comes from ``gpu_memory_utilization``; on CPU (where
    the device reports no memory limit) from ``num_gpu_blocks_override`` or
    ``kv_cache_memory_bytes``, else a documented default.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4.0
    enable_prefix_caching: bool = True
    # The KV pool's storage (vLLM's cache_dtype / --kv-cache-dtype): "auto" = the model's
    # dtype; the 8-bit formats are pagedjax.attention.kv_quant's (docs/kv_quantization.md).
    cache_dtype: Literal[
        "auto", "float32", "bfloat16", "float16",
        "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head",
    ] = "auto"  # fmt: skip
    # fp8 only: "calibrate" sets the per-(layer, KV head) scales from the first prompts
    # (pagedjax/engine/kv_calibration.py); "default" keeps vLLM's 1.0.
    kv_scales: Literal["default", "calibrate"] = "default"
    # The host tier (vLLM's kv_offloading_size / kv_offloading_backend, docs/kv_tiers.md):
    # GiB of host memory (total across TP ranks) for prefix blocks evicted from the device
    # pool, in the swap pool's allocator; 0 = off. Backend "native" only (None = native).
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str | None = None
    # The disk tier under the host tier (pagedjax's own; docs/kv_tiers.md): a directory of
    # block files that outlives the process, at most kv_offloading_disk_size GiB of them.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 8.0
    # The prefix cache's host hint (docs/kv_tiers.md): "hash" (chained block hash -> block,
    # memory/prefix_cache.py) or "radix" (SGLang's radix tree, memory/radix_hint.py); the
    # device verifies either's proposals, so greedy outputs do not depend on it.
    prefix_index: Literal["hash", "radix"] = "hash"
    # Which free cached device block an allocation evicts (docs/kv_tiers.md): "lru" (the
    # free list, least recently freed first: the default, O(1) per block), "lfu" or
    # "cost" (memory/eviction.py; a sort over the pool per allocation, block_stats.py).
    eviction_policy: Literal["lru", "lfu", "cost"] = "lru"

    def __post_init__(self) -> None:
        _check(
            _is_pow2(self.block_size) and self.block_size <= 256,
            "cache.block_size",
            f"must be a power of two in [1, 256], got {self.block_size}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "cache.gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            "cache.num_gpu_blocks_override",
            f"must be >= 2 (block 0 is the null block), got {self.num_gpu_blocks_override}",
        )
        _check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "cache.kv_cache_memory_bytes",
            f"must be > 0, got {self.kv_cache_memory_bytes}",
        )
        _check(self.swap_space >= 0, "cache.swap_space", f"must be >= 0 GiB, got {self.swap_space}")
        _check(
            self.kv_offloading_size >= 0,
            "cache.kv_offloading_size",
            f"must be >= 0 GiB, got {self.kv_offloading_size}",
        )
        _check(
            self.kv_offloading_backend in (None, "native"),
            "cache.kv_offloading_backend",
            f"{self.kv_offloading_backend!r} is not built: only 'native' (pagedjax's host"
            " tier, docs/kv_tiers.md); connectors such as 'lmcache' are not",
        )
        _check(
            self.kv_offloading_size == 0 or self.enable_prefix_caching,
            "cache.kv_offloading_size",
            "needs enable_prefix_caching (the host tier keeps evicted prefix-cache blocks)",
        )
        _check(
            self.kv_offloading_disk_path is None or self.kv_offloading_size > 0,
            "cache.kv_offloading_disk_path",
            "needs kv_offloading_size > 0 (the disk tier sits under the host tier)",
        )
        _check(
            self.kv_offloading_disk_size > 0,
            "cache.kv_offloading_disk_size",
            f"must be > 0 GiB, got {self.kv_offloading_disk_size}",
        )
        _check(
            self.kv_offloading_disk_path is None or self.kv_scales != "calibrate",
            "cache.kv_offloading_disk_path",
            "with kv_scales='calibrate' is not built: calibrated fp8 scales differ between"
            " runs, so stored blocks would be read with other scales",
        )
        _check(
            self.prefix_index in ("hash", "radix"),
            "cache.prefix_index",
            f"must be 'hash' or 'radix', got {self.prefix_index!r}",
        )
        _check(
            self.eviction_policy in ("lru", "lfu", "cost"),
            "cache.eviction_policy",
            f"must be 'lru', 'lfu' or 'cost', got {self.eviction_policy!r}",
        )
        _check(
            self.cache_dtype in CACHE_DTYPES,
            "cache.cache_dtype",
            f"(kv_cache_dtype) must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}",
        )
        _check(
            self.kv_scales in ("default", "calibrate"),
            "cache.kv_scales",
            f"must be 'default' or 'calibrate', got {self.kv_scales!r}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling (the user-facing settings; the engine derives the jitted
    scheduler's static ``pagedjax.scheduler.SchedulerLimits`` from them).

    scheduling_mode: ``default`` (token budget, chunked prefill), ``paper`` (the 2023
        vLLM rules: no chunking, FCFS, 1% watermark) or ``static`` (request-level
        batching, the FasterTransformer baseline).
    watermark: fraction of blocks kept free at admission.
    preemption_mode: ``recompute`` or ``swap``; None picks the paper's default
        (recompute for single-sequence groups, swap for the rest).
    num_multi_steps: K, decode iterations per on-device loop (vLLM's
        ``num_scheduler_steps``); ``"auto"`` picks K by device kind
        (``pagedjax.engine.multi_step.AUTO_STEPS``).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_mode: Literal["default", "paper", "static"] = "default"
    policy: Literal["fcfs", "shortest_remaining"] = "fcfs"
    watermark: float = 0.01
    preemption_mode: Literal["recompute", "swap"] | None = None
    num_multi_steps: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        _check(
            self.max_num_batched_tokens >= 1,
            "scheduler.max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        _check(
            self.max_num_seqs >= 1,
            "scheduler.max_num_seqs",
            f"must be >= 1, got {self.max_num_seqs}",
        )
        _check(
            0.0 <= self.watermark < 1.0,
            "scheduler.watermark",
            f"must be in [0, 1), got {self.watermark}",
        )
        _check(
            self.num_multi_steps == "auto"
            or (isinstance(self.num_multi_steps, int) and self.num_multi_steps >= 1),
            "scheduler.num_multi_steps",
            f"must be 'auto' or an integer >= 1, got {self.num_multi_steps!r}",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size: devices one model is split over (docs/parallelism.md);
    data_parallel_size: engine replicas; data_parallel_routing: how requests pick a replica
    ("least_tokens" or "prefix_affinity", pagedjax/engine/fronts/router.py);
    pipeline_parallel_size: stages the layers are split into, each on tensor_parallel_size
    devices (pagedjax/model/pipeline.py); pipeline_layer_partition: layers per stage
    (None: vLLM's even split; ``LLM`` reads ``PAGEDJAX_PP_LAYER_PARTITION``);
    pipeline_microbatches: micro-batches in flight through the stages in one step
    (pagedjax's own key, vLLM has none; 1: one batch at a time; > 1 needs
    pipeline_parallel_size > 1; docs/parallelism.md)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_routing: Literal["least_tokens", "prefix_affinity"] = "least_tokens"
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] | None = None
    pipeline_microbatches: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size",
                     "pipeline_microbatches"):
            v = getattr(self, name)
            _check(v >= 1, f"parallel.{name}", f"must be >= 1, got {v}")
        _check(self.pipeline_microbatches == 1 or self.pipeline_parallel_size > 1,
               "parallel.pipeline_microbatches", f"={self.pipeline_microbatches} needs"
               " pipeline_parallel_size > 1 (micro-batches overlap pipeline stages)")
        part = self.pipeline_layer_partition
        if part is not None:
            _check(len(part) == self.pipeline_parallel_size and all(
                isinstance(n, int) and n >= 1 for n in part), "parallel.pipeline_layer_partition",
                f"must be pipeline_parallel_size={self.pipeline_parallel_size} layer counts"
                f" >= 1, got {part!r}")  # fmt: skip
        routes = ("least_tokens", "prefix_affinity")
        _check(
            self.data_parallel_routing in routes,
            "parallel.data_parallel_routing",
            f"must be one of {routes}, got {self.data_parallel_routing!r}",
        )


def _batch_size_schedule(table: Any) -> tuple[tuple[int, int, int], ...]:
    """vLLM's ``validate_and_normalize_dynamic_sd_schedule`` rules for the 3-item form:
    ((bs_lo, bs_hi, k), ...) sorted; ConfigError naming the rule broken."""
    key = "speculative_config.num_speculative_tokens_per_batch_size"
    _check(isinstance(table, list | tuple) and len(table) > 0, key, "must be a non-empty list")
    rows = []
    for entry in table:
        _check(isinstance(entry, list | tuple) and len(entry) in (3, 5), key,
               f"each entry is [bs_lo, bs_hi, k], got {entry!r}")  # fmt: skip
        if len(entry) == 5:
            raise ConfigError(f"{key}: the 5-item form (context-length buckets) is not built;"
                              " use [bs_lo, bs_hi, k] entries")  # fmt: skip
        _check(all(isinstance(x, int) and not isinstance(x, bool) for x in entry), key,
               f"entries are integers, got {entry!r}")  # fmt: skip
        lo, hi, k = entry
        _check(lo >= 1 and hi >= 1, key, f"batch-size range ({lo}, {hi}) must be positive")
        _check(lo <= hi, key, f"batch-size range start must be <= end in {entry!r}")
        _check(k >= 0, key, f"k values must be >= 0, got {entry!r}")
        rows.append((lo, hi, k))
    rows.sort()
    prev = 0
    for lo, hi, _ in rows:
        _check(lo > prev, key, "batch-size ranges must be non-overlapping")
        prev = hi
    _check(rows[0][0] == 1, key, "the first batch-size range must start at 1")
    return tuple(rows)


@dataclass(frozen=True)
class DraftTreeConfig:
    """Draft trees (pagedjax's own ``speculative_config.tree``; vLLM 0.32 has no tree key;
    docs/speculative_decoding.md "Draft trees").

    budget: draft nodes per row and step, 1..31 (with the row's last token a tree holds at
    most 32 slots, the tree attention mask's reach). top_k: branches, the n-gram method's
    distinct continuations merged into one trie (the first the chain proposer's), or the
    eagle head's top_k first tokens each continued as a chain (top_k x min(k, budget //
    top_k) nodes). The tree's depth is at most num_speculative_tokens. dynamic (eagle
    only): EAGLE-2's dynamic tree in the same top_k x levels shape, each level the top_k
    of the previous level's top_k x top_k children by cumulative draft log-probability
    (engine/spec/eagle_tree.py); false: the fixed branches.
    """

    budget: int = 16
    top_k: int = 2
    dynamic: bool = False

    def __post_init__(self) -> None:
        b, k = self.budget, self.top_k
        _check(isinstance(b, int) and 1 <= b <= 31, "speculative_config.tree.budget",
               f"must be in [1, 31] (a tree and its root fit the 32-bit tree mask), got {b!r}")
        _check(isinstance(k, int) and k >= 1, "speculative_config.tree.top_k",
               f"must be >= 1, got {k!r}")  # fmt: skip
        _check(isinstance(self.dynamic, bool), "speculative_config.tree.dynamic",
               f"must be true or false, got {self.dynamic!r}")  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys; docs/speculative_decoding.md).

    method: "ngram" (prompt lookup: the continuation of the latest earlier occurrence of
    the last n tokens, n from prompt_lookup_max down to prompt_lookup_min);
    "draft_model" with model "self" (or the target's own model name) and
    draft_num_layers N: a layer-skip draft, the target's first N layers with its final
    norm and LM head (pagedjax's own key); "draft_model" with another model (directory,
    .gguf, catalog or preset name) and no draft_num_layers: a separate draft checkpoint
    with its own KV pool (engine/spec/draft_model.py);
    "eagle" with model a head directory (engine/spec/eagle.py; trained by
    ``python -m pagedjax.tools.train_eagle``); "eagle3" with model an EAGLE-3 head
    directory, pagedjax's layout or vLLM / EAGLE-3's checkpoint names (engine/spec/eagle3.py;
    trained by ``python -m pagedjax.tools.train_eagle3``); "medusa" with model a directory of Medusa
    heads, pagedjax's layout or vLLM's checkpoint names (engine/spec/medusa.py; trained by
    ``python -m pagedjax.tools.train_medusa``), drafting min(k, num_heads) tokens per
    row. num_speculative_tokens: k, proposals
    verified per sequence per step. disable_by_batch_size: no proposals in a step with
    at least this many scheduled sequences (None: always).

    num_speculative_tokens_per_batch_size (vLLM's key, its 3-item form): ranges
    ``[[bs_lo, bs_hi, k], ...]``, inclusive, sorted, non-overlapping, the first starting
    at 1, k >= 0: a step whose batch has B sequences drafts at most k(B) per row (capped
    at num_speculative_tokens); a B in a gap takes the previous range's k, a B past the
    last range the last k (vLLM's ``build_dynamic_sd_schedule_lookup``). k = 0 is a plain
    step. vLLM's 5-item form (context-length buckets) is refused: not built.
    auto_num_speculative_tokens (pagedjax's own key, no vLLM equivalent): size each row's
    k every step from the measured acceptance and the measured cost of the step's
    bucket, down to 0 (``engine/spec/k_schedule.py``); within the table's k when both
    are set. With a tree it sizes each row's tree by levels (depths kept, down to 0).
    draft_sample_method (vLLM's key): "greedy" drafts the argmax; "probabilistic" makes
    the draft_model / eagle / eagle3 / medusa drafts samples of the draft's distribution q
    at the request's temperature, verified by rejection sampling (min(1, p/q), residual
    max(0, p - q)).
    The n-gram method has no q (a point mass): its drafts stay greedy either way.
    tree (pagedjax's own key, ``DraftTreeConfig``): draft trees verified in one step
    (ngram: continuations merged into a trie; eagle: top_k first tokens, each continued
    as a chain, or with "dynamic": true EAGLE-2's dynamic tree); None: chains.
    """

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "medusa"] = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, ...], ...] | None = None
    auto_num_speculative_tokens: bool = False
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    tree: DraftTreeConfig | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        _check(
            isinstance(k, int) and 1 <= k <= 32,
            "speculative_config.num_speculative_tokens", f"must be in [1, 32], got {k!r}",
        )  # fmt: skip
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _check(
            1 <= lo <= hi, "speculative_config.prompt_lookup_min",
            f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}",
        )  # fmt: skip
        if self.method != "ngram":
            _check(self.model is not None, "speculative_config.model",
                   f"method {self.method!r} needs a draft model")  # fmt: skip
        n = self.draft_num_layers
        _check(n is None or n >= 1, "speculative_config.draft_num_layers",
               f"must be >= 1, got {n!r}")  # fmt: skip
        if self.method == "draft_model" and self.model == "self":
            _check(n is not None, "speculative_config.draft_num_layers",
                   "model 'self' (a layer-skip draft) needs draft_num_layers N")  # fmt: skip
        b = self.disable_by_batch_size
        _check(b is None or b >= 1, "speculative_config.disable_by_batch_size",
               f"must be >= 1, got {b}")  # fmt: skip
        table = self.num_speculative_tokens_per_batch_size
        if table is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               _batch_size_schedule(table))  # fmt: skip
        m = self.draft_sample_method
        _check(m in ("greedy", "probabilistic"), "speculative_config.draft_sample_method",
               f"must be 'greedy' or 'probabilistic', got {m!r}")  # fmt: skip
        if self.tree is not None:
            _check(self.method in ("ngram", "eagle", "eagle3"), "speculative_config.tree",
                   "draft trees are built for the ngram, eagle and eagle3 methods, not"
                   f" {self.method!r}")  # fmt: skip
            _check(self.draft_sample_method == "greedy" or self.method == "ngram",
                   "speculative_config.tree", "sampled drafts (draft_sample_method"
                   " 'probabilistic') with a draft tree are not built")
            _check(not self.tree.dynamic or self.method == "eagle",
                   "speculative_config.tree.dynamic", "the dynamic draft tree (EAGLE-2's) is"
                   f" built for the eagle method only, not {self.method!r}")  # fmt: skip
            _check(self.method == "ngram" or self.tree.budget >= self.tree.top_k,
                   "speculative_config.tree", f"an eagle tree needs budget >= top_k (one"
                   f" node per branch), got {self.tree.budget} < {self.tree.top_k}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict (or JSON object) form; unknown keys are rejected by name."""
        return load_dataclass(cls, data, prefix="speculative_config.")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (vLLM's ``structured_outputs_config`` keys;
    docs/structured_outputs.md).

    backend: "auto" (vLLM's default and per-request rule: xgrammar unless it would not
    enforce the constraint, e.g. a JSON schema keyword it ignores or a grammar it
    cannot compile, then guidance), "xgrammar" or "guidance" (llguidance). vLLM's "outlines" and
    "lm-format-enforcer" are not built here (refused by name).
    disable_fallback: accepted for vLLM configs; no backend falls back silently here.
    disable_any_whitespace, disable_additional_properties: engine-wide defaults of the
    request options of the same names (either one turns the option on).
    reasoning_parser ("deepseek_r1" | "qwen3"; "" none; the server writes its
    --reasoning-parser here), enable_in_reasoning (vLLM's default false): with a parser
    and enable_in_reasoning false, a constrained sample runs unconstrained until its
    output ends with ``</think>``'s token ids, and the constraint applies from the next
    token; a prompt that already ended the reasoning constrains from the first token
    (structured/reasoning.py). An unknown parser is a ValueError when the engine starts.
    compile_timeout_s: a constraint whose compilation takes longer is refused (ValueError
    at add_request). cache_size: compiled constraints kept (by constraint text).
    jump_forward (pagedjax's own; vLLM has none): SGLang's jump-forward decoding. Where
    the grammar admits exactly one continuation, its tokens are appended to the output
    at once and computed as one chunk with the next step's token, instead of one decode
    step each. Off by default: the forced text is split into tokens by the grammar
    backend, not sampled, so greedy outputs need not equal vLLM's token for token
    (engine/jump_forward.py; docs/structured_outputs.md).
    device_fsm (pagedjax's own): regex and choice constraints, and JSON schemas that
    xgrammar compiles to a non-recursive grammar (structured/json_regex.py), run as a
    token DFA on the device (structured/token_fsm.py) instead of host bitmasks, so their
    rows need no host round trip per step and run inside the fused K-step decode loop.
    Off by default: it needs outlines-core, and a new table size compiles the step once
    per bucket. Grammars, recursive schemas (json_object), guidance's JSON, ``min_tokens``,
    ``bad_words`` and jump-forward keep the host path (the engine counts and logs which
    path each request took, and why).
    device_fsm_max_bytes: a constraint whose compressed table is larger takes the host
    path (reported; 4 MiB by default).
    json_max_whitespace (pagedjax's own; vLLM passes no such bound): with any whitespace
    allowed in JSON (the default), at most this many whitespace characters between JSON
    tokens (xgrammar's ``max_whitespace_cnt``); 0: unbounded, vLLM's default and the
    same tokens as vLLM. A small model under greedy decoding can fall into newlines
    inside a JSON value until max_tokens (docs/structured_outputs.md, "Measured: tool
    calls"); a bound closes that loop but changes outputs. xgrammar's JSON only: a JSON
    constraint that guidance would compile is refused while it is set (llguidance has no
    count), and bounded JSON rows take the host path, not the device FSM.
    overlap_mask_fill (pagedjax's own name for what vLLM does on its GPUs): true, a
    one-step iteration with host grammar masks to fill runs its forward and its sampling
    as two programs, and the host fills the masks while the forward runs (engine stats
    ``structured_mask_fill_*`` report the time and the part hidden; the two halves
    compile once per bucket on first use). False: one fused program, masks filled
    before it. "auto" (default): true on an accelerator, false on the CPU, where the
    host's fills and XLA's threads share the same cores (measured neutral on 2 cores:
    docs/structured_outputs.md).
    """

    backend: Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"] = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False
    compile_timeout_s: float = 30.0
    cache_size: int = 256
    jump_forward: bool = False
    device_fsm: bool = False
    device_fsm_max_bytes: int = 4 << 20
    json_max_whitespace: int = 0
    overlap_mask_fill: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        _check(self.overlap_mask_fill in (True, False, "auto"),
               "structured_outputs_config.overlap_mask_fill",
               f"must be true, false or 'auto', got {self.overlap_mask_fill!r}")  # fmt: skip
        _check(self.device_fsm_max_bytes > 0, "structured_outputs_config.device_fsm_max_bytes",
               f"must be positive, got {self.device_fsm_max_bytes}")  # fmt: skip
        _check(self.json_max_whitespace >= 0, "structured_outputs_config.json_max_whitespace",
               f"must be >= 0 (0: unbounded), got {self.json_max_whitespace}")  # fmt: skip
        _check(
            self.backend not in ("outlines", "lm-format-enforcer"),
            "structured_outputs_config.backend",
            f"{self.backend!r} is not built in pagedjax; use 'xgrammar', 'guidance' or 'auto'",
        )  # fmt: skip
        _check(self.compile_timeout_s > 0, "structured_outputs_config.compile_timeout_s",
               f"must be positive, got {self.compile_timeout_s}")  # fmt: skip
        _check(self.cache_size >= 0, "structured_outputs_config.cache_size",
               f"must be >= 0, got {self.cache_size}")  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsConfig:
        """From vLLM's dict (or JSON object) form; unknown keys are rejected by name."""
        return load_dataclass(cls, data, prefix="structured_outputs_config.")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``enable_lora`` options; docs/lora.md). Present in an
    EngineConfig only when LoRA is on.

    max_loras: adapters resident on the device at once (the slot table's slots, besides
    slot 0 = the base model); a request whose adapter finds no free slot, and no loaded
    adapter unused by running requests to evict, waits. max_lora_rank: the largest rank
    served; every slot is padded to it (exact: zero padding). max_cpu_loras: adapters
    kept in host memory (LRU; those of unfinished requests always stay); None: max_loras.
    memory: "static" (default): the fixed slot table (max_loras x max_lora_rank) whose
    device bytes (``lora.slots.slot_table_bytes``) come out of the KV budget up front,
    loaded or not. "unified": S-LoRA's unified paging: a resident adapter's weights live
    in blocks of the KV pool, lent from the block allocator when it is loaded (ceil(its
    bytes / a block's bytes), by its own rank) and returned when it is evicted; no table
    (engine/lora_paging.py; opt-in: each step reads every slot's pages, docs/lora.md).
    "separate": the table beside a pool of the full budget (the ablation; the device
    footprint grows with max_loras). num_gpu_blocks_override is a block count, not a
    budget: the same pool for "static" and "separate".
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    memory: str = "static"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"lora.{name}",
                   f"must be an integer >= 1, got {v!r}")  # fmt: skip
        c = self.max_cpu_loras
        _check(c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1),
               "lora.max_cpu_loras", f"must be None or an integer >= 1, got {c!r}")  # fmt: skip
        _check(c is None or c >= self.max_loras, "lora.max_cpu_loras",
               f"({c}) must be >= max_loras ({self.max_loras})")  # fmt: skip
        _check(self.memory in ("unified", "static", "separate"), "lora.memory",
               f"must be 'unified', 'static' or 'separate', got {self.memory!r}")  # fmt: skip

    @property
    def cpu_loras(self) -> int:
        """max_cpu_loras, None resolved to max_loras."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class MultiModalConfig:
    """Multi-modal input (images; docs/multimodal.md). Read only when the model has a
    vision tower (a LLaVA or Idefics3 checkpoint); a text-only model refuses every image.

    limit_mm_per_prompt: vLLM's option, most items per prompt by modality, e.g.
    {"image": 2}; a modality not named allows vLLM V1's default, 999. Only "image" is
    built. encoder_cache_size: embedding rows (image tokens) the encoder cache keeps
    on device between steps (vLLM's encoder cache, sized in tokens); None: the larger
    of max_num_batched_tokens and one image's tokens. A step that needs more images at
    once than fit grows the cache (logged) rather than fail.
    max_num_encoder_input_tokens (vLLM's scheduler budget of that name; here None = no
    budget): image tokens (tiles x tokens per tile) the engine encodes per step for
    queued requests before admitting them, so a request with large or many images is
    encoded over several steps while the running requests keep decoding
    (``multimodal.MultiModalRunner.admit``).
    """

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None

    def __post_init__(self) -> None:
        for k, v in self.limit_mm_per_prompt.items():
            _check(k == "image", "multimodal.limit_mm_per_prompt",
                   f"modality {k!r} is not built; only 'image'")  # fmt: skip
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            _check(ok, "multimodal.limit_mm_per_prompt", f"{k}: must be an integer >= 0, got {v!r}")
        _check(self.encoder_cache_size is None or self.encoder_cache_size >= 1,
               "multimodal.encoder_cache_size", f"must be >= 1, got {self.encoder_cache_size}")
        b = self.max_num_encoder_input_tokens
        _check(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1),
               "multimodal.max_num_encoder_input_tokens", f"must be an integer >= 1, got {b!r}")

    def limit(self, modality: str) -> int:
        """Most items of ``modality`` one prompt may carry."""
        return self.limit_mm_per_prompt.get(modality, 999)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; the top level of an engine YAML file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Speculative decoding (None: off); LLM(speculative_config={...}) builds it.
    speculative: SpeculativeConfig | None = None
    # Structured outputs: the grammar backend and its options (structured_outputs_config).
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # Multi-LoRA serving (None: off); LLM(enable_lora=True, max_loras=...) builds it.
    lora: LoRAConfig | None = None
    # Images (limit_mm_per_prompt, the encoder cache); docs/multimodal.md.
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    attention_backend: Literal["reference", "pallas", "native_cpu", "triton", "auto"] = "auto"
    # Compile at start-up (pagedjax/engine/warmup.py): "auto" = "all" (every step
    # program; cheap with the layer loop and the persistent cache), unless the
    # PAGEDJAX_WARMUP environment variable names another mode (the test suite sets
    # "none"); "decode" = the decode programs only.
    warmup: Literal["auto", "all", "decode", "none"] = "auto"
    # JAX's persistent compilation cache (pagedjax/compile_cache.py): None = the
    # PAGEDJAX_COMPILATION_CACHE environment variable, else ~/.cache/pagedjax/jax;
    # a directory; or "off".
    compilation_cache: str | None = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        return load_yaml(cls, path)


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert nested dataclasses."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return load_dataclass(tp, value, prefix=f"{key}.")
    if origin is typing.Union or origin is types.UnionType:
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        (arg, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(arg, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def load_dataclass[T](cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build ``cls`` from a mapping, rejecting unknown keys and ill-typed values."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}"
            + (f" (and {unknown[1:]})" if unknown[1:] else "")
            + f"; valid keys: {sorted(fields)}"
        )
    kwargs = {k: _convert(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # Nested sections validate with their own names; prefix the outer path.
        msg = str(e)
        section = prefix.rstrip(".").split(".")[-1] if prefix else ""
        if prefix and not msg.startswith(prefix) and not msg.startswith(f"{section}."):
            msg = f"{prefix}{msg}"
        raise ConfigError(msg) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML) to a nested mapping."""
    out = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            child = node.get(p)
            node[p] = dict(child) if isinstance(child, dict) else {}
            node = node[p]
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def load_yaml[T](cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return load_dataclass(cls, apply_overrides(data, overrides or []))
