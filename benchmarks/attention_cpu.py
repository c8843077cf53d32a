"""Times ragged paged attention on the CPU on batch shapes the engine runs: one layer of the
58M-parameter Llama of throughput_vs_hf.py (8 heads of 64, fp32, 16-token pages, 512-token
tables). Columns: the XLA version (pagedjax.attention, the oracle) and the native kernel
(pagedjax.attention.native_cpu, the engine's default on CPU), with their largest difference.

    python benchmarks/attention_cpu.py [--reps 3] [--ref FILE] [--only N]

``--ref FILE`` also times another implementation of the same function (e.g. an older
``pagedjax/attention/reference.py`` from git: ``git show REV:pagedjax/attention/reference.py
> /tmp/old.py``) and prints its time and largest difference beside ours. The last line is
``ms_decode_256: X``: the native kernel (or, where it does not build, the XLA version) on
the 256-sequence decode with contexts ~U(20, 500).

``--kv-dtypes fp8_e4m3,fp8_e5m2,int8_per_token_head`` adds a table of the same batches over
an 8-bit pool (pagedjax.attention.kv_quant; the fp32 pool quantized, stacked as one layer):
time per KV dtype and its ratio to the fp32 pool, for the native kernel (or the XLA version
where it does not build).

``--tree`` adds a table of the native kernel's cost of draft-tree masks (``tree_mask``,
docs/attention.md "Tree masks"): per batch, no mask, an all-bits mask (causal: one word
read per row and page) and, on verification batches of 16-node trees, a random tree's mask.
``--old-kernel REV`` also builds ``cpu_kernel.cc`` as of git REV (before or after tree masks)
and times its fp32 no-mask path beside today's, in the same process.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import native_build
from pagedjax.attention import kv_quant, native_cpu, ragged_paged_attention
from pagedjax.machine import cpu_model

HEADS, HEAD_DIM, BLOCK, MAX_BLOCKS, NUM_BLOCKS = 8, 64, 16, 32, 4096


def case(rng, num_seqs: int, num_tokens: int, q_lens: list[int], kv_lens: list[int]) -> tuple:
    """One batch: queries, a random pool, block tables pointing the null block past kv_len."""
    q = jnp.asarray(rng.standard_normal((num_tokens, HEADS, HEAD_DIM)), jnp.float32)
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    kv = np.zeros(num_seqs, np.int32)
    kv[: len(kv_lens)] = kv_lens
    bt = rng.integers(1, NUM_BLOCKS, (num_seqs, MAX_BLOCKS)).astype(np.int32)
    bt = np.where(np.arange(MAX_BLOCKS)[None, :] * BLOCK < kv[:, None], bt, 0)
    return q, jnp.asarray(bt), jnp.asarray(kv), jnp.asarray(cu)


def quantized_pool(pages: jax.Array, name: str) -> kv_quant.QuantizedPages:
    """The fp32 pages [NB, H, B, D] as an 8-bit stacked pool [1, NB, H, B, D] (fp8 scale 1)."""
    fmt = kv_quant.resolve_kv_format(name)
    if fmt.per_token:
        values, scale = kv_quant.quantize(pages[None], fmt)
        return kv_quant.QuantizedPages(values, scale, fmt)
    values, _ = kv_quant.quantize(pages[None], fmt, jnp.ones((HEADS, 1, 1)))
    return kv_quant.QuantizedPages(values, None, fmt, kv_quant.default_layer_scale(1, HEADS))


def timed(fn, args, reps: int, **kwargs) -> tuple[float, jax.Array]:
    f = jax.jit(lambda *a: fn(*a, sm_scale=HEAD_DIM**-0.5, **kwargs))
    out = f(*args).block_until_ready()  # compile
    t0 = time.perf_counter()
    for _ in range(reps):
        f(*args).block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e3, out


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ref", default=None, help="another reference.py to time beside ours")
    ap.add_argument("--only", type=int, default=None, help="time only the first N batches")
    ap.add_argument(
        "--kv-dtypes", default="", help="comma-separated 8-bit KV dtypes to time (ratio to fp32)"
    )
    ap.add_argument("--tree", action="store_true", help="time tree masks in the native kernel")
    ap.add_argument("--old-kernel", default=None, help="with --tree: git REV of cpu_kernel.cc")
    a = ap.parse_args(argv)
    other = None
    if a.ref and not os.path.isfile(a.ref):
        ap.error(f"--ref {a.ref}: no such file (e.g. git show REV:pagedjax/attention/reference.py)")
    if a.ref:
        spec = importlib.util.spec_from_file_location("other_reference", a.ref)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    rng = np.random.default_rng(0)
    shape = (NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    ctx = rng.integers(20, 500, 200)
    cases = {
        "decode 256 seqs, ctx ~U(20,500)": case(rng, 256, 256, [1] * 200, ctx),
        "decode 256 seqs, ctx 160": case(rng, 256, 256, [1] * 256, [160] * 256),
        "decode 16 seqs, ctx ~U(20,500)": case(rng, 16, 16, [1] * 12, rng.integers(20, 500, 12)),
        "prefill 2 x 200 (T=512, S=4)": case(rng, 4, 512, [200, 200], [200, 200]),
        "mixed 1 x 300 + 50 decodes (T=512, S=64)": case(
            rng, 64, 512, [300] + [1] * 50, [300, *rng.integers(20, 500, 50)]
        ),
    }  # fmt: skip
    geometry = f"{HEADS} x {HEAD_DIM} heads, fp32, pages of {BLOCK}, tables of {MAX_BLOCKS}"
    native, why = native_cpu.available()
    print(f"jax {jax.__version__}, {jax.default_backend()}, {cpu_model()}; one layer: {geometry}")
    print(f"native kernel: {why}")
    head = f"{'batch':>42} | {'XLA ms':>7}"
    if native:
        head += f" | {'native ms':>9} | {'XLA/native':>10} | {'max |diff|':>10}"
    print(head + (f" | {'--ref ms':>8} | {'max |diff|':>10}" if other else ""))
    first = None
    for name, (q, bt, kv, cu) in list(cases.items())[: a.only]:
        args = (q, k_pages, v_pages, bt, kv, cu)
        ms, out = timed(ragged_paged_attention, args, a.reps)
        line = f"{name:>42} | {ms:>7.1f}"
        headline = ms
        if native:
            ms_n, out_n = timed(native_cpu.ragged_paged_attention, args, a.reps)
            diff = float(jnp.max(jnp.abs(out - out_n)))
            line += f" | {ms_n:>9.1f} | {ms / ms_n:>10.2f} | {diff:>10.2e}"
            headline = ms_n
        first = headline if first is None else first
        if other:
            ms_o, out_o = timed(other.ragged_paged_attention, args, a.reps)
            line += f" | {ms_o:>8.1f} | {float(jnp.max(jnp.abs(out - out_o))):>10.2e}"
        print(line, flush=True)
    if a.kv_dtypes:
        kv_dtype_table(cases, k_pages, v_pages, a.kv_dtypes.split(","), a.reps, a.only, native)
    if a.tree and native:
        tree_table(rng, cases, k_pages, v_pages, a.reps, a.only, a.old_kernel)
    print(f"ms_decode_256: {first:.1f}")
    return first


def kv_dtype_table(cases, k_pages, v_pages, names, reps: int, only, native: bool) -> None:
    """Per batch: the fp32 pool's time and each 8-bit dtype's time / ratio (one layer)."""
    fn = native_cpu.ragged_paged_attention if native else ragged_paged_attention
    pools = {"float32": (k_pages[None], v_pages[None])}
    for name in names:
        pools[name] = (quantized_pool(k_pages, name), quantized_pool(v_pages, name))
    print(f"\nper KV dtype ({'native kernel' if native else 'XLA version'}), ms and x fp32:")
    print(f"{'batch':>42} | " + " | ".join(f"{n:>26}" for n in pools))
    for name, (q, bt, kv, cu) in list(cases.items())[:only]:
        times = {}
        for dt, (kp, vp) in pools.items():
            times[dt], _ = timed(fn, (q, kp, vp, bt, kv, cu), reps, layer=jnp.int32(0))
        base = times["float32"]
        cells = [f"{t:>17.1f} ({t / base:>5.2f}x)" for t in times.values()]
        print(f"{name:>42} | " + " | ".join(cells), flush=True)


def old_kernel(rev: str):
    """The fp32 handler of cpu_kernel.cc as of git ``rev``, as an attention callable."""

    def show(path: str) -> str | None:
        done = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    root = Path(tempfile.mkdtemp())
    tmp = root / "attention" / "cpu_kernel_old.cc"  # its "../native_pool.h" beside it
    tmp.parent.mkdir()
    source = show("pagedjax/attention/cpu_kernel.cc")
    if source is None:
        raise SystemExit(f"--old-kernel {rev}: git has no pagedjax/attention/cpu_kernel.cc there")
    tmp.write_text(source)
    tree = (jnp.zeros((0,), jnp.uint32),) if "tree_mask" in source else ()  # its operands
    pool_header = show("pagedjax/native_pool.h")  # absent before the kernels shared it
    if pool_header is not None:
        (root / "native_pool.h").write_text(pool_header)
    target = "pagedjax_ragged_paged_attention_old"
    ok, why = native_build.register_ffi_library(tmp, {target: native_cpu.SYMBOL}, (), "old")
    if not ok:
        raise RuntimeError(why)

    def attend(q, k, v, bt, kv, cu, *, sm_scale, layer=None):
        """One layer's pages [NB, H, B, D], or with ``layer`` a stacked pool's layer."""
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
        if layer is None:
            k, v, layer = k[None], v[None], jnp.int32(0)
        return call(q, k, v, bt, kv, cu, jnp.asarray(layer, jnp.int32), jnp.int32(0), *tree,
                    sm_scale=np.float32(sm_scale), soft_cap=np.float32(0.0))  # fmt: skip

    return attend


def random_tree_words(rng, n: int) -> np.ndarray:
    """uint32 words of a random n-node tree (parents first; pallas_kernels.reference)."""
    words = []
    parents = [-1] + [int(rng.integers(-1, j)) for j in range(1, n)]
    for j in range(n):
        w, a = (0xFFFFFFFF << (j + 1)) & 0xFFFFFFFF, j
        while a >= 0:
            w |= 1 << (j - a)
            a = parents[a]
        words.append(w)
    return np.asarray(words, np.uint32)


def tree_table(rng, cases, k_pages, v_pages, reps: int, only, old_rev: str | None) -> None:
    """Native kernel, ms: no mask, all bits, a tree mask (verification batches), the old
    kernel. Variants alternate within each of 5 rounds (the box is shared); medians."""
    ctx = rng.integers(20, 480, 64)  # + 16 rows within the 512-token tables
    verify = {
        f"verify {n} seqs x 16-node trees (T={16 * n})": case(
            rng, n, 16 * n, [16] * n, ctx[:n] + 16
        )
        for n in (1, 16, 64)
    }
    old = old_kernel(old_rev) if old_rev else None
    print("\ntree masks (native kernel), ms, medians of 5 alternating rounds:")
    cols = ["no mask", "all bits", "tree"] + ([f"{old_rev} kernel"] if old else [])
    print(f"{'batch':>42} | " + " | ".join(f"{c:>14}" for c in cols))
    attend, scale = native_cpu.ragged_paged_attention, HEAD_DIM**-0.5
    plain = jax.jit(lambda *a: attend(*a, sm_scale=scale))
    masked = jax.jit(lambda *a: attend(*a[:6], sm_scale=scale, tree_mask=a[6]))
    old_fn = jax.jit(lambda *a: old(*a, sm_scale=scale)) if old else None
    for name, (q, bt, kv, cu) in [*list(cases.items())[:only], *verify.items()]:
        args = (q, k_pages, v_pages, bt, kv, cu)
        ones = jnp.full(q.shape[:1], 0xFFFFFFFF, jnp.uint32)
        variants = {"no mask": (plain, args), "all bits": (masked, (*args, ones))}
        if name in verify:  # every sequence a 16-node tree
            words = [random_tree_words(rng, 16) for _ in range(q.shape[0] // 16)]
            variants["tree"] = (masked, (*args, jnp.asarray(np.concatenate(words))))
        if old:
            variants["old"] = (old_fn, args)
        outs = {k: f(*x).block_until_ready() for k, (f, x) in variants.items()}  # compile
        assert bool(jnp.all(outs["no mask"] == outs["all bits"])), "all bits must equal no mask"
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(5):
            for k, (f, x) in variants.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    f(*x).block_until_ready()
                times[k].append((time.perf_counter() - t0) / reps * 1e3)
        med = {k: float(np.median(v)) for k, v in times.items()}
        cells = [med["no mask"], med["all bits"], med.get("tree", float("nan"))]
        if old:
            cells.append(med["old"])
        print(f"{name:>42} | " + " | ".join(f"{c:>14.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
