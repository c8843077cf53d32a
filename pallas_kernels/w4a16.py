"""W4A16 matmul for decode shapes (Pallas Mosaic GPU, Hopper), beside its jnp reference.

The role Marlin plays in vLLM: y = x @ W for few tokens (M <= 64, decode) with W stored
as 4-bit codes, dequantized per tile inside the kernel, so the only full-size read is the
packed weight (half a byte per element) and no [K, N] dense copy is ever written.

Weight contract (what ``pagedjax.model.quant`` hands over, after folding its zero points
and code offset into ``bias``):

    W[k, n] = scale[k // group_size, n] * code(k, n) + bias[k // group_size, n]

- ``data``: uint8 [K/2, N], two codes per byte along the input axis: input 2j in the
  low nibble, 2j+1 in the high one (codes 0..15);
- ``scale``, ``bias``: float32 [K / group_size, N].

Kernel. One program per ``block_n`` output columns; it walks K in chunks of 128 inputs
(64 packed rows), two slots deep: the chunk's packed bytes, its scale and bias rows, and
the activations' even and odd inputs (split by XLA beforehand: the low nibbles multiply
the even inputs, the high nibbles the odd ones, so no nibble interleave is needed in
registers) arrive in SMEM by TMA while the previous chunk is computed. The threads
convert the bytes into two bf16 [64, block_n] tiles (code x scale + bias, per group),
``commit_smem``, and two wgmmas accumulate x_even @ W_lo + x_odd @ W_hi in fp32.
Activations are padded to the wgmma's 64 rows; float32 activations are rounded to bf16
for the tensor cores (bf16 products, fp32 accumulation, fp32 output): wgmma's tf32 mode
is not used.

Masking never lets padding act as data: inputs at or past ``in_features`` are zeroed in
both operands (0 x NaN is NaN), and rows at or past ``num_rows`` and columns at or past
``out_features`` are written as 0.

Cost: per program, K/2 bytes x block_n of codes and 2 x 4 x K/group x block_n of scales
read once; the conversion is done by the threads between TMA and wgmma. No split-K: a
small N gives few programs (N / block_n), which leaves most of an H100 idle for the
narrowest layers; it is tested in the GPU interpreter (jax 0.12 and 0.11.2) only, never
timed or run on a GPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma M: activation rows per tile (decode batches up to 64 tokens)
CHUNK = 128  # inputs per K step: 64 packed rows, each half one bf16 wgmma (K = 64)
PACKED = CHUNK // 2
_SUPPORTED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def default_interpret() -> Any:
    """The GPU interpreter (CPU), with race detection."""
    return plgpu.InterpretGPUParams(detect_races=True)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _operand_dtype(dtype: Any) -> Any:
    """The tensor cores' operand dtype for activations of ``dtype``."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.float32 else dtype


def check_w4a16_inputs(
    x: jax.Array, data: jax.Array, scale: jax.Array, bias: jax.Array, *,
    in_features: int, out_features: int, group_size: int,
) -> None:  # fmt: skip
    """ValueError unless the shapes and dtypes follow the contract (module docstring);
    arrays may be larger than the valid region (padding, never read as data)."""
    k, n, gs = in_features, out_features, group_size
    if jnp.dtype(x.dtype) not in _SUPPORTED:
        raise ValueError(f"activations must be bf16, fp16 or fp32, got {x.dtype}")
    if x.ndim != 2 or x.shape[0] > ROWS or x.shape[1] < k:
        raise ValueError(f"x must be [M <= {ROWS}, >= {k}], got {x.shape}")
    if jnp.dtype(data.dtype) != jnp.uint8 or data.ndim != 2:
        raise ValueError(f"data must be uint8 [K/2, N], got {data.dtype} {data.shape}")
    if gs < 2 or gs % 2 or k % gs or not (CHUNK % gs == 0 or gs % CHUNK == 0):
        raise ValueError(
            f"group_size {gs} must be even, divide in_features {k}, and divide or be a"
            f" multiple of {CHUNK}"
        )
    if data.shape[0] * 2 < k or data.shape[1] < n:
        raise ValueError(f"data {data.shape} does not cover [{k // 2}, {n}]")
    for name, a in (("scale", scale), ("bias", bias)):
        if a.ndim != 2 or a.shape[0] < k // gs or a.shape[1] < n:
            raise ValueError(f"{name} {a.shape} does not cover [{k // gs}, {n}]")


def _w4a16_kernel(
    x_even: jax.Array,  # [ROWS, Kp/2] operand dtype: inputs 0, 2, 4, ...
    x_odd: jax.Array,  # [ROWS, Kp/2]: inputs 1, 3, 5, ...
    data: jax.Array,  # uint8 [Kp/2, Np]
    scale: jax.Array,  # f32 [Kp / sub, Np]: one row per ``sub`` inputs
    bias: jax.Array,
    meta: jax.Array,  # int32[3]: num_rows, in_features, out_features
    *,
    sub: int,
    block_n: int,
    out_dtype: Any,
    interpret: Any,
) -> jax.Array:
    """The Mosaic GPU kernel: y [ROWS, Np] in out_dtype (module docstring)."""
    packed_rows, np_ = data.shape
    chunks = packed_rows // PACKED
    per_chunk = CHUNK // sub  # scale rows per chunk
    sub_rows = sub // 2  # packed rows sharing one scale row
    dtype = x_even.dtype

    def body(xe_ref, xo_ref, d_ref, s_ref, b_ref, meta_ref, o_ref,
             xe_smem, xo_smem, lo_smem, hi_smem, d_smem, s_smem, b_smem, o_smem, bar):  # fmt: skip
        j = lax.axis_index("n")
        cols = pl.ds(j * block_n, block_n)
        num_rows, k_valid, n_valid = meta_ref[0], meta_ref[1], meta_ref[2]

        def fetch(c, slot):
            ks = pl.ds(c * PACKED, PACKED)
            groups = pl.ds(c * per_chunk, per_chunk)
            plgpu.copy_gmem_to_smem(xe_ref.at[:, ks], xe_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(xo_ref.at[:, ks], xo_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(d_ref.at[ks, cols], d_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(s_ref.at[groups, cols], s_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(b_ref.at[groups, cols], b_smem.at[slot], bar.at[slot])

        fetch(0, 0)
        prow = plgpu.broadcasted_iota(jnp.int32, (PACKED, block_n), 0, layout=plgpu.Layout.WGMMA)
        xcol = lax.broadcasted_iota(jnp.int32, (ROWS, PACKED), 1)

        def step(c, acc):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < chunks)
            def _():
                fetch(c + 1, 1 - slot)

            plgpu.barrier_wait(bar.at[slot])
            base = c * CHUNK  # the chunk's first input
            # Whole [64, block_n] tiles in the WGMMA register layout (pinned through the
            # iota: sliced sub-block tiles left Mosaic GPU's layout search exponential).
            codes = plgpu.layout_cast(d_smem[slot].astype(jnp.int32), plgpu.Layout.WGMMA)
            sc = bi = None
            for s in range(per_chunk):  # static: the scale row of packed rows >= s * sub_rows
                s_row = lax.broadcast_in_dim(s_smem[slot, s], (PACKED, block_n), [1])
                b_row = lax.broadcast_in_dim(b_smem[slot, s], (PACKED, block_n), [1])
                first = prow >= s * sub_rows
                sc = s_row if sc is None else jnp.where(first, s_row, sc)
                bi = b_row if bi is None else jnp.where(first, b_row, bi)
            # Inputs 2r and 2r+1 are both valid or both not (in_features is even).
            live = base + 2 * prow < k_valid
            lo = (codes & 0xF).astype(jnp.float32) * sc + bi
            hi = (codes >> 4).astype(jnp.float32) * sc + bi
            lo_smem[slot] = jnp.where(live, lo, 0.0).astype(dtype)
            hi_smem[slot] = jnp.where(live, hi, 0.0).astype(dtype)

            @pl.when(base + CHUNK > k_valid)  # the tail: x's padded inputs may be anything
            def _():
                xe = xe_smem[slot]
                xe_smem[slot] = jnp.where(base + 2 * xcol < k_valid, xe, jnp.zeros_like(xe))
                xo = xo_smem[slot]
                xo_smem[slot] = jnp.where(base + 2 * xcol + 1 < k_valid, xo, jnp.zeros_like(xo))

            plgpu.commit_smem()  # W tiles (and masked x) written by threads, read by wgmma

            def mm(acc_ref):
                plgpu.wgmma(acc_ref, xe_smem.at[slot], lo_smem.at[slot])
                plgpu.wgmma(acc_ref, xo_smem.at[slot], hi_smem.at[slot])
                return acc_ref[...]

            # A fresh accumulator plus a register add (the interpreter cannot run_state).
            return acc + pl.run_scoped(mm, plgpu.ACC((ROWS, block_n), jnp.float32))

        acc = plgpu.layout_cast(jnp.zeros((ROWS, block_n), jnp.float32), plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, chunks, step, acc)
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_n), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_n), 1, layout=plgpu.Layout.WGMMA)
        keep = (row < num_rows) & (j * block_n + col < n_valid)
        o_smem[...] = jnp.where(keep, acc, 0.0).astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[:, cols])
        plgpu.wait_smem_to_gmem(0)

    # 128-byte swizzle over (8, 64) tiles: the operand layout wgmma reads without conflicts.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        plgpu.SMEM((2, ROWS, PACKED), dtype, transforms=transforms),  # x even inputs
        plgpu.SMEM((2, ROWS, PACKED), dtype, transforms=transforms),  # x odd inputs
        plgpu.SMEM((2, PACKED, block_n), dtype, transforms=transforms),  # W low nibbles
        plgpu.SMEM((2, PACKED, block_n), dtype, transforms=transforms),  # W high nibbles
        plgpu.SMEM((2, PACKED, block_n), jnp.uint8),  # the packed bytes, staged
        plgpu.SMEM((2, per_chunk, block_n), jnp.float32),
        plgpu.SMEM((2, per_chunk, block_n), jnp.float32),
        plgpu.SMEM((ROWS, block_n), out_dtype),
        plgpu.Barrier(num_arrivals=5, num_barriers=2),
    )
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((ROWS, np_), out_dtype),
        scratch_types=scratch,
        grid=(np_ // block_n,),
        grid_names=("n",),
        interpret=interpret,
    )
    return kernel(x_even, x_odd, data, scale, bias, meta)


def w4a16_matmul(
    x: jax.Array,
    data: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    *,
    in_features: int,
    out_features: int,
    group_size: int,
    num_rows: int | jax.Array | None = None,
    block_n: int = 64,
    interpret: Any = None,
) -> jax.Array:
    """y = x @ W, W 4-bit (module docstring's contract).

    Args:
      x: [M, Kx] bf16 / fp16 / fp32 activations, M <= 64, Kx >= in_features; columns
        from in_features on are padding (never read as data).
      data: uint8 [Kd/2, Nd] packed codes covering [in_features/2, out_features].
      scale, bias: f32 [Gd, Nd] covering [in_features / group_size, out_features].
      num_rows: rows of x that are tokens (may be traced); the rest give 0. Default M.
      block_n: output columns per program (64 or 128).
      interpret: None on a GPU; ``default_interpret()`` runs the kernel on CPU.

    Returns: [M, out_features] in x's dtype.
    """
    check_w4a16_inputs(x, data, scale, bias, in_features=in_features,
                       out_features=out_features, group_size=group_size)  # fmt: skip
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128, got {block_n}")
    m = x.shape[0]
    sub = min(group_size, CHUNK)
    if group_size > CHUNK:  # one scale row per chunk: repeat the group's row
        scale, bias = (jnp.repeat(a, group_size // CHUNK, axis=0) for a in (scale, bias))
    kp = _round_up(max(x.shape[1], 2 * data.shape[0], scale.shape[0] * sub), CHUNK)
    np_ = _round_up(max(data.shape[1], scale.shape[1], bias.shape[1]), block_n)

    def pad(a: jax.Array, rows: int, cols: int) -> jax.Array:
        return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))

    xp = pad(x.astype(_operand_dtype(x.dtype)), ROWS, kp)
    rows = jnp.asarray(m if num_rows is None else num_rows, jnp.int32)
    meta = jnp.stack([rows, jnp.int32(in_features), jnp.int32(out_features)])
    y = _w4a16_kernel(
        xp[:, 0::2], xp[:, 1::2],
        pad(data, kp // 2, np_),
        pad(scale.astype(jnp.float32), kp // sub, np_),
        pad(bias.astype(jnp.float32), kp // sub, np_),
        meta, sub=sub, block_n=block_n, out_dtype=x.dtype, interpret=interpret,
    )  # fmt: skip
    return y[:m, :out_features]


def unpack_codes(data: jax.Array) -> jax.Array:
    """uint8 [K/2, N] -> int32 codes [K, N] (input 2j: low nibble, 2j+1: high)."""
    lo, hi = (data & 0xF).astype(jnp.int32), (data >> 4).astype(jnp.int32)
    return jnp.stack([lo, hi], axis=1).reshape(2 * data.shape[0], data.shape[1])


def w4a16_matmul_reference(
    x: jax.Array,
    data: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    *,
    in_features: int,
    out_features: int,
    group_size: int,
    num_rows: int | jax.Array | None = None,
) -> jax.Array:
    """The kernel's oracle in jnp, same arguments: the valid region dequantized in fp32,
    rounded to the tensor cores' operand dtype with x, one fp32-accumulated dot."""
    check_w4a16_inputs(x, data, scale, bias, in_features=in_features,
                       out_features=out_features, group_size=group_size)  # fmt: skip
    k, n, gs = in_features, out_features, group_size
    codes = unpack_codes(data[: k // 2, :n]).astype(jnp.float32)
    s = jnp.repeat(scale[: k // gs, :n].astype(jnp.float32), gs, axis=0)
    b = jnp.repeat(bias[: k // gs, :n].astype(jnp.float32), gs, axis=0)
    op = _operand_dtype(x.dtype)
    y = jnp.dot(x[:, :k].astype(op), (codes * s + b).astype(op),
                preferred_element_type=jnp.float32)  # fmt: skip
    rows = x.shape[0] if num_rows is None else num_rows
    live = lax.broadcasted_iota(jnp.int32, y.shape, 0) < rows
    return jnp.where(live, y, 0.0).astype(x.dtype)


__all__ = [
    "CHUNK",
    "ROWS",
    "check_w4a16_inputs",
    "default_interpret",
    "unpack_codes",
    "w4a16_matmul",
    "w4a16_matmul_reference",
]
