"""Experiment configuration: one dataclass per section, loaded from YAML (unknown keys fail).

A config names the experiments to run, the executor, the simulated server (model
geometry, GPU, KV pool, scheduler limits) and one section per experiment. Every section
states its trace duration and request rates, so a result can be traced to its setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pagedjax.config import ConfigError

EXPERIMENTS = (
    "memory_waste",
    "batched_requests",
    "throughput_vs_rate",
    "block_size",
    "preemption",
    "engine_throughput",
    "simulator_validation",
    "shared_prefix",
    "sharing",
    "chatbot",
    "ablations",
    "kv_tiers",
    "memory_waste_images",
    "lora",
)
SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged", "ft_static")
DATASETS = ("sharegpt", "alpaca")
# roofline: the GPU's roofline with default efficiencies and server.step_overhead_s.
# vllm2023: the roofline calibrated to 2023 vLLM on an A100-40GB (cost_model.CALIBRATIONS;
# its efficiencies and overhead replace server.step_overhead_s).
COST_MODELS = ("roofline", "vllm2023")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclass(frozen=True)
class ServerSettings:
    """The simulated server: what the cost model and the memory pool describe.

    model: a cost-model preset (``pagedjax.simulator.cost_model.model_geometry``).
    gpu: a GPU of the roofline (A100-40GB, A100-80GB, H100-80GB, H200).
    kv_slots: KV-cache slots (tokens) of the pool; OPT-13B on an A100-40GB: 15,728.
    slots: scheduler rows (waiting + running requests inside the scheduler); arrivals
        beyond them queue outside in order (see pagedjax/simulator/simulate.py).
        The running limit is min(max_num_seqs, slots).
    warmup_frac: the steady window starts at max(first completion, warmup_frac x
        duration) and ends at the last arrival.
    horizon_factor: a run stops at horizon_factor x duration of simulated time;
        requests unfinished then count with their latency so far (a lower bound).
    kv_cache_dtype: the KV cache's storage ("auto" = the model's 16-bit dtype, or an
        8-bit format of pagedjax.attention.kv_quant: "fp8" / "fp8_e4m3", "fp8_e5m2",
        "int8_per_token_head"). kv_slots stays the 16-bit pool's size, i.e. the memory;
        an 8-bit cache holds ``pool_slots`` = kv_slots x the capacity ratio tokens in it
        and a step reads its smaller KV bytes (``--set kv_cache_dtype=fp8``).
    """

    model: str = "opt-13b"
    gpu: str = "A100-40GB"
    tp: int = 1
    kv_slots: int = 15728
    max_model_len: int = 2048
    block_size: int = 16
    slots: int = 256
    max_num_batched_tokens: int = 2560
    max_num_seqs: int = 256
    watermark: float = 0.01
    step_overhead_s: float = 2e-3
    warmup_frac: float = 0.1
    horizon_factor: float = 1.5
    cost_model: str = "roofline"
    kv_cache_dtype: str = "auto"
    # The paged kernel's block-granular access in the step time (systems.BLOCK_COSTS):
    # "kernel" charges a fixed cost per KV block visited and whole-block reads (Fig. 18b's
    # small-block side); "none" leaves it out (the roofline alone).
    block_cost: str = "none"
    # How a paper-mode step is composed (SchedulerLimits.prompt_steps): "mixed" (the
    # paper's section 4.3 and vLLM v0.1.0-v0.1.2, whose v0.1.2 the vllm2023 calibration
    # anchors) or "separate" (vLLM v0.1.3-v0.3: prompt-only and decode-only steps).
    prompt_steps: str = "mixed"

    @property
    def pool_slots(self) -> int:
        """Tokens the KV memory of ``kv_slots`` 16-bit slots holds in ``kv_cache_dtype``."""
        from pagedjax.simulator.cost_model import model_geometry

        ratio = model_geometry(self.model, self.tp, self.kv_cache_dtype).kv_capacity_ratio
        return int(self.kv_slots * ratio)

    def __post_init__(self) -> None:
        from pagedjax.attention.kv_quant import KV_CACHE_DTYPES
        from pagedjax.simulator.cost_model import GPUS
        from pagedjax.simulator.systems import BLOCK_COSTS

        _check(
            self.block_cost in BLOCK_COSTS,
            "server.block_cost",
            f"must be one of {sorted(BLOCK_COSTS)}, got {self.block_cost!r}",
        )

        _check(
            self.prompt_steps in ("mixed", "separate"),
            "server.prompt_steps",
            f"must be 'mixed' or 'separate', got {self.prompt_steps!r}",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "server.kv_cache_dtype",
            f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )

        _check(
            self.cost_model in COST_MODELS,
            "server.cost_model",
            f"must be one of {list(COST_MODELS)}, got {self.cost_model!r}",
        )
        _check(self.gpu in GPUS, "server.gpu", f"must be one of {sorted(GPUS)}, got {self.gpu!r}")
        _check(self.kv_slots >= 16, "server.kv_slots", f"must be >= 16, got {self.kv_slots}")
        _check(self.slots >= 1, "server.slots", f"must be >= 1, got {self.slots}")
        _check(self.max_num_seqs >= 1, "server.max_num_seqs", "must be >= 1")
        _check(0 <= self.watermark < 1, "server.watermark", "must be in [0, 1)")
        _check(0 <= self.warmup_frac < 1, "server.warmup_frac", "must be in [0, 1)")
        _check(self.horizon_factor >= 1, "server.horizon_factor", "must be >= 1")
        _check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "server.block_size",
            f"must be a power of two, got {self.block_size}",
        )


@dataclass(frozen=True)
class MemoryWasteSettings:
    """Fig. 2: KV memory by category, averaged over the steady window."""

    dataset: Literal["sharegpt", "alpaca"] = "sharegpt"
    # req/s, or "knee": the paged system's knee at 0.5 s/token found by
    # throughput_vs_rate's search (the operating point rule, docs/experiments.md).
    rate: float | Literal["knee"] = 2.0
    duration_s: float = 1200.0
    seed: int = 0
    spread_scales: list[float] = field(default_factory=lambda: [0.75, 1.25])

    def __post_init__(self) -> None:
        _check(self.rate == "knee" or self.rate > 0, "memory_waste.rate", "must be > 0 or knee")
        _check(self.duration_s > 0, "memory_waste.duration_s", "must be > 0")


@dataclass(frozen=True)
class ImageWasteSettings:
    """Fig. 2 / Fig. 13 for image traffic (experiments/memory_waste_images.py): the
    memory-waste comparison on image-chat requests (1-4 images of ``family``'s tokens
    plus ShareGPT-like text; pagedjax/workloads/image_chat.py), simulated on the
    server's pool with ``max_model_len`` as the context (Orca reserves it).

    rate: req/s; "token_matched": the Fig. 2 text operating point (memory_waste.rate,
    resolved) x (mean tokens of a text request / mean tokens of an image request), the
    same token load in image requests (cheap: reuses the text search); or "knee": the
    paged system's own knee at 0.5 s/token on the image workload (the operating-point
    rule applied to it: a knee search of its own, ~1-2 minutes).
    """

    family: Literal["llava-1.5", "idefics3", "smolvlm", "qwen2-vl"] = "llava-1.5"
    max_model_len: int = 4096
    rate: float | Literal["token_matched", "knee"] = "token_matched"
    duration_s: float = 200.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check(
            self.rate in ("token_matched", "knee") or self.rate > 0,
            "memory_waste_images.rate",
            "must be > 0, token_matched or knee",
        )
        _check(self.duration_s > 0, "memory_waste_images.duration_s", "must be > 0")
        _check(self.max_model_len >= 1024, "memory_waste_images.max_model_len", ">= 1024")


@dataclass(frozen=True)
class Workload:
    """A dataset at a request rate; duration_s (optional) overrides the section's."""

    dataset: Literal["sharegpt", "alpaca"] = "sharegpt"
    rate: float | Literal["knee"] = 2.0  # "knee": as memory_waste.rate
    duration_s: float | None = None
    slots: int | None = None  # scheduler rows for this workload (None: server.slots)


@dataclass(frozen=True)
class BatchedRequestsSettings:
    """Fig. 13: average scheduled requests per step over the steady window."""

    workloads: list[Workload] = field(
        default_factory=lambda: [Workload("sharegpt", 2.0), Workload("alpaca", 30.0)]
    )
    duration_s: float = 1200.0
    seed: int = 0
    spread_scales: list[float] = field(default_factory=lambda: [0.75, 1.25])
    also_cost_models: list[str] = field(default_factory=list)  # rerun under these (spread 1)

    def __post_init__(self) -> None:
        _check(self.duration_s > 0, "batched_requests.duration_s", "must be > 0")
        for c in self.also_cost_models:
            _check(c in COST_MODELS, "batched_requests.also_cost_models", f"unknown {c!r}")
        for i, w in enumerate(self.workloads):
            _check(
                w.rate == "knee" or w.rate > 0,
                f"batched_requests.workloads[{i}].rate",
                "must be > 0 or knee",
            )


@dataclass(frozen=True)
class KneeSearchSettings:
    """Bracketing + bisection of each system's knee on the request rate
    (experiments/knee_search.py).

    start: first rate probed (req/s); rate_min / rate_max: the search stays inside;
    growth: bracketing step factor; resolution: stop when hi / lo <= 1 + resolution, so
    a knee is known to within that fraction (a ratio of two knees to about twice it).
    """

    start: float = 2.0
    rate_min: float = 0.0625
    rate_max: float = 64.0
    resolution: float = 0.03
    growth: float = 2.0
    # A probe stops once its mean normalized latency provably exceeds this (s/token):
    # it has exploded, which is all the search needs. Must exceed every threshold.
    stop_latency: float = 1.5

    def __post_init__(self) -> None:
        _check(
            0 < self.rate_min <= self.start <= self.rate_max,
            "throughput_vs_rate.search",
            "needs 0 < rate_min <= start <= rate_max",
        )
        _check(0 < self.resolution < 1, "throughput_vs_rate.search.resolution", "in (0, 1)")
        _check(self.growth > 1, "throughput_vs_rate.search.growth", "must be > 1")


@dataclass(frozen=True)
class ThroughputSettings:
    """Fig. 12: normalized latency vs request rate; knees at the thresholds."""

    dataset: Literal["sharegpt", "alpaca"] = "sharegpt"
    rates: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0])
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    duration_s: float = 600.0
    seed: int = 0
    thresholds: list[float] = field(default_factory=lambda: [0.2, 0.5, 1.0])
    spread_scales: list[float] = field(default_factory=lambda: [0.75, 1.25])
    slots: int | None = None  # scheduler rows for this sweep (None: server.slots)
    also_cost_models: list[str] = field(default_factory=list)  # rerun under these (spread 1)
    # Stop a system's sweep after its first rate above the largest threshold: higher rates
    # only explode further, and exploded runs are the most expensive (they reach the horizon).
    stop_after_exceed: bool = True
    # Knees by search (bracketing + bisection) instead of the grid; null: grid `rates`.
    search: KneeSearchSettings | None = None

    def __post_init__(self) -> None:
        if self.search is not None:
            _check(
                self.search.stop_latency > max(self.thresholds, default=0),
                "throughput_vs_rate.search.stop_latency",
                "must exceed every threshold",
            )
        for c in self.also_cost_models:
            _check(c in COST_MODELS, "throughput_vs_rate.also_cost_models", f"unknown {c!r}")
        _check(len(self.rates) >= 2, "throughput_vs_rate.rates", "needs >= 2 rates")
        _check(
            all(r > 0 for r in self.rates) and list(self.rates) == sorted(self.rates),
            "throughput_vs_rate.rates",
            "must be positive and increasing",
        )
        for s in self.systems:
            _check(s in SYSTEMS, "throughput_vs_rate.systems", f"unknown system {s!r}")
        _check(self.duration_s > 0, "throughput_vs_rate.duration_s", "must be > 0")


@dataclass(frozen=True)
class BlockSizeSettings:
    """Fig. 18b: mean normalized latency vs block size (paged, simulated)."""

    workloads: list[Workload] = field(
        default_factory=lambda: [Workload("sharegpt", 2.0), Workload("alpaca", 20.0)]
    )
    block_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    duration_s: float = 300.0
    seed: int = 0
    # Also time the native CPU kernel at these block sizes (a cross-check of the per-block
    # cost, experiments/block_cost_cpu.py; ~20 s).
    cpu_cross_check: bool = False

    def __post_init__(self) -> None:
        for b in self.block_sizes:
            _check(b >= 1 and b & (b - 1) == 0, "block_size.block_sizes", f"{b} not a power of 2")


@dataclass(frozen=True)
class PreemptionSettings:
    """Fig. 19b: recompute vs swap across block sizes (paged, simulated; the swap copies
    cost the cost model's swap_time: PCIe bandwidth plus a fixed cost per block copy).

    swap_space_gib: the host swap pool per GPU (vLLM's default 4 GiB)."""

    dataset: Literal["sharegpt", "alpaca"] = "sharegpt"
    rate: float = 2.0
    block_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256])
    duration_s: float = 300.0
    seed: int = 0
    swap_space_gib: float = 4.0

    def __post_init__(self) -> None:
        for b in self.block_sizes:
            _check(b >= 1 and b & (b - 1) == 0, "preemption.block_sizes", f"{b} not a power of 2")
        _check(self.swap_space_gib > 0, "preemption.swap_space_gib", "must be > 0")


@dataclass(frozen=True)
class EngineSettings:
    """The real executor: a (small) model served by pagedjax.LLM on this machine."""

    model: str = "tiny-llama"
    max_model_len: int = 256
    num_requests: int = 32
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    num_gpu_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 16
    # None: max(512, max_model_len). Every (token, seq) padding bucket is compiled before
    # timing, so a smaller budget and seq cap mean fewer compilations at start-up.
    max_num_batched_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        b = self.max_num_batched_tokens
        _check(
            b is None or b >= self.max_model_len,
            "engine.max_num_batched_tokens",
            f"must be >= max_model_len ({self.max_model_len}) or null, got {b}",
        )


@dataclass(frozen=True)
class ValidationSettings:
    """Simulator validation (experiments/simulator_validation.py): the step-time profile
    is fitted on the real engine's steps of ``fit_workload`` only and checked on it (in
    sample) and on each ``held_out`` workload (out of sample), at ``rates`` (default: the
    ``engine`` section's; ``held_out_rates`` for the held-out ones, if set). ``repeats``
    independent sets of real runs, the workloads' runs interleaved within each (so a
    change of the machine's load hits the fit and the held-out runs alike); each repeat
    fits its own profile; each workload's error is the median over repeats, reported
    beside the real runs' run-to-run spread (this CPU is shared and noisy).

    Workloads: "sharegpt" (synthetic ShareGPT lengths scaled to engine.max_model_len),
    "alpaca" (synthetic Alpaca lengths as drawn, clipped to the context: they are short),
    "azure_conv" (the Azure 2023 conversation trace, data/traces/: requests of <= 2048
    tokens, lengths scaled like ShareGPT's, the trace's own arrival pattern rescaled to
    the rate).
    """

    fit_workload: Literal["sharegpt", "alpaca", "azure_conv"] = "sharegpt"
    held_out: list[Literal["sharegpt", "alpaca", "azure_conv"]] = field(
        default_factory=lambda: ["alpaca", "azure_conv"]
    )
    held_out_rates: list[float] | None = None
    # The fit workload's rates (null: the engine section's). Set, the validation serves
    # its own fit runs, interleaved with the held-out ones, instead of reusing
    # engine_throughput's (served minutes earlier, under possibly different load).
    rates: list[float] | None = None
    repeats: int = 1

    def __post_init__(self) -> None:
        _check(self.repeats >= 1, "simulator_validation.repeats", "must be >= 1")
        _check(
            self.rates is None or (len(self.rates) > 0 and all(r > 0 for r in self.rates)),
            "simulator_validation.rates",
            "must be positive (or null: the engine rates)",
        )
        _check(
            self.fit_workload not in self.held_out,
            "simulator_validation.held_out",
            f"must not contain the fit workload {self.fit_workload!r}",
        )
        rates = self.held_out_rates
        _check(
            rates is None or (len(rates) > 0 and all(r > 0 for r in rates)),
            "simulator_validation.held_out_rates",
            "must be positive (or null: the engine rates)",
        )


@dataclass(frozen=True)
class SharedPrefixSettings:
    """Fig. 16 analogue on the real executor: translation-like prompts that share a
    few-shot prefix, served with prefix caching off and on.

    prefix_tokens: the shared prefix per setting (the paper's 1-shot 80 and 5-shot 341).
    sentence_tokens / output_tokens: means of the per-request suffix and output lengths
        (uniform over [mean/2, 3*mean/2], a WMT16-sentence-like scale).
    rates: Poisson request rates (req/s); num_requests per run.
    warmup: compile every (token, seq) bucket and the cache programs before timing.
    """

    model: str = "tiny-llama"
    max_model_len: int = 512
    prefix_tokens: list[int] = field(default_factory=lambda: [80, 341])
    sentence_tokens: int = 32
    output_tokens: int = 32
    num_requests: int = 32
    rates: list[float] = field(default_factory=lambda: [4.0, 16.0])
    num_gpu_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    seed: int = 0
    # Compile every bucket before timing; off only for smoke tests (throughput then
    # includes compilations, prefill counts do not change).
    warmup: bool = True

    def __post_init__(self) -> None:
        longest = max(self.prefix_tokens, default=0) + 3 * self.sentence_tokens // 2
        longest += 3 * self.output_tokens // 2
        _check(
            longest <= self.max_model_len,
            "shared_prefix.max_model_len",
            f"must hold the longest request ({longest} tokens), got {self.max_model_len}",
        )
        _check(bool(self.prefix_tokens), "shared_prefix.prefix_tokens", "needs >= 1 entry")
        _check(all(r > 0 for r in self.rates), "shared_prefix.rates", "must be positive")
        _check(self.num_requests >= 2, "shared_prefix.num_requests", "must be >= 2")
        _check(
            self.max_num_batched_tokens >= self.max_model_len,
            "shared_prefix.max_num_batched_tokens",
            f"must be >= max_model_len ({self.max_model_len})",
        )


@dataclass(frozen=True)
class SharingSettings:
    """Fig. 15 on the real executor: KV blocks saved by parallel sampling and beam search
    (benchmarks/sharing_memory.py: Alpaca-like lengths, closed loop of ``concurrency``
    requests in flight, block size 16, nothing preempted)."""

    model: str = "tiny-llama"
    num_requests: int = 32
    concurrency: int = 8
    max_model_len: int = 512
    max_num_seqs: int = 64
    max_output: int | None = None  # cap on output lengths (smoke tests)
    parallel_n: list[int] = field(default_factory=lambda: [2, 4, 6])
    beam_widths: list[int] = field(default_factory=lambda: [2, 4, 6])
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.num_requests >= 1, "sharing.num_requests", "must be >= 1")
        _check(self.concurrency >= 1, "sharing.concurrency", "must be >= 1")
        for k in (*self.parallel_n, *self.beam_widths):
            _check(k >= 1, "sharing.parallel_n / beam_widths", f"must be >= 1, got {k}")
        _check(
            self.max_num_seqs >= self.concurrency * max([*self.parallel_n, *self.beam_widths, 1]),
            "sharing.max_num_seqs",
            "must hold concurrency x the largest n or beam width (no preemption)",
        )


@dataclass(frozen=True)
class ChatbotSettings:
    """Fig. 17 (experiments/chatbot.py): prompts cut to their last 1024 tokens, outputs
    capped at 1024, each system's knee at 0.5 s/token by throughput_vs_rate's search
    (simulated). prompts: "azure_conv" (the history lengths of the Azure 2023
    conversation trace, cut to 1024; experiments/common.py ``chat_prompt_lens``) or
    "cap" (every prompt 1024 tokens)."""

    systems: list[str] = field(
        default_factory=lambda: ["orca_max", "orca_pow2", "orca_oracle", "paged"]
    )
    duration_s: float = 3600.0  # the paper's 1-hour traces (configs/opt13b.yaml: why)
    prompts: Literal["azure_conv", "cap"] = "azure_conv"

    def __post_init__(self) -> None:
        _check(
            self.prompts in ("azure_conv", "cap"),
            "chatbot.prompts",
            f"must be 'azure_conv' or 'cap', got {self.prompts!r}",
        )
        for s in self.systems:
            _check(s in SYSTEMS and s != "ft_static", "chatbot.systems", f"bad system {s!r}")
        _check("paged" in self.systems, "chatbot.systems", "must include paged")
        _check(self.duration_s > 0, "chatbot.duration_s", "must be > 0")


@dataclass(frozen=True)
class TierProfile:
    """One GPU profile of the simulated KV-tier curves (experiments/kv_tiers.py).

    gpu / model: the roofline's GPU and a dense cost-model preset; device_pool_gib /
    host_tier_gib: the KV pool on the GPU and the host tier (0: the tier-on arm is
    skipped); rate: the offered load (req/s) of the TTFT curve; max_model_len: the
    conversations' context cap.
    """

    gpu: str = "A100-40GB"
    model: str = "llama-2-7b"
    device_pool_gib: float = 20.0
    host_tier_gib: float = 160.0
    rate: float = 1.0
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        from pagedjax.simulator.cost_model import GPUS, MODEL_PRESETS

        _check(self.gpu in GPUS, "kv_tiers.profiles.gpu", f"unknown GPU {self.gpu!r}")
        _check(self.model in MODEL_PRESETS, "kv_tiers.profiles.model", f"unknown {self.model!r}")
        _check(self.device_pool_gib > 0, "kv_tiers.profiles.device_pool_gib", "must be > 0")
        _check(self.host_tier_gib >= 0, "kv_tiers.profiles.host_tier_gib", "must be >= 0")
        _check(self.rate > 0, "kv_tiers.profiles.rate", "must be > 0")
        _check(self.max_model_len >= 64, "kv_tiers.profiles.max_model_len", "must be >= 64")


@dataclass(frozen=True)
class KvTiersSettings:
    """Simulated KV tiers (experiments/kv_tiers.py, pagedjax/simulator/kv_tiers.py): TTFT
    and throughput against the working set (multiples of the device pool), host tier
    off and on, per GPU profile.

    workload: "multi_turn" (ShareGPT-like chats, ``turns`` each) or "agentic" (agents over
    a shared ``agent_context_len``-token context, ``turns`` short turns each).
    real_engine: also run benchmarks/kv_tiers.py (the real engine on a small model, tier
    off / on; minutes on CPU) with ``real_engine_args``; off by default.
    """

    workload: Literal["multi_turn", "agentic"] = "multi_turn"
    profiles: list[TierProfile] = field(
        default_factory=lambda: [
            TierProfile(),
            TierProfile("H100-80GB", "llama-3-8b", 8.0, 64.0, 3.0, 8192),
        ]
    )
    working_set_multiples: list[float] = field(
        default_factory=lambda: [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    )
    turns: int = 8
    agent_context_len: int = 2048
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    reload: Literal["async", "sync"] = "async"
    seed: int = 0
    real_engine: bool = False
    real_engine_args: list[str] = field(default_factory=list)
    real_engine_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        _check(bool(self.profiles), "kv_tiers.profiles", "needs >= 1 profile")
        ws = self.working_set_multiples
        _check(
            bool(ws) and all(x > 0 for x in ws) and list(ws) == sorted(ws),
            "kv_tiers.working_set_multiples",
            "must be positive and increasing",
        )
        _check(self.turns >= 1, "kv_tiers.turns", "must be >= 1")
        _check(self.agent_context_len >= 1, "kv_tiers.agent_context_len", "must be >= 1")
        for p in self.profiles if self.workload == "agentic" else []:
            _check(
                p.max_model_len >= self.agent_context_len + 64,
                "kv_tiers.agent_context_len",
                f"must leave >= 64 tokens of turns under {p.gpu}'s max_model_len "
                f"({p.max_model_len})",
            )
        b = self.block_size
        _check(b >= 1 and b & (b - 1) == 0, "kv_tiers.block_size", "must be a power of two")
        _check(self.max_num_batched_tokens >= 1, "kv_tiers.max_num_batched_tokens", ">= 1")
        _check(self.max_num_seqs >= 1, "kv_tiers.max_num_seqs", "must be >= 1")
        _check(self.real_engine_timeout_s > 0, "kv_tiers.real_engine_timeout_s", "must be > 0")


@dataclass(frozen=True)
class LoraSettings:
    """Multi-LoRA serving simulated at paper scale (experiments/lora.py,
    pagedjax/simulator/lora.py): throughput and batch size against the number of adapters,
    unified memory (S-LoRA's unified paging) against separate adapter pools of several
    ``separate_max_loras``, all in one device ``budget_gib`` for KV and adapters.

    rank_sets: name -> ranks (adapter i has rank ranks[i % len]); "S1" / "S2" are S-LoRA's
    settings (Llama-7B, ranks {8} / {64, 32, 16, 8}) that the claims read. The trace is
    S-LoRA's synthetic one (pagedjax/workloads/adapters.py): ``num_requests`` requests at
    ``rate`` req/s (inf: all at once, the server's capacity), Zipf(``alpha``) popularity,
    lengths uniform on ``input_range`` / ``output_range``; one trace for every adapter
    count (only the adapter draws differ). 0 adapters is the base model alone.
    """

    gpu: str = "A100-80GB"
    model: str = "llama-2-7b"
    budget_gib: float = 50.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    rank_sets: dict[str, list[int]] = field(
        default_factory=lambda: {"S1": [8], "S2": [64, 32, 16, 8], "r16": [16], "r64": [64]}
    )
    num_adapters: list[int] = field(default_factory=lambda: [0, 1, 5, 100, 1000, 2000])
    separate_max_loras: list[int] = field(default_factory=lambda: [8, 32])
    num_requests: int = 1200
    rate: float = float("inf")
    alpha: float = 1.0
    input_range: list[int] = field(default_factory=lambda: [8, 512])
    output_range: list[int] = field(default_factory=lambda: [8, 512])
    block_size: int = 16
    max_num_batched_tokens: int = 2560
    max_num_seqs: int = 256
    kernel: Literal["grouped", "gathered"] = "grouped"
    load: Literal["async", "sync"] = "async"
    seed: int = 0

    def __post_init__(self) -> None:
        from pagedjax.simulator.cost_model import GPUS, MODEL_PRESETS

        _check(self.gpu in GPUS, "lora.gpu", f"unknown GPU {self.gpu!r}")
        _check(self.model in MODEL_PRESETS, "lora.model", f"unknown {self.model!r}")
        _check(self.budget_gib > 0, "lora.budget_gib", "must be > 0")
        _check(bool(self.rank_sets), "lora.rank_sets", "needs >= 1 set")
        for k, v in self.rank_sets.items():
            _check(bool(v) and min(v) >= 1, f"lora.rank_sets.{k}", "ranks must be >= 1")
        _check(bool(self.num_adapters) and min(self.num_adapters) >= 0, "lora.num_adapters",
               "needs counts >= 0")  # fmt: skip
        _check(all(m >= 1 for m in self.separate_max_loras), "lora.separate_max_loras", ">= 1")
        _check(self.num_requests >= 1, "lora.num_requests", "must be >= 1")
        _check(self.rate > 0, "lora.rate", "must be > 0 (inf: all at once)")
        _check(self.alpha >= 0, "lora.alpha", "must be >= 0")
        for key, r in (("input_range", self.input_range), ("output_range", self.output_range)):
            ok = len(r) == 2 and 1 <= r[0] <= r[1]
            _check(ok, f"lora.{key}", "must be [lo, hi], 1 <= lo <= hi")
        b = self.block_size
        _check(b >= 1 and b & (b - 1) == 0, "lora.block_size", "must be a power of two")
        _check(self.max_num_batched_tokens >= 1, "lora.max_num_batched_tokens", ">= 1")
        _check(self.max_num_seqs >= 1, "lora.max_num_seqs", "must be >= 1")


@dataclass(frozen=True)
class ExperimentConfig:
    """Top level of configs/*.yaml."""

    name: str = "experiments"
    executor: Literal["auto", "real", "simulated"] = "auto"
    experiments: list[str] = field(default_factory=lambda: ["memory_waste"])
    server: ServerSettings = field(default_factory=ServerSettings)
    memory_waste: MemoryWasteSettings = field(default_factory=MemoryWasteSettings)
    batched_requests: BatchedRequestsSettings = field(default_factory=BatchedRequestsSettings)
    throughput_vs_rate: ThroughputSettings = field(default_factory=ThroughputSettings)
    block_size: BlockSizeSettings = field(default_factory=BlockSizeSettings)
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    simulator_validation: ValidationSettings = field(default_factory=ValidationSettings)
    shared_prefix: SharedPrefixSettings = field(default_factory=SharedPrefixSettings)
    sharing: SharingSettings = field(default_factory=SharingSettings)
    chatbot: ChatbotSettings = field(default_factory=ChatbotSettings)
    kv_tiers: KvTiersSettings = field(default_factory=KvTiersSettings)
    memory_waste_images: ImageWasteSettings = field(default_factory=ImageWasteSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    # Wall-time allocation per experiment (s) on an idle box, printed in the report beside
    # the time each part took (llama7b.yaml: 8 minutes in all); empty: none stated.
    time_allocation_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k, v in self.time_allocation_s.items():
            _check(k in self.experiments, "time_allocation_s", f"{k!r} is not an experiment here")
            _check(v > 0, f"time_allocation_s.{k}", "must be > 0")
        for i, e in enumerate(self.experiments):
            _check(e in EXPERIMENTS, f"experiments[{i}]", f"unknown experiment {e!r}")
        knee_rates = [self.memory_waste.rate] + [w.rate for w in self.batched_requests.workloads]
        if "memory_waste_images" in self.experiments:  # (token_matched: memory_waste.rate)
            knee_rates.append(self.memory_waste_images.rate)
        _check(
            "chatbot" not in self.experiments or self.throughput_vs_rate.search is not None,
            "throughput_vs_rate.search",
            "the chatbot experiment (Fig. 17) needs the knee search configured",
        )
        _check(
            "knee" not in knee_rates or self.throughput_vs_rate.search is not None,
            "throughput_vs_rate.search",
            "rate: knee (the operating point rule) needs the knee search configured",
        )
