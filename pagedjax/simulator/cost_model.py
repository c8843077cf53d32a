"""Step-time models for the simulated executor: a GPU roofline and a fitted linear profile.

A step's work is described by four numbers (scalars or arrays, traced or not):
    prefill_tokens: prompt tokens computed this step (all prefilling sequences).
    decode_seqs: sequences decoding one token this step.
    kv_tokens: KV tokens read from the cache by attention (sum of context lengths of the
        decoding sequences plus cached prefixes of chunked prefills).
    prefill_attn_pairs: query-key pairs of the prefills (about L^2/2 per prompt of
        length L); 0 by default.
    prefill_seqs: sequences that prefill this step (each adds one row of logits).
Both models are pure jnp arithmetic and return float32 seconds, so they run under
jax.jit and inside lax.while_loop. See docs/workloads.md for the formulas and constants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax.numpy as jnp
import numpy as np

from pagedjax.attention.kv_quant import resolve_kv_format


@dataclass(frozen=True)
class GPUSpec:
    """Vendor peak numbers of one GPU (SXM parts; dense fp16/bf16 tensor-core FLOP/s)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per GPU, both directions added
    host_link_bytes_per_s: float = 32e9  # PCIe x16 to the host, one direction (swap)


GPUS: dict[str, GPUSpec] = {
    # Host links: PCIe 4.0 x16 (A100), PCIe 5.0 x16 (H100 / H200), one direction.
    "A100-40GB": GPUSpec("A100-40GB", 1.555e12, 312e12, 40e9, 600e9, 32e9),
    "A100-80GB": GPUSpec("A100-80GB", 2.039e12, 312e12, 80e9, 600e9, 32e9),
    "H100-80GB": GPUSpec("H100-80GB", 3.35e12, 989e12, 80e9, 900e9, 64e9),
    "H200": GPUSpec("H200", 4.8e12, 989e12, 141e9, 900e9, 64e9),
}


@dataclass(frozen=True)
class ModelGeometry:
    """Decoder-only transformer shape, enough to count bytes and FLOPs per step.

    gated_mlp: Llama-style SwiGLU (3 matrices) rather than OPT's 2. tied_embeddings: the
    LM head shares the embedding (it is still read once per step for the logits).
    tp: tensor-parallel degree; per-GPU weights, KV and FLOPs are divided by it, except
    that KV heads split only min(tp, num_kv_heads) ways (``kv_shards``): past that they are
    replicated (as vLLM and pagedjax/model/sharding.py do), and so are the k/v projections.
    num_experts / experts_per_token: a Mixtral-style MoE MLP (num_experts copies of the
    MLP, each token through experts_per_token of them, plus a hidden x E router); 0 = dense.
    A step reads only the experts its tokens chose: ``expected_experts_read`` assumes
    uniform, independent routing (a stated simplification; real routers are skewed, which
    reads fewer distinct experts).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2
    gated_mlp: bool = False
    tied_embeddings: bool = True
    max_position: int = 0  # learned position embeddings (OPT); 0 for rotary
    tp: int = 1
    num_experts: int = 0
    experts_per_token: int = 0
    # The KV cache's storage (pagedjax.attention.kv_quant): "auto" stores bytes_per_param
    # per element; the 8-bit formats 1 byte, int8 plus a 4-byte scale per token-head.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        resolve_kv_format(self.kv_cache_dtype)  # ValueError for an unknown name
        for field in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
            "intermediate", "vocab", "bytes_per_param", "tp",
        ):  # fmt: skip
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be in [1, num_experts="
                f"{self.num_experts}]"
            )
        if self.num_kv_heads % self.tp and self.tp % self.num_kv_heads:
            raise ValueError(
                f"tp={self.tp} does not divide or replicate {self.num_kv_heads} KV heads"
            )

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v, o projections (and the MoE router, read by every token)."""
        q_o = 2 * self.hidden * self.num_heads * self.head_dim
        k_v = 2 * self.hidden * self.num_kv_heads * self.head_dim
        return q_o + k_v + self.hidden * self.num_experts

    @property
    def mlp_params(self) -> int:
        """One MLP (one expert's, for an MoE)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrices (q, k, v, o projections and the MLP, every
        expert of an MoE)."""
        return self.attention_params + self.mlp_params * max(1, self.num_experts)

    @property
    def active_layer_params(self) -> int:
        """Weights one token multiplies by in one layer (its chosen experts only)."""
        return self.attention_params + self.mlp_params * max(1, self.experts_per_token)

    def expected_experts_read(self, new_tokens) -> jnp.ndarray:
        """Expected distinct experts per layer that n new tokens choose, routing uniform and
        independent: E * (1 - (1 - k / E) ** n) (each expert is missed by a token with
        probability 1 - k / E). 1 for a dense MLP. float32, n may be traced."""
        n = _f32(new_tokens)
        if not self.num_experts:
            return jnp.ones_like(n)
        miss = 1.0 - self.experts_per_token / self.num_experts
        return self.num_experts * (1.0 - jnp.power(jnp.float32(miss), n))

    def step_weight_bytes_read(self, new_tokens) -> jnp.ndarray:
        """Bytes of weights one step reads, all GPUs: every dense matrix and the LM head
        once, and for an MoE the experts its new tokens use (``expected_experts_read``).
        Equals ``step_weight_bytes`` for a dense model."""
        if not self.num_experts:
            return _f32(self.step_weight_bytes) + 0.0 * _f32(new_tokens)
        per_layer = self.attention_params + self.mlp_params * self.expected_experts_read(new_tokens)
        return (self.num_layers * per_layer + self.lm_head_params) * self.bytes_per_param

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """All parameters (biases and norms excluded, < 0.1 %)."""
        embed = self.vocab * self.hidden + self.max_position * self.hidden
        head = 0 if self.tied_embeddings else self.lm_head_params
        return self.num_layers * self.layer_matmul_params + embed + head

    @property
    def weight_bytes(self) -> int:
        """Bytes of all parameters, all GPUs together."""
        return self.total_params * self.bytes_per_param

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of every layer matrix and the LM head, all GPUs: what a dense step reads
        (an MoE step reads less: ``step_weight_bytes_read``)."""
        return (
            self.num_layers * self.layer_matmul_params + self.lm_head_params
        ) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, all GPUs (e.g. 800 KiB for OPT-13B fp16;
        half that, 400 KiB, with an fp8 cache), scales included."""
        fmt = resolve_kv_format(self.kv_cache_dtype)
        if fmt is None:
            per_head = self.head_dim * self.bytes_per_param
        else:
            per_head = self.head_dim + fmt.scale_bytes_per_token_head  # 1 byte per element
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def kv_capacity_ratio(self) -> float:
        """Tokens this cache holds per token of a cache in the model's dtype, same bytes."""
        return replace(self, kv_cache_dtype="auto").kv_bytes_per_token / self.kv_bytes_per_token

    @property
    def kv_shards(self) -> int:
        """Ways the KV heads (and the KV cache) split: min(tp, num_kv_heads)."""
        return min(self.tp, self.num_kv_heads)

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """One GPU's share of a token's KV (all layers): replicated past num_kv_heads."""
        return self.kv_bytes_per_token / self.kv_shards

    @property
    def weight_bytes_per_gpu(self) -> float:
        """One GPU's parameter bytes under the Megatron split: q/o, MLP, embedding and
        head by tp; k/v projections by kv_shards (replicated past the KV heads)."""
        k_v = 2 * self.hidden * self.num_kv_heads * self.head_dim * self.num_layers
        rest = self.total_params - k_v
        return (rest / self.tp + k_v / self.kv_shards) * self.bytes_per_param

    def with_tp(self, tp: int) -> ModelGeometry:
        return replace(self, tp=tp)


MODEL_PRESETS: dict[str, ModelGeometry] = {
    # paper_notes.md section 5; OPT ties its LM head and learns 2048 (+2) positions.
    "opt-13b": ModelGeometry("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, max_position=2050),
    "opt-66b": ModelGeometry(
        "opt-66b", 64, 9216, 72, 72, 128, 36864, 50272, max_position=2050, tp=4
    ),
    "opt-175b": ModelGeometry(
        "opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, max_position=2050, tp=8
    ),
    "llama-2-7b": ModelGeometry(
        "llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, gated_mlp=True, tied_embeddings=False
    ),
    "llama-3-8b": ModelGeometry(
        "llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, gated_mlp=True, tied_embeddings=False
    ),
    "llama-3-70b": ModelGeometry(
        "llama-3-70b",
        80,
        8192,
        64,
        8,
        128,
        28672,
        128256,
        gated_mlp=True,
        tied_embeddings=False,
    ),  # fmt: skip
    # Issue 23's families (pagedjax/model/presets.py has their full HF configs).
    "pythia-6.9b": ModelGeometry(
        "pythia-6.9b", 32, 4096, 32, 32, 128, 16384, 50432, tied_embeddings=False
    ),
    "pythia-12b": ModelGeometry(
        "pythia-12b", 36, 5120, 40, 40, 128, 20480, 50688, tied_embeddings=False
    ),
    "gemma-2-9b": ModelGeometry("gemma-2-9b", 42, 3584, 16, 8, 256, 14336, 256000, gated_mlp=True),
    "qwen3-8b": ModelGeometry(
        "qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, gated_mlp=True, tied_embeddings=False
    ),
    "phi-3-mini": ModelGeometry(
        "phi-3-mini", 32, 3072, 32, 32, 96, 8192, 32064, gated_mlp=True, tied_embeddings=False
    ),
    "mixtral-8x7b": ModelGeometry(
        "mixtral-8x7b",
        32,
        4096,
        32,
        8,
        128,
        14336,
        32000,
        gated_mlp=True,
        tied_embeddings=False,
        num_experts=8,
        experts_per_token=2,
    ),  # fmt: skip
}


def model_geometry(name: str, tp: int | None = None, kv_cache_dtype: str = "auto") -> ModelGeometry:
    """A preset by name (paper TP degrees: opt-66b 4, opt-175b 8, others 1), optionally re-TP'd,
    with its KV cache in ``kv_cache_dtype`` (default: the model's dtype)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"name must be one of {sorted(MODEL_PRESETS)}, got {name!r}")
    geom = MODEL_PRESETS[name]
    if kv_cache_dtype != "auto":
        geom = replace(geom, kv_cache_dtype=kv_cache_dtype)
    return geom if tp is None else geom.with_tp(tp)


LINKS = ("nvlink", "pcie")


def _f32(x) -> jnp.ndarray:
    return jnp.asarray(x, dtype=jnp.float32)


@dataclass(frozen=True)
class RooflineCostModel:
    """t = max(bytes / (mem_eff * HBM BW), flops / (flop_eff * peak)) + comm + overhead.

    Per GPU: weights are read once per step (an MoE's: the experts its tokens use); KV of
    the context is read and the new tokens' KV written; FLOPs are 2 per active matmul
    parameter (an MoE token's: its chosen experts) per new token, 2 per LM-head
    parameter per logit row, 4 * heads * head_dim per layer per attention pair. With
    tp > 1, two ring all-reduces of the new tokens' activations per layer go over the
    interconnect (``link``): "nvlink" (the GPU's NVLink, half of its both-directions
    figure each way) or "pcie" (the GPU's host link, one direction: GPUs without NVLink
    exchange through PCIe switches); each costs bytes / (comm_efficiency x bandwidth) +
    ``allreduce_latency_s`` (10 us on NVLink; PCIe-class rings are slower to start, use
    ``allreduce_latency_s`` to say so).
    """

    gpu: GPUSpec
    model: ModelGeometry
    mem_efficiency: float = 0.85
    flop_efficiency: float = 0.70
    comm_efficiency: float = 0.70
    allreduce_latency_s: float = 10e-6
    link: str = "nvlink"  # the TP interconnect: "nvlink" or "pcie" (see the docstring)
    step_overhead_s: float = 2e-3
    # Host work per sequence in a step (scheduling, input preparation, sampling and
    # detokenization done one sequence at a time while the GPU waits): 0 in the roofline.
    seq_overhead_s: float = 0.0
    # Swap copies (swap_time): PCIe efficiency, and the fixed cost of one copy call. vLLM
    # 0.1 swapped with one cudaMemcpyAsync per block, per layer, for K and for V, so small
    # blocks pay many fixed costs; 5 us is a typical launch + DMA setup (an assumption).
    host_link_efficiency: float = 0.8
    copy_latency_s: float = 5e-6
    # Block-granular KV access of a paged kernel (block_time; 0 / False: not charged).
    # block_overhead_tokens: the fixed cost of visiting one KV block (block-table lookup,
    # one tile's issue and wait), as the HBM time of that many tokens' KV; whole_block_reads:
    # the kernel loads every block whole, so the last block's unused slots are read too.
    block_overhead_tokens: float = 0.0
    whole_block_reads: bool = False

    def __post_init__(self) -> None:
        for field in (
            "mem_efficiency",
            "flop_efficiency",
            "comm_efficiency",
            "host_link_efficiency",
        ):
            v = getattr(self, field)
            if not 0 < v <= 1:
                raise ValueError(f"{field} must be in (0, 1], got {v}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {self.link!r}")
        for field in (
            "allreduce_latency_s",
            "step_overhead_s",
            "seq_overhead_s",
            "copy_latency_s",
            "block_overhead_tokens",
        ):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")

    def step_bytes(self, prefill_tokens, decode_seqs, kv_tokens) -> jnp.ndarray:
        """HBM bytes moved per GPU in one step (float32)."""
        m = self.model
        new_tokens = _f32(prefill_tokens) + _f32(decode_seqs)
        kv = (_f32(kv_tokens) + new_tokens) * m.kv_bytes_per_token_per_gpu
        return m.step_weight_bytes_read(new_tokens) / m.tp + kv

    def step_flops(
        self, prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs=0, prefill_seqs=0
    ) -> jnp.ndarray:
        """FLOPs per GPU in one step (float32)."""
        m = self.model
        new_tokens = _f32(prefill_tokens) + _f32(decode_seqs)
        logit_rows = _f32(decode_seqs) + _f32(prefill_seqs)
        pairs = _f32(kv_tokens) + _f32(prefill_attn_pairs)
        flops = (
            2.0 * m.num_layers * m.active_layer_params * new_tokens
            + 2.0 * m.lm_head_params * logit_rows
            + 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        )
        return flops / m.tp

    def link_bytes_per_s(self) -> float:
        """One direction of the TP interconnect, before comm_efficiency."""
        if self.link == "pcie":
            return self.gpu.host_link_bytes_per_s
        return self.gpu.nvlink_bytes_per_s / 2

    def allreduce_time(self, new_tokens) -> jnp.ndarray:
        """One ring all-reduce of [new_tokens, hidden] activations: each GPU sends and
        receives 2 (tp - 1) / tp of them; float32 seconds (0 when tp = 1)."""
        m = self.model
        if m.tp == 1:
            return jnp.zeros((), jnp.float32) * _f32(new_tokens)
        sent = 2.0 * (m.tp - 1) / m.tp * _f32(new_tokens) * m.hidden * m.bytes_per_param
        return sent / (self.comm_efficiency * self.link_bytes_per_s()) + self.allreduce_latency_s

    def comm_time(self, prefill_tokens, decode_seqs) -> jnp.ndarray:
        """Tensor-parallel all-reduce time of a step: two per layer (after attention and
        after the MLP); 0 when tp = 1."""
        new_tokens = _f32(prefill_tokens) + _f32(decode_seqs)
        return 2 * self.model.num_layers * self.allreduce_time(new_tokens)

    def memory_time(self, prefill_tokens, decode_seqs, kv_tokens) -> jnp.ndarray:
        bw = self.mem_efficiency * self.gpu.hbm_bytes_per_s
        return self.step_bytes(prefill_tokens, decode_seqs, kv_tokens) / bw

    def compute_time(
        self, prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs=0, prefill_seqs=0
    ) -> jnp.ndarray:
        flops = self.step_flops(
            prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs, prefill_seqs
        )
        return flops / (self.flop_efficiency * self.gpu.peak_flops)

    def is_memory_bound(
        self, prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs=0, prefill_seqs=0
    ) -> jnp.ndarray:
        """bool: the memory term of the roofline is the larger one."""
        return self.memory_time(prefill_tokens, decode_seqs, kv_tokens) >= self.compute_time(
            prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs, prefill_seqs
        )

    def swap_time(self, blocks_moved, block_size: int) -> jnp.ndarray:
        """Seconds to copy ``blocks_moved`` KV blocks over the host link (either way):
        one copy per block, layer and K/V (copy_latency_s each) plus the bytes at the
        link's bandwidth x host_link_efficiency. float32."""
        m = self.model
        blocks = _f32(blocks_moved)
        bytes_ = blocks * (block_size * m.kv_bytes_per_token_per_gpu)
        bw = self.gpu.host_link_bytes_per_s * self.host_link_efficiency
        return blocks * (2 * m.num_layers * self.copy_latency_s) + bytes_ / bw

    def block_time(self, kv_blocks, pad_tokens) -> jnp.ndarray:
        """Seconds a paged kernel spends on block granularity in one step (float32):
        ``kv_blocks`` block visits (per layer: every layer reads the same blocks) at
        ``block_overhead_tokens`` tokens' HBM time each, plus, with whole_block_reads,
        the ``pad_tokens`` unused slots of the blocks read. Added to the step time (not
        folded into the roofline's max: a small overestimate in compute-bound steps)."""
        m = self.model
        extra = _f32(kv_blocks) * self.block_overhead_tokens
        if self.whole_block_reads:
            extra = extra + _f32(pad_tokens)
        bw = self.mem_efficiency * self.gpu.hbm_bytes_per_s
        return extra * m.kv_bytes_per_token_per_gpu / bw

    def __call__(
        self, prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs=0, prefill_seqs=0
    ) -> jnp.ndarray:
        """Step time in seconds (float32, broadcast over the inputs' shapes)."""
        roof = jnp.maximum(
            self.memory_time(prefill_tokens, decode_seqs, kv_tokens),
            self.compute_time(
                prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs, prefill_seqs
            ),
        )
        host = self.step_overhead_s + self.seq_overhead_s * (_f32(decode_seqs) + _f32(prefill_seqs))
        return roof + self.comm_time(prefill_tokens, decode_seqs) + host


def roofline(
    gpu: str, model: str | ModelGeometry, tp: int | None = None, **kwargs: float
) -> RooflineCostModel:
    """A RooflineCostModel for a named GPU and a preset name or geometry.

    kwargs override the efficiency factors and overheads of RooflineCostModel.
    """
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {gpu!r}")
    geom = model_geometry(model, tp) if isinstance(model, str) else model
    if isinstance(model, ModelGeometry) and tp is not None:
        geom = geom.with_tp(tp)
    return RooflineCostModel(GPUS[gpu], geom, **kwargs)


# A roofline calibrated to 2023 vLLM (v0.1.2) serving OPT-13B on one A100-SXM4-40GB, from
# an independent throughput anchor (1000 x 512-token prompts, capped-exponential outputs,
# paper_notes.md section 7), NOT from the paper's Fig. 12/13. Derived by
# ``python -m pagedjax.simulator.calibrate`` (docs/experiments.md): efficiencies fitted
# on a 0.01 grid, the per-step overhead in closed form; rms error 0.9 % over the four
# anchor points. The memory efficiency sits at the grid's edge (1.0): the anchor puts
# 2023 vLLM's slowness in a per-step constant (~23 ms: Python scheduling, no CUDA graphs,
# unfused kernels) rather than in lower bandwidth. The per-sequence host cost is not
# fitted (the anchor's batches are all ~25 sequences, so it cannot tell it apart): it is
# measured on vLLM 0.1.2's own scheduler, worker, sampler and API-server code on 2023's
# software (Python 3.8, torch 2.0.1, transformers 4.31, Starlette 0.27),
# ``experiments/vllm2023_host_cost.py --asgi-2023`` at Alpaca-like lengths (93.7 us, the
# median of three runs; a lower bound: the GPU's syncs and launches are not in it, and
# longer outputs cost more); the fit then gives the per-step overhead.
CALIBRATIONS: dict[str, dict[str, float]] = {
    "vllm2023": {
        "mem_efficiency": 1.0,
        "flop_efficiency": 0.61,
        "step_overhead_s": 0.0228,
        "seq_overhead_s": 93.7e-6,
    },
}


def calibrated(
    name: str, gpu: str, model: str | ModelGeometry, tp: int | None = None, **kwargs: Any
) -> RooflineCostModel:
    """The roofline with a named calibration's efficiencies and overhead (CALIBRATIONS);
    kwargs set the other fields (e.g. BLOCK_COSTS)."""
    if name not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {sorted(CALIBRATIONS)}, got {name!r}")
    return roofline(gpu, model, tp, **CALIBRATIONS[name], **kwargs)


# The paged kernel's fixed cost per KV block visited, in tokens' worth of HBM reads: the
# paper's Fig. 18a (PagedAttention at block 16 is 20-26 % slower than a contiguous
# kernel, read as ~0.23 x a 16-token block; systems.BLOCK_COSTS "kernel").
KERNEL_BLOCK_OVERHEAD_TOKENS = 0.23 * 16

FEATURE_NAMES = ("const", "prefill_tokens", "decode_seqs", "kv_tokens", "prefill_attn_pairs")


def step_features(prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs=0) -> np.ndarray:
    """float64[N, 5] design matrix: [1, prefill_tokens, decode_seqs, kv_tokens, pairs]."""
    cols = np.broadcast_arrays(
        *(
            np.asarray(c, np.float64)
            for c in (prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs)
        )
    )
    cols = [np.ravel(c) for c in cols]
    return np.stack([np.ones_like(cols[0]), *cols], axis=1)


@dataclass(frozen=True)
class FittedCostModel:
    """t = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens + e*prefill_attn_pairs.

    Coefficients (seconds per unit, in FEATURE_NAMES order) come from `fit` on measured
    steps of the real engine. Same call signature as RooflineCostModel (prefill_seqs is
    accepted and ignored: its effect is folded into the other terms).

    wake_s: extra seconds of the first step after the executor sat idle (no request
    live), which the simulator adds when its clock jumps to the next arrival. Fitted
    when ``fit`` is given each step's ``after_idle``; 0 otherwise. Why a term of its
    own: a CPU executor's worker threads park while idle, and the step that wakes them
    pays for it (measured on this 2-core box by experiments/idle_wake.py: the tiny
    model's step after a 50 ms pause 2.37 ms against 1.07 ms, docs/experiments.md).
    That cost falls on one step per idle gap, so
    its share depends on the arrival rate, which the per-work terms cannot express.
    """

    coef: tuple[float, float, float, float, float]
    rms_residual_s: float = 0.0
    wake_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURE_NAMES):
            raise ValueError(f"coef must have {len(FEATURE_NAMES)} entries, got {len(self.coef)}")

    @classmethod
    def fit(
        cls,
        prefill_tokens,
        decode_seqs,
        kv_tokens,
        step_time_s,
        prefill_attn_pairs=None,
        nonnegative: bool = False,
        after_idle=None,
    ) -> FittedCostModel:
        """Least squares (numpy lstsq) over N measured steps; all inputs [N].

        after_idle: [N] 1 where the step was the first after the executor sat idle, else
        0; given, ``wake_s`` is fitted as one more column (0 when no step woke).

        Columns are scaled to unit max before solving so that pairs (~1e6) and the
        constant (1) are equally conditioned; an all-zero column gets coefficient 0.
        nonnegative: solve with every coefficient >= 0 (scipy's NNLS). Work never takes
        negative time; an unconstrained fit on one workload's steps, whose columns are
        nearly collinear (decode sequences and KV tokens rise together), can trade a
        negative KV or pair cost against a larger decode cost: fine on that workload,
        nonsense on another (measured: a negative pair cost gave the prefill-heavy
        Azure trace near-zero steps; docs/experiments.md).
        """
        pairs = 0 if prefill_attn_pairs is None else prefill_attn_pairs
        x = step_features(prefill_tokens, decode_seqs, kv_tokens, pairs)
        if after_idle is not None:
            woke = np.ravel(np.asarray(after_idle, np.float64))
            if woke.shape[0] != x.shape[0]:
                raise ValueError(f"after_idle has {woke.shape[0]} samples, features {x.shape[0]}")
            x = np.concatenate([x, woke[:, None]], axis=1)
        y = np.ravel(np.asarray(step_time_s, np.float64))
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"step_time_s has {y.shape[0]} samples, features have {x.shape[0]}")
        if x.shape[0] < 2:
            raise ValueError(f"step_time_s needs >= 2 samples, got {x.shape[0]}")
        scale = np.abs(x).max(axis=0)
        used = scale > 0  # a feature never seen in the samples gets exactly 0
        if nonnegative:
            from scipy.optimize import nnls  # scipy is a dependency of jax

            sol, _ = nnls(x[:, used] / scale[used], y)
        else:
            sol, *_ = np.linalg.lstsq(x[:, used] / scale[used], y, rcond=None)
        coef = np.zeros(x.shape[1])
        coef[used] = sol / scale[used]
        rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
        base = tuple(float(c) for c in coef[: len(FEATURE_NAMES)])
        wake = float(coef[len(FEATURE_NAMES)]) if after_idle is not None else 0.0
        return cls(base, rms, wake)

    def __call__(
        self, prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs=0, prefill_seqs=0
    ) -> jnp.ndarray:
        """Step time in seconds (float32)."""
        del prefill_seqs
        a, b, c, d, e = self.coef
        return (
            a
            + b * _f32(prefill_tokens)
            + c * _f32(decode_seqs)
            + d * _f32(kv_tokens)
            + e * _f32(prefill_attn_pairs)
        )
