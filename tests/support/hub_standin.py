"""A stand-in for the Hugging Face Hub on 127.0.0.1, answering what ``huggingface_hub`` asks.

Point ``HF_ENDPOINT`` at :attr:`HubStandIn.endpoint`. It serves, as the Hub does (read from
the installed ``huggingface_hub``: ``HfApi.model_info``, ``get_hf_file_metadata``,
``http_get``):

- ``GET /api/models/OWNER/REPO[/revision/REV]`` (``?blobs=true``): the repository's commit
  (``sha``) and ``siblings`` with ``size``, ``blobId`` and ``lfs`` {``size``, ``sha256``,
  ``pointerSize``}; an unknown repository is a 404 with ``X-Error-Code: RepoNotFound``;
- ``HEAD`` / ``GET /OWNER/REPO/resolve/REV/FILE``: ``X-Repo-Commit``, ``ETag``,
  ``X-Linked-Etag`` (the sha256), ``X-Linked-Size``, ``Content-Length``, ``Accept-Ranges``,
  and ``Range: bytes=N-`` answered with 206 and ``Content-Range``.

Faults a test can ask for: ``drop_after[FILE] = n`` sends the full length but closes the
connection after ``n`` bytes, once (a dropped connection mid-file); ``corrupt.add(FILE)``
serves bytes that do not match the advertised sha256. Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def record(self, r: Request) -> None:
        with self._lock:
            self.requests.append(r)

    def gets(self, file: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + file)]


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _path(self) -> str:
            return unquote(urlsplit(self.path).path)

        def _note(self):
            hub.record(Request(self.command, self._path(), self.headers.get("Range"),
                               self.headers.get("Authorization")))

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _not_found(self, repo: str):
            self._send(404, json.dumps({"error": "Repository not found"}).encode(),
                       {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found",
                        "Content-Type": "application/json"}, head=self.command == "HEAD")

        def do_GET(self):
            self._note()
            m = _API.match(self._path())
            if m:
                return self._api(m["repo"])
            m = _RESOLVE.match(self._path())
            if m:
                return self._resolve(m["repo"], m["file"], head=False)
            self._send(404, b"not found")

        def do_HEAD(self):
            self._note()
            m = _RESOLVE.match(self._path())
            if m:
                return self._resolve(m["repo"], m["file"], head=True)
            self._send(404, head=True)

        def _api(self, repo: str):
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found(repo)
            siblings = [{"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest(),
                         "lfs": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}}
                        for name, data in files.items()]
            doc = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}
            self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

        def _resolve(self, repo: str, file: str, head: bool):
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found(repo)
            if file not in files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, head=True)
            data = files[file]
            sha = hashlib.sha256(data).hexdigest()
            if file in hub.corrupt:
                data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
            meta = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": len(data), "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if head:
                return self._send(200, data, meta, head=True)
            start = 0
            rng = self.headers.get("Range")
            if rng:
                m = re.match(r"^bytes=(\d+)-$", rng.strip())
                if not m or int(m[1]) >= len(data):
                    return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                start = int(m[1])
            body = data[start:]
            self.send_response(206 if rng else 200)
            for k, v in meta.items():
                self.send_header(k, str(v))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = hub.drop_after.pop(file, None)
            if cut is not None and cut < len(body):
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True  # the rest never comes: the client sees a short body
                return
            self.wfile.write(body)

    return Handler


# -- every connection this process opens ------------------------------------------------------
_watch: list[list] = []


def _audit(event: str, args) -> None:
    if _watch and event == "socket.connect":
        for seen in _watch:
            seen.append(args[1])


_installed = False


@contextmanager
def connections():
    """The addresses every socket of this process connected to while inside (an audit hook)."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True
    seen: list = []
    _watch.append(seen)
    try:
        yield seen
    finally:
        _watch.remove(seen)
