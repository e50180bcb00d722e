"""A Hub on 127.0.0.1 that answers huggingface_hub's upload calls as the Hub does, and records what arrives.

What the client sends (huggingface_hub 2.4, hf_api.py, _commit_api.py and lfs.py): POST /api/repos/create
{"name", "organization", "visibility"?, "type"}; POST /api/validate-yaml {"content", "repoType"} for a README.md;
POST /api/models/{repo}/preupload/{revision} {"files": [{"path", "sample", "size"}]}, answered as the Hub does
(`upload_mode`): "lfs" for the weights' suffixes of the Hub's default .gitattributes, for a file of 10 MB or more and
for binary content (a NUL byte in the 512-byte sample), else "regular". The LFS files then go through the Git LFS
batch API: POST /{repo}.git/info/lfs/objects/batch {"operation": "upload", "objects": [{"oid", "size"}]} with the
token, answered with an upload href per object not stored yet (a presigned URL, as the Hub's storage hrefs: the
client PUTs the bytes there without its token, and the signature in the URL is what lets it in) and a verify href;
PUT the bytes in one request, or, with `lfs_multipart` set, an object larger than it in parts of that many bytes:
the upload action's header then holds "chunk_size" and one presigned URL per part ("00001", ...), the client PUTs
each part there and POSTs {"oid", "parts": [{"partNumber", "etag"}]} to the href, which joins the parts whose
ETags match; then POST the verify href {"oid", "size"} with the token, answered 200 only when the stored object
has that size and sha256. Then POST /api/models/{repo}/commit/{revision}, NDJSON: a "header" line
{"summary", "description"}, one "file" line per regular file {"path", "content", "encoding": "base64"} and one
"lfsFile" line per LFS file {"path", "algo": "sha256", "oid", "size"}: the committed file is assembled from the
stored object, and a commit naming an object the store does not hold (or holds with another size or hash) is
refused whole (422), as the Hub refuses it. GETs (a model's revision, tree) answer 404 RepoNotFound, as
tests/test_hub.py's server does: huggingface_hub then uses its cache.

The client takes this LFS path where hf_xet is not installed or HF_HUB_DISABLE_XET=1; with hf_xet it uploads the
LFS files to the Hub's Xet storage instead, which this server does not answer (the tests set HF_HUB_DISABLE_XET=1).

Faults: `hang` (a piece of a path) reads such a request and never answers it (until the server shuts down), as a
Hub that accepts connections and then stalls; `silent()` is a server that accepts connections and never answers
anything; `fail` answers 500 to every POST (with `retry_after`, a Retry-After header of that many seconds);
`lfs_fault="500"` answers the storage PUTs (whole or part) 500 (with Retry-After: 0, so that the client's retries
do not wait seconds each); `lfs_fault="short"` keeps only the first
half of each upload (or of each part: a cut transfer) and answers 200, which the verify call then finds."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The Hub's default .gitattributes (a new repo's) sends these through LFS whatever their size or content.
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack", ".model", ".npy",
                ".npz", ".pkl", ".pickle", ".zip", ".gz", ".tar", ".tgz", ".zst", ".xz", ".7z", ".arrow", ".parquet")
LFS_THRESHOLD = 10 * 1000 * 1000  # bytes: the Hub refuses a regular (non-LFS) file of 10 MB or more
BATCH = ".git/info/lfs/objects/batch"
VERIFY = ".git/info/lfs/objects/verify"
STORE = "/lfs-store/"


def upload_mode(path: str, size: int, sample: bytes, threshold: int = LFS_THRESHOLD) -> str:
    if path.endswith(LFS_SUFFIXES) or size >= threshold or b"\0" in sample:
        return "lfs"
    return "regular"


@dataclass
class Commit:
    repo_id: str
    revision: str
    header: dict
    files: dict[str, bytes]
    authorization: str | None
    lfs: dict[str, tuple[str, int]] = field(default_factory=dict)  # path -> (oid: sha256 hex, size) of its lfsFile line


@dataclass
class FakeHub:
    url: str = ""
    fail: bool = False
    hang: str | None = None  # requests whose path holds this get no answer
    retry_after: int | None = None  # with `fail`: the Retry-After (seconds) each 500 asks for
    lfs_fault: str | None = None  # None, "500" or "short" (see the module's docstring)
    lfs_threshold: int = LFS_THRESHOLD
    lfs_multipart: int | None = None  # part size: larger objects are uploaded in parts of this many bytes
    created: list[dict] = field(default_factory=list)  # (create bodies, with the Authorization header added)
    commits: list[Commit] = field(default_factory=list)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Authorization)
    batches: list[dict] = field(default_factory=list)  # the LFS batch bodies, with "authorization" and "accept" added
    objects: dict[str, bytes] = field(default_factory=dict)  # the LFS store: what each PUT left, by the oid in its URL
    parts: dict[tuple[str, int], bytes] = field(default_factory=dict)  # (oid, part number) -> a multipart upload's part
    secret: bytes = field(default_factory=lambda: os.urandom(16))  # signs the storage hrefs

    def reset(self, fail: bool = False, lfs_fault: str | None = None, lfs_threshold: int = LFS_THRESHOLD,
              lfs_multipart: int | None = None, hang: str | None = None, retry_after: int | None = None) -> None:
        self.fail, self.lfs_fault, self.hang, self.retry_after = fail, lfs_fault, hang, retry_after
        self.lfs_threshold, self.lfs_multipart = lfs_threshold, lfs_multipart
        for records in (self.created, self.commits, self.requests, self.batches, self.objects, self.parts):
            records.clear()

    def signed(self, path: str) -> str:
        """A presigned storage URL for `path` (/lfs-store/...)."""
        return f"{self.url}{path}?X-Amz-Signature={self.signature(path)}"

    def signature(self, path: str) -> str:
        return hmac.new(self.secret, path.encode(), hashlib.sha256).hexdigest()

    def stored(self, oid: str, size: int) -> bool:
        data = self.objects.get(oid)
        return data is not None and len(data) == size and hashlib.sha256(data).hexdigest() == oid


def silent() -> tuple[str, "callable"]:
    """A server on 127.0.0.1 that accepts every connection and never answers: (its URL, the function that stops it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    held, stopped = [], threading.Event()

    def accept():
        while not stopped.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            held.append(conn)  # kept open, unread and unanswered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()

    def stop():
        stopped.set()
        thread.join(10)
        listener.close()
        for conn in held:
            conn.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}", stop


def serve() -> tuple[FakeHub, ThreadingHTTPServer, threading.Thread]:
    hub = FakeHub()
    lock = threading.Lock()
    stopped = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def send(self, status: int, payload: dict, error_code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            if error_code:
                self.send_header("X-Error-Code", error_code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # a streamed file of unknown length
                parts = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))

        def record(self) -> tuple[str, str | None]:
            auth = self.headers.get("Authorization")
            path = self.path.split("?", 1)[0]
            with lock:
                hub.requests.append((self.command, path, auth))
            if hub.hang and hub.hang in path:
                stopped.wait(600)  # no answer; the server's shutdown ends the wait
            return path, auth

        def do_GET(self):
            self.record()
            self.send(404, {"error": "RepoNotFound"}, "RepoNotFound")

        do_HEAD = do_GET

        def presigned(self, path: str) -> bool:
            query = dict(p.split("=", 1) for p in self.path.partition("?")[2].split("&") if "=" in p)
            return path.startswith(STORE) and hmac.compare_digest(query.get("X-Amz-Signature", ""), hub.signature(path))

        def do_PUT(self):
            """The storage's presigned href (/lfs-store/OID, or /lfs-store/OID/part/N of a multipart upload): the
            signature in the URL, not a token, lets the bytes in."""
            data = self.body()
            path, _ = self.record()
            oid, _, part = path[len(STORE):].partition("/part/")
            if not self.presigned(path):
                self.send(403, {"error": "SignatureDoesNotMatch"})
            elif hub.lfs_fault == "500":
                self.send(500, {"error": "InternalError"}, headers={"Retry-After": "0"})
            else:
                kept = data[: len(data) // 2] if hub.lfs_fault == "short" else data
                with lock:
                    if part:
                        hub.parts[oid, int(part)] = kept
                    else:
                        hub.objects[oid] = kept
                self.send(200, {}, headers={"ETag": f'"{hashlib.md5(kept).hexdigest()}"'})

        def complete(self, path: str, req: dict) -> None:
            """A multipart upload's completion (its upload href): the parts joined in order, each ETag checked."""
            oid = path[len(STORE):]
            stored = [hub.parts.get((oid, p["partNumber"])) for p in req["parts"]]
            if not self.presigned(path) or req["oid"] != oid:
                self.send(403, {"error": "SignatureDoesNotMatch"})
            elif [p["partNumber"] for p in req["parts"]] != list(range(1, len(stored) + 1)) or any(
                    b is None or p["etag"].strip('"') != hashlib.md5(b).hexdigest()
                    for p, b in zip(req["parts"], stored)):
                self.send(400, {"error": "InvalidPart"})
            else:
                with lock:
                    hub.objects[oid] = b"".join(stored)
                self.send(200, {})

        def do_POST(self):
            data = self.body()
            path, auth = self.record()
            if hub.fail:
                wait = {"Retry-After": str(hub.retry_after)} if hub.retry_after is not None else None
                self.send(500, {"error": "Internal Error"}, headers=wait)
                return
            if path.startswith(STORE):
                self.complete(path, json.loads(data))
            elif path.endswith((BATCH, VERIFY)) and auth is None:
                self.send(401, {"error": "Invalid credentials in Authorization header"})
            elif path == "/api/repos/create":
                req = json.loads(data)
                with lock:
                    hub.created.append({**req, "authorization": auth})
                self.send(200, {"url": f"{hub.url}/{req.get('organization') or 'tester'}/{req['name']}"})
            elif path == "/api/validate-yaml":
                self.send(200, {"errors": [], "warnings": []})
            elif "/preupload/" in path:
                files = json.loads(data)["files"]
                self.send(200, {"files": [{"path": f["path"], "shouldIgnore": False, "uploadMode": upload_mode(
                    f["path"], f["size"], base64.b64decode(f["sample"]), hub.lfs_threshold)} for f in files]})
            elif path.endswith(BATCH):
                self.batch(path[1:-len(BATCH)], json.loads(data), auth)
            elif path.endswith(VERIFY):
                req = json.loads(data)
                if hub.stored(req["oid"], req["size"]):
                    self.send(200, {"message": "Object verified"})
                else:
                    self.send(422, {"error": f"Object {req['oid']} of size {req['size']} is not in storage "
                                             "(or another size or hash)"})
            elif "/commit/" in path:
                self.commit(*path[len("/api/models/"):].split("/commit/"), data, auth)
            else:
                self.send(404, {"error": "not answered by this fake Hub"}, "EntryNotFound")

        def batch(self, repo: str, req: dict, auth: str | None) -> None:
            with lock:
                hub.batches.append({**req, "repo": repo, "authorization": auth, "accept": self.headers.get("Accept")})
            objects = []
            for obj in req["objects"]:
                oid, size = obj["oid"], obj["size"]
                if hub.stored(oid, size):  # already in storage: nothing to upload
                    objects.append({"oid": oid, "size": size})
                    continue
                upload = {"href": hub.signed(f"{STORE}{oid}"), "header": {}}
                if hub.lfs_multipart and size > hub.lfs_multipart:  # the completion href, and one URL per part
                    upload["header"] = {"chunk_size": str(hub.lfs_multipart), **{
                        f"{n:05d}": hub.signed(f"{STORE}{oid}/part/{n}")
                        for n in range(1, math.ceil(size / hub.lfs_multipart) + 1)}}
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": upload, "verify": {"href": f"{hub.url}/{repo}{VERIFY}", "header": {}}}})
            body = json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.git-lfs+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def commit(self, repo: str, revision: str, data: bytes, auth: str | None) -> None:
            lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            files, lfs = {}, {}
            for line in lines:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value.get("algo") != "sha256" or not hub.stored(value["oid"], value["size"]):
                        self.send(422, {"error": f"{value['path']}: the LFS object {value['oid']} is not in storage"})
                        return  # the commit is refused whole: nothing of it lands
                    files[value["path"]] = hub.objects[value["oid"]]
                    lfs[value["path"]] = (value["oid"], value["size"])
                elif line["key"] != "header":
                    self.send(422, {"error": f"this fake Hub answers no {line['key']!r} operation"})
                    return
            sha = hashlib.sha1(data).hexdigest()
            with lock:
                hub.commits.append(Commit(repo, revision, header, files, auth, lfs))
            self.send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha})

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def shutdown(self):
            stopped.set()  # a hung request ends
            super().shutdown()

    server = Server(("127.0.0.1", 0), Handler)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return hub, server, thread
