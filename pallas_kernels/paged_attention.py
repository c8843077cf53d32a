"""Paged attention kernels for Hopper, written for the Pallas Mosaic GPU backend.

One kernel serves decode, prefill, chunked prefill and mixed batches. The XLA side cuts
the ragged batch into *tiles*: up to ``block_q`` query tokens of one sequence times the
``G = num_q_heads // num_kv_heads`` query heads that share a KV head, stacked as the
64 rows of one wgmma (GQA/MQA heads ride along for free; decode fills G of the rows).
The kernel runs one program per (kv head, tile, context split):

  * q tile -> SMEM by TMA; the split's KV chunks (``block_kv`` tokens, i.e.
    ``block_kv // block_size`` pages gathered through the block table) -> SMEM by TMA,
    two slots deep, so chunk i+1 streams in while chunk i is computed;
  * S = Q K^T and O += P V on the tensor cores (wgmma, fp32 accumulators), online softmax
    in fp32 registers, masked by length and causality;
  * every split writes its normalised partial output and log-sum-exp; XLA merges the splits
    (flash-decoding), so long contexts with few sequences still fill the GPU.

Masking never lets non-data act as data: scores outside [0, kv_len) and past a row's
position are replaced (``where``, not multiplied), and V rows past kv_len in the last
chunk are zeroed in SMEM before P V, because 0 x NaN is NaN and the null block, unused
table entries and slots past kv_len may hold anything.

Calling convention (docs/kernels.md): the pool is stacked over layers, ``[L, N, Hkv, B, D]``
per K and V, and the kernel gets the whole pool plus the layer index (and the sliding
window, 0 = none) as scalar operands it reads itself: the model's layer loop must not hand
it ``pool[layer]``, which XLA would copy every layer of every step.

8-bit pages (``kv_format``: "fp8_e4m3" / "fp8_e5m2", pages as their uint8 bytes with one
scale per (layer, KV head); "int8", int8 pages with one scale per (layer, block, head,
slot)): TMA moves the 8-bit page (half the bytes of a bf16 one) into a staging SMEM
buffer; the threads convert it to the compute dtype times its scale into the bf16 tile
wgmma reads (wgmma has no bf16 x fp8 mode), then ``commit_smem``. The per-token int8 scales
travel by TMA beside their pages. Tested in the GPU interpreter (jax 0.12 and 0.11.2) only.

Draft-tree masks (``tree_mask``, ``pallas_kernels.reference.tree_visible``): XLA gathers
each tile row's uint32 word (as int32) into ``[tiles, ROWS]``; the kernel brings its tile's
64 words into SMEM by TMA beside q and ANDs ``d >= 32 or bit d of the word`` (d = row
position - key position) into the causal mask of every chunk. Without a mask the kernel
is built without that operand, so the causal path is the one verified on the H200.

The dense-gather reference is ``pallas_kernels.reference``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.reference import TREE_BITS, check_paged_inputs, stacked_pool

ROWS = 64  # wgmma M: query rows (tokens x grouped heads) per tile
_MASK = -1e30  # finite mask value: an all-masked row gives exp(0) junk, never NaN
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# kv_format -> (stored page dtype, the dtype its bytes mean, per-token scales)
KV_FORMATS: dict[str, tuple[Any, Any, bool]] = {
    "fp8_e4m3": (jnp.uint8, jnp.float8_e4m3fn, False),
    "fp8_e5m2": (jnp.uint8, jnp.float8_e5m2, False),
    "int8": (jnp.int8, jnp.int8, True),
}


def _page_to_float(x: jax.Array, kv_format: str) -> jax.Array:
    """8-bit stored values -> float32 (fp8 bytes bit-cast first)."""
    storage, element, _ = KV_FORMATS[kv_format]
    if storage != element:
        x = lax.bitcast_convert_type(x, element)
    return x.astype(jnp.float32)


def default_interpret() -> Any:
    """Interpreter params for running the kernels on CPU (race detection on)."""
    return plgpu.InterpretGPUParams(detect_races=True)


def _tile_schedule(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_tiles: int, block_q: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Cuts the ragged batch into tiles of <= block_q tokens of one sequence.

    Returns int32[num_tiles] each: sequence (-1 for an empty tile), first token index in
    the flat batch, number of valid tokens, and the first token's position.
    """
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles_per_seq)  # inclusive ends
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    live = seq < q_lens.shape[0]
    seq_c = jnp.minimum(seq, q_lens.shape[0] - 1)
    first_tile = tile_end[seq_c] - tiles_per_seq[seq_c]
    tok_in_seq = (t - first_tile) * block_q
    ntok = jnp.where(live, jnp.clip(q_lens[seq_c] - tok_in_seq, 0, block_q), 0)
    tok0 = cu_q_lens[seq_c] + tok_in_seq
    pos0 = kv_lens[seq_c] - q_lens[seq_c] + tok_in_seq
    return jnp.where(live, seq_c, -1), tok0, ntok.astype(jnp.int32), pos0


def _attention_tiles(
    q_tiles: jax.Array,  # [Hkv, num_tiles, ROWS, D]
    k_pages: jax.Array,  # [L, N, Hkv, B, D]: the whole stacked pool
    v_pages: jax.Array,
    block_tables: jax.Array,  # int32[S, M], M a multiple of pages per chunk
    meta: jax.Array,  # int32[num_tiles, 4]: seq, pos0, ntok, kv_len
    scalars: jax.Array,  # int32[2]: layer index, sliding window (0: none)
    k_scale: jax.Array | None = None,  # fp8: f32[L, Hkv]; int8: f32[L, N, Hkv, B, 1]
    v_scale: jax.Array | None = None,
    tree_words: jax.Array | None = None,  # int32[num_tiles, ROWS]: tree word of each row
    *,
    kv_format: str | None = None,
    group: int,
    sm_scale: float,
    soft_cap: float | None,
    block_kv: int,
    num_splits: int,
    interpret: Any,
) -> tuple[jax.Array, jax.Array]:
    """The Mosaic GPU kernel. Returns per split o [Hkv, tiles, splits, ROWS, D] (q dtype,
    normalised) and lse [Hkv, tiles, splits, ROWS] (fp32, -inf where nothing was seen)."""
    num_kv_heads, num_tiles, rows, head_dim = q_tiles.shape
    _, _, _, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    pages_per_chunk = block_kv // block_size
    max_chunks = max_blocks // pages_per_chunk
    chunks_per_split = pl.cdiv(max_chunks, num_splits)
    dtype = q_tiles.dtype
    quantized = kv_format is not None
    per_token = quantized and KV_FORMATS[kv_format][2]
    tree = tree_words is not None

    def body(q_ref, k_ref, v_ref, bt_ref, meta_ref, scal_ref, *rest):
        if quantized:
            ks_ref, vs_ref, *rest = rest
        if tree:
            tw_ref, *rest = rest
        o_ref, lse_ref, *scratch = rest
        q_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bar, v_bar = scratch[:8]
        # 8-bit: TMA lands in staging buffers (and int8 scales beside them), converted below.
        k_in, v_in = (scratch[8], scratch[9]) if quantized else (k_smem, v_smem)
        layer = scal_ref[0]
        window = scal_ref[1]
        windowed = window > 0
        h = lax.axis_index("h")
        t = lax.axis_index("t")
        sp = lax.axis_index("split")
        seq = meta_ref[t, 0]
        pos0 = meta_ref[t, 1]
        ntok = meta_ref[t, 2]
        kv_len = meta_ref[t, 3]
        # Keys a tile can see end at its last token's position (causal, <= kv_len).
        kv_end = jnp.where(ntok > 0, pos0 + ntok, 0)
        first_chunk = sp * chunks_per_split
        kv_begin = jnp.where(windowed, jnp.maximum(pos0 - window + 1, 0), 0)
        first_chunk = jnp.maximum(first_chunk, kv_begin // block_kv)
        end_chunk = jnp.minimum((sp + 1) * chunks_per_split, pl.cdiv(kv_end, block_kv))
        seq_row = jnp.maximum(seq, 0)

        def fetch(chunk, slot):
            for j in range(pages_per_chunk):  # static: one TMA per page
                page = bt_ref[seq_row, chunk * pages_per_chunk + j]
                dst = pl.ds(j * block_size, block_size)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[layer, page, h], k_in.at[slot, dst], k_bar.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_ref.at[layer, page, h], v_in.at[slot, dst], v_bar.at[slot]
                )
                if per_token:
                    ks_smem, vs_smem = scratch[10], scratch[11]
                    plgpu.copy_gmem_to_smem(
                        ks_ref.at[layer, page, h], ks_smem.at[slot, dst], k_bar.at[slot]
                    )
                    plgpu.copy_gmem_to_smem(
                        vs_ref.at[layer, page, h], vs_smem.at[slot, dst], v_bar.at[slot]
                    )

        def dequantize_into(src, scale_smem, scale_ref, dst, slot, zero_past=None):
            """dst[slot] = compute-dtype (src[slot] as float x its scale); rows at or past
            ``zero_past`` (a key position bound) become 0 (V: 0 x NaN is NaN)."""
            x = _page_to_float(src[slot], kv_format)  # [block_kv, D]
            if per_token:  # each slot's own scale, [block_kv] along the rows
                x = x * lax.broadcast_in_dim(scale_smem[slot], x.shape, [0])
            else:
                x = x * scale_ref[layer, h]
            if zero_past is not None:
                x = jnp.where(zero_past, x, jnp.zeros_like(x))
            dst[slot] = x.astype(dtype)

        plgpu.copy_gmem_to_smem(q_ref.at[h, t], q_smem, q_bar)
        if tree:  # the tile's row words ride on q's barrier (two arrivals)
            plgpu.copy_gmem_to_smem(tw_ref.at[t], scratch[-1], q_bar)

        @pl.when(first_chunk < end_chunk)
        def _():
            fetch(first_chunk, 0)

        plgpu.barrier_wait(q_bar)

        row = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1, layout=plgpu.Layout.WGMMA)
        row_tok = lax.div(row, jnp.int32(group))
        row_pos = pos0 + row_tok
        row_live = row_tok < ntok
        vrow = plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0, layout=plgpu.Layout.WGMMA)
        if tree:
            words = plgpu.layout_cast(scratch[-1][...], plgpu.Layout.WGMMA.reduce(1))
            row_word = lax.broadcast_in_dim(words, (rows, block_kv), [0])

        def step(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i - first_chunk, 2)

            @pl.when(i + 1 < end_chunk)
            def _():
                fetch(i + 1, 1 - slot)

            plgpu.barrier_wait(k_bar.at[slot])
            if quantized:
                dequantize_into(k_in, scratch[10] if per_token else None, ks_ref, k_smem, slot)
                plgpu.commit_smem()  # K written by threads, read by the tensor cores

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32)) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kv_pos = i * block_kv + col
            visible = row_live & (kv_pos <= row_pos) & (kv_pos < kv_len)
            visible = visible & (jnp.logical_not(windowed) | (kv_pos > row_pos - window))
            if tree:  # keys 32+ back always; nearer ones by their bit (arithmetic >> is fine)
                back = row_pos - kv_pos
                bit = lax.shift_right_arithmetic(row_word, jnp.clip(back, 0, TREE_BITS - 1)) & 1
                visible = visible & ((back >= TREE_BITS) | (bit == 1))
            s = jnp.where(visible, s, _MASK)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            p = jnp.where(visible, p, 0.0)
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p_smem[...] = p.astype(dtype)

            plgpu.barrier_wait(v_bar.at[slot])

            if quantized:  # converting touches every V row anyway: zero those past kv_len
                vs_smem = scratch[11] if per_token else None
                dequantize_into(v_in, vs_smem, vs_ref, v_smem, slot, i * block_kv + vrow < kv_len)
            else:
                # The chunk holding kv_len: zero V rows past it (poisoned slots, null block).
                @pl.when((i + 1) * block_kv > kv_len)
                def _():
                    v = v_smem[slot]
                    v_smem[slot] = jnp.where(i * block_kv + vrow < kv_len, v, jnp.zeros_like(v))

            plgpu.commit_smem()  # P and V written by threads, read by the tensor cores

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            # A fresh accumulator plus a register add, not pl.run_state(ACC.init(acc)):
            # the GPU interpreter cannot run run_state, and the add is 64 x D flops.
            acc = acc + pl.run_scoped(pv, plgpu.ACC((rows, head_dim), jnp.float32))
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((rows,), _MASK, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m_i, l_i = lax.fori_loop(first_chunk, end_chunk, step, (acc, m_i, l_i))

        seen = l_i > 0.0
        inv_l = 1.0 / jnp.where(seen, l_i, 1.0)
        q_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
        lse_smem[...] = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, t, sp])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[h, t, sp])
        plgpu.wait_smem_to_gmem(0)

    # 128-byte swizzle over (8, 64) tiles: the operand layout wgmma reads without conflicts.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        plgpu.SMEM((rows, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((2, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((2, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((rows, block_kv), dtype, transforms=transforms),
        plgpu.SMEM((rows,), jnp.float32),
        plgpu.Barrier(num_arrivals=2 if tree else 1),
        plgpu.Barrier(num_arrivals=pages_per_chunk * (2 if per_token else 1), num_barriers=2),
        plgpu.Barrier(num_arrivals=pages_per_chunk * (2 if per_token else 1), num_barriers=2),
    )
    if quantized:
        storage = KV_FORMATS[kv_format][0]
        scratch += (
            plgpu.SMEM((2, block_kv, head_dim), storage),  # staged 8-bit K pages
            plgpu.SMEM((2, block_kv, head_dim), storage),
        )
        if per_token:
            scratch += (
                plgpu.SMEM((2, block_kv), jnp.float32),  # their per-slot scales
                plgpu.SMEM((2, block_kv), jnp.float32),
            )
    if tree:
        scratch += (plgpu.SMEM((rows,), jnp.int32),)  # scratch[-1]: this tile's row words
    out_type = (
        jax.ShapeDtypeStruct((num_kv_heads, num_tiles, num_splits, rows, head_dim), dtype),
        jax.ShapeDtypeStruct((num_kv_heads, num_tiles, num_splits, rows), jnp.float32),
    )
    operands = (q_tiles, k_pages, v_pages, block_tables, meta, scalars)
    if per_token:  # [L, N, Hkv, B, 1] -> [L, N, Hkv, B] (a free reshape), rows of SMEM
        k_scale, v_scale = (s.reshape(s.shape[:-1]) for s in (k_scale, v_scale))
    if quantized:
        operands += (k_scale, v_scale)
    if tree:
        operands += (tree_words,)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_kv_heads, num_tiles, num_splits),
        grid_names=("h", "t", "split"),
        interpret=interpret,
    )
    return kernel(*operands)


def _merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Flash-decoding merge: o [..., splits, R, D], lse [..., splits, R] -> [..., R, D] fp32."""
    m = lse.max(axis=-2, keepdims=True)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = w.sum(axis=-2)
    merged = (o.astype(jnp.float32) * w[..., None]).sum(axis=-3)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def _default_num_splits(work_items: int, max_chunks: int, target_programs: int = 264) -> int:
    # Enough (kv head, tile, split) programs to fill ~2 waves of 132 SMs, never a split
    # with no chunk at all.
    return max(1, min(max_chunks, target_programs // max(work_items, 1)))


def unsupported(
    q_dtype: Any, page_dtype: Any, eight_bit: bool, head_dim: int, block_size: int, group: int
) -> str | None:
    """Why the kernel refuses inputs of this kind, or None when it takes them: q in bf16 or
    fp16 with pages of the same dtype (or 8-bit pages), head_dim a multiple of 64 (wgmma
    tiles), block_size a multiple of 8 in [8, 128], at most ``ROWS`` query heads per KV
    head. Static facts only (dtypes and shapes), so a caller can choose at trace time."""
    if jnp.dtype(q_dtype) not in _SUPPORTED_DTYPES or (
        not eight_bit and jnp.dtype(page_dtype) != jnp.dtype(q_dtype)
    ):
        return f"q and pages must share a dtype in bf16/fp16, got {q_dtype}, {page_dtype}"
    if head_dim % 64:
        return f"head_dim must be a multiple of 64 (wgmma tiles), got {head_dim}"
    if block_size % 8 or not 8 <= block_size <= 128:
        return f"block_size must be a multiple of 8 in [8, 128], got {block_size}"
    if group > ROWS:
        return f"at most {ROWS} query heads per KV head, got {group}"
    return None


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "block_q",
        "block_kv",
        "num_splits",
        "interpret",
        "kv_format",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    interpret: Any = None,
    kv_format: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal ragged paged attention (prefill, chunked prefill, decode, mixed batches).

    Args:
      q: [T, num_q_heads, head_dim], bf16 or fp16. Token i of sequence s is
        q[cu_q_lens[s] + i] at position kv_lens[s] - q_len_s + i.
      k_pages, v_pages: the stacked pool [num_layers, num_blocks, num_kv_heads, block_size,
        head_dim] in q's dtype, with ``layer`` the int32 scalar index (may be traced) of
        the layer to read; or one layer's 4-D pages with layer=None. Block 0 is the null
        block.
      block_tables: int32[S, max_blocks_per_seq].
      kv_lens: int32[S], context length including this step's tokens (0: padding).
      cu_q_lens: int32[S+1]; tokens at index >= cu_q_lens[S] are padding.
      sm_scale: score scale (usually head_dim ** -0.5).
      sliding_window: if set, a query sees only its last ``sliding_window`` positions; may
        be a traced int32 scalar (<= 0: no window).
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      block_q: query tokens per tile; default 64 // G (G = query heads per KV head).
      block_kv: KV tokens per pipeline step, a multiple of 64 and of block_size;
        default max(64, block_size).
      num_splits: context splits per tile (flash-decoding); default fills ~2 waves.
      interpret: None on a GPU; ``default_interpret()`` runs the kernel on CPU.
      kv_format: None (pages in q's dtype) or an 8-bit format (``KV_FORMATS``): "fp8_e4m3"
        / "fp8_e5m2" pages of uint8 bytes with k_scale / v_scale f32[L, Hkv] (per layer and
        KV head), or "int8" pages with k_scale / v_scale f32[L, N, Hkv, B, 1] (per slot).
        Values are value x scale; the stacked pool (a layer index) is required.
      tree_mask: uint32[T] or None: draft-tree rows (``reference.tree_visible``): bit d
        of a token's word lets it see the key d positions back, keys 32 or more back
        always; None (or all bits set) is the causal rule. Any page format.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; padding tokens are 0.
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer)
    if kv_format is not None:
        _check_kv_format(kv_format, k_pages, k_scale, v_scale, layer)
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    why = unsupported(q.dtype, k_pages.dtype, kv_format is not None, head_dim, block_size, group)
    if why is not None:
        raise ValueError(why)
    block_q = block_q or ROWS // group
    if block_q * group > ROWS:
        raise ValueError(f"block_q * group must be <= {ROWS}, got {block_q} * {group}")
    block_kv = block_kv or max(64, block_size)
    if block_kv % 64 or block_kv % block_size:
        raise ValueError(f"block_kv ({block_kv}) must be a multiple of 64 and of block_size")
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    scalars = jnp.stack([layer, window]).astype(jnp.int32)
    if tree_mask is not None and tree_mask.shape != (num_tokens,):
        raise ValueError(f"tree_mask must be uint32[T={num_tokens}], got {tree_mask.shape}")

    num_seqs, max_blocks = block_tables.shape
    pages_per_chunk = block_kv // block_size
    max_chunks = pl.cdiv(max_blocks, pages_per_chunk)
    # Entries past a sequence's last page point at the null block: a copy of it is wasted
    # but harmless (masked), and a stale or garbage table entry is never dereferenced.
    needed = (kv_lens + block_size - 1) // block_size
    bt = jnp.where(jnp.arange(max_blocks)[None, :] < needed[:, None], block_tables, 0)
    bt = jnp.pad(bt, ((0, 0), (0, max_chunks * pages_per_chunk - max_blocks)))

    # Each sequence wastes < 1 tile on its ragged end; no tile is empty of live tokens.
    num_tiles = min(num_tokens, pl.cdiv(num_tokens + num_seqs * (block_q - 1), block_q))
    seq, tok0, ntok, pos0 = _tile_schedule(cu_q_lens, kv_lens, num_tiles, block_q)
    kv_len_t = jnp.where(seq >= 0, kv_lens[jnp.maximum(seq, 0)], 0)
    meta = jnp.stack([seq, pos0, ntok, kv_len_t], axis=1).astype(jnp.int32)

    # Gather q into tile-major rows: row r of a tile is token r // G, head r % G.
    r = jnp.arange(ROWS)
    r_tok = r // group
    tok = tok0[:, None] + r_tok[None, :]  # [tiles, R]
    row_ok = r_tok[None, :] < ntok[:, None]
    head = jnp.arange(num_kv_heads)[:, None, None] * group + (r % group)[None, None, :]
    q_tiles = q[jnp.clip(tok, 0, num_tokens - 1)[None], head]  # [Hkv, tiles, R, D]
    q_tiles = jnp.where(row_ok[None, :, :, None], q_tiles, 0).astype(q.dtype)
    tree_words = None
    if tree_mask is not None:  # int32 bits (the kernel's shifts); dead rows: all bits
        words = lax.bitcast_convert_type(tree_mask.astype(jnp.uint32), jnp.int32)
        tree_words = jnp.where(row_ok, words[jnp.clip(tok, 0, num_tokens - 1)], -1)

    if num_splits is None:
        num_splits = _default_num_splits(num_kv_heads * num_tiles, max_chunks)
    o, lse = _attention_tiles(
        q_tiles,
        k_pages,
        v_pages,
        bt,
        meta,
        scalars,
        k_scale,
        v_scale,
        tree_words,
        kv_format=kv_format,
        group=group,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        block_kv=block_kv,
        num_splits=num_splits,
        interpret=interpret,
    )
    out_tiles = _merge_splits(o, lse)  # [Hkv, tiles, R, D]

    # Scatter rows back to [T, Hq, D]; dead rows drop (index T is out of range).
    dest_tok = jnp.where(row_ok, tok, num_tokens)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = out.at[dest_tok[None], head].set(out_tiles, mode="drop")
    return out.astype(q.dtype)


def _check_kv_format(kv_format: str, k_pages: jax.Array, k_scale: Any, v_scale: Any,
                     layer: Any) -> None:  # fmt: skip
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {kv_format!r}")
    storage, _, per_token = KV_FORMATS[kv_format]
    if layer is None or k_pages.ndim != 5 or k_pages.dtype != jnp.dtype(storage):
        raise ValueError(
            f"{kv_format} pages must be the stacked {jnp.dtype(storage).name} pool with a layer"
            f" index, got {k_pages.dtype}{list(k_pages.shape)}"
        )
    n_layers, n_blocks, n_heads, block_size, _ = k_pages.shape
    want = (n_layers, n_blocks, n_heads, block_size, 1) if per_token else (n_layers, n_heads)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or tuple(s.shape) != want or s.dtype != jnp.float32:
            got = None if s is None else f"{s.dtype}{list(s.shape)}"
            raise ValueError(f"{kv_format}: {name} must be float32{list(want)}, got {got}")


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    interpret: Any = None,
    kv_format: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Decode attention, one query token per sequence: q [S, Hq, D] -> [S, Hq, D].

    A decode batch is the ragged batch with q_len 1 (tiles of one token, the G heads of a
    KV head in one wgmma); sequences with kv_len 0 are padding and output 0. Tuning as in
    ``ragged_paged_attention``; splits default to filling the GPU, which for small
    batches and long contexts means many splits per sequence.
    """
    if q.ndim != 3 or q.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"decode q must be [S, Hq, D] with S = {block_tables.shape[0]}, got {q.shape}"
        )
    q_lens = (kv_lens > 0).astype(jnp.int32)
    # Live sequences first, so the ragged layout is dense; scatter back afterwards.
    order = jnp.argsort(1 - q_lens, stable=True)
    cu_q_lens = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens[order], dtype=jnp.int32)]
    )
    out = ragged_paged_attention(
        q[order],
        k_pages,
        v_pages,
        block_tables[order],
        kv_lens[order],
        cu_q_lens,
        layer=layer,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=1,
        block_kv=block_kv,
        num_splits=num_splits,
        interpret=interpret,
        kv_format=kv_format,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return jnp.zeros_like(out).at[order].set(out)


__all__ = [
    "KV_FORMATS",
    "ROWS",
    "default_interpret",
    "paged_decode_attention",
    "ragged_paged_attention",
]
