"""A local HTTP server for image-URL tests (no network here): routes -> handlers."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def serve_media(png: bytes) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) of a server with: /a.png (``png``),
    /big (declares 10 MB), /endless (no length; streams 64 KB chunks for ~2 s), /slow
    (answers after 3 s), /redirect (302 to /a.png), /missing (404)."""

    def endless(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        for _ in range(200):
            try:
                h.wfile.write(b"\0" * 65536)
            except OSError:
                return
            time.sleep(0.01)

    def body(data: bytes, status: int = 200, **headers: str) -> Callable:
        def send(h: BaseHTTPRequestHandler) -> None:
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k.replace("_", "-"), v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)

        return send

    def big(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(10 << 20))
        h.end_headers()

    def slow(h: BaseHTTPRequestHandler) -> None:
        time.sleep(3)
        body(png)(h)

    routes = {"/a.png": body(png, Content_Type="image/png"), "/big": big, "/endless": endless,
              "/slow": slow, "/redirect": body(b"", 302, Location="/a.png"),
              "/missing": body(b"no", 404)}  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            routes.get(self.path, body(b"no", 404))(self)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
