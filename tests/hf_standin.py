"""A local stand-in of the Hugging Face hub's endpoints that ``huggingface_hub`` calls, reached
through ``HF_ENDPOINT``: model info with the file list (sizes, LFS SHA-256s), ``resolve``
with the commit and ETag headers, range requests for resumed downloads; repositories that are
private (401 without the right token) or gated (403), files cut mid-body once, served
corrupted or slowly. Every request is recorded for the tests to inspect."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    private_token: str | None = None
    """Served only with this bearer token (401 otherwise)."""
    gated: bool = False
    """403 GatedRepo for every request."""
    cut_once: dict[str, int] = field(default_factory=dict)
    """Files whose first GET ends after this many bytes (the connection closed)."""
    corrupt: set[str] = field(default_factory=set)
    """Files served with a flipped byte (their SHA-256 in the listing is the true one's)."""
    slow: dict[str, float] = field(default_factory=dict)
    """Files served at this many seconds per 64 KiB."""
    hold: dict[str, tuple[int, threading.Event]] = field(default_factory=dict)
    """Files whose GET, once it has sent this many bytes, waits for the event (60 s at most)
    before the rest: a test sees the download in progress for as long as it needs."""


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Seen] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, name: str) -> list[Seen]:
        """The GETs of a file (its ``resolve`` URL ends with ``name``)."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + name)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _error(self, status: int, code: str | None, message: str = "") -> None:
                body = json.dumps({"error": message or code}).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                if message:
                    self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _repo(self, name: str) -> Repo | None:
                repo = hub.repos.get(name)
                if repo is None:
                    self._error(404, "RepoNotFound")
                    return None
                if repo.private_token is not None:
                    auth = self.headers.get("Authorization", "")
                    if auth != f"Bearer {repo.private_token}":
                        self._error(401, None, "Invalid username or password.")
                        return None
                if repo.gated:
                    self._error(403, "GatedRepo", "Access to model is restricted.")
                    return None
                return repo

            def _record(self) -> None:
                with hub.lock:
                    hub.requests.append(Seen(self.command, self.path, dict(self.headers)))

            def do_HEAD(self) -> None:
                self._record()
                self._serve(body=False)

            def do_GET(self) -> None:
                self._record()
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = self._repo("/".join(parts[2:4]))
                    if repo is not None:
                        self._info("/".join(parts[2:4]), repo)
                    return
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = self._repo("/".join(parts[:2]))
                    if repo is not None:
                        self._file(repo, "/".join(parts[4:]), body)
                    return
                self._error(404, None, "no such endpoint")

            def _info(self, name: str, repo: Repo) -> None:
                siblings = []
                for fname, data in sorted(repo.files.items()):
                    sha = hashlib.sha256(data).hexdigest()
                    siblings.append(
                        {
                            "rfilename": fname,
                            "size": len(data),
                            "blobId": hashlib.sha1(data).hexdigest(),
                            "lfs": {"sha256": sha, "size": len(data), "pointerSize": 134},
                        }
                    )
                info = {
                    "_id": "x",
                    "id": name,
                    "modelId": name,
                    "sha": repo.commit,
                    "private": repo.private_token is not None,
                    "gated": False,
                    "disabled": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": ["gguf"],
                    "siblings": siblings,
                }
                data = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _file(self, repo: Repo, fname: str, body: bool) -> None:
                data = repo.files.get(fname)
                if data is None:
                    self._error(404, "EntryNotFound")
                    return
                sha = hashlib.sha256(data).hexdigest()
                served = data
                if fname in repo.corrupt:
                    served = bytes([data[0] ^ 0xFF]) + data[1:]
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[len("bytes=") :].split("-")[0] or 0)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                cut = repo.cut_once.pop(fname, None) if start == 0 else None
                if cut is not None:
                    self.wfile.write(served[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                delay = repo.slow.get(fname)
                held = repo.hold.get(fname)
                if delay is None and held is None:
                    self.wfile.write(served[start:])
                    return
                for at in range(start, len(served), 1 << 16):
                    if held is not None and at >= held[0]:
                        self.wfile.flush()
                        held[1].wait(60)
                        held = None
                    self.wfile.write(served[at : at + (1 << 16)])
                    self.wfile.flush()
                    if delay is not None:
                        time.sleep(delay)

        return Handler
