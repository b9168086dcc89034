"""TEST DOUBLE of the Hugging Face Hub HTTP API, for offline end-to-end tests only.

This is not a Hub implementation to deploy anywhere: it keeps everything in memory, has one
hard-coded user, no real git objects and no security beyond a token comparison. It exists so
that the real `huggingface_hub` client (and transformers on top of it) can publish and
download models in tests without network access. It speaks the subset of the Hub API the
client uses for publishing and loading models:

- accounts:   GET  /api/whoami-v2
- repos:      POST /api/repos/create (409 when it exists), DELETE /api/repos/delete,
              PUT /api/models/{repo}/settings (visibility)
- info:       GET  /api/models/{repo}[/revision/{rev}] (sha, siblings, private)
- listing:    GET  /api/models/{repo}/tree/{rev}[/{path}] (recursive), POST .../paths-info/{rev},
              GET  /api/models/{repo}/commits/{rev}
- refs:       GET  /api/models/{repo}/refs, POST/DELETE .../branch/{name}, POST .../tag/{rev},
              DELETE .../tag/{name}
- uploads:    POST /api/models/{repo}/preupload/{rev} (binary weights go through LFS, small text
              files inline), POST /{repo}.git/info/lfs/objects/batch (LFS "basic" transfer) with
              the PUT upload and verify URLs it hands out, POST /api/models/{repo}/commit/{rev}
              (NDJSON: header, file (base64), lfsFile, deletedFile, deletedFolder)
- model card: POST /api/validate-yaml
- downloads:  GET/HEAD /{repo}/resolve/{rev}/{path}: regular files are served directly with
              X-Repo-Commit, ETag (git blob sha1) and Content-Length; LFS files answer 302 to a
              second "CDN" host (another loopback address, so the client drops its token as for the
              real CDN; 127.0.0.2) with X-Linked-Etag (sha256) and X-Linked-Size. Range requests get 206.

Not spoken: xet storage (clients must run with HF_HUB_DISABLE_XET=1, or `upload_folder` takes
the xet pipeline when hf_xet is installed), pull requests, LFS multipart transfers.

Errors carry the `X-Error-Code` header the client maps to its exceptions: RepoNotFound (404,
or 401 without a valid token for a private repo), RevisionNotFound, EntryNotFound (with
X-Repo-Commit, so the client can cache that an optional file is absent).

Storage: per repo a dict of commits (id = sha1 hex of the commit content), branches and tags
pointing at commit ids, and blobs keyed by git sha1 (regular) or sha256 (LFS). Every request is
recorded in `HubServer.requests` so tests can assert, for example, that offline loading made
no request at all; `HubServer.failing_commits` makes the next commits fail with a 500.
"""

import base64
import fnmatch
import hashlib
import json
import re
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

USER_NAME = "test-user"
USER_ORGS = ("test-org",)
# Files the real Hub stores through LFS by default (its initial .gitattributes), plus size.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf")
LFS_MIN_SIZE = 10 * 1024 * 1024
INITIAL_GITATTRIBUTES = "".join(f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in LFS_PATTERNS)
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class FileEntry:
    size: int
    git_oid: str  # sha1 of the blob (for LFS files: of the pointer file, as on the Hub)
    lfs_sha256: str | None = None


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: str
    files: dict  # path -> FileEntry


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: str
    commits: dict = field(default_factory=dict)  # oid -> Commit
    branches: dict = field(default_factory=dict)  # name -> commit oid
    tags: dict = field(default_factory=dict)  # name -> commit oid
    blobs: dict = field(default_factory=dict)  # git sha1 -> bytes (regular files)
    lfs: dict = field(default_factory=dict)  # sha256 -> bytes (LFS objects, uploaded before commit)

    def resolve(self, revision: str) -> Commit | None:
        """Branch, tag or (possibly abbreviated) commit id -> commit."""
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and re.fullmatch(r"[0-9a-f]{7,40}", revision):
            matches = [c for c in self.commits if c.startswith(revision)]
            oid = matches[0] if len(matches) == 1 else None
        return self.commits.get(oid) if oid else None


class HubError(Exception):
    """An HTTP error answer with the Hub's error code header."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **body):
        super().__init__(message)
        self.status, self.message, self.code, self.headers, self.body = status, message, code, headers or {}, body


class NoRoute(HubError):
    """A request this double does not implement: recorded so tests notice a client using it."""

    def __init__(self, method: str, path: str):
        super().__init__(404, f"No route for {method} {path}")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class HubState:
    """All repos plus the single valid token; one lock serialises every request."""

    def __init__(self, token: str):
        self.token = token
        self.repos: dict = {}  # (repo_type, repo_id) -> Repo
        self.lock = threading.RLock()
        self.commit_counter = 0

    def new_commit(self, repo: Repo, parent: Commit | None, title: str, message: str, files: dict) -> Commit:
        self.commit_counter += 1
        listing = "".join(f"{p} {e.git_oid}\n" for p, e in sorted(files.items()))
        content = f"{parent.oid if parent else ''}\n{title}\n{message}\n{listing}{self.commit_counter}"
        commit = Commit(hashlib.sha1(content.encode()).hexdigest(), parent.oid if parent else None, title, message, _now(), files)
        repo.commits[commit.oid] = commit
        return commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "HubTestDouble/1.0"
    hub: "HubServer"  # set on the per-server subclass

    # --- plumbing -----------------------------------------------------------------------------
    def log_message(self, format, *args):  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query, keep_blank_values=True)
        self.body = self._read_body()
        # Keep %2F inside segments: revisions like "refs%2Fpr%2F1" are one segment.
        self.segments = [unquote(s) for s in url.path.split("/")[1:]]
        status = 500
        try:
            with self.hub.state.lock:
                status = self.hub.route(self, method)
        except HubError as error:
            status = error.status
            if isinstance(error, NoRoute):
                self.hub.server.unrouted.append((method, self.path))
            headers = dict(error.headers)
            if error.code:
                headers["X-Error-Code"] = error.code
            headers["X-Error-Message"] = error.message
            self._send_json(error.status, {"error": error.message, **error.body}, headers, method)
        except Exception as error:  # a bug in the double: answer 500 and let the tests see it
            self.hub.server.crashes.append((method, self.path, traceback.format_exc()))
            self._send_json(500, {"error": f"test double crashed: {error!r}"}, {}, method)
        finally:
            self.hub.requests.append((self.hub.name, method, self.path, status, self.headers.get("Authorization")))

    def _send(self, status: int, body: bytes, headers: dict, method: str) -> int:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, str(value))
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)
        return status

    def _send_json(self, status: int, payload, headers: dict | None = None, method: str = "GET") -> int:
        return self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})}, method)

    def json_body(self):
        try:
            return json.loads(self.body or b"{}")
        except ValueError:
            raise HubError(400, "Invalid JSON body") from None

    def bearer(self) -> str | None:
        value = self.headers.get("Authorization", "")
        return value[len("Bearer "):] if value.startswith("Bearer ") else None


class HubServer:
    """The Hub test double: an API server and a "CDN" server for LFS blobs, both on 127.0.0.1."""

    def __init__(self, token: str = "hf_test_dummy_token"):
        self.state = HubState(token)
        self.requests: list = []  # (server name, method, path, status, authorization header)
        self.unrouted: list = []  # (method, path) of requests no route handles
        self.crashes: list = []  # (method, path, traceback) of requests the double failed on
        self.failing_commits = 0  # tests set this to make the next commits fail like a Hub outage
        self._api = self._make_server("api")
        self._cdn = self._make_server("cdn")
        self.endpoint = f"http://127.0.0.1:{self._api.server_address[1]}"
        cdn_host = "localhost" if self._cdn.server_address[0] == "127.0.0.1" else self._cdn.server_address[0]
        self.cdn_endpoint = f"http://{cdn_host}:{self._cdn.server_address[1]}"
        self._threads = []

    @property
    def token(self) -> str:
        return self.state.token

    def _make_server(self, name: str) -> ThreadingHTTPServer:
        hub = _NamedView(self, name)
        handler = type(f"_{name.title()}Handler", (_Handler,), {"hub": hub})
        # The CDN must be another *host* (not just port): clients drop the token only then.
        # Linux routes all of 127/8 to loopback; elsewhere fall back to the name "localhost".
        for address in (("127.0.0.1",) if name == "api" else ("127.0.0.2", "127.0.0.1")):
            try:
                server = ThreadingHTTPServer((address, 0), handler)
                break
            except OSError:
                continue
        server.daemon_threads = True
        return server

    def start(self) -> "HubServer":
        for server in (self._api, self._cdn):
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for server in (self._api, self._cdn):
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- helpers for tests -------------------------------------------------------------------
    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.state.repos[(repo_type, repo_id)]


class _NamedView:
    """Routes one listening socket: "api" serves the Hub, "cdn" only serves LFS blobs."""

    def __init__(self, server: HubServer, name: str):
        self.server, self.name = server, name
        self.state, self.requests = server.state, server.requests

    def route(self, request: _Handler, method: str) -> int:
        if self.name == "cdn":
            return _serve_cdn(self.server, request, method)
        return _route_api(self.server, request, method)


# --- routing ---------------------------------------------------------------------------------


def _route_api(hub: HubServer, req: _Handler, method: str) -> int:
    seg = req.segments
    if seg[:2] == ["api", "whoami-v2"]:
        return _whoami(hub, req)
    if seg[:3] == ["api", "repos", "create"] and method == "POST":
        return _create_repo(hub, req)
    if seg[:3] == ["api", "repos", "delete"] and method == "DELETE":
        return _delete_repo(hub, req)
    if seg[:2] == ["api", "validate-yaml"] and method == "POST":
        return _validate_yaml(req)
    if seg[0] == "api" and len(seg) >= 4 and seg[1] in REPO_TYPES:
        return _route_repo_api(hub, req, method, REPO_TYPES[seg[1]], f"{seg[2]}/{seg[3]}", seg[4:])
    if seg[0] == "lfs-upload" and method == "PUT":
        return _lfs_put(hub, req)
    if seg[0] == "lfs-verify" and method == "POST":
        return _lfs_verify(hub, req)
    # /{repo}.git/info/lfs/objects/batch and /{repo}/resolve/{rev}/{path}, with a type prefix
    repo_type = "model"
    if seg[0] in REPO_TYPES and seg[0] != "models":
        repo_type, seg = REPO_TYPES[seg[0]], seg[1:]
    if len(seg) >= 6 and seg[1].endswith(".git") and seg[2:6] == ["info", "lfs", "objects", "batch"]:
        return _lfs_batch(hub, req, repo_type, f"{seg[0]}/{seg[1][:-4]}")
    if len(seg) >= 5 and seg[2] == "resolve" and method in ("GET", "HEAD"):
        return _resolve(hub, req, method, repo_type, f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]))
    raise NoRoute(method, req.path)


def _route_repo_api(hub, req, method, repo_type, repo_id, rest) -> int:
    if not rest and method == "GET":
        return _repo_info(hub, req, repo_type, repo_id, "main")
    action, args = rest[0] if rest else "", rest[1:]
    if action == "revision" and args and method == "GET":
        return _repo_info(hub, req, repo_type, repo_id, args[0])
    if action == "tree" and args and method == "GET":
        return _tree(hub, req, repo_type, repo_id, args[0], "/".join(args[1:]))
    if action == "paths-info" and args and method == "POST":
        return _paths_info(hub, req, repo_type, repo_id, args[0])
    if action == "commits" and args and method == "GET":
        return _list_commits(hub, req, repo_type, repo_id, args[0])
    if action == "refs" and method == "GET":
        return _list_refs(hub, req, repo_type, repo_id)
    if action == "branch" and args:
        return _branch(hub, req, method, repo_type, repo_id, args[0])
    if action == "tag" and args and method == "POST":
        return _create_tag(hub, req, repo_type, repo_id, args[0])
    if action == "tag" and args and method == "DELETE":
        return _delete_tag(hub, req, repo_type, repo_id, args[0])
    if action == "settings" and method == "PUT":
        return _update_settings(hub, req, repo_type, repo_id)
    if action == "preupload" and args and method == "POST":
        return _preupload(hub, req, repo_type, repo_id, args[0])
    if action == "commit" and args and method == "POST":
        return _commit(hub, req, repo_type, repo_id, args[0])
    raise NoRoute(method, req.path)


# --- access ----------------------------------------------------------------------------------


def _require_token(hub: HubServer, req: _Handler) -> None:
    if req.bearer() != hub.token:
        raise HubError(401, "Invalid credentials in Authorization header")


def _get_repo(hub: HubServer, req: _Handler, repo_type: str, repo_id: str, write: bool = False) -> Repo:
    """The repo, hidden like the Hub hides it: private repos are 'not found' without the token."""
    repo = hub.state.repos.get((repo_type, repo_id))
    authorised = req.bearer() == hub.token
    if repo is None or (repo.private and not authorised):
        # the Hub answers 401 to anonymous callers and 404 to authenticated ones
        raise HubError(404 if authorised else 401, "Repository not found", "RepoNotFound")
    if write and not authorised:
        raise HubError(401, "Invalid credentials in Authorization header")
    return repo


def _get_commit(repo: Repo, revision: str) -> Commit:
    commit = repo.resolve(revision)
    if commit is None:
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
    return commit


# --- account and repos -----------------------------------------------------------------------


def _whoami(hub, req) -> int:
    _require_token(hub, req)
    orgs = [{"type": "org", "name": org, "roleInOrg": "write"} for org in USER_ORGS]
    payload = {
        "type": "user",
        "id": "0" * 24,
        "name": USER_NAME,
        "fullname": "Test User",
        "orgs": orgs,
        "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
    }
    return req._send_json(200, payload)


def _repo_url(hub: HubServer, repo_type: str, repo_id: str) -> str:
    prefix = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{hub.endpoint}/{prefix}{repo_id}"


def _create_repo(hub, req) -> int:
    _require_token(hub, req)
    body = req.json_body()
    name, namespace = body.get("name"), body.get("organization") or USER_NAME
    if not name or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", namespace):
        raise HubError(400, f"Invalid repo name: {namespace}/{name}")
    if namespace not in (USER_NAME, *USER_ORGS):
        raise HubError(403, f"You don't have the rights to create a repo under the namespace {namespace!r}")
    repo_type = body.get("type") or "model"
    repo_id = f"{namespace}/{name}"
    url = _repo_url(hub, repo_type, repo_id)
    if (repo_type, repo_id) in hub.state.repos:
        # the Hub answers with the existing repo's url, which `create_repo(exist_ok=True)` returns
        raise HubError(409, f"You already created this {repo_type} repo", url=url)
    private = bool(body.get("private")) or body.get("visibility") == "private"
    repo = Repo(repo_type, repo_id, private, _now())
    attributes = INITIAL_GITATTRIBUTES.encode()
    repo.blobs[git_blob_sha1(attributes)] = attributes
    first = hub.state.new_commit(repo, None, "initial commit", "",
                                {".gitattributes": FileEntry(len(attributes), git_blob_sha1(attributes))})
    repo.branches["main"] = first.oid
    hub.state.repos[(repo_type, repo_id)] = repo
    return req._send_json(200, {"url": url, "name": repo_id, "id": repo_id})


def _delete_repo(hub, req) -> int:
    _require_token(hub, req)
    body = req.json_body()
    namespace = body.get("organization") or USER_NAME
    key = (body.get("type") or "model", f"{namespace}/{body.get('name')}")
    if key not in hub.state.repos:
        raise HubError(404, "Repository not found", "RepoNotFound")
    del hub.state.repos[key]
    return req._send_json(200, {})


def _update_settings(hub, req, repo_type, repo_id) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    body = req.json_body()
    visibility = body.get("visibility", "private" if body.get("private") else "public" if "private" in body else None)
    if visibility is not None:
        if visibility not in ("public", "private"):
            raise HubError(400, f"Invalid visibility: {visibility}")
        repo.private = visibility == "private"
    return req._send_json(200, {"private": repo.private})


def _validate_yaml(req) -> int:
    """Checks that the card's front matter is a YAML mapping, as the Hub does before a commit."""
    content = req.json_body().get("content", "")
    match = re.match(r"\A---\n(.*?)\n---", content, re.S)
    if match:
        try:
            import yaml  # the Hub validates with a YAML parser; PyYAML ships with huggingface_hub
        except ImportError:  # pragma: no cover - PyYAML is a huggingface_hub dependency
            yaml = None
        if yaml is not None:
            try:
                data = yaml.safe_load(match.group(1))
            except yaml.YAMLError as error:
                raise HubError(400, f"Invalid YAML in README.md: {error}") from error
            if data is not None and not isinstance(data, dict):
                raise HubError(400, "Invalid YAML in README.md: metadata must be a mapping")
    return req._send_json(200, {"errors": [], "warnings": []})


# --- reading ---------------------------------------------------------------------------------


def _file_json(path: str, entry: FileEntry, commit: Commit, expand: bool) -> dict:
    item = {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}
    if entry.lfs_sha256:
        item["lfs"] = {"oid": entry.lfs_sha256, "size": entry.size, "pointerSize": len(lfs_pointer(entry.lfs_sha256, entry.size))}
    if expand:
        item["lastCommit"] = {"id": commit.oid, "title": commit.title, "date": commit.date}
    return item


def _folder_json(path: str, commit: Commit, expand: bool) -> dict:
    item = {"type": "directory", "oid": hashlib.sha1(f"{commit.oid}:{path}".encode()).hexdigest(), "size": 0, "path": path}
    if expand:
        item["lastCommit"] = {"id": commit.oid, "title": commit.title, "date": commit.date}
    return item


def _folders(files: dict) -> set:
    return {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}


def _repo_info(hub, req, repo_type, repo_id, revision) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id)
    commit = _get_commit(repo, revision)
    siblings = [
        {"rfilename": p, **({"size": e.size, "blobId": e.git_oid} if "blobs" in req.query else {})}
        for p, e in sorted(commit.files.items())
    ]
    payload = {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "modelId": repo_id,
        "author": repo_id.split("/")[0],
        "sha": commit.oid,
        "lastModified": commit.date,
        "createdAt": repo.created_at,
        "private": repo.private,
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
    }
    config = _json_file(repo, commit, "config.json")
    if isinstance(config, dict):
        payload["config"] = {k: config[k] for k in ("architectures", "model_type", "auto_map") if k in config}
        payload["library_name"] = "transformers"
    return req._send_json(200, payload)


def _json_file(repo: Repo, commit: Commit, path: str):
    entry = commit.files.get(path)
    if entry is None or entry.lfs_sha256:
        return None
    try:
        return json.loads(repo.blobs[entry.git_oid])
    except ValueError:
        return None


def _query_flag(req, name: str) -> bool:
    return (req.query.get(name) or ["false"])[-1].lower() in ("1", "true")


def _tree(hub, req, repo_type, repo_id, revision, path) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id)
    commit = _get_commit(repo, revision)
    recursive, expand = _query_flag(req, "recursive"), _query_flag(req, "expand")
    path = path.strip("/")
    folders = _folders(commit.files)
    if path and path not in folders:
        if path in commit.files:
            raise HubError(400, f"{path} is a file, not a directory")
        raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
    prefix = f"{path}/" if path else ""

    def wanted(p: str) -> bool:
        return p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])

    items = [_folder_json(f, commit, expand) for f in sorted(folders) if wanted(f)]
    items += [_file_json(p, e, commit, expand) for p, e in sorted(commit.files.items()) if wanted(p)]
    return req._send_json(200, items)


def _paths_info(hub, req, repo_type, repo_id, revision) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id)
    commit = _get_commit(repo, revision)
    content_type = req.headers.get("Content-Type", "")
    if content_type.startswith("application/json"):
        body = req.json_body()
        paths, expand = body.get("paths", []), bool(body.get("expand"))
    else:
        form = parse_qs(req.body.decode(), keep_blank_values=True)
        paths, expand = form.get("paths", []), (form.get("expand") or ["false"])[-1].lower() in ("1", "true")
    folders = _folders(commit.files)
    items = []
    for path in paths:
        path = path.strip("/")
        if path in commit.files:
            items.append(_file_json(path, commit.files[path], commit, expand))
        elif path in folders:
            items.append(_folder_json(path, commit, expand))
    return req._send_json(200, items)


def _list_commits(hub, req, repo_type, repo_id, revision) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id)
    commit, history = _get_commit(repo, revision), []
    while commit is not None:
        history.append(
            {"id": commit.oid, "title": commit.title, "message": commit.message, "date": commit.date, "authors": [{"user": USER_NAME}]}
        )
        commit = repo.commits.get(commit.parent) if commit.parent else None
    return req._send_json(200, history)


def _list_refs(hub, req, repo_type, repo_id) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id)

    def refs(kind: str, names: dict) -> list:
        return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid} for n, oid in sorted(names.items())]

    payload = {"branches": refs("heads", repo.branches), "tags": refs("tags", repo.tags), "converts": []}
    if "include_prs" in req.query:
        payload["pullRequests"] = []
    return req._send_json(200, payload)


def _branch(hub, req, method, repo_type, repo_id, branch) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    if method == "DELETE":
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        if branch == "main":
            raise HubError(403, "Cannot delete the default branch")
        del repo.branches[branch]
        return req._send_json(200, {})
    if method != "POST":
        raise HubError(405, f"{method} not allowed on a branch")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", branch) or re.fullmatch(r"[0-9a-f]{40}", branch):
        raise HubError(400, f"Invalid branch name: {branch}")
    if branch in repo.branches:
        raise HubError(409, f"Reference already exists: refs/heads/{branch}")
    start = req.json_body().get("startingPoint") or "main"
    repo.branches[branch] = _get_commit(repo, start).oid
    return req._send_json(200, {})


def _create_tag(hub, req, repo_type, repo_id, revision) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    tag = req.json_body().get("tag")
    if not tag or not re.fullmatch(r"[\w.-]+", tag):
        raise HubError(400, f"Invalid tag name: {tag}")
    if tag in repo.tags:
        raise HubError(409, f"Reference already exists: refs/tags/{tag}")
    repo.tags[tag] = _get_commit(repo, revision).oid
    return req._send_json(200, {})


def _delete_tag(hub, req, repo_type, repo_id, tag) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    if tag not in repo.tags:
        raise HubError(404, f"Invalid rev id: {tag}", "RevisionNotFound")
    del repo.tags[tag]
    return req._send_json(200, {})


def _byte_range(header: str | None, size: int) -> tuple | None:
    """Parses a single `bytes=a-b` / `bytes=a-` / `bytes=-n` range; None when absent."""
    if not header:
        return None
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or match.groups() == ("", ""):
        raise HubError(416, f"Unsupported range: {header}", headers={"Content-Range": f"bytes */{size}"})
    first, last = match.groups()
    start, end = (max(size - int(last), 0), size - 1) if first == "" else (int(first), min(int(last), size - 1) if last else size - 1)
    if start >= size or start > end:
        raise HubError(416, f"Range not satisfiable: {header}", headers={"Content-Range": f"bytes */{size}"})
    return start, end


def _send_content(req, method: str, data: bytes, headers: dict) -> int:
    span = _byte_range(req.headers.get("Range"), len(data))
    headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **headers}
    if span is None:
        return req._send(200, data, {**headers, "Content-Length": len(data)}, method)
    start, end = span
    headers.update({"Content-Range": f"bytes {start}-{end}/{len(data)}", "Content-Length": end - start + 1})
    return req._send(206, data[start : end + 1], headers, method)


def _resolve(hub, req, method, repo_type, repo_id, revision, path) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id)
    commit = _get_commit(repo, revision)
    entry = commit.files.get(path)
    if entry is None:
        raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
    headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{entry.git_oid}"'}
    if entry.lfs_sha256:
        headers.update(
            {
                "X-Linked-Etag": f'"{entry.lfs_sha256}"',
                "X-Linked-Size": entry.size,
                "Location": f"{hub.cdn_endpoint}/lfs/{quote(repo_type)}/{quote(repo_id)}/{entry.lfs_sha256}",
            }
        )
        return req._send(302, b"", headers, method)
    return _send_content(req, method, repo.blobs[entry.git_oid], headers)


def _serve_cdn(hub: HubServer, req: _Handler, method: str) -> int:
    """The LFS storage origin: anonymous, content-addressed, like a signed CDN url."""
    seg = req.segments
    if method not in ("GET", "HEAD") or len(seg) != 5 or seg[0] != "lfs":
        raise NoRoute(method, req.path)
    repo = hub.state.repos.get((seg[1], f"{seg[2]}/{seg[3]}"))
    data = repo.lfs.get(seg[4]) if repo else None
    if data is None:
        raise HubError(404, "NoSuchKey")
    return _send_content(req, method, data, {"ETag": f'"{seg[4]}"'})


# --- writing ---------------------------------------------------------------------------------


def _is_lfs_path(path: str, size: int) -> bool:
    name = path.rsplit("/", 1)[-1]
    return size >= LFS_MIN_SIZE or any(fnmatch.fnmatch(name, pattern) for pattern in LFS_PATTERNS)


def _preupload(hub, req, repo_type, repo_id, revision) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    commit = repo.resolve(revision)
    if commit is None and "create_pr" not in req.query:
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
    files = req.json_body().get("files")
    if not isinstance(files, list):
        raise HubError(400, "preupload expects a list of files")
    answer = []
    for item in files:
        path, size = item.get("path"), item.get("size")
        if not isinstance(path, str) or not isinstance(size, int):
            raise HubError(400, f"Malformed preupload entry: {item}")
        mode = "lfs" if _is_lfs_path(path, size) else "regular"
        existing = commit.files.get(path) if commit else None
        remote_oid = None
        if existing is not None:
            # the client compares this with its own oid: sha256 for LFS files, git sha1 otherwise
            remote_oid = existing.lfs_sha256 if mode == "lfs" else (None if existing.lfs_sha256 else existing.git_oid)
        answer.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": remote_oid})
    return req._send_json(200, {"files": answer, "commitOid": commit.oid if commit else None})


def _lfs_batch(hub, req, repo_type, repo_id) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    body = req.json_body()
    if body.get("operation") != "upload":
        raise HubError(400, "Only the upload operation is supported by this test double")
    if "basic" not in body.get("transfers", ["basic"]):
        raise HubError(400, "Only the basic LFS transfer is supported by this test double")
    objects = []
    for obj in body.get("objects", []):
        oid, size = obj.get("oid"), obj.get("size")
        if not (isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{64}", oid) and isinstance(size, int)):
            raise HubError(400, f"Malformed LFS object: {obj}")
        if oid in repo.lfs:
            objects.append({"oid": oid, "size": size})  # already stored: no actions
            continue
        target = f"{quote(repo_type)}/{quote(repo_id, safe='')}/{oid}/{size}"
        objects.append(
            {
                "oid": oid,
                "size": size,
                "authenticated": True,
                "actions": {
                    "upload": {"href": f"{hub.endpoint}/lfs-upload/{target}"},
                    "verify": {"href": f"{hub.endpoint}/lfs-verify/{target}"},
                },
            }
        )
    return req._send_json(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})


def _lfs_target(hub, req) -> tuple:
    seg = req.segments
    if len(seg) != 5:
        raise NoRoute("PUT/POST", req.path)
    repo = hub.state.repos.get((seg[1], seg[2]))
    if repo is None:
        raise HubError(404, "Repository not found", "RepoNotFound")
    return repo, seg[3], int(seg[4])


def _lfs_put(hub, req) -> int:
    repo, oid, size = _lfs_target(hub, req)
    if len(req.body) != size or hashlib.sha256(req.body).hexdigest() != oid:
        raise HubError(400, "Uploaded content does not match the announced oid/size")
    repo.lfs[oid] = req.body
    return req._send(200, b"", {}, "PUT")


def _lfs_verify(hub, req) -> int:
    _require_token(hub, req)
    repo, oid, size = _lfs_target(hub, req)
    body = req.json_body()
    if oid not in repo.lfs or len(repo.lfs[oid]) != size or body.get("oid") != oid or body.get("size") != size:
        raise HubError(404, f"LFS object {oid} was not uploaded")
    return req._send_json(200, {})


def _commit(hub, req, repo_type, repo_id, revision) -> int:
    repo = _get_repo(hub, req, repo_type, repo_id, write=True)
    if "create_pr" in req.query:
        raise HubError(400, "Pull requests are not supported by this test double")
    if revision not in repo.branches:
        raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", "RevisionNotFound")
    if hub.failing_commits > 0:
        hub.failing_commits -= 1
        raise HubError(500, "Internal Error - injected by the test")
    parent = repo.commits[repo.branches[revision]]
    try:
        lines = [json.loads(line) for line in req.body.decode().splitlines() if line.strip()]
    except ValueError:
        raise HubError(400, "Commit payload is not NDJSON") from None
    if not lines or lines[0].get("key") != "header":
        raise HubError(400, "Commit payload must start with a header line")
    header = lines[0]["value"]
    expected_parent = header.get("parentCommit")
    if expected_parent and not parent.oid.startswith(expected_parent):
        raise HubError(412, f"A commit has happened since. Please refresh and try again. (parent {expected_parent})")
    files = dict(parent.files)
    for line in lines[1:]:
        _apply_operation(repo, files, line.get("key"), line.get("value") or {})
    title = header.get("summary") or ""
    if not title.strip():
        raise HubError(400, "Commit summary must not be empty")
    commit = hub.state.new_commit(repo, parent, title, header.get("description") or "", files)
    repo.branches[revision] = commit.oid
    return req._send_json(
        200,
        {
            "success": True,
            "commitOid": commit.oid,
            "commitUrl": f"{_repo_url(hub, repo_type, repo_id)}/commit/{commit.oid}",
            "commitMessage": title,
            "pullRequestUrl": None,
        },
    )


def _apply_operation(repo: Repo, files: dict, key: str, value: dict) -> None:
    path = value.get("path")
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise HubError(400, f"Invalid path in commit operation: {path!r}")
    if key == "file":
        if value.get("encoding") != "base64":
            raise HubError(400, "Only base64 file content is supported")
        data = base64.b64decode(value.get("content", ""))
        oid = git_blob_sha1(data)
        repo.blobs[oid] = data
        files[path] = FileEntry(len(data), oid)
    elif key == "lfsFile":
        oid = value.get("oid")
        if value.get("algo", "sha256") != "sha256" or oid not in repo.lfs:
            raise HubError(400, f"LFS object for {path} was not uploaded")
        size = len(repo.lfs[oid])
        files[path] = FileEntry(size, git_blob_sha1(lfs_pointer(oid, size)), oid)
    elif key == "deletedFile":
        if path not in files:
            raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        del files[path]
    elif key == "deletedFolder":
        prefix = path.rstrip("/") + "/"
        doomed = [p for p in files if p.startswith(prefix)]
        if not doomed:
            raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
        for p in doomed:
            del files[p]
    else:
        raise HubError(400, f"Unknown commit operation: {key!r}")
