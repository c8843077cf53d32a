"""Parity cases for the Triton kernels, and a worker process that runs them interpreted.

Triton's interpreter must be switched on (``TRITON_INTERPRET=1``) before ``triton`` is
first imported: its standard library (``tl.max``, ``tl.sum``, ...) is made of ``triton.jit``
functions that are only interpretable when created in that mode. A test process may have
imported triton already (transformers' Llama module does), and the compile tests need the
normal mode, so the interpreted cases run in a process of their own:

    python -m pallas_kernels.triton.check_cases --serve

reads one JSON request per line on stdin ({"op": "case" | "binding" | "tree_chain",
"spec": {...}}) and
writes one JSON result per line on stdout. ``run_case`` is also what the GPU check runs on
CUDA tensors.

8-bit cases (``kv_format``): the case's pool quantized here with numpy (fp8 with a scale
per (layer, KV head) chosen so the values use the format's upper range, not 1.0; int8 with
a scale per token-head; NaN slots stay NaN bytes / get NaN scales), the reference run on the
dequantized pool. The engine-side check, the kernel against the XLA reference on the
engine's own ``QuantizedPages``, is tests/triton_attention/test_triton_kv8.py.

A case: ``pallas_kernels.cases.make_case`` (pages in random order, NaN in every slot that
holds no token, garbage table tails), stacked into a pool of ``num_layers`` layers of
which only ``layer`` holds the case (the others are all NaN, so reading the wrong layer
shows), compared with ``pallas_kernels.reference`` on the same (dtype-rounded) inputs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import warnings
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_tokens: int
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    max_blocks: int = 4
    extra_blocks: int = 3  # pool blocks beyond those the case needs (garbage tails point here)
    num_layers: int = 2
    layer: int = 1
    dtype: str = "float16"
    sliding_window: int | None = None
    dynamic_window: bool = False  # pass the window as a run-time int32 scalar (0 if None)
    soft_cap: float | None = None
    num_splits: int | None = None
    # Table entries past each sequence's last page set to ids far outside the pool (huge and
    # negative), not just other blocks: a kernel that dereferenced one would fault or read
    # garbage. Off by default: some backends refuse such tables outright.
    wild_tail: bool = False
    kv_format: str | None = None  # 8-bit pools (configs.KV_FORMATS); None: spec.dtype
    block_m: int | None = None  # tile override (block_m, tile_n); None: the sm_80 table
    tile_n: int | None = None
    seed: int = 0
    # Draft trees (tree_mask): per sequence, the parents of its q_len nodes
    # (pallas_kernels.cases.tree_words) or None for plain causal rows; None: no mask.
    trees: tuple[tuple[int, ...] | None, ...] | None = None

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CaseSpec:
        d = dict(d)
        for k in ("q_lens", "kv_lens"):
            d[k] = tuple(d[k])
        if d.get("trees") is not None:
            d["trees"] = tuple(None if t is None else tuple(t) for t in d["trees"])
        return CaseSpec(**d)


def tree_mask(spec: CaseSpec) -> np.ndarray | None:
    """uint32[num_tokens] words of the case's trees (all bits for plain rows and padding),
    or None without trees."""
    if spec.trees is None:
        return None
    from pallas_kernels.cases import ALL_BITS, tree_words

    words = np.full(spec.num_tokens, ALL_BITS, np.uint32)
    start = 0
    for q_len, parents in zip(spec.q_lens, spec.trees, strict=True):
        if parents is not None:
            if len(parents) != q_len:
                raise ValueError(f"a tree of {len(parents)} nodes for {q_len} query rows")
            words[start : start + q_len] = tree_words(list(parents))
        start += q_len
    return words


def make_inputs(spec: CaseSpec) -> dict[str, np.ndarray]:
    """fp32 numpy inputs of a case; the pool is [L, N, Hkv, B, D], NaN outside ``layer``."""
    from pallas_kernels.cases import make_case

    need = sum(-(-n // spec.block_size) for n in spec.kv_lens)
    case = make_case(
        np.random.default_rng(spec.seed),
        q_lens=list(spec.q_lens), kv_lens=list(spec.kv_lens), num_tokens=spec.num_tokens,
        num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, block_size=spec.block_size, max_blocks=spec.max_blocks,
        num_blocks=need + spec.extra_blocks,
    )  # fmt: skip
    if spec.wild_tail:
        for row, n in zip(case.block_tables, spec.kv_lens, strict=True):
            first_unused = -(-n // spec.block_size)
            for j in range(first_unused, row.shape[0]):
                row[j] = 2**30 + j if j % 2 else -(j + 1)
    pool_shape = (spec.num_layers, *case.k_pages.shape)
    k_pool = np.full(pool_shape, np.nan, np.float32)
    v_pool = np.full(pool_shape, np.nan, np.float32)
    k_pool[spec.layer], v_pool[spec.layer] = case.k_pages, case.v_pages
    out = dict(
        q=case.q, k_pool=k_pool, v_pool=v_pool, block_tables=case.block_tables,
        kv_lens=case.kv_lens, cu_q_lens=case.cu_q_lens,
    )  # fmt: skip
    if spec.trees is not None:
        out["tree_mask"] = tree_mask(spec)
    if spec.kv_format is not None:
        for name in ("k", "v"):
            values, scale, dequantized = quantize_pool(out[f"{name}_pool"], spec.kv_format)
            out[f"{name}_pool"], out[f"{name}_scale"] = values, scale
            out[f"{name}_dequantized"] = dequantized
    return out


def quantize_pool(pool: np.ndarray, kv_format: str) -> tuple[np.ndarray, ...]:
    """(stored values, scales, dequantized float32 pool) of a float32 pool [L, N, Hkv, B, D]
    with NaN slots. fp8: uint8 bytes, scales float32[L, Hkv] = max |x| of that layer-head /
    (half the format's max) (1 for an all-NaN layer), so scaling is really exercised; NaN
    stays NaN. int8: round(x / s), s = max |x| / 127 per token-head, float32[L, N, Hkv, B,
    1]; a NaN slot gets values 0 and a NaN scale."""
    import ml_dtypes

    if kv_format == "int8":
        amax = np.max(np.abs(pool), axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)  # NaN stays NaN
        values = np.nan_to_num(np.clip(np.round(pool / scale), -127, 127)).astype(np.int8)
        return values, scale, values.astype(np.float32) * scale
    element = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}[kv_format]
    fmax = float(ml_dtypes.finfo(element).max)
    with warnings.catch_warnings():  # an all-NaN (poisoned) layer: amax NaN, scale 1
        warnings.simplefilter("ignore", RuntimeWarning)
        amax = np.nanmax(np.abs(pool), axis=(1, 3, 4))  # [L, Hkv]
    scale = np.where(np.isfinite(amax) & (amax > 0), amax / (fmax / 2), 1.0).astype(np.float32)
    per_elem = scale[:, None, :, None, None]
    stored = np.clip(pool / per_elem, -fmax, fmax).astype(element)
    return stored.view(np.uint8), scale, stored.astype(np.float32) * per_elem


def reference_output(spec: CaseSpec, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The jnp reference in fp32 on the layer's pages, inputs rounded to spec.dtype first."""
    import jax.numpy as jnp

    from pallas_kernels.reference import ragged_paged_attention_reference

    def rounded(a: np.ndarray) -> jnp.ndarray:
        return jnp.asarray(a).astype(spec.dtype).astype(jnp.float32)

    if spec.kv_format is None:
        k, v = rounded(inputs["k_pool"][spec.layer]), rounded(inputs["v_pool"][spec.layer])
    else:  # the dequantized values are what the pages mean, exactly
        k = jnp.asarray(inputs["k_dequantized"][spec.layer])
        v = jnp.asarray(inputs["v_dequantized"][spec.layer])
    out = ragged_paged_attention_reference(
        rounded(inputs["q"]), k, v, jnp.asarray(inputs["block_tables"]),
        jnp.asarray(inputs["kv_lens"]), jnp.asarray(inputs["cu_q_lens"]),
        sm_scale=spec.head_dim**-0.5, sliding_window=spec.sliding_window,
        soft_cap=spec.soft_cap, tree_mask=_tree_arg(inputs, jnp.asarray),
    )  # fmt: skip
    return np.asarray(out, np.float32)


def _tree_arg(inputs: dict[str, np.ndarray], convert: Any) -> Any:
    """The case's tree mask converted for a launcher (torch gets the int32 bits), or None."""
    words = inputs.get("tree_mask")
    return None if words is None else convert(words)


def compare(spec: CaseSpec, out: np.ndarray, ref: np.ndarray, **extra: Any) -> dict[str, Any]:
    """Metrics the tests assert on: NaN anywhere, largest |value| of padding tokens,
    relative Frobenius error and max abs error of the live tokens."""
    live = sum(spec.q_lens)
    o, r = out[:live], ref[:live]
    finite = bool(np.isfinite(out).all())
    return dict(
        finite=finite,
        padding_max_abs=float(np.abs(out[live:]).max()) if out.shape[0] > live else 0.0,
        rel_err=float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-12)) if finite else None,
        max_abs_err=float(np.abs(o - r).max()) if finite and live else 0.0,
        **extra,
    )


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def run_case(spec: CaseSpec, device: str = "cpu") -> dict[str, Any]:
    """The torch launcher on one case (interpreted on CPU, compiled on CUDA)."""
    import torch

    from pallas_kernels.triton import configs, torch_launch

    inputs = make_inputs(spec)
    dt = _torch_dtype(spec.dtype)
    # uint32 tree words travel as their int32 bits (what the kernel reads)
    t = {k: torch.from_numpy(v.view(np.int32) if v.dtype == np.uint32 else v).to(device)
         for k, v in inputs.items()}  # fmt: skip
    pools = t["k_pool"].to(dt), t["v_pool"].to(dt)
    quant: dict[str, Any] = {}
    if spec.kv_format is not None:
        pools = t["k_pool"], t["v_pool"]
        quant = dict(kv_format=spec.kv_format, k_scale=t["k_scale"], v_scale=t["v_scale"])
    tile = None
    if spec.block_m is not None:
        tile = configs.TileConfig(spec.block_m, spec.tile_n or 16, 4, 2)
    window: Any = spec.sliding_window
    if spec.dynamic_window:
        window = torch.tensor(spec.sliding_window or 0, dtype=torch.int32, device=device)
    out = torch_launch.paged_attention(
        t["q"].to(dt), *pools, spec.layer,
        t["block_tables"], t["kv_lens"], t["cu_q_lens"], sm_scale=spec.head_dim**-0.5,
        sliding_window=window, soft_cap=spec.soft_cap, num_splits=spec.num_splits,
        tile=tile, tree_mask=_tree_arg(inputs, lambda w: t["tree_mask"]),
        **quant,
    )  # fmt: skip
    plan = configs.plan_launch(
        num_tokens=spec.num_tokens, num_q_heads=spec.num_q_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, block_size=spec.block_size,
        num_seqs=len(spec.kv_lens), max_blocks=spec.max_blocks, dtype=spec.dtype,
        sm_scale=1.0, sliding_window=None if spec.dynamic_window else spec.sliding_window,
        soft_cap=spec.soft_cap, dynamic_window=spec.dynamic_window,
        num_splits=spec.num_splits, tile=tile, kv_format=spec.kv_format,
        tree=spec.trees is not None,
    )  # fmt: skip
    ref = reference_output(spec, inputs)
    return compare(spec, out.float().cpu().numpy(), ref, num_splits=plan.num_splits)


class FakeJaxTriton:
    """A stand-in for jax-triton's ``triton_call`` (0.3.x spelling): records each call and
    runs it the way jax-triton lays out a kernel call (array and scalar arguments in order,
    then one pointer per output; keyword metaparameters as constexprs; outputs in
    ``zeroed_outputs`` zero-filled, the others NaN-filled so an unwritten slot shows), in
    Triton's interpreter on CPU tensors.

    ``callback=False``: runs at once on concrete arrays (eager calls only).
    ``callback=True``: runs through ``jax.pure_callback``, so it also works under
    ``jax.jit`` and inside the model's layer loop (a ``fori_loop``) (traced layer and window)."""

    def __init__(self, callback: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.callback = callback

    def triton_call(
        self, *args: Any, kernel: Any, out_shape: Any, grid: Any, num_warps: Any = None,
        num_stages: Any = None, zeroed_outputs: Any = (), input_output_aliases: Any = None,
        **metaparams: Any,
    ) -> list[Any]:  # fmt: skip
        import jax
        import jax.numpy as jnp
        import torch

        from pallas_kernels.triton.torch_launch import interpreted

        outs_spec = list(out_shape)
        self.calls.append(dict(
            kernel=kernel.fn.__name__, grid=list(grid), num_warps=num_warps,
            num_stages=num_stages, zeroed_outputs=list(zeroed_outputs),
            array_shapes=[list(a.shape) for a in args if isinstance(a, jax.Array)],
            array_dtypes=[str(a.dtype) for a in args if isinstance(a, jax.Array)],
            scalars=[a for a in args if isinstance(a, int)],
            out_shapes=[list(s.shape) for s in outs_spec],
            constexprs={k: v for k, v in metaparams.items()},
        ))  # fmt: skip
        for a in args:
            if not isinstance(a, jax.Array | int):
                raise TypeError(f"jax-triton takes arrays and Python scalars, got {type(a)}")
        is_array = [isinstance(a, jax.Array) for a in args]

        def host(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
            it = iter(arrays)
            t_args = [torch.from_numpy(np.array(next(it))) if arr else a
                      for a, arr in zip(args, is_array, strict=True)]  # fmt: skip
            outs = []
            for i, s in enumerate(outs_spec):
                fill = 0 if i in zeroed_outputs else float("nan")
                dt = _torch_dtype(jnp.dtype(s.dtype).name)
                outs.append(torch.full(s.shape, fill, dtype=dt))
            interpreted(kernel)[tuple(grid)](*t_args, *outs, **metaparams)
            return tuple(o.numpy() for o in outs)

        arrays = [a for a, arr in zip(args, is_array, strict=True) if arr]
        if not self.callback:
            return [jnp.asarray(o) for o in host(*arrays)]
        shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in outs_spec)
        return list(jax.pure_callback(host, shapes, *arrays))


def run_binding_case(spec: CaseSpec) -> dict[str, Any]:
    """``jax_binding.triton_paged_attention`` on jax arrays with jax-triton replaced by the
    stand-in: checks what the binding hands jax-triton, and the numbers it gets back."""
    import jax.numpy as jnp

    fake = FakeJaxTriton()
    saved = sys.modules.get("jax_triton")
    sys.modules["jax_triton"] = fake  # type: ignore[assignment]
    try:
        from pallas_kernels.triton.jax_binding import triton_paged_attention

        inputs = make_inputs(spec)
        j = {k: jnp.asarray(v) for k, v in inputs.items()}
        window: Any = spec.sliding_window
        if spec.dynamic_window:
            window = jnp.int32(spec.sliding_window or 0)
        pools = j["k_pool"].astype(spec.dtype), j["v_pool"].astype(spec.dtype)
        quant: dict[str, Any] = {}
        if spec.kv_format is not None:
            pools = j["k_pool"], j["v_pool"]
            quant = dict(kv_format=spec.kv_format, k_scale=j["k_scale"], v_scale=j["v_scale"])
        out = triton_paged_attention(
            j["q"].astype(spec.dtype), *pools, jnp.int32(spec.layer), j["block_tables"],
            j["kv_lens"], j["cu_q_lens"], sm_scale=spec.head_dim**-0.5,
            sliding_window=window, soft_cap=spec.soft_cap, num_splits=spec.num_splits,
            tree_mask=j.get("tree_mask"), **quant,
        )  # fmt: skip
    finally:
        if saved is None:
            sys.modules.pop("jax_triton", None)
        else:
            sys.modules["jax_triton"] = saved
    ref = reference_output(spec, inputs)
    return compare(
        spec, np.asarray(out, np.float32), ref, calls=fake.calls,
        out_dtype=str(out.dtype), out_shape=list(out.shape),
    )  # fmt: skip


def run_tree_vs_chain(params: dict[str, Any]) -> dict[str, Any]:
    """The torch launcher (interpreted on CPU) on ``pallas_kernels.cases.tree_and_chain``:
    the accepted path of a tree verified with its mask against the same tokens verified
    as a causal chain without one. ``params``: prefix, parents, leaf, num_q_heads,
    num_kv_heads, head_dim, block_size, dtype, and optionally num_splits, block_m, tile_n,
    seed. Returns finite, rel_err of the path's rows, decode_equal (the row beside it)."""
    import torch

    from pallas_kernels.cases import tree_and_chain
    from pallas_kernels.triton import configs, torch_launch

    p = dict(params)
    dt = _torch_dtype(p["dtype"])
    tree, words, chain, path = tree_and_chain(
        np.random.default_rng(p.get("seed", 0)), prefix=p["prefix"], parents=list(p["parents"]),
        leaf=p["leaf"], num_q_heads=p["num_q_heads"], num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"], block_size=p["block_size"],
    )  # fmt: skip
    tile = None
    if p.get("block_m") is not None:
        tile = configs.TileConfig(p["block_m"], p.get("tile_n") or 16, 4, 2)

    def run(case: Any, mask: np.ndarray | None) -> np.ndarray:
        tm = None if mask is None else torch.from_numpy(mask.view(np.int32))
        out = torch_launch.paged_attention(
            torch.from_numpy(case.q).to(dt), torch.from_numpy(case.k_pages)[None].to(dt),
            torch.from_numpy(case.v_pages)[None].to(dt), 0,
            torch.from_numpy(case.block_tables), torch.from_numpy(case.kv_lens),
            torch.from_numpy(case.cu_q_lens), sm_scale=p["head_dim"] ** -0.5,
            num_splits=p.get("num_splits"), tile=tile, tree_mask=tm,
        )  # fmt: skip
        return out.float().numpy()

    got, want = run(tree, words), run(chain, None)
    a, b = got[path], want[: len(path)]
    return dict(
        finite=bool(np.isfinite(got).all()),
        rel_err=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)),
        decode_equal=bool(np.array_equal(got[-1], want[-1])),
    )


def serve() -> int:
    """The worker loop: one JSON request per stdin line, one JSON result per stdout line."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req["op"] == "tree_chain":  # its own parameters, not a CaseSpec
                result = {"ok": True, "result": run_tree_vs_chain(req["spec"])}
            else:
                spec = CaseSpec.from_dict(req["spec"])
                fn = {"case": run_case, "binding": run_binding_case}[req["op"]]
                result = {"ok": True, "result": fn(spec)}
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if "--serve" not in sys.argv[1:]:
        sys.exit("usage: python -m pallas_kernels.triton.check_cases --serve")
    if "triton" in sys.modules:
        sys.exit("triton was imported before TRITON_INTERPRET could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(serve())
