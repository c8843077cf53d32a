"""Paged attention in the Triton language: one attention kernel and one split-merge kernel.

Both launchers (``torch_launch`` for the CPU interpreter tests, ``jax_binding`` for JAX
through jax-triton) call these two kernels with the same arguments, laid out by
``configs.plan_launch``. Pointer and scalar arguments come first, in the order jax-triton
passes them (inputs, then outputs); ``tl.constexpr`` arguments are keyword metaparameters.

``paged_attention_kernel``: one program per (query tile, KV head, context split).

  * A *query tile* is up to ``BLOCK_Q`` consecutive query tokens of one sequence times the
    ``GROUP`` query heads that share the KV head (GQA/MQA heads are stacked into the rows
    of one ``tl.dot``, padded to ``GROUP_PAD``): ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows.
    Tile ``j`` of sequence ``s`` is program ``cu_q_lens[s] // BLOCK_Q + s + j``, so the grid
    is ``T // BLOCK_Q + S`` programs long, fixed by the static shapes, and a program finds
    its sequence by a binary search over ``cu_q_lens`` (an upper bound; programs past a
    sequence's last tile return at once). Tiles never straddle sequences, so no two
    programs write the same output row.
  * The keys a tile may see, ``[kv_start, kv_end)`` (causal end = last query's position
    + 1, window start = first query's position - window + 1), are cut into ``TILE_N``-key
    steps; with ``NUM_SPLITS > 1`` each split takes an equal share of the *sequence's own*
    steps (flash-decoding), so a long context with few sequences still fills the GPU.
  * Each step gathers ``TILE_N`` keys through the block table, key by key (the page is
    ``pos // BLOCK_SIZE``, the slot ``pos % BLOCK_SIZE``), so ``TILE_N`` and the page size
    are independent. Loads are masked to positions ``< kv_end <= kv_len``: a table entry
    past the sequence's last page, the null block and slots past ``kv_len`` are never read
    (masked loads return 0 without touching memory, and 0 x NaN cannot happen).
  * Online softmax in fp32: scores outside causality / length / window become -inf, the
    running max used for rescaling is 0 while nothing was seen (so no ``-inf - -inf``).
  * ``NUM_SPLITS == 1``: writes the normalised output in the output's dtype. Otherwise
    writes an fp32 normalised partial and its log-sum-exp (-inf: the split saw nothing),
    which ``merge_splits_kernel`` combines.

8-bit pages (``KV_FORMAT``, docs/kv_quantization.md): the pools hold bytes, "fp8_e4m3" /
"fp8_e5m2" as uint8 with one float32 scale per (layer, KV head) in ``k_scale`` /
``v_scale`` [L, Hkv], or "int8" with one float32 scale per (layer, block, KV head, slot)
[L, N, Hkv, B, 1] loaded beside the page (same masks, so a poisoned scale is never read).
A step's 8-bit tile is converted *exactly* to q's dtype (every fp8 / int8 value is a
float16 and a bfloat16), and the scales are applied in fp32 outside the dot: the fp8 K
scale folds into the score scale, the fp8 V scale into the final normalisation, the int8
K scales multiply score columns, the int8 V scales the V rows before the dot. fp8 bytes
are decoded with integer operations (``_fp8_to_float32``), not Triton's float8 types:
``float8e4nv`` does not compile for sm_80 ("type fp8e4nv not supported in this
architecture"), and Triton's CPU interpreter converts fp8 NaN / inf bytes to finite
numbers (e4m3 0x7F -> 480, e5m2 0x7C -> 65536), so the interpreted tests would not test
what a GPU does. The integer decode is exact for every byte on every target.

Draft-tree masks (``USE_TREE``; ``pallas_kernels.reference.tree_visible``): ``tree_ptr``
holds one int32 word per query token (the uint32 bits); each row loads its token's word
once, and a key ``back = pos - kpos`` positions back is visible only if ``back >= 32`` or
bit ``back`` is set, ANDed into the causal mask of every step. Without a mask the
constexpr drops that code and ``tree_ptr`` is never read.

The layer index and the sliding window arrive as a small int32 array the kernel reads (not
as launch constants): inside the model's layer loop both are traced values.

Pool offsets are computed in int64: a whole stacked pool [L, N, Hkv, B, D] on a large GPU
holds more than 2**31 elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp8_to_float32(bits, E5M2: tl.constexpr):
    """uint8 bytes of float8 (e5m2, or e4m3fn) -> float32, exact for every byte (NaN, inf,
    subnormals, -0). e5m2 is the high byte of a float16. e4m3fn: sign to float16's sign bit
    and exponent + mantissa into float16's low exponent bits and high mantissa bits; that
    float16 is the value / 2**8 (exponent bias 15 vs 7; e4m3 subnormals land on float16
    subnormals, equally exact), and magnitude 0x7F is e4m3fn's only NaN (no inf)."""
    b = bits.to(tl.uint16)
    if E5M2:
        return (b << 8).to(tl.float16, bitcast=True).to(tl.float32)
    mag = b & 0x7F
    half = ((b & 0x80) << 8) | (mag << 7)
    x = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where(mag == 0x7F, float("nan"), x)


@triton.jit
def _page_tile(raw, KV_FORMAT: tl.constexpr):
    """A loaded page tile as float32 values before scaling (8-bit formats only)."""
    if KV_FORMAT == "int8":
        return raw.to(tl.float32)
    else:
        return _fp8_to_float32(raw, KV_FORMAT == "fp8_e5m2")


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_pool_ptr,  # [L, N, Hkv, B, D]
    v_pool_ptr,  # same shape and strides as k_pool
    k_scale_ptr,  # fp32: [L, Hkv] (fp8), [L, N, Hkv, B, 1] (int8), unread [1] (float pools)
    v_scale_ptr,  # same shape and strides as k_scale
    scalars_ptr,  # int32[2]: the layer of the stacked pool to read, the window (<= 0: none)
    block_tables_ptr,  # int32[S, M]
    kv_lens_ptr,  # int32[S]
    cu_q_lens_ptr,  # int32[S + 1]
    tree_ptr,  # int32[T]: each token's tree word (USE_TREE), else unread [1]
    stride_q_tok,
    stride_q_head,
    stride_kv_layer,
    stride_kv_block,
    stride_kv_head,
    stride_kv_tok,
    stride_s_layer,  # scale strides: fp8 (Hkv, 0, 1, 0); int8 [L, N, Hkv, B, 1]'s first 4
    stride_s_block,
    stride_s_head,
    stride_s_tok,
    stride_bt_seq,
    stride_o_split,  # output strides; out is [T, Hq, D] or [splits, T, Hq, D]
    stride_o_tok,
    stride_o_head,
    stride_lse_split,  # lse is [splits, T, Hq]
    stride_lse_tok,
    num_seqs,
    max_blocks,
    out_ptr,
    lse_ptr,
    SM_SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,  # 0.0: no soft cap
    USE_WINDOW: tl.constexpr,  # False: no window code at all (the window is statically None)
    USE_TREE: tl.constexpr,  # False: no tree-mask code (tree_ptr unread)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    TILE_N: tl.constexpr,  # keys per step
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit)
    KV_FORMAT: tl.constexpr,  # "none" (pools in q's dtype), "fp8_e4m3", "fp8_e5m2", "int8"
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The sequence of this tile: the last s with cu_q_lens[s] // BLOCK_Q + s <= pid_q.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid_q:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    q_block = pid_q - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # past this sequence's last tile (or a padding sequence)
    kv_len = tl.load(kv_lens_ptr + seq)
    layer = tl.load(scalars_ptr).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # token index within the sequence
    g = rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    pos = kv_len - q_len + q_idx  # each row's query position
    tok = q_start + q_idx  # each row's token index in the batch
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    if USE_TREE:
        word = tl.load(tree_ptr + tok, mask=row_ok, other=-1)  # dead rows: all bits

    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Keys this tile may see; rows of later tokens see more, masked below.
    last_q = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = kv_len - q_len + last_q + 1
    kv_start = 0
    if USE_WINDOW:
        # A runtime value: layers with different windows share one compiled kernel.
        window = tl.load(scalars_ptr + 1)
        first_pos = kv_len - q_len + q_block * BLOCK_Q
        kv_start = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    step_lo = kv_start // TILE_N
    step_hi = tl.cdiv(kv_end, TILE_N)
    per_split = tl.cdiv(step_hi - step_lo, NUM_SPLITS)
    my_lo = step_lo + split * per_split
    my_hi = tl.minimum(my_lo + per_split, step_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    base = layer * stride_kv_layer + kv_head.to(tl.int64) * stride_kv_head
    qk_scale = SM_SCALE
    v_layer_scale = 1.0
    if KV_FORMAT == "fp8_e4m3" or KV_FORMAT == "fp8_e5m2":
        # One scale per (layer, KV head): K's folds into the score scale, V's into the end.
        s_off = layer * stride_s_layer + kv_head * stride_s_head
        qk_scale = SM_SCALE * tl.load(k_scale_ptr + s_off)
        v_layer_scale = tl.load(v_scale_ptr + s_off)
    s_base = layer * stride_s_layer + kv_head.to(tl.int64) * stride_s_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    cols = tl.arange(0, TILE_N)
    for step in range(my_lo, my_hi):
        kpos = step * TILE_N + cols
        page_idx = kpos // BLOCK_SIZE
        # Only table entries of pages holding data are read; a garbage tail stays unread.
        key_ok = (kpos < kv_end) & (page_idx < max_blocks)
        page = tl.load(bt_row + page_idx, mask=key_ok, other=0).to(tl.int64)
        kv_off = base + page * stride_kv_block + (kpos % BLOCK_SIZE) * stride_kv_tok
        k = tl.load(
            k_pool_ptr + kv_off[None, :] + d[:, None],
            mask=key_ok[None, :] & d_ok[:, None],
            other=0,
        )  # [HEAD_DIM_PAD, TILE_N]
        if KV_FORMAT != "none":
            k = _page_tile(k, KV_FORMAT).to(q.dtype)  # exact: 8-bit values fit q's dtype
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if KV_FORMAT == "int8":
            s_off = s_base + page * stride_s_block + (kpos % BLOCK_SIZE) * stride_s_tok
            k_tok_scale = tl.load(k_scale_ptr + s_off, mask=key_ok, other=0.0)
            s = s * k_tok_scale[None, :]
        if SOFT_CAP > 0:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no libdevice call.
            s = SOFT_CAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFT_CAP) + 1.0))
        visible = row_ok[:, None] & key_ok[None, :] & (kpos[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & ((window <= 0) | (kpos[None, :] > pos[:, None] - window))
        if USE_TREE:  # keys 32+ back always; nearer ones by their bit (arithmetic >> is fine)
            back = pos[:, None] - kpos[None, :]
            bit = (word[:, None] >> tl.minimum(tl.maximum(back, 0), 31)) & 1
            visible = visible & ((back >= 32) | (bit == 1))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # exactly 0 where masked
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_pool_ptr + kv_off[:, None] + d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if KV_FORMAT == "int8":
            v_tok_scale = tl.load(v_scale_ptr + s_off, mask=key_ok, other=0.0)
            v = (_page_tile(v, KV_FORMAT) * v_tok_scale[:, None]).to(q.dtype)
        elif KV_FORMAT != "none":
            v = _page_tile(v, KV_FORMAT).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = acc * v_layer_scale / tl.where(seen, l_i, 1.0)[:, None]  # saw nothing: acc is 0
    o_mask = row_ok[:, None] & d_ok[None, :]
    o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(out_ptr + split * stride_o_split + o_off, out, mask=o_mask)
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        lse_off = split * stride_lse_split + tok * stride_lse_tok + head
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    partial_ptr,  # fp32 [splits, T, Hq, D], normalised per split
    lse_ptr,  # fp32 [splits, T, Hq], -inf where a split saw nothing
    cu_q_lens_ptr,  # int32[S + 1]: tokens at index >= cu_q_lens[S] are padding
    stride_p_split,
    stride_p_tok,
    stride_p_head,
    stride_lse_split,
    stride_lse_tok,
    stride_o_tok,
    stride_o_head,
    num_seqs,
    out_ptr,  # [T, Hq, D]
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    """One program per (token, query head): out = sum_s w_s o_s / sum_s w_s with
    w_s = exp(lse_s - max lse). Padding tokens get 0; a split that saw nothing (lse -inf)
    is not even read, so its partial may hold anything."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    o_ptrs = out_ptr + tok * stride_o_tok + head * stride_o_head + d
    live = tok < tl.load(cu_q_lens_ptr + num_seqs)
    sp = tl.arange(0, SPLITS_PAD)
    lse = tl.load(
        lse_ptr + sp * stride_lse_split + tok * stride_lse_tok + head,
        mask=(sp < NUM_SPLITS) & live,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_use)  # 0 for empty splits and padding tokens
    has = lse > float("-inf")
    part = tl.load(
        partial_ptr + sp[:, None] * stride_p_split + tok * stride_p_tok
        + head * stride_p_head + d[None, :],
        mask=has[:, None] & d_ok[None, :],
        other=0.0,
    )  # fmt: skip
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


KERNELS = {"attention": paged_attention_kernel, "merge": merge_splits_kernel}
