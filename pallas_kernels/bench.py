"""Benchmark of the paged attention kernels (for an H200 run; --interpret --tiny on CPU).

    python -m pallas_kernels.bench                 # GPU: all shapes, report under docs/
    python -m pallas_kernels.bench --interpret --tiny --out /tmp/b.md   # CPU smoke run

Order: (1) parity of every kernel against the reference on a reduced, NaN-poisoned case of
each shape (a failure stops the run: timing a wrong kernel is pointless); (2) the device's
copy bandwidth (bytes read + written per second of a large device-to-device copy); (3) per
shape, under its own timeout, the median time of the kernel and, side by side, of the XLA
reference, JAX's deprecated Triton-backend paged_attention (decode, where it runs), the
same kernel over an identity block table, and dense contiguous attention. Each row is
printed as it finishes; a markdown table is written at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cases import make_case
from pallas_kernels.paged_attention import (
    default_interpret,
    paged_decode_attention,
    ragged_paged_attention,
)
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "decode" or "prefill"
    batch: int
    context: int  # kv_len of every sequence
    q_len: int = 1
    num_q_heads: int = 32  # Llama-3-8B
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


SHAPES = [
    Shape("decode b1 32k", "decode", 1, 32768),
    Shape("decode b16 8k", "decode", 16, 8192),
    Shape("decode b16 32k", "decode", 16, 32768),
    Shape("decode b64 4k", "decode", 64, 4096),
    Shape("decode b64 16k", "decode", 64, 16384),
    Shape("decode b256 1k", "decode", 256, 1024),
    Shape("prefill b1 4k", "prefill", 1, 4096, q_len=4096),
    Shape("chunked prefill b4 512/8k", "prefill", 4, 8192, q_len=512),
]
TINY = [
    Shape("tiny decode", "decode", 2, 40, num_q_heads=4, num_kv_heads=2, head_dim=64),
    Shape("tiny prefill", "prefill", 1, 24, q_len=8, num_q_heads=4, num_kv_heads=2, head_dim=64),
]


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def handler(signum, frame):
        raise TimeoutError(f"over {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def bench(fn: Callable[[], jax.Array], warmup: int, iters: int) -> float:
    """Median seconds of fn() after warm-up, each run synchronised."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, warmup: int, iters: int) -> float:
    """Bytes read + written per second of a device-to-device elementwise copy."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)  # +1 so XLA cannot elide the copy
    return 2 * x.nbytes / bench(lambda: f(x), warmup, iters)


def _inputs(shape: Shape, key: jax.Array, dtype=jnp.bfloat16):
    """Full-size inputs: contiguous-per-sequence pages in a random block order."""
    pages_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * pages_per_seq + 1
    kq, kk, kv, kp = jax.random.split(key, 4)
    pshape = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
    k_pages = jax.random.normal(kk, pshape, dtype)
    v_pages = jax.random.normal(kv, pshape, dtype)
    perm = jax.random.permutation(kp, jnp.arange(1, num_blocks, dtype=jnp.int32))
    tables = perm.reshape(shape.batch, pages_per_seq)
    identity = jnp.arange(1, num_blocks, dtype=jnp.int32).reshape(shape.batch, pages_per_seq)
    kv_lens = jnp.full((shape.batch,), shape.context, jnp.int32)
    t = shape.batch * shape.q_len
    q = jax.random.normal(kq, (t, shape.num_q_heads, shape.head_dim), dtype)
    cu = jnp.arange(shape.batch + 1, dtype=jnp.int32) * shape.q_len
    return q, k_pages, v_pages, tables, identity, kv_lens, cu


def _kernel_fn(shape: Shape, interpret):
    sm = shape.head_dim**-0.5
    if shape.kind == "decode":
        return lambda q, k, v, bt, kl, cu: paged_decode_attention(
            q, k, v, bt, kl, sm_scale=sm, interpret=interpret
        )
    return lambda q, k, v, bt, kl, cu: ragged_paged_attention(
        q, k, v, bt, kl, cu, sm_scale=sm, interpret=interpret
    )


def _reference_fn(shape: Shape):
    sm = shape.head_dim**-0.5
    if shape.kind == "decode":
        f = functools.partial(paged_decode_attention_reference, sm_scale=sm)
        return jax.jit(lambda q, k, v, bt, kl, cu: f(q, k, v, bt, kl))
    return jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm))


def parity(shape: Shape, interpret, seed: int = 0) -> float:
    """Relative error of the kernel against the reference on a reduced, poisoned case."""
    rng = np.random.default_rng(seed)
    # Capped so the dense-gather reference ([T, Hkv, ctx, D] fp32) stays ~2 GB.
    context = min(shape.context, 64 if interpret else 1024)
    batch = min(shape.batch, 2 if interpret else 4)
    q_len = min(shape.q_len, context, 128)
    bs = shape.block_size
    pages = -(-context // bs)
    kv_lens = [context - i * (bs // 2 + 1) for i in range(batch)]  # ragged, off-block
    case = make_case(
        rng,
        q_lens=[q_len] * batch,
        kv_lens=kv_lens,
        num_tokens=q_len * batch,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=bs,
        max_blocks=pages,
        num_blocks=batch * pages + 2,
    )
    args = [jnp.asarray(a, jnp.bfloat16) for a in (case.q, case.k_pages, case.v_pages)]
    args += [jnp.asarray(case.block_tables), jnp.asarray(case.kv_lens), jnp.asarray(case.cu_q_lens)]
    out = np.asarray(_kernel_fn(shape, interpret)(*args), np.float32)
    ref = np.asarray(_reference_fn(shape)(*args), np.float32)
    if np.isnan(out).any():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _triton_fn(shape: Shape):
    from jax.experimental.pallas.ops.gpu import paged_attention as triton_pa

    def f(q, k, v, bt, kl, cu):
        # Its page layout is [Hkv, N, B, D]; the transpose is done outside the timing.
        return triton_pa.paged_attention(q, k, v, bt, kl)

    return jax.jit(f)


def _dense_fn(shape: Shape):
    """Dense contiguous-cache attention on [batch, context, H, D] (no paging at all)."""

    def f(q, k, v, kl):
        q4 = q.reshape(shape.batch, shape.q_len, shape.num_q_heads, shape.head_dim)
        o = jax.nn.dot_product_attention(
            q4, k, v, is_causal=shape.kind == "prefill" and shape.q_len == shape.context,
            query_seq_lengths=None, key_value_seq_lengths=kl,
        )  # fmt: skip
        return o.reshape(q.shape)

    return jax.jit(f)


def run_shape(shape: Shape, copy_bw: float, interpret, warmup: int, iters: int) -> dict:
    q, k, v, tables, identity, kv_lens, cu = _inputs(shape, jax.random.key(1))
    args = (q, k, v, tables, kv_lens, cu)
    kernel = jax.jit(_kernel_fn(shape, interpret))
    t_kernel = bench(lambda: kernel(*args), warmup, iters)
    row = {"shape": shape.name, "time_ms": 1e3 * t_kernel}
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * 2
    row["kv_bw_frac"] = kv_bytes / t_kernel / copy_bw
    if shape.kind == "prefill":
        # causal: query i sees context - q_len + i + 1 keys
        seen = shape.q_len * (shape.context - shape.q_len) + shape.q_len * (shape.q_len + 1) / 2
        flops = 4 * shape.batch * seen * shape.num_q_heads * shape.head_dim
        row["tflops"] = flops / t_kernel / 1e12

    def ratio(name: str, make: Callable[[], Callable[[], jax.Array]]) -> None:
        try:
            row[name] = bench(make(), warmup, iters) / t_kernel
        except Exception as e:  # a baseline that does not run here is reported, not fatal
            row[name] = f"n/a ({type(e).__name__})"

    ref = _reference_fn(shape)
    ratio("vs_reference", lambda: lambda: ref(*args))
    if shape.kind == "decode" and not interpret:
        tri = _triton_fn(shape)
        kt, vt = k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3)
        ratio("vs_triton", lambda: lambda: tri(q, kt, vt, tables, kv_lens, cu))
    else:
        row["vs_triton"] = "n/a"
    ratio("vs_identity_table", lambda: lambda: kernel(q, k, v, identity, kv_lens, cu))

    def dense():
        kd = k[1:].reshape(shape.batch, -1, *k.shape[1:]).transpose(0, 1, 3, 2, 4)
        kd = kd.reshape(shape.batch, -1, shape.num_kv_heads, shape.head_dim)
        vd = v[1:].reshape(shape.batch, -1, *v.shape[1:]).transpose(0, 1, 3, 2, 4)
        vd = vd.reshape(shape.batch, -1, shape.num_kv_heads, shape.head_dim)
        f = _dense_fn(shape)
        return lambda: f(q, kd, vd, kv_lens)

    ratio("vs_dense", dense)
    return row


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


COLUMNS = ["shape", "time_ms", "kv_bw_frac", "tflops", "vs_reference", "vs_triton",
           "vs_identity_table", "vs_dense"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interpret", action="store_true", help="GPU interpreter on CPU")
    p.add_argument("--tiny", action="store_true", help="two tiny shapes (CPU smoke test)")
    p.add_argument("--out", type=Path, default=None, help="markdown report path")
    p.add_argument("--timeout", type=int, default=300, help="seconds per shape")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--only", default=None, help="run only shapes whose name contains this")
    args = p.parse_args(argv)
    interpret = default_interpret() if args.interpret else None
    shapes = TINY if args.tiny else SHAPES
    shapes = [s for s in shapes if args.only is None or args.only in s.name]
    if not shapes:
        p.error(f"no shape matches --only {args.only!r}")
    warmup, iters = (1, args.iters or 1) if args.interpret else (3, args.iters or 20)
    date = datetime.date.today().isoformat()
    device = jax.devices()[0]
    out = args.out or Path(__file__).resolve().parent.parent / "docs" / f"kernel_bench_{date}.md"

    print("parity (relative error vs reference, reduced poisoned case):", flush=True)
    errors = {}
    for shape in shapes:
        errors[shape.name] = parity(shape, interpret)
        print(f"  {shape.name}: {errors[shape.name]:.2e}", flush=True)
    if not all(e < 2e-2 for e in errors.values()):  # NaN fails too
        print("PARITY FAILED: not timing.")
        return 1

    copy_bw = copy_bandwidth(1 << (20 if args.tiny else 30), warmup, iters)
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.1f} GB/s", flush=True)
    print(" | ".join(COLUMNS), flush=True)
    rows = []
    for shape in shapes:
        try:
            with time_limit(args.timeout):
                row = run_shape(shape, copy_bw, interpret, warmup, iters)
        except Exception as e:
            row = {"shape": shape.name, "time_ms": f"failed ({type(e).__name__}: {e})"[:120]}
        rows.append(row)
        print(" | ".join(_fmt(row.get(c, "")) for c in COLUMNS), flush=True)

    lines = [
        f"# Paged attention kernel benchmark, {date}",
        "",
        f"- device: {device.device_kind} ({device.platform}), jax {jax.__version__}"
        + (", GPU interpreter on CPU (timings meaningless)" if args.interpret else ""),
        f"- copy bandwidth (read + write): {copy_bw / 1e9:.1f} GB/s",
        "- parity (relative error vs reference): "
        + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
        "- kv_bw_frac: K/V bytes read per second / copy bandwidth; vs_*: baseline time /"
        " kernel time (> 1: the kernel is faster); tflops: prefill only",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
