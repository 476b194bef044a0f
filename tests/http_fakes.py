"""Local HTTP servers that speak the download APIs `innerq pull` uses, for offline tests.

* FakeHub: the Hugging Face Hub's as huggingface_hub calls it (HF_ENDPOINT): the tree listing
  `/api/models/ORG/REPO/tree/REV`, and `HEAD`/`GET /ORG/REPO/resolve/REV/PATH` with the
  headers it reads (X-Repo-Commit, ETag, Content-Length) and byte ranges. A file can be given a
  plan for its successive GETs ("cut": send part of the body then drop the connection; "500";
  "ok"), and a repository a token it requires (401 without it).
* FakeIndex: a Python package index's simple API (PEP 503 HTML, $PIP_INDEX_URL).

Every request is logged as (method, path, headers with lower-case names).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


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


class FakeHub(_Server):
    def __init__(self):
        super().__init__(_HubHandler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.tokens: dict[str, str] = {}      # repo -> the token it requires
        self.plans: dict[str, list[str]] = {}  # file path -> what its next GETs do
        self.cut_bytes: int | None = None      # what a "cut" sends (None: half the body)

    def add(self, repo: str, files: dict[str, bytes], token: str | None = None) -> None:
        self.repos[repo] = files
        if token:
            self.tokens[repo] = token


class _HubHandler(_Handler):
    def _repo_ok(self, repo: str) -> bool:
        hub = self.server
        if repo not in hub.repos:
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return False
        want = hub.tokens.get(repo)
        if want and self.headers.get("Authorization") != f"Bearer {want}":
            self._send(401, b'{"error": "Invalid credentials"}', {"X-Error-Code": "GatedRepo"})
            return False
        return True

    def _serve(self, head: bool) -> None:
        hub = self.server
        path = urlsplit(self.path).path
        hub.log.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)/?$", path)
        if m and not head:
            if self._repo_ok(m.group(1)):
                tree = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest(),
                         "lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}}
                        for p, b in hub.repos[m.group(1)].items()]
                self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if not m:
            self._send(404)
            return
        repo, name = m.group(1), m.group(3)
        if not self._repo_ok(repo):
            return
        data = hub.repos[repo].get(name)
        if data is None:
            self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
            return
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        if head:
            self._send(200, data, headers, head=True)
            return
        plan = hub.plans.get(name)
        action = plan.pop(0) if plan else "ok"
        if action == "500":
            self._send(500, b"server error")
            return
        start = 0
        rng = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
        if rng:
            start = int(rng.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        self.send_response(206 if rng else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if action == "cut":  # part of the body, then the connection drops
            self.wfile.write(body[:hub.cut_bytes if hub.cut_bytes is not None else len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)


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
