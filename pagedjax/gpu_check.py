"""One GPU check of the paged attention kernels and the engine, writing one dated report.

    python -m pagedjax.gpu_check --group kernels          # one CUDA GPU, < 10 minutes
    python -m pagedjax.gpu_check --group engine           # the 7B engine, < 10 minutes
    python -m pagedjax.gpu_check                          # both (about 20 minutes)
    python -m pagedjax.gpu_check --dry-run --out r.md     # CPU, every part tiny

Parts, each in its own process under its own timeout (a hung compile or kernel loses that
part only; the output printed before a timeout is kept):

1. environment: versions (jax, jaxlib, triton and its ptxas, jax-triton, torch), device.
2. parity (three parts: the XLA reference with the Mosaic GPU kernels on Hopper; Triton
   through jax-triton; Triton through torch where torch has CUDA): every backend against
   the dense-gather reference on NaN-poisoned cases in bf16 and fp16.
3. kernel bench: decode and prefill shapes (Llama-3-8B heads); time of both kernel
   families, JAX's own Pallas paged-attention op, the XLA reference and dense attention;
   K/V bytes per second as a share of a measured device copy.
4. engine roofline: ``pagedjax/tools/host_overhead.py`` (decode-step device time over
   weights + KV bytes at the copy bandwidth, host overhead share) on a Llama-2-7B-shaped
   bf16 model.
5. end to end (one part per attention backend): ``pagedjax/tools/offline_throughput.py``,
   generated tokens per second of ``LLM.generate`` on the same model.

The report (``docs/gpu_check_<date>.md`` unless ``--out``) sets nothing "verified": a
person reads it, then commits ``parity.H200_PARITY_VERIFIED`` / ``parity.TRITON_PARITY_REPORTS``.

``--dry-run`` runs every part at a tiny size on the CPU: Triton kernels in Triton's
interpreter (jax-triton replaced by a stand-in that runs the call interpreted), Mosaic GPU
kernels in the Pallas GPU interpreter, the engine parts on tiny-llama. It tests the
script, not the kernels' speed. This module imports nothing from ``pagedjax``: the engine
parts are separate processes (``python -m pagedjax.tools.*``, so the check runs from an
installed wheel as from the repository), and the XLA reference comes through ``dispatch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # the repository, or site-packages in a wheel
IN_REPO = (REPO / "pyproject.toml").is_file()
RESULT = "GPU_CHECK_RESULT "  # prefix of a part's one machine-readable line


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    title: str
    argv: list[str]
    timeout_s: int
    interpret: bool = False  # child gets TRITON_INTERPRET=1 (dry run)
    fenced: bool = False  # output is plain text, not markdown


def _triton_jax_available() -> bool:
    return importlib.util.find_spec("jax_triton") is not None


def _is_hopper() -> bool:
    import jax

    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


# The parts of each group; the two groups fit the device tool's 10-minute command each
# (``--group``). A part is one process, so a hang or a slow compile loses that part only.
GROUPS = {
    "kernels": ["environment", "parity-mosaic", "parity-triton-jax", "parity-triton-torch",
                "bench"],
    "engine": ["environment", "roofline", "e2e-triton", "e2e-reference", "e2e-pallas"],
}  # fmt: skip


def plan_parts(dry_run: bool, on_gpu: bool, hopper: bool) -> list[Part]:
    """Every part this host runs, in order. Timeouts on a GPU: the parity parts took 71,
    50 and 51 s, the bench 81 s, an e2e backend 54 s on the first H200 run (2026-12-04,
    docs/gpu_check_2026-12-04.md); each gets 1.7-2.4x that, the roofline (which did not
    finish in 100 s there) 200 s, so each group stays under 600 s."""
    py = sys.executable
    me = [py, "-m", "pagedjax.gpu_check"]
    dry = ["--dry-run"] if dry_run else []
    triton_jax = on_gpu and _triton_jax_available()
    if dry_run:
        roofline = [py, "-m", "pagedjax.tools.host_overhead", "--model", "tiny-llama", "--num-seqs",
                    "2", "--prompt-len", "8", "--output-len", "4", "--ks", "1",
                    "--device-k", "2", "--repeats", "1", "--copy-mib", "8"]  # fmt: skip
        e2e_model = ["--tiny"]
        backends = ["auto"]
    else:
        roofline = [py, "-m", "pagedjax.tools.host_overhead", "--model", "llama-2-7b", "--dtype",
                    "bfloat16", "--num-seqs", "256", "--prompt-len", "128", "--output-len",
                    "64", "--ks", "1", "8", "--device-k", "32", "--repeats", "1",
                    "--attention-backend", "triton" if triton_jax else "auto"]  # fmt: skip
        e2e_model = ["--model", "llama-2-7b", "--dtype", "bfloat16", "--num-requests", "256",
                     "--prompt-len", "128", "--output-len", "128"]  # fmt: skip
        backends = (
            (["triton"] if triton_jax else []) + ["reference"] + (["pallas"] if hopper else [])
        )
    t = (dict(environment=300, parity=300, bench=300, roofline=300, e2e=300) if dry_run
         else dict(environment=40, parity=120, bench=160, roofline=200, e2e=110))  # fmt: skip
    parity_kinds = {"mosaic": "reference mosaic", "triton-jax": "triton-jax",
                    "triton-torch": "triton-torch"}  # fmt: skip
    if not (dry_run or triton_jax):
        del parity_kinds["triton-jax"]
    parts = [Part("environment", "Environment", [*me, "--part", "environment", *dry],
                  t["environment"])]  # fmt: skip
    for kind, names in parity_kinds.items():
        title = f"Parity against the reference: {names}"
        parts.append(Part(f"parity-{kind}", title,
                          [*me, "--part", "parity", "--backends", *names.split(), *dry],
                          t["parity"], interpret=dry_run))  # fmt: skip
    parts += [
        Part("bench", "Kernel bench", [*me, "--part", "bench", *dry], t["bench"],
             interpret=dry_run),
        Part("roofline", "Engine decode step: roofline (pagedjax.tools.host_overhead)",
             roofline, t["roofline"], fenced=True),
    ]  # fmt: skip
    for b in backends:
        parts.append(Part(f"e2e-{b}", f"End to end, {b}: offline throughput"
                          " (pagedjax.tools.offline_throughput)",
                          [py, "-m", "pagedjax.tools.offline_throughput", *e2e_model,
                           "--backends", b], t["e2e"], fenced=True))  # fmt: skip
    return parts


def _child_env(interpret: bool) -> dict[str, str]:
    env = dict(os.environ)
    if IN_REPO:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_part(part: Part) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            part.argv, capture_output=True, text=True, cwd=REPO if IN_REPO else None,
            env=_child_env(part.interpret),
            timeout=part.timeout_s,
        )  # fmt: skip
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timed out after {part.timeout_s} s"

        def text(b: Any) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        out, err = text(e.stdout), text(e.stderr)
    seconds = time.perf_counter() - t0
    lines = out.splitlines()
    results = [json.loads(line[len(RESULT) :]) for line in lines if line.startswith(RESULT)]
    shown = "\n".join(line for line in lines if not line.startswith(RESULT))
    return dict(status=status, seconds=seconds, out=shown, err=err, results=results)


def _summary(part: Part, r: dict[str, Any]) -> str:
    """The key numbers of a part for the summary table."""
    if r["results"]:
        return r["results"][-1].get("summary", "")
    keys = ("device time / roofline", "host overhead at", "offline_throughput_tok_s")
    lines = [line.strip() for line in r["out"].splitlines() if any(k in line for k in keys)]
    short = []
    for line in lines:
        if "device time / roofline" in line:
            short.append("roofline ratio " + line.rsplit(":", 1)[1].strip())
        else:
            short.append(line)
    return "; ".join(short)[:300]


def _git_commit() -> str:
    if not IN_REPO:
        return "unknown (an installed package)"
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=REPO, timeout=10)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=REPO, timeout=10)  # fmt: skip
        if out.returncode != 0 or not out.stdout.strip():
            return "unknown (not a git checkout)"
        return out.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_report(
    path: Path, parts: list[Part], results: list[dict[str, Any]], dry_run: bool, argv: list[str]
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    lines = [
        f"# GPU check, {now:%Y-%m-%d %H:%M} UTC" + (" (DRY RUN on CPU)" if dry_run else ""),
        "",
        f"Command: `python -m pagedjax.gpu_check {' '.join(argv)}`".rstrip()
        + f" at commit {_git_commit()}.",
        "",
        "This report sets nothing verified. After reading it, a person may commit"
        " `pallas_kernels/parity.py`: `H200_PARITY_VERIFIED = True` (Mosaic GPU kernels, on an"
        " H200 with every parity row passing), `H200_TREE_PARITY_VERIFIED = True` (their"
        " `trees` rows passing too) or an entry in `TRITON_PARITY_REPORTS` for this"
        " GPU model (Triton kernels).",
        "",
    ]
    if dry_run:
        lines += [
            "**Dry run**: tiny sizes on the CPU, kernels in the interpreters; timings and"
            " bandwidth shares mean nothing.",
            "",
        ]
    lines += ["| part | status | seconds | key numbers |", "|---|---|---|---|"]
    for p, r in zip(parts, results, strict=True):
        key = _summary(p, r).replace("|", "/")
        lines.append(f"| {p.name} | {r['status']} | {r['seconds']:.0f} | {key} |")
    for p, r in zip(parts, results, strict=True):
        command = " ".join("python" if a == sys.executable else a for a in p.argv)
        lines += ["", f"## {p.title}", "", f"Status: {r['status']}, {r['seconds']:.0f} s"
                  f" (timeout {p.timeout_s} s). Command: `{command}`", ""]  # fmt: skip
        body = r["out"].strip() or "(no output)"
        lines += ["```text", body, "```"] if p.fenced else [body]
        if r["status"] != "ok" and r["err"].strip():
            tail = "\n".join(r["err"].strip().splitlines()[-25:])
            lines += ["", "stderr (last lines):", "", "```text", tail, "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------
# Parts run in child processes.


def _emit(result: dict[str, Any]) -> None:
    print(RESULT + json.dumps(result), flush=True)


def part_environment(dry_run: bool) -> int:
    import platform

    import jax

    rows = [("python", platform.python_version()), ("jax", jax.__version__)]
    try:
        import jaxlib

        rows.append(("jaxlib", jaxlib.__version__))
    except ImportError:
        pass
    for mod in ("triton", "jax_triton", "torch"):
        try:
            from importlib.metadata import version

            dist = {"jax_triton": "jax-triton"}.get(mod, mod)
            rows.append((mod, version(dist)))
        except Exception as e:
            rows.append((mod, f"not installed ({type(e).__name__})"))
    try:
        import triton

        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if ptxas.exists():
            v = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True)
            rows.append(("ptxas (triton wheel)", v.stdout.strip().splitlines()[-1]))
    except Exception as e:
        rows.append(("ptxas", f"n/a ({type(e).__name__})"))
    try:
        import torch

        rows.append(("torch CUDA", str(torch.cuda.is_available())))
    except ImportError:
        pass
    d = jax.devices()[0]
    rows += [
        ("device", f"{d.device_kind} ({d.platform}), {len(jax.devices())} device(s)"),
        ("compute capability", str(getattr(d, "compute_capability", "n/a"))),
        ("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset")),
    ]
    print("| component | version |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    _emit({"summary": f"{d.device_kind}, jax {jax.__version__}"})
    return 0


def _parity_specs(dry_run: bool) -> list[Any]:
    from pallas_kernels.triton.check_cases import CaseSpec

    if dry_run:  # heads 4 / 2, head_dim 64 (the Mosaic kernels' minimum), fp16
        small = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float16")
        return [
            CaseSpec((1, 1, 1), (1, 16, 17), 4, block_size=16, max_blocks=2, **small),
            CaseSpec((5, 1, 0), (40, 1, 0), 8, block_size=16, max_blocks=3,
                     sliding_window=20, dynamic_window=True, soft_cap=5.0, num_splits=2,
                     **small),
            # an 8-bit pool (the Triton paths only, see _parity_results)
            CaseSpec((1, 1, 1), (1, 16, 17), 4, block_size=16, max_blocks=2,
                     kv_format="fp8_e4m3", **small),
            # a draft tree (tree_mask) beside a decode row
            CaseSpec((5, 1), (21, 9), 7, block_size=16, max_blocks=2,
                     trees=(_heap_tree(5), None), **small),
        ]  # fmt: skip
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    return [
        CaseSpec((1,) * 8, (1, 15, 16, 17, 100, 513, 1000, 2047), 10, block_size=16,
                 max_blocks=128, **llama),
        CaseSpec((1, 1), (8192, 3000), 2, block_size=16, max_blocks=512, **llama),
        CaseSpec((300, 1, 37, 0), (300, 900, 1037, 0), 400, block_size=16, max_blocks=80,
                 **llama),
        CaseSpec((64, 1), (700, 333), 65, block_size=16, max_blocks=48, sliding_window=256,
                 soft_cap=30.0, **llama),
        CaseSpec((64, 1), (700, 333), 65, block_size=16, max_blocks=48, sliding_window=100,
                 dynamic_window=True, num_layers=3, layer=2, **llama),
        CaseSpec((17, 1), (129, 127), 18, block_size=32, max_blocks=8, num_q_heads=8,
                 num_kv_heads=8, head_dim=128, dtype="float16"),
        CaseSpec((1, 1, 1), (129, 5, 1024), 3, block_size=128, max_blocks=8,
                 num_q_heads=16, num_kv_heads=1, head_dim=64, dtype="bfloat16"),
        # 8-bit pools (docs/kv_quantization.md), the Triton paths only
        CaseSpec((1,) * 8, (1, 15, 16, 17, 100, 513, 1000, 2047), 10, block_size=16,
                 max_blocks=128, kv_format="fp8_e4m3", **llama),
        CaseSpec((300, 1, 37, 0), (300, 900, 1037, 0), 400, block_size=16, max_blocks=80,
                 kv_format="fp8_e5m2", **llama),
        CaseSpec((64, 1), (700, 333), 65, block_size=16, max_blocks=48, sliding_window=100,
                 dynamic_window=True, soft_cap=30.0, kv_format="int8", **llama),
        # draft trees (tree_mask, issue 36): 16- and 31-node trees beside prefill and decode
        # rows, every backend; then one over an int8 pool (the Triton paths)
        CaseSpec((16, 64, 31, 1), (416, 600, 1031, 77), 120, block_size=16, max_blocks=80,
                 trees=(_heap_tree(16), None, _heap_tree(31), None), **llama),
        CaseSpec((16, 1), (300, 129), 20, block_size=16, max_blocks=24, kv_format="int8",
                 trees=(_heap_tree(16), None), **llama),
    ]  # fmt: skip


def _heap_tree(n: int) -> tuple[int, ...]:
    """A draft tree of n nodes as parents: node j's parent is (j - 1) // 2 (a binary tree,
    parents first)."""
    return (-1, *((j - 1) // 2 for j in range(1, n)))


_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


def _split_window(spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(static keywords, traced keywords) for the case's window: a static int / None is
    bound before jit; a run-time window (the layer loop's per-layer values, 0 = none) is an
    int32 argument of the jitted call."""
    import jax.numpy as jnp

    if spec.dynamic_window:
        return {}, {"sliding_window": jnp.int32(spec.sliding_window or 0)}
    return {"sliding_window": spec.sliding_window}, {}


def _jax_backends(dry_run: bool) -> dict[str, Any]:
    """name -> fn(spec, inputs as jnp arrays) -> output, for the backends this host runs.
    Every backend gets the whole stacked pool and the layer index (the engine's contract)."""
    import functools

    import jax
    import jax.numpy as jnp

    from pagedjax.attention import select_attention_backend

    on_gpu = jax.devices()[0].platform == "gpu"
    backends: dict[str, Any] = {}

    def stacked(fn, needs_64: bool = False, jit: bool = True):
        def run(spec, a):
            if needs_64 and (spec.head_dim % 64 or spec.dtype == "float32"):
                return None  # outside the Mosaic kernels' contract
            static, dynamic = _split_window(spec)
            f = functools.partial(fn, sm_scale=spec.head_dim**-0.5, soft_cap=spec.soft_cap,
                                  **static)  # fmt: skip
            if jit:
                f = jax.jit(f)
            tree = {"tree_mask": a["tree_mask"]} if "tree_mask" in a else {}
            return f(a["q"], a["k_pool"], a["v_pool"], a["block_tables"], a["kv_lens"],
                     a["cu_q_lens"], layer=jnp.int32(spec.layer), **dynamic, **tree)  # fmt: skip

        return run

    ref = select_attention_backend("reference").ragged_paged_attention
    backends["XLA reference (pagedjax.attention)"] = stacked(ref)
    if _is_hopper() or dry_run:
        from pallas_kernels.paged_attention import default_interpret, ragged_paged_attention

        interp = default_interpret() if dry_run else None
        backends["Mosaic GPU (pallas_kernels)"] = stacked(
            functools.partial(ragged_paged_attention, interpret=interp), needs_64=True
        )
    if (on_gpu and _triton_jax_available()) or dry_run:
        from pallas_kernels.triton.jax_binding import triton_paged_attention

        def triton_jax(spec, a):
            static, dynamic = _split_window(spec)
            quant = {}
            if spec.kv_format is not None:
                quant = dict(kv_format=spec.kv_format, k_scale=a["k_scale"], v_scale=a["v_scale"])
            f = functools.partial(
                triton_paged_attention, sm_scale=spec.head_dim**-0.5, soft_cap=spec.soft_cap,
                num_splits=spec.num_splits, **static, **quant,
            )  # fmt: skip
            if on_gpu:  # the stand-in of the dry run runs eagerly
                f = jax.jit(f)
            return f(a["q"], a["k_pool"], a["v_pool"], jnp.int32(spec.layer),
                     a["block_tables"], a["kv_lens"], a["cu_q_lens"], tree_mask=a.get("tree_mask"),
                     **dynamic)  # fmt: skip

        name = "Triton via jax-triton" + (" (stand-in, interpreted)" if dry_run else "")
        backends[name] = triton_jax
    return backends


def _install_fake_jax_triton() -> None:
    from pallas_kernels.triton.check_cases import FakeJaxTriton

    sys.modules["jax_triton"] = FakeJaxTriton()  # type: ignore[assignment]


def _progress(msg: str) -> None:
    """A timestamped line on stderr: where a part that times out spent its time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _parity_results(spec: Any, backends: dict[str, Any], torch_device: str | None) -> list:
    """[(backend name, metrics dict or an exception)] of one case, every backend on it."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.triton import check_cases

    inputs = check_cases.make_inputs(spec)
    ref = check_cases.reference_output(spec, inputs)
    arrays = {k: jnp.asarray(v) for k, v in inputs.items()}
    for k in ("q", "k_pool", "v_pool") if spec.kv_format is None else ("q",):
        arrays[k] = arrays[k].astype(spec.dtype)  # an 8-bit pool stays as its bytes
    results: list[tuple[str, Any]] = []
    for name, fn in backends.items():
        if spec.kv_format is not None and not name.startswith("Triton"):
            continue  # 8-bit pools: the Triton paths (the others have their own 8-bit tests)
        _progress(f"parity: {name} ...")
        try:
            out = fn(spec, arrays)
            if out is not None:  # None: the case is outside this backend's contract
                results.append((name, check_cases.compare(spec, np.asarray(out, np.float32), ref)))
        except Exception as e:
            results.append((name, e))
    if torch_device is not None:
        name = f"Triton via torch ({torch_device})"
        _progress(f"parity: {name} ...")
        try:
            results.append((name, check_cases.run_case(spec, device=torch_device)))
        except Exception as e:
            results.append((name, e))
    return results


PARITY_BACKENDS = ("reference", "mosaic", "triton-jax", "triton-torch")


def _keep_backend(name: str, only: list[str] | None) -> bool:
    """Whether the parity backend ``name`` (a _jax_backends key, or "Triton via torch") is
    among ``only`` (PARITY_BACKENDS keys; None: all)."""
    key = ("reference" if name.startswith("XLA") else "mosaic" if name.startswith("Mosaic")
           else "triton-torch" if "torch" in name else "triton-jax")  # fmt: skip
    return only is None or key in only


def part_parity(dry_run: bool, only: list[str] | None = None) -> int:
    if dry_run:
        _install_fake_jax_triton()
    backends = {k: v for k, v in _jax_backends(dry_run).items() if _keep_backend(k, only)}
    torch_device = None
    if _keep_backend("Triton via torch", only):
        try:
            import torch

            torch_device = "cuda" if torch.cuda.is_available() else ("cpu" if dry_run else None)
        except ImportError:
            pass
    print("| backend | case | dtype | rel. error | max abs error | NaN-free | padding 0 | result |")
    print("|---|---|---|---|---|---|---|---|", flush=True)  # the header survives a timeout
    failures = rows = 0
    for i, spec in enumerate(_parity_specs(dry_run)):
        _progress(f"parity: case {i}: make inputs")
        label = (f"q {list(spec.q_lens)} kv {list(spec.kv_lens)} bs {spec.block_size}"
                 f" heads {spec.num_q_heads}/{spec.num_kv_heads} d {spec.head_dim}"
                 + (f" window {spec.sliding_window}" if spec.sliding_window else "")
                 + (" (run-time)" if spec.dynamic_window else "")
                 + f" layer {spec.layer}/{spec.num_layers}"
                 + (f" cap {spec.soft_cap}" if spec.soft_cap else "")
                 + (f" pool {spec.kv_format}" if spec.kv_format else "")
                 + (" trees " + "/".join("-" if t is None else str(len(t)) for t in spec.trees)
                    if spec.trees else ""))  # fmt: skip
        for name, m in _parity_results(spec, backends, torch_device):
            rows += 1
            if isinstance(m, Exception):
                failures += 1
                msg = f"{type(m).__name__}: {m}".replace("|", "/").replace("\n", " ")[:200]
                print(f"| {name} | {label} | {spec.dtype} | | | | | ERROR {msg} |", flush=True)
                continue
            ok = (m["finite"] and m["padding_max_abs"] == 0.0
                  and m["rel_err"] is not None and m["rel_err"] < _TOL[spec.dtype])  # fmt: skip
            failures += not ok
            err = f"{m['rel_err']:.2e}" if m["rel_err"] is not None else "n/a"
            print(f"| {name} | {label} | {spec.dtype} | {err} | {m['max_abs_err']:.2e} |"
                  f" {m['finite']} | {m['padding_max_abs'] == 0.0} |"
                  f" {'pass' if ok else 'FAIL'} |", flush=True)  # fmt: skip
    print(
        f"\nTolerances (relative Frobenius error): {_TOL}. Reference: dense-gather jnp in"
        " fp32 on the same rounded inputs. Poison: NaN in every slot without a token, the"
        " null block, pages behind garbage table tails and every other layer of the pool."
    )
    summary = f"{rows - failures}/{rows} rows pass" + ("" if failures else " (all)")
    if rows == 0:
        summary = "no backend of this part runs here"
    _emit({"summary": summary, "failures": failures, "rows": rows})
    return 1 if failures else 0


@dataclasses.dataclass(frozen=True)
class BenchShape:
    name: str
    kind: str  # "decode" or "prefill"
    batch: int
    context: int
    q_len: int = 1
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


BENCH_SHAPES = [
    BenchShape("decode b1 32k", "decode", 1, 32768),
    BenchShape("decode b16 8k", "decode", 16, 8192),
    BenchShape("decode b64 4k", "decode", 64, 4096),
    BenchShape("decode b256 1k", "decode", 256, 1024),
    BenchShape("prefill b1 4k", "prefill", 1, 4096, q_len=4096),
    BenchShape("chunked prefill b4 512/8k", "prefill", 4, 8192, q_len=512),
]
TINY_SHAPES = [  # the dry run: every column's code path, at interpreter-friendly sizes
    BenchShape("tiny decode", "decode", 1, 20, num_q_heads=2, num_kv_heads=1, head_dim=64),
    BenchShape("tiny prefill", "prefill", 1, 20, q_len=4, num_q_heads=2, num_kv_heads=1,
               head_dim=64),
]  # fmt: skip


def _bench_inputs(shape: BenchShape, dtype: Any) -> dict[str, Any]:
    """Pages of each sequence in a random block order, a one-layer stacked pool."""
    import jax
    import jax.numpy as jnp

    pages = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * pages + 1
    kq, kk, kv, kp = jax.random.split(jax.random.key(1), 4)
    pshape = (1, num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
    perm = jax.random.permutation(kp, jnp.arange(1, num_blocks, dtype=jnp.int32))
    t = shape.batch * shape.q_len
    return dict(
        q=jax.random.normal(kq, (t, shape.num_q_heads, shape.head_dim), dtype),
        k_pool=jax.random.normal(kk, pshape, dtype),
        v_pool=jax.random.normal(kv, pshape, dtype),
        block_tables=perm.reshape(shape.batch, pages),
        kv_lens=jnp.full((shape.batch,), shape.context, jnp.int32),
        cu_q_lens=jnp.arange(shape.batch + 1, dtype=jnp.int32) * shape.q_len,
    )


BENCH_COLUMNS = ["shape", "Triton ms", "Triton bw", "Triton TFLOP/s", "Mosaic ms",
                 "Mosaic bw", "JAX Pallas op ms", "XLA reference ms", "dense ms"]  # fmt: skip


def _bench_row(
    shape: BenchShape, dtype: Any, copy_bw: float, warmup: int, iters: int, dry_run: bool
) -> dict[str, str]:
    """One row of the bench table: each timing on its own (a baseline that does not run
    here reads "n/a (<error>)"), milliseconds and K/V-bytes-per-second share of copy_bw."""
    import functools

    import jax
    import jax.numpy as jnp

    from pagedjax.attention import select_attention_backend
    from pallas_kernels import bench

    on_gpu = jax.devices()[0].platform == "gpu"
    row: dict[str, str] = {"shape": shape.name}
    a = _bench_inputs(shape, dtype)
    sm = shape.head_dim**-0.5
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim
    kv_bytes *= jnp.dtype(dtype).itemsize
    q, k_pool, v_pool = a["q"], a["k_pool"], a["v_pool"]
    bt, kv_lens, cu = a["block_tables"], a["kv_lens"], a["cu_q_lens"]
    stacked = (q, k_pool, v_pool, bt, kv_lens, cu)
    layer0 = jnp.int32(0)

    def timed(key: str, fn: Any, bw_key: str | None = None) -> float | None:
        try:
            t = bench.bench(fn, warmup, iters)
        except Exception as e:
            row[key] = f"n/a ({type(e).__name__})"
            return None
        row[key] = f"{1e3 * t:.3f}"
        if bw_key:
            row[bw_key] = f"{kv_bytes / t / copy_bw:.2f}"
        return t

    if (on_gpu and _triton_jax_available()) or dry_run:
        from pallas_kernels.triton.jax_binding import triton_paged_attention

        f = functools.partial(triton_paged_attention, sm_scale=sm)
        f = jax.jit(f) if on_gpu else f
        layer = jnp.int32(0)
        t = timed("Triton ms", lambda: f(q, k_pool, v_pool, layer, bt, kv_lens, cu), "Triton bw")
        if t and shape.kind == "prefill":
            seen = shape.q_len * (shape.context - shape.q_len) + shape.q_len * (shape.q_len + 1) / 2
            flops = 4 * shape.batch * seen * shape.num_q_heads * shape.head_dim
            row["Triton TFLOP/s"] = f"{flops / t / 1e12:.1f}"
    if _is_hopper() or dry_run:
        from pallas_kernels.paged_attention import default_interpret, ragged_paged_attention

        interp = default_interpret() if dry_run else None
        g = jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm, interpret=interp))
        timed("Mosaic ms", lambda: g(*stacked, layer=layer0), "Mosaic bw")
    if shape.kind == "decode" and on_gpu:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

        kt, vt = k_pool[0].transpose(1, 0, 2, 3), v_pool[0].transpose(1, 0, 2, 3)  # [Hkv, N, B, D]
        h = jax.jit(jax_pa.paged_attention)
        timed("JAX Pallas op ms", lambda: h(q, kt, vt, bt, kv_lens))
    ref_fn = select_attention_backend("reference").ragged_paged_attention
    ref = jax.jit(functools.partial(ref_fn, sm_scale=sm))
    timed("XLA reference ms", lambda: ref(*stacked, layer=layer0))

    def dense_layout(x: jax.Array) -> jax.Array:  # [N, Hkv, B, D] -> [batch, ctx, Hkv, D]
        x = x[1:].reshape(shape.batch, -1, *x.shape[1:]).transpose(0, 1, 3, 2, 4)
        return x.reshape(shape.batch, -1, shape.num_kv_heads, shape.head_dim)

    # XLA's CPU dot has no fp16 x fp16 -> fp32: the dry run times the dense path in fp32.
    cast = (lambda x: x) if on_gpu else (lambda x: x.astype(jnp.float32))
    kd, vd = cast(dense_layout(k_pool[0])), cast(dense_layout(v_pool[0]))
    q4 = cast(q.reshape(shape.batch, shape.q_len, shape.num_q_heads, shape.head_dim))
    causal = shape.kind == "prefill" and shape.q_len == shape.context  # else: all keys

    def dense_fn(q: jax.Array, k: jax.Array, v: jax.Array, kl: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kl, is_causal=causal)

    dense = jax.jit(dense_fn)
    timed("dense ms", lambda: dense(q4, kd, vd, kv_lens))
    return row


def part_bench(dry_run: bool) -> int:
    import jax.numpy as jnp

    from pallas_kernels import bench

    if dry_run:
        _install_fake_jax_triton()
    warmup, iters = (1, 1) if dry_run else (2, 10)
    dtype = jnp.float16 if dry_run else jnp.bfloat16  # the interpreter's bf16 dot is junk
    copy_bw = bench.copy_bandwidth(1 << (20 if dry_run else 30), warmup, iters)
    print(f"Copy bandwidth (read + write of a {'1 MiB' if dry_run else '1 GiB'} device copy):"
          f" {copy_bw / 1e9:.1f} GB/s. Median of {iters} synchronised runs after {warmup}"
          " warm-up; `bw` = K/V bytes read per second / copy bandwidth;"
          " n/a: not run here.\n")  # fmt: skip
    print("| " + " | ".join(BENCH_COLUMNS) + " |\n|" + "---|" * len(BENCH_COLUMNS))
    best = None
    for shape in TINY_SHAPES if dry_run else BENCH_SHAPES:
        try:
            with bench.time_limit(120 if dry_run else 25):
                row = _bench_row(shape, dtype, copy_bw, warmup, iters, dry_run)
        except Exception as e:
            row = {"shape": shape.name, "Triton ms": f"failed ({type(e).__name__})"}
        if shape.kind == "decode" and "Triton bw" in row:
            best = max(best or 0.0, float(row["Triton bw"]))
        print("| " + " | ".join(row.get(c, "n/a") for c in BENCH_COLUMNS) + " |", flush=True)
    summary = f"best Triton decode bw share {best:.2f}" if best is not None else "no Triton row"
    _emit({"summary": summary + f"; copy {copy_bw / 1e9:.0f} GB/s"})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreters")
    ap.add_argument("--out", type=Path, default=None, help="report path")
    ap.add_argument("--only", nargs="+", default=None, help="run only these parts")
    ap.add_argument(
        "--group",
        choices=sorted(GROUPS),
        default=None,
        help="run one group of parts (each fits a 10-minute command on a GPU)",
    )
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # child process
    ap.add_argument("--backends", nargs="+", choices=PARITY_BACKENDS, default=None,
                    help="with --part parity: only these backends (default: all)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.part == "parity":
        return part_parity(args.dry_run, args.backends)
    if args.part is not None:
        fn = {"environment": part_environment, "bench": part_bench}
        return fn[args.part](args.dry_run)

    import jax

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not on_gpu and not args.dry_run:
        print("no GPU here: run with --dry-run for the CPU smoke run", file=sys.stderr)
        return 2
    parts = plan_parts(args.dry_run, on_gpu, _is_hopper())
    if args.only:
        unknown = set(args.only) - {p.name for p in parts}
        if unknown:
            ap.error(f"unknown parts {sorted(unknown)}; parts: {[p.name for p in parts]}")
        parts = [p for p in parts if p.name in args.only]
    if args.group:
        parts = [
            p
            for p in parts
            if p.name in GROUPS[args.group]
            or (args.group == "engine" and p.name.startswith("e2e-"))
        ]
    date = datetime.date.today().isoformat()
    out = args.out or (REPO / "docs" if IN_REPO else Path.cwd()) / (
        f"gpu_check{'_dry_run' if args.dry_run else ''}_{date}"
        + (f"_{args.group}" if args.group else "")
        + ".md"
    )
    results = []
    for part in parts:
        print(f"== {part.name} (timeout {part.timeout_s} s)", flush=True)
        r = run_part(part)
        print(f"   {r['status']} in {r['seconds']:.0f} s: {_summary(part, r)}", flush=True)
        results.append(r)
    write_report(out, parts, results, args.dry_run, argv)
    print(f"wrote {out}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
