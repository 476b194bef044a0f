"""Local HTTP servers that speak the download APIs `innerq pull` uses, for offline tests.

* FakeIndex: a Python package index's simple API (PEP 503 HTML, $PIP_INDEX_URL).

Every request is logged as (method, path, headers with lower-case names).
"""
from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)
        self.log: list[tuple[str, str, dict]] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        """A whole response; a HEAD response's headers describe body without sending it."""
        headers = {"Content-Length": len(body), **(headers or {})}
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if not head:
            self.wfile.write(body)


class FakeIndex(_Server):
    """A simple-API index: self.files maps a project to {wheel file name: bytes}; a sha256
    override per file name (to serve a wrong one) is in self.bad_hash."""

    def __init__(self):
        super().__init__(_IndexHandler)
        self.files: dict[str, dict[str, bytes]] = {}
        self.bad_hash: set[str] = set()


class _IndexHandler(_Handler):
    def do_GET(self):
        idx = self.server
        path = urlsplit(self.path).path
        idx.log.append(("GET", path, {k.lower(): v for k, v in self.headers.items()}))
        m = re.match(r"^/simple/([^/]+)/$", path)
        if m and m.group(1) in idx.files:
            links = []
            for name, data in idx.files[m.group(1)].items():
                sha = "0" * 64 if name in idx.bad_hash else hashlib.sha256(data).hexdigest()
                links.append(f'<a href="../../files/{name}#sha256={sha}">{name}</a><br/>')
            self._send(200, ("<!DOCTYPE html><html><body>" + "".join(links) + "</body></html>").encode(),
                       {"Content-Type": "text/html"})
            return
        m = re.match(r"^/files/(.+)$", path)
        for files in idx.files.values():
            if m and m.group(1) in files:
                self._send(200, files[m.group(1)], {"Content-Type": "application/octet-stream"})
                return
        self._send(404)
