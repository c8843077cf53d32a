"""Compile a native CPU kernel (C++ against XLA's FFI headers) once, and cache the library.

Used by the native attention kernel (``attention/native_cpu.py``), the stacked-weight
matmul (``model/native_matmul.py``) and the LoRA delta (``model/native_lora.py``); they
share ``native_pool.h`` (work units on XLA's intra-op pool). A library is compiled with
the system C++ compiler (``CXX``, else ``g++``) into a cache directory
(``PAGEDJAX_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/pagedjax/kernels``, i.e.
``~/.cache/pagedjax/kernels``), named by a hash of the source and the project headers it
includes (``local_headers``), the flags, the compiler's version, the FFI headers' path,
the jax / jaxlib versions (the headers' ABI can change in place under the same path) and
the CPU, so a changed source, header, compiler, jaxlib or machine builds anew and an
unchanged one costs a file lookup (tests/test_cache_keys.py). Callers fall back to XLA
when ``compiler()`` is None or the build fails, so pagedjax never depends on a compiler
being present.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from pagedjax.machine import cpu_model

log = logging.getLogger(__name__)

# -fopenmp-simd: `omp simd` loops vectorize without linking an OpenMP runtime.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd")


def cache_dir() -> Path:
    """Where built libraries live: ``$PAGEDJAX_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/pagedjax/kernels`` (``~/.cache/pagedjax/kernels``)."""
    env = os.environ.get("PAGEDJAX_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedjax" / "kernels"


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> list[Path]:
    """The headers ``source`` includes with quotes that exist beside it (relative to the
    including file, as the compiler looks first), and theirs, each once, in order: the
    project's own headers (``native_pool.h``), whose text is part of the build. Quoted
    includes found only on the FFI include path (``xla/ffi/api/ffi.h``) are not listed:
    the include directory and the jax / jaxlib versions stand for them."""
    seen: list[Path] = []
    todo = [source]
    while todo:
        for name in _LOCAL_INCLUDE.findall(todo.pop(0).read_text()):
            path = (source.parent / name).resolve()
            if path.is_file() and path not in seen:
                seen.append(path)
                todo.append(path)
    return seen


def build_key(source: Path, include_dir: str, cxx: str, flags: tuple[str, ...] = FLAGS) -> str:
    """The cache key of one build: what the library depends on (module docstring)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    headers = [f"{h.name}\0{h.read_text()}" for h in local_headers(source)]
    return hashlib.sha256(
        "\0".join(
            [source.read_text(), *headers, " ".join(flags), version, include_dir,
             jax.__version__, jaxlib.version.__version__, cpu_model(), platform.machine()]
        ).encode()
    ).hexdigest()[:16]  # fmt: skip


def compiler() -> str | None:
    """The C++ compiler's path (``$CXX``, else ``g++``), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def register_ffi_library(
    source: Path, targets: dict[str, str], disable_vars: tuple[str, ...], what: str
) -> tuple[bool, str]:
    """Build ``source`` (if needed), load it and register each FFI target (name -> exported
    handler symbol) for the CPU: (True, how) or (False, why not). Any of ``disable_vars`` set
    to "0" turns it off; a missing compiler or a failed build is logged (``what`` names the
    kernel) and reported, never raised, so callers fall back to XLA."""
    for var in disable_vars:
        if os.environ.get(var, "1") == "0":
            return False, f"disabled by {var}=0"
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler (set CXX or install g++)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build_library(source, jax.ffi.include_dir(), cxx)))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), "cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("%s unavailable, using XLA: %s", what, e)
        return False, f"build or load failed: {e}"
    return True, f"built with {cxx}"


def build_library(source: Path, include_dir: str, cxx: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile ``source`` into a shared library unless this exact build is cached; returns
    its path. Raises RuntimeError with the compiler's output when the build fails."""
    out = cache_dir() / f"{source.stem}-{build_key(source, include_dir, cxx, flags)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent builders (pytest workers) never see
    # a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, f"-I{include_dir}", str(source), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


__all__ = ["FLAGS", "build_key", "build_library", "cache_dir", "compiler", "local_headers",
           "register_ffi_library"]
