"""Launches the Triton paged attention kernels on torch tensors.

This is what the CPU tests run, under Triton's interpreter (``interpret=True``: the kernels'
Python bodies executed with numpy, one program at a time, on CPU tensors). On a CUDA GPU
with torch it also runs the compiled kernels (``interpret=False``), which the GPU check
uses to tell a kernel bug from a jax-triton binding bug. The JAX path is
``jax_binding.triton_paged_attention``; both lay out the launch with ``configs``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pallas_kernels.triton import configs
from pallas_kernels.triton.kernels import merge_splits_kernel, paged_attention_kernel

_DTYPE_NAMES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.uint8: "uint8", torch.int8: "int8",
}  # fmt: skip


@functools.cache
def interpreted(kernel: Any) -> Any:
    """The interpreter's version of a ``triton.jit`` kernel, whatever TRITON_INTERPRET said
    when the kernel module was imported (the kernels stay compilable for the other tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


def _dtype_name(t: torch.Tensor) -> str:
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int | torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    *,
    sm_scale: float,
    sliding_window: int | torch.Tensor | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    tile: configs.TileConfig | None = None,
    capability: int | None = None,
    interpret: bool | None = None,
    kv_format: str | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged paged attention on torch tensors; the contract of
    ``jax_binding.triton_paged_attention``.

    q [T, Hq, D]; k_pool, v_pool [L, N, Hkv, B, D] (same strides); layer: int or int32
    tensor; block_tables int32[S, M]; kv_lens int32[S]; cu_q_lens int32[S + 1], all on one
    device. Returns [T, Hq, D] in q's dtype; tokens at index >= cu_q_lens[S] are 0.
    ``sliding_window``: None, an int >= 1, or an int32 scalar tensor read at run time
    (<= 0: no window), as the layer loop passes per-layer windows.
    ``interpret`` defaults to True on CPU tensors; ``capability`` (e.g. 90) picks the tile
    table, default the tensor's GPU or 80 on CPU.
    ``kv_format`` ("fp8_e4m3" / "fp8_e5m2": uint8 pools, "int8": int8 pools;
    ``configs.KV_FORMATS``) with contiguous float32 ``k_scale`` / ``v_scale`` [L, Hkv]
    (fp8) or [L, N, Hkv, B, 1] (int8): the pools hold 8-bit values, each times its scale.
    ``tree_mask``: None or one word per token, int32 or uint32 [T], the bits of
    ``pallas_kernels.reference.tree_visible`` (draft-tree rows).
    """
    scales = None
    if kv_format is not None:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{kv_format} needs k_scale and v_scale")
        scales = tuple((tuple(s.shape), _dtype_name(s)) for s in (k_scale, v_scale))
    configs.check_shapes(
        tuple(q.shape), tuple(k_pool.shape), tuple(v_pool.shape), tuple(block_tables.shape),
        tuple(kv_lens.shape), tuple(cu_q_lens.shape), _dtype_name(q), _dtype_name(k_pool),
        (_dtype_name(block_tables), _dtype_name(kv_lens), _dtype_name(cu_q_lens)),
        kv_format=kv_format, scales=scales,
    )  # fmt: skip
    if k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool strides differ: {k_pool.stride()} {v_pool.stride()}")
    if kv_format is None:  # never read: any float32 buffer will do as the pointer
        k_scale = v_scale = torch.zeros((1,), dtype=torch.float32, device=q.device)
    elif not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous")
    device = q.device
    if tree_mask is not None:
        word_dtypes = (torch.int32, getattr(torch, "uint32", torch.int32))
        if tuple(tree_mask.shape) != (q.shape[0],) or tree_mask.dtype not in word_dtypes:
            raise ValueError(
                f"tree_mask must be uint32[T={q.shape[0]}], got {tree_mask.dtype}"
                f"{list(tree_mask.shape)}"
            )
        tree = tree_mask.view(torch.int32).contiguous()  # the kernel reads int32 bits
    else:  # never read: any int32 buffer will do as the pointer
        tree = torch.zeros((1,), dtype=torch.int32, device=device)
    if interpret is None:
        interpret = device.type == "cpu"
    if capability is None:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            capability = 10 * major + minor
        else:
            capability = 80
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, block_size, _ = k_pool.shape
    num_seqs, max_blocks = block_tables.shape
    dynamic = isinstance(sliding_window, torch.Tensor)
    static_window = None if dynamic else sliding_window
    plan = configs.plan_launch(
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_seqs=num_seqs, max_blocks=max_blocks,
        dtype=_dtype_name(q), sm_scale=sm_scale, sliding_window=static_window,
        soft_cap=soft_cap, dynamic_window=dynamic, capability=capability,
        num_splits=num_splits, tile=tile, kv_format=kv_format, tree=tree_mask is not None,
    )  # fmt: skip
    window = sliding_window if sliding_window is not None else 0
    scalars_t = torch.stack([
        torch.as_tensor(layer, dtype=torch.int32, device=device).reshape(()),
        torch.as_tensor(window, dtype=torch.int32, device=device).reshape(()),
    ])  # fmt: skip
    if not 0 <= int(scalars_t[0].item()) < num_layers:
        raise ValueError(f"layer {int(scalars_t[0].item())} outside [0, {num_layers})")
    attend = interpreted(paged_attention_kernel) if interpret else paged_attention_kernel
    merge = interpreted(merge_splits_kernel) if interpret else merge_splits_kernel
    out = torch.zeros_like(q)  # padding tokens stay 0
    if plan.num_splits == 1:
        target, lse = out, torch.empty((1,), dtype=torch.float32, device=device)
        out_strides, lse_strides = (0, *out.stride()), (0, 0)
    else:
        # Partials start as NaN: the merge must never read a slot no program wrote.
        target = torch.full(
            (plan.num_splits, *q.shape), float("nan"), dtype=torch.float32, device=device
        )
        lse = torch.full(target.shape[:-1], float("nan"), dtype=torch.float32, device=device)
        out_strides, lse_strides = target.stride(), lse.stride()
    scalars = configs.attention_scalars(
        q.stride(), k_pool.stride(), block_tables.stride(), out_strides, lse_strides,
        num_seqs, max_blocks, configs.scale_strides(kv_format, tuple(k_scale.shape)),
    )  # fmt: skip
    attend[plan.grid](
        q, k_pool, v_pool, k_scale, v_scale, scalars_t, block_tables, kv_lens, cu_q_lens, tree,
        *scalars, target, lse,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **plan.attention_constexprs,
    )  # fmt: skip
    if plan.merge_grid is not None:
        merge_args = configs.merge_scalars(target.stride(), lse.stride(), out.stride(), num_seqs)
        merge[plan.merge_grid](
            target, lse, cu_q_lens, *merge_args, out, num_warps=1, **plan.merge_constexprs
        )
    return out


__all__ = ["interpreted", "paged_attention"]
