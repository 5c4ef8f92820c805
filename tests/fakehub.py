"""A stand-in for the Hugging Face hub on 127.0.0.1: the other side of the boundary.

Serves the two endpoints huggingface-hub uses here (the repository tree, and
``resolve`` with HEAD, GET and HTTP range requests), from local files, and
counts the bytes it sends so tests can check that only headers were read.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "a" * 40


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Path]], size_override: dict[str, int] | None = None,
                 ignore_range: bool = False) -> None:
        self.repos = repos
        self.size_override = size_override or {}
        self.ignore_range = ignore_range  # a mirror without range support: 200 and the whole file, always
        self.bytes_sent = 0
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _serve(self, head: bool):
                hub.requests.append(f"{self.command} {self.path}")
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/[^/?]+", self.path)
                if m:
                    files = hub.repos.get(m.group(1))
                    if files is None:
                        return self._error(404, "RepoNotFound")
                    body = json.dumps([{"type": "file", "path": n, "size": p.stat().st_size, "oid": "0" * 40}
                                       for n, p in files.items()]).encode()
                    return self._send(200, body, {"Content-Type": "application/json"}, head)
                m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", self.path)
                if not m or m.group(1) not in hub.repos:
                    return self._error(404, "RepoNotFound")
                path = hub.repos[m.group(1)].get(m.group(2))
                if path is None:
                    return self._error(404, "EntryNotFound")
                real_size = path.stat().st_size
                size = hub.size_override.get(m.group(2), real_size)
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha256(path)}"',
                           "Accept-Ranges": "none" if hub.ignore_range else "bytes",
                           "Content-Type": "application/octet-stream"}
                rng = self.headers.get("Range")
                if hub.ignore_range and not head:  # the whole file, streamed from disk
                    self.send_response(200)
                    for k, v in {**headers, "Content-Length": str(real_size)}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    try:
                        with open(path, "rb") as fh:
                            while block := fh.read(1 << 20):
                                self.wfile.write(block)
                                hub.bytes_sent += len(block)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client took what it needed and hung up
                    return None
                if head:
                    return self._send(200, b"", {**headers, "Content-Length": str(size)}, head)
                if rng:
                    a, b = rng.removeprefix("bytes=").split("-")
                    start, end = int(a), min(int(b) if b else size - 1, size - 1)
                    with open(path, "rb") as fh:  # only the range, never the whole file
                        fh.seek(start)
                        chunk = fh.read(max(0, end + 1 - start))
                    chunk += bytes(end + 1 - start - len(chunk))  # past the real file (size_override): zeros
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
                    return self._send(206, chunk, headers, head)
                data = path.read_bytes()
                headers["Content-Length"] = str(size)
                return self._send(200, data, headers, head, length=size)

            def _error(self, code: int, kind: str):
                self._send(code, json.dumps({"error": kind}).encode(), {"X-Error-Code": kind,
                                                                         "Content-Type": "application/json"}, False)

            def _send(self, code, body, headers, head, length=None):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                    hub.bytes_sent += len(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
