"""The disk tier: prefix-cache blocks in files, so a restarted engine keeps its prefix cache.

Issue 35, item 1's optional third tier (docs/kv_tiers.md). Under the host tier
(``host_tier.py``, ``engine/kv_offload.py``): every block the host tier is given is also
written here (write-through), and a prompt whose prefix misses the device and the host
reads the blocks that continue it from here into the host tier, from where the existing
reload copies them to the device. The files outlive the process: that is the point.

Contract:

- One file per block, ``<root>/<fingerprint>/<chained hash, 16 hex digits>.npz`` (numpy's
  zip of arrays, read with ``allow_pickle=False``: a file cannot run code). It holds the
  block's token ids (int32[B]), its KV leaves (one array per leaf of the engine's host
  pool, [L, 1, ...]) and a ``meta`` array: the fingerprint as UTF-8 bytes.
- ``fingerprint`` names everything the KV depends on (the caller passes it: model and
  weights digest, dtype, block size, KV cache format, the pool's leaf shapes), so an engine
  never reads another model's or another format's blocks; the directory is the
  fingerprint, and the fingerprint inside the file is checked again on read.
- ``read`` returns a block only when the file parses, its fingerprint matches, its
  leaves have the expected shapes and dtypes and its tokens equal the prompt's block
  (so a hash collision cannot return wrong KV). Anything else (a corrupt, truncated or
  foreign file) is ignored with one warning per file and never loaded.
- Writes are atomic (a temporary file, then ``os.replace``): a crash mid-write leaves no
  half file under a block's name. A hash already on disk is not written again.
- Bounded: at most ``capacity_bytes`` of block files under the fingerprint's directory;
  past it the least recently used files (a write or a read is a use; kept as the file's
  modification time, so the order survives a restart) are deleted. Files of other
  fingerprints are never touched.

Cost: one file write per offloaded block (the whole block, all layers) and one read per
disk hit, on the engine's thread, synchronous. Refusals (``ValueError``): a
non-positive capacity, a fingerprint that is not a short hex string.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_FINGERPRINT = re.compile(r"^[0-9a-f]{8,64}$")


class DiskTier:
    """Block files of one fingerprint under ``root``, at most ``capacity_bytes``.

    leaf_specs: (shape, dtype) of each KV leaf of one block, [L, 1, ...], in the host
    pool's leaf order: what a file must hold to be read.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        leaf_specs: list[tuple[tuple[int, ...], Any]],
        block_size: int,
        capacity_bytes: int,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if not _FINGERPRINT.match(fingerprint):
            raise ValueError(f"fingerprint must be 8-64 hex digits, got {fingerprint!r}")
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.leaf_specs = [(tuple(s), np.dtype(d)) for s, d in leaf_specs]
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self._warned: set[str] = set()
        # Sizes and last uses of the files on disk (name -> bytes / time), read once, kept
        # current by our writes and reads. Uses are strictly increasing (file times can
        # be coarser than two writes apart) and stored as the file's mtime, so the order
        # survives a restart.
        self._sizes: dict[str, int] = {}
        self._used: dict[str, float] = {}
        for p in self.dir.glob("*.npz"):
            st = p.stat()
            self._sizes[p.name], self._used[p.name] = st.st_size, st.st_mtime
        self._clock = max(self._used.values(), default=0.0)

    def _path(self, h: int) -> Path:
        return self.dir / f"{h & (2**64 - 1):016x}.npz"

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and self._path(h).name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def write(self, hashes: list[int], tokens: np.ndarray, leaves: list[np.ndarray]) -> int:
        """Write block ``i`` (``leaves``: the KV leaves of n blocks, [L, n, ...] each) under
        ``hashes[i]`` with ``tokens[i]`` (int32[n, B]); hashes already on disk are
        skipped. Returns the number of files written."""
        written = 0
        for i, h in enumerate(hashes):
            path = self._path(h)
            if path.name in self._sizes:
                continue
            arrays = {f"leaf_{j}": np.ascontiguousarray(x[:, i : i + 1]) for j, x in
                      enumerate(leaves)}  # fmt: skip
            arrays["tokens"] = np.asarray(tokens[i], np.int32)
            arrays["meta"] = np.frombuffer(self.fingerprint.encode(), np.uint8)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, **arrays)
                os.replace(tmp, path)
            except OSError as e:  # a full disk: the block is simply not kept
                Path(tmp).unlink(missing_ok=True)
                log.warning("disk tier: could not write %s (%s)", path.name, e)
                continue
            self._sizes[path.name] = path.stat().st_size
            self._touch(path)
            written += 1
        self._trim()
        return written

    def read(self, h: int, tokens: np.ndarray | list[int]) -> list[np.ndarray] | None:
        """The KV leaves ([L, 1, ...] each) of the block kept under ``h`` whose tokens
        equal ``tokens``, or None (no file, or a file that is not this engine's: warned
        once, never loaded)."""
        path = self._path(h)
        if path.name not in self._sizes:
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = bytes(z["meta"]).decode()
                if meta != self.fingerprint:
                    raise ValueError(f"fingerprint {meta[:16]!r}, expected this engine's")
                leaves = [z[f"leaf_{j}"] for j in range(len(self.leaf_specs))]
                stored = z["tokens"]
        except Exception as e:  # corrupt, truncated, foreign: never loaded
            self._warn(path, e)
            return None
        for x, (shape, dtype) in zip(leaves, self.leaf_specs, strict=True):
            if x.shape != shape or x.dtype != dtype:
                self._warn(path, ValueError(f"leaf {x.shape} {x.dtype}, expected {shape} {dtype}"))
                return None
        if stored.shape != (self.block_size,) or not np.array_equal(stored, np.asarray(tokens)):
            return None  # another block under this hash (a collision): not ours to use
        self._touch(path)  # recently used: kept longest by _trim
        return leaves

    def _touch(self, path: Path) -> None:
        self._clock = max(time.time(), self._clock + 1e-3)
        self._used[path.name] = self._clock
        try:
            os.utime(path, (self._clock, self._clock))
        except OSError:
            pass

    def _warn(self, path: Path, e: Exception) -> None:
        if path.name not in self._warned:
            self._warned.add(path.name)
            log.warning("disk tier: ignoring %s: %s: %s", path, type(e).__name__, e)

    def _trim(self) -> None:
        """Delete the least recently used files past capacity_bytes."""
        total = self.used_bytes
        if total <= self.capacity_bytes:
            return
        for name in sorted(self._sizes, key=self._used.__getitem__):
            if total <= self.capacity_bytes:
                break
            (self.dir / name).unlink(missing_ok=True)
            total -= self._sizes.pop(name)
            del self._used[name]


__all__ = ["DiskTier"]
