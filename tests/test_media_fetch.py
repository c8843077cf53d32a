"""Image URLs the server fetches (entrypoints/openai/media.py): http(s) with a timeout and a
size cap, file:// only under --allowed-local-media-path, an allow-list of hosts; every
refusal or failure a 400 naming it. Against a local HTTP server (tests/media_server.py)."""

from __future__ import annotations

import asyncio
import io
import os

import pytest

from pagedjax.entrypoints.openai.media import MediaFetchPolicy
from pagedjax.entrypoints.openai.protocol import MediaURL, OpenAIError, image_source
from tests.media_server import serve_media


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _fetch(policy: MediaFetchPolicy, url: str) -> bytes:
    return asyncio.run(policy.fetch(MediaURL(url, 0)))


def _refused(policy: MediaFetchPolicy, url: str, match: str) -> None:
    with pytest.raises(OpenAIError) as e:
        _fetch(policy, url)
    assert e.value.status == 400 and match in str(e.value), str(e.value)


def test_http_fetch_limits_and_allow_list():
    png = _png()
    any_host = MediaFetchPolicy(timeout_s=1.0, max_bytes=1 << 20)
    listed = MediaFetchPolicy(allowed_media_domains=("127.0.0.1",), timeout_s=1.0)
    with serve_media(png) as base:
        assert _fetch(any_host, f"{base}/a.png") == png
        assert _fetch(listed, f"{base}/a.png") == png
        assert _fetch(any_host, f"{base}/redirect") == png  # followed without a list
        _refused(listed, f"{base}/redirect", "HTTP 302")  # not followed with one
        _refused(MediaFetchPolicy(allowed_media_domains=("example.com",)), f"{base}/a.png",
                 "not in --allowed-media-domains")  # fmt: skip
        _refused(any_host, f"{base}/big", "over the size limit")  # declared length
        _refused(any_host, f"{base}/endless", "over the size limit")  # counted while streaming
        _refused(any_host, f"{base}/slow", "timed out after 1 s")
        _refused(any_host, f"{base}/missing", "HTTP 404")
    _refused(any_host, base + "/a.png", "failed")  # the server is gone: connection refused
    _refused(any_host, "ftp://127.0.0.1/a.png", "scheme 'ftp'")


def test_file_urls_only_inside_the_allowed_directory(tmp_path):
    png = _png()
    root, outside = tmp_path / "media", tmp_path / "secret"
    root.mkdir(), outside.mkdir()
    (root / "a.png").write_bytes(png)
    (outside / "b.png").write_bytes(png)
    os.symlink(outside / "b.png", root / "link.png")  # inside by name, outside in fact
    (root / "big.png").write_bytes(b"\0" * 2048)
    policy = MediaFetchPolicy(allowed_local_media_path=str(root), max_bytes=1024)
    assert _fetch(policy, f"file://{root}/a.png") == png
    _refused(policy, f"file://{root}/../secret/b.png", "outside --allowed-local-media-path")
    _refused(policy, f"file://{root}/link.png", "outside --allowed-local-media-path")
    _refused(policy, f"file://{root}", "is not a file")
    _refused(policy, f"file://{root}/big.png", "over the size limit")
    _refused(policy, f"file://otherhost{root}/a.png", "names no host")
    _refused(MediaFetchPolicy(), f"file://{root}/a.png", "need --allowed-local-media-path")
    with pytest.raises(ValueError, match="not a directory"):
        MediaFetchPolicy(allowed_local_media_path=str(root / "a.png"))


def test_protocol_keeps_urls_for_the_server_and_env_sets_the_limits(monkeypatch):
    assert image_source({"url": "https://x/a.png"}, 3) == MediaURL("https://x/a.png", 3)
    assert image_source({"url": "data:image/png;base64,aGk="}, 0) == b"hi"
    monkeypatch.setenv("PAGEDJAX_IMAGE_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("PAGEDJAX_MAX_MEDIA_DOWNLOAD_SIZE_MB", "3")
    p = MediaFetchPolicy.from_env(None, ["Example.COM"])
    assert (p.timeout_s, p.max_bytes, p.allowed_media_domains) == (2.5, 3 << 20, ("example.com",))
    monkeypatch.setenv("PAGEDJAX_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PAGEDJAX_IMAGE_FETCH_TIMEOUT"):
        MediaFetchPolicy.from_env()
