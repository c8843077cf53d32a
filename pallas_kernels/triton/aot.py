"""Compiles the Triton kernels for a CUDA target on a machine without a GPU.

``triton.compile`` with a ``GPUTarget`` runs the whole pipeline (Triton IR, TritonGPU IR
with the target's layouts and pipelining, LLVM IR, PTX, and cubin through the ``ptxas``
shipped in the triton wheel); nothing needs a driver. So a kernel that does not compile
for sm_80 or sm_90 fails CI instead of a user's GPU job. What it cannot catch: run-time
behaviour (wrong results, illegal addresses, shared memory overflow at launch).

    python -m pallas_kernels.triton.aot 80 90      # prints one JSON line per variant

Must run with TRITON_INTERPRET unset (the interpreter replaces the kernels by Python).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from pallas_kernels.triton import configs

_TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_POOL_TYPES = {"fp8_e4m3": "u8", "fp8_e5m2": "u8", "int8": "i8"}  # configs.KV_FORMATS


@dataclasses.dataclass(frozen=True)
class Variant:
    """A launch to compile: shapes of a typical call and its options."""

    name: str
    num_tokens: int
    num_seqs: int
    dtype: str = "bfloat16"
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    max_blocks: int = 256
    sliding_window: int | None = None
    soft_cap: float | None = None
    num_splits: int | None = None
    kv_format: str | None = None  # 8-bit pools (configs.KV_FORMATS); None: in dtype
    tree: bool = False  # a draft-tree mask (USE_TREE)


VARIANTS = [
    Variant("decode, one split", num_tokens=256, num_seqs=256, num_splits=1),
    Variant("decode, 8 splits + merge", num_tokens=4, num_seqs=4, num_splits=8),
    Variant("prefill GQA 4", num_tokens=2048, num_seqs=4),
    Variant("prefill fp16, window, soft cap, tree mask", num_tokens=512, num_seqs=2,
            dtype="float16", sliding_window=256, soft_cap=30.0, tree=True),
    Variant("decode fp32 MHA, head_dim 64, pages of 8", num_tokens=8, num_seqs=8,
            dtype="float32", num_q_heads=8, num_kv_heads=8, head_dim=64, block_size=8),
    Variant("prefill MQA, pages of 128", num_tokens=1024, num_seqs=2, num_q_heads=16,
            num_kv_heads=1, block_size=128, max_blocks=32),
    # num_seqs == max_blocks == 1: jax-triton and Triton's launcher make them constexprs
    Variant("decode batch 1, one page, 2 splits", num_tokens=1, num_seqs=1, max_blocks=1,
            num_splits=2),
    # 8-bit pools: fp8 bytes decoded with integer ops (float8e4nv does not exist on sm_80)
    Variant("decode fp8_e4m3 pages, 4 splits", num_tokens=16, num_seqs=16, num_splits=4,
            kv_format="fp8_e4m3"),
    Variant("prefill fp16, fp8_e5m2 pages, window", num_tokens=512, num_seqs=2,
            dtype="float16", sliding_window=256, kv_format="fp8_e5m2"),
    Variant("prefill int8 pages (per-token scales)", num_tokens=1024, num_seqs=4,
            kv_format="int8"),
]  # fmt: skip


def _signature(kernel: Any, pointer_types: dict[str, str], constexprs: dict[str, Any]) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointer_types[name]
        else:
            sig[name] = "i32"
    return sig


def _scalar_values(variant: Variant, num_splits: int) -> dict[str, dict[str, int]]:
    """The integer arguments equal to 1, by kernel: jax-triton (and Triton's own launcher)
    compile those as the constant 1, so the compile test must too."""
    from pallas_kernels.triton.kernels import merge_splits_kernel, paged_attention_kernel

    rm = configs.row_major_strides
    q = (variant.num_tokens, variant.num_q_heads, variant.head_dim)
    pool = (1, 1, variant.num_kv_heads, variant.block_size, variant.head_dim)
    bt = (variant.num_seqs, variant.max_blocks)
    if num_splits == 1:
        out, lse = (0, *rm(q)), (0, 0)
    else:
        out, lse = rm((num_splits, *q)), rm((num_splits, *q[:2]))
    scale_shape = (1, 1, variant.num_kv_heads, variant.block_size, 1)
    if variant.kv_format is not None and not configs.KV_FORMATS[variant.kv_format][1]:
        scale_shape = (1, variant.num_kv_heads)
    scales = configs.scale_strides(variant.kv_format, scale_shape)
    attn = configs.attention_scalars(rm(q), rm(pool), rm(bt), out, lse, *bt, scales)
    merge = configs.merge_scalars(out, lse, rm(q), variant.num_seqs)
    first = paged_attention_kernel.arg_names.index("stride_q_tok")  # after the pointers
    names_a = paged_attention_kernel.arg_names[first : first + len(attn)]
    names_m = merge_splits_kernel.arg_names[3 : 3 + len(merge)]
    return {
        "attention": {n: 1 for n, v in zip(names_a, attn, strict=True) if v == 1},
        "merge": {n: 1 for n, v in zip(names_m, merge, strict=True) if v == 1},
    }


def compile_variant(variant: Variant, capability: int) -> dict[str, Any]:
    """Compiles the kernels of one launch for sm_<capability>; returns sizes and timings.

    Raises whatever triton raises when a kernel does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pallas_kernels.triton.kernels import merge_splits_kernel, paged_attention_kernel

    plan = configs.plan_launch(
        num_tokens=variant.num_tokens, num_q_heads=variant.num_q_heads,
        num_kv_heads=variant.num_kv_heads, head_dim=variant.head_dim,
        block_size=variant.block_size, num_seqs=variant.num_seqs,
        max_blocks=variant.max_blocks, dtype=variant.dtype, sm_scale=variant.head_dim**-0.5,
        sliding_window=variant.sliding_window, soft_cap=variant.soft_cap,
        capability=capability, num_splits=variant.num_splits, kv_format=variant.kv_format,
        tree=variant.tree,
    )  # fmt: skip
    data = _TRITON_TYPES[variant.dtype]
    pool = _POOL_TYPES[variant.kv_format] if variant.kv_format else data
    split_out = "fp32" if plan.num_splits > 1 else data
    pointers = dict(
        q_ptr=data, k_pool_ptr=pool, v_pool_ptr=pool, k_scale_ptr="fp32", v_scale_ptr="fp32",
        scalars_ptr="i32",
        block_tables_ptr="i32", kv_lens_ptr="i32", cu_q_lens_ptr="i32", tree_ptr="i32",
        out_ptr=split_out, lse_ptr="fp32", partial_ptr="fp32",
    )  # fmt: skip
    target = GPUTarget("cuda", capability, 32)
    scalars = _scalar_values(variant, plan.num_splits)
    launches = [(paged_attention_kernel, {**scalars["attention"], **plan.attention_constexprs},
                 plan.num_warps)]  # fmt: skip
    if plan.merge_constexprs is not None:
        launches.append(
            (merge_splits_kernel, {**scalars["merge"], **plan.merge_constexprs}, 1)
        )
    result: dict[str, Any] = dict(
        variant=variant.name, capability=capability, num_splits=plan.num_splits, kernels=[]
    )
    for kernel, constexprs, num_warps in launches:
        ptrs = dict(pointers, out_ptr=data if kernel is merge_splits_kernel else split_out)
        src = ASTSource(kernel, _signature(kernel, ptrs, constexprs), constexprs=constexprs)
        t0 = time.perf_counter()
        compiled = triton.compile(
            src, target=target, options=dict(num_warps=num_warps, num_stages=plan.num_stages)
        )
        result["kernels"].append(dict(
            name=kernel.fn.__name__, seconds=round(time.perf_counter() - t0, 2),
            ptx_chars=len(compiled.asm["ptx"]), cubin_bytes=len(compiled.asm["cubin"]),
            shared_bytes=compiled.metadata.shared, num_warps=num_warps,
            target=f"sm_{capability}",
        ))  # fmt: skip
    return result


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    caps = [int(a) for a in argv] or [80, 90]
    failed = 0
    for cap in caps:
        for v in VARIANTS:
            try:
                print(json.dumps({"ok": True, **compile_variant(v, cap)}), flush=True)
            except Exception as e:
                failed += 1
                msg = f"{type(e).__name__}: {e}"[-2000:]
                print(json.dumps({"ok": False, "variant": v.name, "capability": cap,
                                  "error": msg}), flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
