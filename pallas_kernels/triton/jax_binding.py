"""Triton paged attention for JAX arrays, through ``jax_triton.triton_call``.

``triton_paged_attention`` takes the whole stacked KV pool and a layer index (never a
``pool[layer]`` slice: inside the layer loop that slice would be a copy per layer per step)
and lays out the launch with ``configs.plan_launch``. The one call into jax-triton is
``_triton_call`` below; everything else is plain JAX, so a jax-triton release that renames
an argument touches one function. Versions: jax-triton 0.3.x (``out_shape=``) fits the H200
image's jax 0.11.2 + triton 3.6; 0.4.x (``out_type=``) wants triton >= 3.7 and its lowering
fails under jax 0.12 (docs/kernels.md). Both spellings are handled; only the first has a
planned GPU run.

jax-triton is an optional extra (``pip install 'pagedjax[triton]'``); this module imports
it on first call, so importing it needs only jax.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.triton import configs


def _jax_triton() -> Any:
    try:
        return importlib.import_module("jax_triton")
    except ImportError as e:
        raise ImportError(
            "attention backend 'triton' needs jax-triton: pip install 'pagedjax[triton]'"
            f" ({e})"
        ) from e


def _triton_call(
    *args: Any,
    kernel: Any,
    out_shapes: list[jax.ShapeDtypeStruct],
    grid: tuple[int, ...],
    num_warps: int,
    num_stages: int,
    zeroed_outputs: tuple[int, ...],
    constexprs: dict[str, Any],
) -> list[jax.Array]:
    """The single call site of jax-triton. Array and int arguments go to the kernel in
    order, then one pointer per output; ``constexprs`` become ``tl.constexpr`` arguments;
    outputs listed in ``zeroed_outputs`` start zeroed."""
    jt = _jax_triton()
    params = inspect.signature(jt.triton_call).parameters
    out_key = "out_shape" if "out_shape" in params else "out_type"  # 0.3.x vs 0.4.x
    outs = jt.triton_call(
        *args,
        kernel=kernel,
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        zeroed_outputs=zeroed_outputs,
        **{out_key: out_shapes},
        **constexprs,
    )
    return list(outs)


def _capability(capability: int | None) -> int:
    if capability is not None:
        return capability
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or cc is None:
        return 80  # tracing off-GPU (tests, cross-compilation): the sm_80 tables
    major, minor = str(cc).split(".")
    return 10 * int(major) + int(minor)


def triton_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    capability: int | None = None,
    kv_format: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal ragged paged attention (prefill, chunked prefill, decode, mixed batches).

    Args:
      q: [T, Hq, D] in float16, bfloat16 or float32. Token i of sequence s is
        q[cu_q_lens[s] + i], at position kv_lens[s] - q_len_s + i.
      k_pool, v_pool: [L, N, Hkv, B, D], q's dtype (or 8-bit, see kv_format); block 0 is
        the null block.
      layer: int32 scalar (may be traced: the layer loop's ``fori_loop`` index): the layer.
      block_tables: int32[S, M]; only entries of pages below kv_len are read.
      kv_lens: int32[S], context including this step's tokens (0: padding sequence).
      cu_q_lens: int32[S + 1]; tokens at index >= cu_q_lens[S] are padding.
      sm_scale, soft_cap: as in the reference.
      sliding_window: None, an int >= 1, or an int32 scalar array (may be traced: the
        layer loop's per-layer window; <= 0 means none), read by the kernel at run time.
      num_splits: context splits (flash-decoding); default from ``configs.plan_launch``.
      capability: compute capability as 80 / 86 / 89 / 90 for the tile table; default
        the first device's (80 off-GPU).
      kv_format: None, or the pools' 8-bit format (``configs.KV_FORMATS``, the Pallas
        kernels' names): "fp8_e4m3" / "fp8_e5m2" pools of uint8 bytes with k_scale /
        v_scale float32[L, Hkv] (per layer and KV head), or "int8" pools with k_scale /
        v_scale float32[L, N, Hkv, B, 1] (per slot). A page value means value x scale.
      tree_mask: uint32[T] or None: draft-tree rows (``reference.tree_visible``): bit d
        of a token's word lets it see the key d positions back, keys 32 or more back
        always; None (or all bits set) is the causal rule.

    Returns:
      [T, Hq, D] in q's dtype; padding tokens are 0.
    """
    scales = None
    if kv_format is not None:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{kv_format} needs k_scale and v_scale")
        scales = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in (k_scale, v_scale))
    configs.check_shapes(
        q.shape, k_pool.shape, v_pool.shape, block_tables.shape, kv_lens.shape,
        cu_q_lens.shape, jnp.dtype(q.dtype).name, jnp.dtype(k_pool.dtype).name,
        tuple(jnp.dtype(a.dtype).name for a in (block_tables, kv_lens, cu_q_lens)),
        kv_format=kv_format, scales=scales,
    )  # fmt: skip
    if kv_format is None:  # never read by the kernel; jax-triton needs an array to point at
        k_scale = v_scale = jnp.zeros((1,), jnp.float32)
    if tree_mask is not None and tree_mask.shape != (q.shape[0],):
        raise ValueError(f"tree_mask must be uint32[T={q.shape[0]}], got {tree_mask.shape}")
    if tree_mask is None:  # unread (USE_TREE off)
        tree = jnp.zeros((1,), jnp.int32)
    else:  # the kernel reads the bits as int32
        tree = jax.lax.bitcast_convert_type(tree_mask.astype(jnp.uint32), jnp.int32)
    from pallas_kernels.triton.kernels import merge_splits_kernel, paged_attention_kernel

    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, block_size, _ = k_pool.shape
    num_seqs, max_blocks = block_tables.shape
    dynamic = sliding_window is not None and not isinstance(sliding_window, int)
    if dynamic and jnp.ndim(sliding_window) != 0:
        raise ValueError(f"sliding_window must be a scalar, got shape {jnp.shape(sliding_window)}")
    if jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar index, got shape {jnp.shape(layer)}")
    plan = configs.plan_launch(
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_seqs=num_seqs, max_blocks=max_blocks,
        dtype=jnp.dtype(q.dtype).name, sm_scale=sm_scale,
        sliding_window=None if dynamic else sliding_window, soft_cap=soft_cap,
        dynamic_window=dynamic, capability=_capability(capability), num_splits=num_splits,
        kv_format=kv_format, tree=tree_mask is not None,
    )  # fmt: skip
    # Layer and window as an int32[2] operand: jax-triton bakes Python scalars into the
    # kernel, and both may be traced.
    window = sliding_window if sliding_window is not None else 0
    run_scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    strides = configs.row_major_strides  # XLA hands the kernel dense row-major buffers
    if plan.num_splits == 1:
        target = out_shape
        lse = jax.ShapeDtypeStruct((1,), jnp.float32)  # unused with one split
        out_strides, lse_strides = (0, *strides(q.shape)), (0, 0)
        zeroed = (0,)  # padding tokens are never written
    else:
        target = jax.ShapeDtypeStruct((plan.num_splits, *q.shape), jnp.float32)
        lse = jax.ShapeDtypeStruct(target.shape[:-1], jnp.float32)
        out_strides, lse_strides = strides(target.shape), strides(lse.shape)
        zeroed = ()  # every slot the merge reads is written
    scalars = configs.attention_scalars(
        strides(q.shape), strides(k_pool.shape), strides(block_tables.shape),
        out_strides, lse_strides, num_seqs, max_blocks,
        configs.scale_strides(kv_format, tuple(k_scale.shape)),
    )  # fmt: skip
    partial, lse_out = _triton_call(
        q, k_pool, v_pool, k_scale, v_scale, run_scalars, block_tables, kv_lens, cu_q_lens,
        tree, *scalars,
        kernel=paged_attention_kernel, out_shapes=[target, lse], grid=plan.grid,
        num_warps=plan.num_warps, num_stages=plan.num_stages, zeroed_outputs=zeroed,
        constexprs=plan.attention_constexprs,
    )  # fmt: skip
    if plan.merge_grid is None:
        return partial
    merge_args = configs.merge_scalars(
        strides(target.shape), strides(lse.shape), strides(q.shape), num_seqs
    )
    (out,) = _triton_call(
        partial, lse_out, cu_q_lens, *merge_args,
        kernel=merge_splits_kernel, out_shapes=[out_shape], grid=plan.merge_grid,
        num_warps=1, num_stages=1, zeroed_outputs=(), constexprs=plan.merge_constexprs,
    )  # fmt: skip
    return out


def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    kv_format: str | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """The engine's attention contract (``pagedjax.attention``): the stacked pool
    [L, N, Hkv, B, D] with ``layer``, or one layer's 4-D pages with ``layer=None`` (a
    one-layer pool: ``k[None]`` is a reshape, not a copy). 8-bit pools (``kv_format``,
    ``k_scale``, ``v_scale`` as ``triton_paged_attention`` takes them, the same keywords
    as the Pallas kernels) only stacked, with their layer."""
    if k_pool.ndim == 4:
        if kv_format is not None:
            raise ValueError(f"{kv_format} pages must be the stacked 5-D pool with a layer")
        if layer is not None:
            raise ValueError("4-D pages take layer=None; pass the stacked 5-D pool with a layer")
        k_pool, v_pool, layer = k_pool[None], v_pool[None], 0
    elif layer is None:
        raise ValueError("a stacked 5-D pool needs its layer index")
    return triton_paged_attention(
        q, k_pool, v_pool, layer, block_tables, kv_lens, cu_q_lens,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        kv_format=kv_format, k_scale=k_scale, v_scale=v_scale, tree_mask=tree_mask,
    )  # fmt: skip


__all__ = ["ragged_paged_attention", "triton_paged_attention"]
