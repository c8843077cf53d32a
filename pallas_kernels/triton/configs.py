"""Launch plans for the Triton paged attention kernels: tile sizes per GPU generation, the
grid, the context splits and the kernels' compile-time constants. Pure Python (no torch, no
jax, no triton), so both launchers and the tests share one source of truth.

The tables below are explicit starting points, not autotuned results: no run on an A100
(sm_80), A10 / RTX 30xx (sm_86), L4 / RTX 40xx (sm_89) or H100 / H200 (sm_90) is
committed yet (docs/kernels.md). They are sized by shared memory: one query tile plus
``num_stages`` K and V steps must fit (sm_80 164 KiB, sm_86 / sm_89 100 KiB, sm_90
228 KiB), e.g. prefill on sm_90 with head_dim 128 in bf16: Q 128 x 128 x 2 = 32 KiB plus
3 x (K + V = 2 x 64 x 128 x 2 = 32 KiB) = 128 KiB.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
# 8-bit pool formats (the names ``pallas_kernels.paged_attention.KV_FORMATS`` uses, so the
# backend switch hands both kernel families the same arguments) -> (stored page dtype,
# per-token scales). fp8 pages are their uint8 bytes with scales float32[L, Hkv]; int8
# pages carry scales float32[L, N, Hkv, B, 1] (one per slot).
KV_FORMATS: dict[str, tuple[str, bool]] = {
    "fp8_e4m3": ("uint8", False),
    "fp8_e5m2": ("uint8", False),
    "int8": ("int8", True),
}


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """block_m: rows of a query tile (tokens x padded GQA group), >= 16 (tl.dot's minimum);
    tile_n: keys per step (>= 16); num_warps / num_stages: Triton launch options."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    name: str
    num_sms: int  # of the smallest common part of this generation: sets the split count
    decode: TileConfig  # batches with at most one query token per sequence
    prefill: TileConfig  # everything else (prefill, chunked prefill, mixed)


ARCH_CONFIGS: dict[int, ArchConfig] = {
    80: ArchConfig("sm_80 (A100)", 108, TileConfig(16, 64, 4, 2), TileConfig(64, 64, 4, 3)),
    86: ArchConfig("sm_86 (A10, RTX 30xx)", 72, TileConfig(16, 32, 4, 2), TileConfig(64, 32, 4, 2)),
    89: ArchConfig("sm_89 (L4, RTX 40xx)", 58, TileConfig(16, 32, 4, 2), TileConfig(64, 32, 4, 2)),
    90: ArchConfig("sm_90 (H100, H200)", 132, TileConfig(16, 64, 4, 3), TileConfig(128, 64, 8, 3)),
}
MAX_SPLITS = 32
MIN_STEPS_PER_SPLIT = 4  # a split shorter than this costs more in the merge than it saves


def arch_config(capability: int) -> ArchConfig:
    """The table row for a compute capability given as 80, 86, 89, 90, ... : the nearest
    generation at or below it (sm_87 -> sm_86, sm_100 -> sm_90); below sm_80 is refused
    (the kernels use bf16 and cp.async-era pipelining)."""
    if capability < 80:
        raise ValueError(f"Triton paged attention needs sm_80 or newer, got sm_{capability}")
    return ARCH_CONFIGS[max(c for c in ARCH_CONFIGS if c <= capability)]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything a launcher needs besides the arrays.

    grid: the attention kernel's (query tiles, KV heads, splits); merge_grid: (T, Hq) of
    the split merge, or None when num_splits == 1 (the attention kernel then writes the
    output itself and the output must start zeroed, for padding tokens).
    """

    grid: tuple[int, int, int]
    merge_grid: tuple[int, int] | None
    num_splits: int
    num_warps: int
    num_stages: int
    attention_constexprs: dict[str, Any]
    merge_constexprs: dict[str, Any] | None
    arch: str


def check_shapes(
    q_shape: tuple[int, ...],
    k_pool_shape: tuple[int, ...],
    v_pool_shape: tuple[int, ...],
    block_tables_shape: tuple[int, ...],
    kv_lens_shape: tuple[int, ...],
    cu_q_lens_shape: tuple[int, ...],
    q_dtype: str,
    pool_dtype: str,
    index_dtypes: tuple[str, str, str],
    kv_format: str | None = None,
    scales: tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]] | None = None,
) -> None:
    """Raises ValueError on shapes or dtypes the kernels do not take.

    q [T, Hq, D]; k_pool, v_pool [L, N, Hkv, B, D]; block_tables int32[S, M];
    kv_lens int32[S]; cu_q_lens int32[S + 1]; q and pool share a dtype in
    SUPPORTED_DTYPES, or with ``kv_format`` (``KV_FORMATS``) the pool holds that format's
    bytes and ``scales`` = ((k_scale shape, dtype name), (v_scale shape, dtype name)) are
    float32 [L, Hkv] (fp8) or [L, N, Hkv, B, 1] (int8); index_dtypes are (block_tables,
    kv_lens, cu_q_lens)'s dtype names.
    """
    if len(q_shape) != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q_shape}")
    if len(k_pool_shape) != 5 or tuple(k_pool_shape) != tuple(v_pool_shape):
        raise ValueError(
            "k_pool and v_pool must both be [num_layers, num_blocks, num_kv_heads, block_size,"
            f" head_dim], got {k_pool_shape} and {v_pool_shape}"
        )
    if kv_format is not None:
        check_kv_format(kv_format, k_pool_shape, pool_dtype, scales)
        if q_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"q must be one of {SUPPORTED_DTYPES}, got {q_dtype}")
    elif q_dtype != pool_dtype or q_dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q and the pools must share a dtype in {SUPPORTED_DTYPES}, got {q_dtype} and"
            f" {pool_dtype}"
        )
    _, _, num_kv_heads, block_size, head_dim = k_pool_shape
    if q_shape[2] != head_dim:
        raise ValueError(f"q head_dim {q_shape[2]} != pool head_dim {head_dim}")
    if q_shape[1] % num_kv_heads:
        raise ValueError(
            f"num_q_heads {q_shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(block_tables_shape) != 2:
        raise ValueError(f"block_tables must be int32[S, max_blocks], got {block_tables_shape}")
    num_seqs = block_tables_shape[0]
    if tuple(kv_lens_shape) != (num_seqs,):
        raise ValueError(f"kv_lens must be int32[{num_seqs}], got shape {kv_lens_shape}")
    if tuple(cu_q_lens_shape) != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be int32[{num_seqs + 1}], got shape {cu_q_lens_shape}")
    for name, dt in zip(("block_tables", "kv_lens", "cu_q_lens"), index_dtypes, strict=True):
        if dt != "int32":
            raise ValueError(f"{name} must be int32, got {dt}")


def check_kv_format(
    kv_format: str,
    pool_shape: tuple[int, ...],
    pool_dtype: str,
    scales: tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]] | None,
) -> None:
    """Raises ValueError unless the pool holds ``kv_format``'s bytes and both scales are
    float32 of the format's shape (see ``KV_FORMATS``)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {kv_format!r}")
    storage, per_token = KV_FORMATS[kv_format]
    if pool_dtype != storage:
        raise ValueError(f"{kv_format} pools must be {storage}, got {pool_dtype}")
    num_layers, num_blocks, num_kv_heads, block_size, _ = pool_shape
    want = (
        (num_layers, num_blocks, num_kv_heads, block_size, 1) if per_token
        else (num_layers, num_kv_heads)
    )  # fmt: skip
    for name, scale in zip(("k_scale", "v_scale"), scales or (None, None), strict=True):
        if scale is None or tuple(scale[0]) != want or scale[1] != "float32":
            raise ValueError(f"{kv_format}: {name} must be float32{list(want)}, got {scale}")


def scale_strides(kv_format: str | None, scale_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The kernel's (layer, block, head, slot) element strides of a row-major scale array:
    fp8 [L, Hkv] -> (Hkv, 0, 1, 0); int8 [L, N, Hkv, B, 1] -> its first four strides;
    float pools (no scales read) -> zeros."""
    if kv_format is None:
        return (0, 0, 0, 0)
    if KV_FORMATS[kv_format][1]:
        return row_major_strides(scale_shape)[:4]
    return (scale_shape[1], 0, 1, 0)


def plan_launch(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_seqs: int,
    max_blocks: int,
    dtype: str,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    dynamic_window: bool = False,
    capability: int = 80,
    num_splits: int | None = None,
    tile: TileConfig | None = None,
    kv_format: str | None = None,
    tree: bool = False,
) -> LaunchPlan:
    """The launch for one call, from static shapes only (so it is fixed under jit).

    A batch with at most one token per sequence (num_tokens <= num_seqs) uses the decode
    tiles, and is split along the context until ~2 waves of programs fill the GPU, each
    split keeping >= MIN_STEPS_PER_SPLIT key steps; ``num_splits`` overrides that. ``tile``
    overrides the table (tests use small tiles to exercise many steps on small shapes).
    ``sliding_window`` is the static window (None: none); ``dynamic_window`` says a window
    arrives at run time (a traced per-layer value, <= 0 meaning none), so the kernel keeps
    its window code without knowing the value. ``dtype`` is q's (the compute dtype, which
    sets the tiles); ``kv_format`` (``KV_FORMATS``, None: pools in q's dtype) the pools'.
    ``tree``: a draft-tree mask (one int32 word per token) is passed (``USE_TREE``).
    """
    if kv_format is not None and kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {kv_format!r}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    arch = arch_config(capability)
    decode_like = num_tokens <= num_seqs
    cfg = tile or (arch.decode if decode_like else arch.prefill)
    if cfg.block_m < 16 or cfg.tile_n < 16 or cfg.tile_n & (cfg.tile_n - 1):
        raise ValueError(f"block_m and tile_n must be >= 16, tile_n a power of two: {cfg}")
    tile_n, num_stages = cfg.tile_n, cfg.num_stages
    if dtype == "float32":  # twice the bytes per step: halve the step, shallower pipeline
        tile_n, num_stages = max(16, tile_n // 2), min(num_stages, 2)
    group = num_q_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, next_pow2(cfg.block_m) // group_pad)
    num_q_tiles = num_tokens // block_q + num_seqs
    context = max_blocks * block_size
    if sliding_window is not None:
        context = min(context, sliding_window + block_q)
    steps = -(-context // tile_n)
    if num_splits is None:
        num_splits = 1
        if decode_like:
            live_programs = max(1, min(num_tokens, num_seqs) * num_kv_heads)
            want = -(-2 * arch.num_sms // live_programs)
            num_splits = max(1, min(want, steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
    attention = dict(
        SM_SCALE=float(sm_scale),
        SOFT_CAP=float(soft_cap or 0.0),
        USE_WINDOW=sliding_window is not None or dynamic_window,
        USE_TREE=bool(tree),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if dtype == "float32" else "tf32",
        KV_FORMAT=kv_format or "none",
    )
    merge = None
    if num_splits > 1:
        merge = dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=attention["HEAD_DIM_PAD"],
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
        )
    return LaunchPlan(
        grid=(num_q_tiles, num_kv_heads, num_splits),
        merge_grid=(num_tokens, num_q_heads) if num_splits > 1 else None,
        num_splits=num_splits,
        num_warps=cfg.num_warps,
        num_stages=num_stages,
        attention_constexprs=attention,
        merge_constexprs=merge,
        arch=arch.name,
    )


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major array (JAX's device layout)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


__all__ = [
    "ARCH_CONFIGS",
    "ArchConfig",
    "LaunchPlan",
    "SUPPORTED_DTYPES",
    "TileConfig",
    "arch_config",
    "attention_scalars",
    "KV_FORMATS",
    "check_kv_format",
    "check_shapes",
    "merge_scalars",
    "next_pow2",
    "plan_launch",
    "row_major_strides",
    "scale_strides",
]


def attention_scalars(
    q_strides: tuple[int, ...],
    pool_strides: tuple[int, ...],
    block_table_strides: tuple[int, ...],
    out_strides: tuple[int, ...],
    lse_strides: tuple[int, ...],
    num_seqs: int,
    max_blocks: int,
    scale_strides: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> tuple[int, ...]:
    """The attention kernel's integer arguments, in its order (after the 9 input arrays).

    Strides are in elements; ``scale_strides`` as ``scale_strides()`` gives them.
    out_strides / lse_strides are those of [splits, T, Hq, D] and
    [splits, T, Hq]; with one split the output is [T, Hq, D]: pass (0, *its strides).
    The innermost (head_dim) stride of q, the pools and the output must be 1.
    """
    if q_strides[-1] != 1 or pool_strides[-1] != 1 or out_strides[-1] != 1:
        raise ValueError("q, the pools and the output must be contiguous along head_dim")
    return (
        q_strides[0], q_strides[1],
        pool_strides[0], pool_strides[1], pool_strides[2], pool_strides[3],
        *scale_strides,
        block_table_strides[0],
        out_strides[0], out_strides[1], out_strides[2],
        lse_strides[0], lse_strides[1],
        num_seqs, max_blocks,
    )  # fmt: skip


def merge_scalars(
    partial_strides: tuple[int, ...],
    lse_strides: tuple[int, ...],
    out_strides: tuple[int, ...],
    num_seqs: int,
) -> tuple[int, ...]:
    """The merge kernel's integer arguments, in its order (after its 3 input arrays)."""
    return (
        partial_strides[0], partial_strides[1], partial_strides[2],
        lse_strides[0], lse_strides[1],
        out_strides[0], out_strides[1],
        num_seqs,
    )  # fmt: skip
