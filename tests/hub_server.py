"""A Hub on 127.0.0.1 that answers huggingface_hub's upload calls as the Hub does, and records what arrives.

What the client sends (huggingface_hub 2.4, hf_api.py and _commit_api.py): POST /api/repos/create
{"name", "organization", "visibility"?, "type"}; POST /api/validate-yaml {"content", "repoType"} for a README.md;
POST /api/models/{repo}/preupload/{revision} {"files": [{"path", "sample", "size"}]}, answered here with
uploadMode "regular" for every file, so that each file's bytes come inline (base64) in the commit rather than
through LFS; POST /api/models/{repo}/commit/{revision}, NDJSON: a "header" line {"summary", "description"}, then
one "file" line per file {"path", "content", "encoding": "base64"}. GETs (a model's revision, tree) answer 404
RepoNotFound, as tests/test_hub.py's server does: huggingface_hub then uses its cache. With `fail` set, every
request answers 500."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Commit:
    repo_id: str
    revision: str
    header: dict
    files: dict[str, bytes]
    authorization: str | None


@dataclass
class FakeHub:
    url: str = ""
    fail: bool = False
    created: list[dict] = field(default_factory=list)  # (create bodies, with the Authorization header added)
    commits: list[Commit] = field(default_factory=list)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Authorization)

    def reset(self, fail: bool = False) -> None:
        self.fail = fail
        self.created.clear()
        self.commits.clear()
        self.requests.clear()


def serve() -> tuple[FakeHub, ThreadingHTTPServer, threading.Thread]:
    hub = FakeHub()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def send(self, status: int, payload: dict, error_code: str | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            if error_code:
                self.send_header("X-Error-Code", error_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))

        def do_GET(self):
            with lock:
                hub.requests.append(("GET", self.path, self.headers.get("Authorization")))
            self.send(404, {"error": "RepoNotFound"}, "RepoNotFound")

        do_HEAD = do_GET

        def do_POST(self):
            data = self.body()
            auth = self.headers.get("Authorization")
            path = self.path.split("?", 1)[0]
            with lock:
                hub.requests.append(("POST", path, auth))
            if hub.fail:
                self.send(500, {"error": "Internal Error"})
                return
            if path == "/api/repos/create":
                req = json.loads(data)
                with lock:
                    hub.created.append({**req, "authorization": auth})
                self.send(200, {"url": f"{hub.url}/{req.get('organization') or 'tester'}/{req['name']}"})
            elif path == "/api/validate-yaml":
                self.send(200, {"errors": [], "warnings": []})
            elif "/preupload/" in path:
                files = json.loads(data)["files"]
                self.send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                          for f in files]})
            elif "/commit/" in path:
                repo, revision = path[len("/api/models/"):].split("/commit/")
                lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                         for line in lines if line["key"] == "file"}
                assert not any(line["key"] == "lfsFile" for line in lines)  # every file was answered "regular"
                sha = hashlib.sha1(data).hexdigest()
                with lock:
                    hub.commits.append(Commit(repo, revision, header, files, auth))
                self.send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha})
            else:
                self.send(404, {"error": "not answered by this fake Hub"}, "EntryNotFound")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return hub, server, thread
