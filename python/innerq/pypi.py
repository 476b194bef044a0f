"""A project's newest wheel from a Python package index, over plain HTTP, for environments
without pip (a virtual environment made with --without-pip, uv's): `innerq pull` uses pip
where it is installed, since pip also honours its configuration files, and this otherwise.

The index is pip's simple repository API (PEP 503 HTML; PEP 691 JSON where the index offers
it) at $PIP_INDEX_URL, else PyPI's. A file with a sha256 in its link is checked against it.
Importable without the native library.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

PYPI_SIMPLE = "https://pypi.org/simple"
_JSON = "application/vnd.pypi.simple.v1+json"


def index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or PYPI_SIMPLE).rstrip("/")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _Links(HTMLParser):
    """The anchors of a PEP 503 project page: (href, text, yanked)."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str, bool]] = []
        self._open: tuple[str, bool] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            a = dict(attrs)
            self._open = (a.get("href") or "", "data-yanked" in a)
            self.links.append((self._open[0], "", self._open[1]))

    def handle_data(self, data):
        if self._open is not None:
            href, yanked = self._open
            self.links[-1] = (href, self.links[-1][1] + data, yanked)

    def handle_endtag(self, tag):
        if tag == "a":
            self._open = None


def _project_files(project: str) -> list[tuple[str, str, str | None]]:
    """(file name, absolute URL, sha256 or None) of every file of project the index lists,
    yanked ones left out."""
    page = f"{index_url()}/{_normalize(project)}/"
    req = urllib.request.Request(page, headers={"Accept": f"{_JSON}, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
        kind = r.headers.get("Content-Type", "")
        base = r.geturl()
    out = []
    if kind.startswith(_JSON):
        for f in json.loads(body)["files"]:
            if not f.get("yanked"):
                out.append((f["filename"], urllib.parse.urljoin(base, f["url"]), f.get("hashes", {}).get("sha256")))
        return out
    links = _Links()
    links.feed(body.decode("utf-8", "replace"))
    for href, text, yanked in links.links:
        if yanked:
            continue
        url, _, frag = urllib.parse.urljoin(base, href).partition("#")
        sha = frag[len("sha256="):] if frag.startswith("sha256=") else None
        out.append((text.strip() or url.rsplit("/", 1)[-1], url, sha))
    return out


def _version_key(version: str) -> tuple:
    """Orders release versions (1.10 after 1.9); a pre-release sorts before its release."""
    parts = re.findall(r"\d+|[a-z]+", version.lower())
    final = not any(p.isalpha() for p in parts)
    return tuple(int(p) for p in parts if p.isdigit()), final


def newest_wheel(project: str) -> tuple[str, str, str | None]:
    """(file name, URL, sha256) of the newest pure-Python wheel of project on the index."""
    # a wheel's name is {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    wheels = [f for f in _project_files(project) if f[0].endswith("-none-any.whl") and f[0].count("-") >= 4
              and _normalize(f[0].split("-")[0]) == _normalize(project)]
    if not wheels:
        raise RuntimeError(f"{index_url()} lists no wheel of {project}")
    return max(wheels, key=lambda f: _version_key(f[0].split("-")[1]))


def download_wheel(project: str, dest_dir: Path, progress=None) -> Path:
    """Downloads the newest wheel of project into dest_dir (checked against its sha256 where
    the index gives one); `progress(done_bytes, total_bytes)` is called as it arrives."""
    name, url, sha256 = newest_wheel(project)
    path = Path(dest_dir) / Path(name).name
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as r, open(path, "wb") as out:
        total, done = int(r.headers.get("Content-Length") or 0), 0
        while chunk := r.read(1 << 20):
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total or done)
    if sha256 and digest.hexdigest() != sha256.lower():
        path.unlink()
        raise RuntimeError(f"{name} from {url}: sha256 {digest.hexdigest()}, the index says {sha256}")
    return path
