"""Image URLs the server fetches: http(s) with a timeout and a size cap, local files under
one allowed directory. vLLM's rules and flags (docs/multimodal.md, docs/security.md).

- ``data:`` URLs never come here: ``protocol`` decodes them.
- ``file://`` URLs: only with ``--allowed-local-media-path DIR``, and only for a regular
  file whose real path (symbolic links resolved) lies inside DIR's real path; else a
  400 naming the rule. Read in a worker thread, at most the size cap.
- ``http://`` / ``https://`` URLs: fetched, unless ``--allowed-media-domains`` is given
  and the URL's host is not one of them (a 400). With an allow-list, redirects are not
  followed (a redirect could leave the list); without one they are, as vLLM's client
  does. Each fetch has a timeout (``PAGEDJAX_IMAGE_FETCH_TIMEOUT``, seconds, default 5:
  vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``) and a size cap
  (``PAGEDJAX_MAX_MEDIA_DOWNLOAD_SIZE_MB``, default 256: vLLM's
  ``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB``) enforced while the body streams, so an endless
  or huge body costs at most the cap. A timeout, a connection error, an HTTP error status
  or a body over the cap is a 400 naming the URL and the reason.
- Anything else (``ftp:``, no scheme): a 400.

Why a 400 and not a 500 for a failed fetch: the URL is the client's input; the server
and the other requests in flight are unaffected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pagedjax.entrypoints.openai.protocol import MediaURL, bad

DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_MAX_DOWNLOAD_MB = 256


@dataclasses.dataclass(frozen=True)
class MediaFetchPolicy:
    """What the server may read for an image URL.

    allowed_local_media_path: the directory ``file://`` URLs may name (None: refused);
    allowed_media_domains: hosts http(s) URLs may name (None: any);
    timeout_s: per fetch; max_bytes: the most bytes one image may have.
    """

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_DOWNLOAD_MB << 20

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_bytes <= 0:
            raise ValueError(f"timeout_s and max_bytes must be > 0, got {self.timeout_s},"
                             f" {self.max_bytes}")  # fmt: skip
        if self.allowed_local_media_path is not None:
            p = Path(self.allowed_local_media_path)
            if not p.is_dir():
                raise ValueError(f"--allowed-local-media-path {p}: not a directory")

    @classmethod
    def from_env(
        cls, allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None,
    ) -> MediaFetchPolicy:  # fmt: skip
        """The policy with the timeout and the size cap from the environment."""
        env = os.environ
        try:
            timeout = float(env.get("PAGEDJAX_IMAGE_FETCH_TIMEOUT", DEFAULT_FETCH_TIMEOUT_S))
            mb = int(env.get("PAGEDJAX_MAX_MEDIA_DOWNLOAD_SIZE_MB", DEFAULT_MAX_DOWNLOAD_MB))
        except ValueError as e:
            msg = f"PAGEDJAX_IMAGE_FETCH_TIMEOUT / PAGEDJAX_MAX_MEDIA_DOWNLOAD_SIZE_MB: {e}"
            raise ValueError(msg) from None
        domains = None
        if allowed_media_domains:
            domains = tuple(d.lower() for d in allowed_media_domains)
        return cls(allowed_local_media_path, domains, timeout, mb << 20)

    async def fetch(self, ref: MediaURL) -> bytes:
        """The bytes ``ref.url`` names, or an OpenAIError 400 (module docstring)."""
        parts = urlsplit(ref.url)
        scheme = parts.scheme.lower()
        where = f"messages[{ref.message}]"
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, parts, where)
        if scheme not in ("http", "https"):
            raise bad(f"{where}: image URL scheme {scheme!r} is not supported", "messages")
        host = (parts.hostname or "").lower()
        if self.allowed_media_domains is not None and host not in self.allowed_media_domains:
            raise bad(f"{where}: image URL host {host!r} is not in --allowed-media-domains",
                      "messages")  # fmt: skip
        return await self._download(ref.url, where)

    def _read_file(self, parts, where: str) -> bytes:  # noqa: ANN001 (urllib's SplitResult)
        if self.allowed_local_media_path is None:
            raise bad(f"{where}: file image URLs need --allowed-local-media-path", "messages")
        if parts.netloc not in ("", "localhost"):
            raise bad(f"{where}: a file URL names no host, got {parts.netloc!r}", "messages")
        root = os.path.realpath(self.allowed_local_media_path)
        path = os.path.realpath(unquote(parts.path))
        if os.path.commonpath([root, path]) != root:
            raise bad(f"{where}: {unquote(parts.path)} is outside --allowed-local-media-path",
                      "messages")  # fmt: skip
        if not os.path.isfile(path):
            raise bad(f"{where}: {unquote(parts.path)} is not a file", "messages")
        if os.path.getsize(path) > self.max_bytes:
            raise self._too_large(where)
        with open(path, "rb") as f:
            return f.read(self.max_bytes + 1)[: self.max_bytes]

    async def _download(self, url: str, where: str) -> bytes:
        import httpx

        follow = self.allowed_media_domains is None
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=follow) as c:
                async with asyncio.timeout(self.timeout_s):  # the whole fetch, not per read
                    async with c.stream("GET", url) as r:
                        if r.status_code >= 300:
                            raise bad(f"{where}: fetching the image URL gave HTTP"
                                      f" {r.status_code}", "messages")  # fmt: skip
                        declared = r.headers.get("content-length")
                        if declared and declared.isdigit() and int(declared) > self.max_bytes:
                            raise self._too_large(where)
                        body = bytearray()
                        async for chunk in r.aiter_bytes():
                            body += chunk
                            if len(body) > self.max_bytes:
                                raise self._too_large(where)
                        return bytes(body)
        except (TimeoutError, httpx.TimeoutException):
            raise bad(f"{where}: fetching the image URL timed out after {self.timeout_s:g} s",
                      "messages") from None  # fmt: skip
        except httpx.HTTPError as e:
            raise bad(f"{where}: fetching the image URL failed: {type(e).__name__}: {e}",
                      "messages") from None  # fmt: skip

    def _too_large(self, where: str) -> Exception:
        return bad(f"{where}: the image is over the size limit of {self.max_bytes} bytes"
                   " (PAGEDJAX_MAX_MEDIA_DOWNLOAD_SIZE_MB)", "messages")  # fmt: skip


__all__ = ["MediaFetchPolicy"]
