"""Compiled step programs kept on disk and loaded again without tracing (warm start).

Why: with JAX's persistent compilation cache warm, a start still traces and lowers every
step program in Python to find its cache key (~0.3-0.5 s per program on the 2-core CPU,
14 programs: most of a warm start; docs/startup.md). This store keys a compiled program by
what determines it, computed without tracing, and keeps the serialized executable
(``jax.experimental.serialize_executable``) beside the compilation cache. A hit loads the
executable (tens of ms) and the engine calls it directly (``ModelRunner.run``).

The key (sha256) covers: the source of pagedjax and pallas_kernels (every .py, .cc and
.h file), the jax / jaxlib versions, the platform, device kind and CPU model (programs hold
native code built for this CPU), ``XLA_FLAGS`` and every ``PAGEDJAX_*`` variable, the
runner's configuration (architecture, block size, attention function, logprob width,
native matmul), the program's static arguments, and the tree structure, shapes, dtypes,
weak types and array kinds of its arguments. Anything else a step's trace could depend on
would have to live in one of those; a change to any of them is a miss (and a compile).

Refusals, by design: off when the compilation cache is off (``compilation_cache="off"``)
or the engine spans several devices (a mesh's placement is not part of the key); a file
that fails to load is reported and compiled again, never fatal.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from pagedjax.compile_cache import CompileCounter
from pagedjax.machine import cpu_model

log = logging.getLogger(__name__)

SUBDIR = "pagedjax-programs"
_ROOTS = ("pagedjax", "pallas_kernels")


def tree_digest(base: Path, roots: tuple[str, ...] = _ROOTS) -> str:
    """sha256 over the .py, .cc and .h files (path and content) under ``base / root``."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted((base / root).rglob("*")):
            if path.suffix in (".py", ".cc", ".h") and path.is_file():
                h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@functools.cache
def source_digest() -> str:
    """sha256 over pagedjax's and pallas_kernels' .py, .cc and .h files (path and content)."""
    return tree_digest(Path(__file__).resolve().parents[2])


def describe_function(fn: Callable[..., Any]) -> str:
    """A stable description of a (possibly partial) function for the key."""
    if isinstance(fn, functools.partial):
        keywords = sorted(fn.keywords.items())
        return f"partial({describe_function(fn.func)}, {fn.args!r}, {keywords!r})"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _leaf_signature(x: Any) -> str:
    kind = "jax" if isinstance(x, jax.Array) else type(x).__name__
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        weak = getattr(x, "weak_type", False)
        return f"{kind}:{np.dtype(x.dtype).name}{list(x.shape)}{'w' if weak else ''}"
    return f"{kind}:{x!r}"


def environment() -> str:
    """The process facts a compiled program depends on (module docstring)."""
    dev = jax.devices()[0]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("PAGEDJAX_"))
    return repr((
        source_digest(), jax.__version__, jaxlib.version.__version__, dev.platform,
        dev.device_kind, cpu_model(), platform.machine(), os.environ.get("XLA_FLAGS", ""), env,
    ))  # fmt: skip


class ProgramStore:
    """Serialized compiled programs in ``directory`` (module docstring).

    ``key(name, config, args, statics)`` -> str; ``load(key)`` -> a callable compiled
    program or None; ``save(key, compiled)``. ``hits`` / ``saved`` count this store's uses.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.hits = self.saved = 0
        self._env = environment()

    @classmethod
    def for_current_cache(cls, num_devices: int) -> ProgramStore | None:
        """The store beside JAX's persistent compilation cache, or None when that cache is
        off or the engine spans several devices."""
        cache = jax.config.jax_compilation_cache_dir
        if not cache or num_devices != 1:
            return None
        return cls(Path(cache) / SUBDIR)

    def key(self, name: str, config: str, args: Any, statics: dict[str, Any]) -> str:
        leaves, treedef = jax.tree.flatten(args)
        text = repr((self._env, name, config, sorted(statics.items()), str(treedef),
                     [_leaf_signature(x) for x in leaves]))  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.pkl"

    def load(self, key: str) -> Any | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a stale or damaged file: compile again
            log.warning("program store: %s did not load (%s); compiling", path.name, e)
            return None
        self.hits += 1
        CompileCounter.note_stored()
        return compiled

    def save(self, key: str, compiled: Any) -> None:
        try:
            data = pickle.dumps(serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))  # readers never see half a file
        except Exception as e:  # a full disk or an unserializable program: not fatal
            log.warning("program store: could not save a program (%s)", e)
            return
        self.saved += 1


__all__ = ["ProgramStore", "describe_function", "environment", "source_digest", "tree_digest"]
