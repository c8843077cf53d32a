"""JAX's persistent compilation cache, on by default, and a count of what it saved.

Contract. ``enable()`` points JAX's persistent compilation cache at a per-user directory
(``$XDG_CACHE_HOME/pagedjax/jax`` or ``~/.cache/pagedjax/jax``), or at the directory named
by the ``cache_dir`` argument or the ``PAGEDJAX_COMPILATION_CACHE`` environment variable;
``"off"`` (or ``"0"``, ``"none"``, ``False``) disables it. Every program is kept, however
small or quick to compile (``jax_persistent_cache_min_compile_time_secs = 0``): a step
program of a small model compiles in about a second, and a server start-up compiles twenty
of them. ``LLM``, the server, ``experiments/run.py`` and the benchmarks call it before
their first compilation; the test suite uses the same per-user directory (tests/conftest.py),
so a second run of the suite loads what the first compiled. ``prune`` keeps a directory
under a size cap (oldest files first): the program store's keys cover the whole source,
so every edit leaves stale entries behind.

``CompileCounter`` counts, from JAX's monitoring events, how many programs a span of code
compiled and how many of those came from the cache, for the start-up line
("compiled 18 programs: 18 from the cache, 0 new, in 2.1 s").

Why a module of its own: the cache is process-wide JAX state, and JAX decides whether to use
it at the first compilation of the process; calling ``enable`` later switches it on with
``reset_cache()`` (public, in ``jax.experimental.compilation_cache``), so the order of
imports and calls does not matter. Programs holding the native CPU attention kernel (an XLA
FFI custom call) reload from the cache like any other: the call is by target name, and the
kernel registers that name while the step is traced, which happens before the cache lookup
(tests/test_compile_cache.py checks it in a fresh process).

Refusals: a cache directory that cannot be created is reported (logged) and the cache is
left off; compilation then works as without a cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

log = logging.getLogger(__name__)

ENV_VAR = "PAGEDJAX_COMPILATION_CACHE"
_OFF = {"", "0", "off", "none", "false", "no"}

_HITS = "/jax/compilation_cache/cache_hits"
_MISSES = "/jax/compilation_cache/cache_misses"  # recorded when a new entry is written
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pagedjax/jax``, else ``~/.cache/pagedjax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedjax" / "jax"


def resolve_cache_dir(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """The directory to use: the argument, else the environment variable, else the
    default; None when disabled (``False`` or an "off" value)."""
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        env = os.environ.get(ENV_VAR)
        if env is not None:
            return None if env.strip().lower() in _OFF else Path(env).expanduser()
        return default_cache_dir()
    text = str(cache_dir)
    return None if text.strip().lower() in _OFF else Path(text).expanduser()


def enable(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """Turns the persistent compilation cache on at the resolved directory (or off).

    Returns the directory in use, or None when disabled or not creatable. Idempotent: a
    second call with the same directory changes nothing.
    """
    path = resolve_cache_dir(cache_dir)
    current = jax.config.jax_compilation_cache_dir
    if path is None:
        if current:
            jax_cache.set_cache_dir(None)
            jax_cache.reset_cache()
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if current != str(path):
        jax_cache.set_cache_dir(str(path))
        # JAX decides at the first compilation of a process whether the cache is used;
        # resetting makes the next compilation look again, with the new directory.
        jax_cache.reset_cache()
    return path


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Compilations inside neither read nor write the persistent cache (then it is on again
    as before). For programs the engine serializes itself (engine/program_store.py): an
    executable loaded from the persistent cache does not serialize whole on the CPU (jaxlib
    0.12: the copy loaded back fails with "Function ... not found"), so those are compiled
    afresh, once."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        yield
        return
    jax_cache.set_cache_dir(None)
    jax_cache.reset_cache()
    try:
        yield
    finally:
        jax_cache.set_cache_dir(directory)
        jax_cache.reset_cache()


DEFAULT_MAX_BYTES = 4 << 30


def prune(directory: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Deletes the least recently written files under ``directory`` (default: the resolved
    cache directory; its program store too) until they total at most ``max_bytes``;
    returns the bytes freed. Files that vanish meanwhile (another process) are skipped."""
    root = resolve_cache_dir(directory) if directory is None else Path(directory)
    if root is None or not root.is_dir():
        return 0
    files = []
    for path in root.rglob("*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    freed = 0
    for _, size, path in sorted(files):
        if total - freed <= max_bytes:
            break
        try:
            path.unlink()
        except OSError:
            continue
        freed += size
    return freed


class CompileCounter:
    """Counts compilations between ``start()`` and ``stop()`` from JAX's monitoring
    events (process-wide: concurrent compilations elsewhere in the process count too).

    ``requests``: programs that went to the persistent cache (every compilation while the
    cache is on); ``hits``: loaded from it; ``written``: compiled and stored; ``stored``:
    programs the engine loaded from its program store without tracing or compiling
    (``engine/program_store.py``, counted through ``note_stored``).
    """

    _lock = threading.Lock()
    _active: list[CompileCounter] = []
    _registered = False

    def __init__(self) -> None:
        self.requests = self.hits = self.written = self.stored = 0
        self.seconds = 0.0
        self._t0 = 0.0

    @classmethod
    def _listener(cls, event: str, **kwargs: object) -> None:
        with cls._lock:
            for c in cls._active:
                if event == _HITS:
                    c.hits += 1
                elif event == _MISSES:
                    c.written += 1
                elif event == _REQUESTS:
                    c.requests += 1

    @classmethod
    def note_stored(cls) -> None:
        """One program loaded from a program store: counted by every active counter."""
        with cls._lock:
            for c in cls._active:
                c.stored += 1

    def start(self) -> CompileCounter:
        with CompileCounter._lock:
            if not CompileCounter._registered:
                jax.monitoring.register_event_listener(CompileCounter._listener)
                CompileCounter._registered = True
            CompileCounter._active.append(self)
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> CompileCounter:
        self.seconds = time.perf_counter() - self._t0
        with CompileCounter._lock:
            if self in CompileCounter._active:
                CompileCounter._active.remove(self)
        return self

    def __enter__(self) -> CompileCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self) -> str:
        """One line for start-up logs."""
        return (
            f"{self.requests + self.stored} programs: {self.stored} loaded from the program "
            f"store, {self.requests} compiled ({self.hits} from the cache, "
            f"{self.requests - self.hits} new), in {self.seconds:.1f} s"
        )


__all__ = [
    "DEFAULT_MAX_BYTES", "ENV_VAR", "CompileCounter", "bypassed", "default_cache_dir", "enable",
    "prune", "resolve_cache_dir",
]  # fmt: skip
