"""A local stand-in for the Hugging Face hub, for tests: it answers the HTTP requests that huggingface_hub 2.4.0 (its
httpx2 client) makes for HfApi.dataset_info, HfApi.list_repo_files, hf_hub_download and snapshot_download (of dataset
and model repositories), and for HfApi.create_repo and HfApi.upload_folder (model repositories), so that the real
client, pointed at it with HF_ENDPOINT, runs end to end without a network. Standard library only; 127.0.0.1 only.

The requests, as read in huggingface_hub 2.4.0 (hf_api.py, file_download.py, _commit_api.py, lfs.py, utils/_http.py,
utils/_pagination.py) and logged from it; {kind} is "datasets" or "models", {repo} is "namespace/name" as is,
{revision} URL-quoted whole ("refs%2Fconvert%2Fparquet"), {prefix} "datasets/" for a dataset and nothing for a model:

    GET  /api/{kind}/{repo}/revision/{revision}       -> {"id", "sha"}: the commit the revision points to
    GET  /api/{kind}/{repo}                           -> the same, of main
    GET  /api/{kind}/{repo}/tree/{revision}[/{folder}]?recursive=true&expand=false[&cursor=k]
                                                       -> a page of PAGE entries {"type": "file" | "directory", "path",
                                                          "oid", "size"[, "lfs"]}, the next page in a Link header
    HEAD /{prefix}{repo}/resolve/{revision}/{path}    -> 302 to the file on the "CDN" (the second port, another origin,
                                                          so the client sends it no token), with X-Repo-Commit,
                                                          X-Linked-Etag (the sha256, the blob's name in the cache) and
                                                          X-Linked-Size; a GET gets the same
    GET  /cdn/{sha256}                                -> the bytes; "Range: bytes=N-" gets 206 and Content-Range
  writing (each needs "Authorization: Bearer {write_token}", else 401):
    POST /api/repos/create {"name", "organization"[, "type"]}
                                                       -> {"url"}, a first commit holding .gitattributes, as the hub
                                                          makes; 409 when the repository exists
    POST /api/{kind}/{repo}/preupload/{revision} {"files": [{"path", "sample", "size"}]}
                                                       -> {"files": [{"path", "uploadMode", "shouldIgnore", "oid"}]}:
                                                          "lfs" for weights (LFS_SUFFIXES) and for a sample holding a
                                                          NUL byte (binary), else "regular"
    POST /{prefix}{repo}.git/info/lfs/objects/batch {"objects": [{"oid", "size"}]}
                                                       -> each object with an upload action to PUT /lfs/{oid} on the
                                                          CDN, or none when the hub has those bytes
    PUT  /lfs/{oid}                                   -> the bytes kept, when their sha256 is the oid
    POST /api/{kind}/{repo}/commit/{revision}         an NDJSON body: a "header" line, then "file" (base64 content),
                                                          "lfsFile" (an uploaded oid) and "deletedFile" lines
                                                       -> {"commitUrl", "commitOid"}: a new commit of the revision
    POST /api/validate-yaml                           -> {"warnings": []}: every model card's metadata is accepted

The client also asks once per process for GET /api/agent-harnesses (a 404 here, as for every other path). Errors come
as the hub sends them: the status, X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), a JSON
{"error": ...} body. Not spoken: Xet transfers (no X-Xet-Hash header, so the client downloads over plain HTTP, as it
does from the hub when hf_xet is not installed; uploads need HF_HUB_DISABLE_XET=1), multipart LFS uploads, pull
requests, and everything else of the API.

    hub = Hub()                            # started: hub.url is the HF_ENDPOINT to use
    commit = hub.add("owner/name", {"data/0.parquet": b"..."}, revision="main")   # a dataset; repo_type="model"
    hub.token = "hf_x"                     # a gated repo: downloads need "Authorization: Bearer hf_x", else 401
    hub.write_token = "hf_w"               # the token that may write (None: no one may)
    hub.status = 500                       # every request answered with this status (the hub is down)
    hub.failing["/api/models/owner/name/commit/"] = 403   # requests whose path starts so get this status
    hub.cut(data, after=1000, then_status=503)  # the next download of data drops its connection after 1000 bytes
                                                # (and the hub answers 503 from then on)
    hub.requests                           # (method, path, headers) of every request, in order
    hub.close()
"""

import base64
import hashlib
import http.server
import json
import sys
import threading
from urllib.parse import parse_qs, quote, unquote, urlsplit

PAGE = 3  # entries per page of a tree listing (the hub's is 1000): small, so that a listing takes several pages
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".parquet")  # among the hub's .gitattributes ones
GITATTRIBUTES = b"".join(b"*%s filter=lfs diff=lfs merge=lfs -text\n" % suffix.encode() for suffix in LFS_SUFFIXES)


class Hub:
    def __init__(self):
        # ("datasets" or "models", repo id) -> {"refs": {revision: commit}, "commits": {commit: {path: bytes}}}
        self.repos = {}
        self.blobs = {}  # sha256 -> bytes, what the CDN serves
        self.requests, self.token, self.status, self._cut = [], None, None, None
        self.write_token, self.failing = None, {}
        self.errors = []  # exceptions raised while answering (a client that went away, or a bug here)
        self.lock = threading.Lock()
        handler = type("Handler", (Handler,), {"hub": self})
        self.servers = [Server(("127.0.0.1", 0), handler) for _ in ("hub", "cdn")]
        self.url, self.cdn_url = (f"http://127.0.0.1:{server.server_address[1]}" for server in self.servers)
        self.threads = [threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # quick to shut down
                        for server in self.servers]
        for thread in self.threads:
            thread.start()

    def add(self, repo_id, files, revision="main", repo_type="dataset"):
        """A new commit of repo_id holding files ({path: bytes}), to which revision now points -> its sha."""
        key = (f"{repo_type}s", repo_id)
        commit = hashlib.sha1(json.dumps([*key, revision, len(self.repos.get(key, {}).get("commits", {})),
                                          sorted((p, hashlib.sha256(b).hexdigest()) for p, b in files.items())]
                                         ).encode()).hexdigest()
        repo = self.repos.setdefault(key, {"refs": {}, "commits": {}})
        repo["refs"][revision], repo["commits"][commit] = commit, dict(files)
        for data in files.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return commit

    def cut(self, data, after, then_status=None):
        """The next download of these bytes stops after `after` of them and the connection drops; then_status: the
        status every request gets from then on (the hub went down)."""
        self._cut = (hashlib.sha256(data).hexdigest(), after, then_status)

    def count(self, method, prefix):
        """How many requests of this method had a path starting with prefix."""
        return sum(1 for m, path, _ in self.requests if m == method and path.startswith(prefix))

    def close(self):
        for server, thread in zip(self.servers, self.threads):
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # kept for the test to look at, not printed
        self.RequestHandlerClass.hub.errors.append(sys.exc_info()[1])


class Handler(http.server.BaseHTTPRequestHandler):
    hub = None  # set per server: the Hub it serves
    timeout = 10  # seconds a connection may wait for the client, so that no thread waits forever

    def log_message(self, *args):  # no line on stderr per request
        pass

    def do_HEAD(self):
        self.answer()

    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.answer()

    def do_PUT(self):
        self.answer()

    def answer(self):
        hub, url = self.hub, urlsplit(self.path)
        segments = url.path.split("/")[1:]  # still quoted: a quoted revision holds slashes
        with hub.lock:
            hub.requests.append((self.command, url.path, {k.lower(): v for k, v in self.headers.items()}))
        body = self.read_body() if self.command in ("POST", "PUT") else b""
        if hub.status:
            return self.error(hub.status, None, "the hub is down")
        failing = [status for prefix, status in hub.failing.items() if url.path.startswith(prefix)]
        if failing:
            return self.error(failing[0], None, f"{url.path} is refused here")
        if self.command in ("POST", "PUT"):
            return self.write(segments, body)
        if segments[:1] == ["api"] and len(segments) >= 4 and segments[1] in ("datasets", "models"):
            kind = segments[1]
            if len(segments) == 4:  # repo_info of main
                segments = [*segments, "revision", "main"]
            if len(segments) < 6 or segments[4] not in ("revision", "tree"):
                return self.error(404, None, f"no such path: {url.path}")
            repo_id, commit, files = self.resolve(kind, segments[2:4], segments[5])
            if commit is None:
                return
            if segments[4] == "revision":
                return self.json(200, {"id": repo_id, "sha": commit, "private": False, "gated": bool(hub.token),
                                       "siblings": [{"rfilename": name} for name in sorted(files)]})
            query = parse_qs(url.query)
            if query.get("recursive") != ["true"]:  # what list_repo_files asks for; nothing else is spoken here
                return self.error(400, None, "only recursive listings are served here")
            return self.tree(files, unquote("/".join(segments[6:])), int(query.get("cursor", ["0"])[0]), url.path,
                             query)
        kind, rest = ("datasets", segments[1:]) if segments[:1] == ["datasets"] else ("models", segments)
        if len(rest) >= 5 and rest[2] == "resolve" and segments[0] not in ("api", "cdn"):
            repo_id, commit, files = self.resolve(kind, rest[:2], rest[3])
            if commit is None:
                return
            path = unquote("/".join(rest[4:]))
            if path not in files:
                return self.error(404, "EntryNotFound", f"{path} is not in {repo_id}", commit=commit)
            if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self.error(401, "GatedRepo", f"Access to {kind[:-1]} {repo_id} is restricted. You must have "
                                  "access to it and be authenticated to access it. Please log in.")
            sha256 = hashlib.sha256(files[path]).hexdigest()
            return self.send(302, b"", {"Location": f"{hub.cdn_url}/cdn/{sha256}", "X-Repo-Commit": commit,
                                        "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(files[path])),
                                        "ETag": f'"{git_oid(files[path])}"'})
        if segments[:1] == ["cdn"] and len(segments) == 2 and segments[1] in hub.blobs:
            return self.download(segments[1])
        return self.error(404, None, f"no such path: {url.path}")

    def read_body(self):
        """The request's body, sent with a Content-Length or in chunks."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()  # the CRLF after the chunk
                if not size:
                    return b"".join(chunks)
                chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def write(self, segments, body):
        """The requests that change the hub (or may lead to a change)."""
        hub = self.hub
        if segments == ["api", "validate-yaml"]:
            return self.json(200, {"warnings": []})
        if segments[:1] == ["lfs"] and len(segments) == 2:  # on the CDN: a presigned address, no token
            if hashlib.sha256(body).hexdigest() != segments[1]:
                return self.error(400, None, "the bytes do not have the sha256 of the address")
            hub.blobs[segments[1]] = body
            return self.send(200, b"", {})
        if hub.write_token is None or self.headers.get("Authorization") != f"Bearer {hub.write_token}":
            return self.error(401, None, "Invalid username or password.")
        if segments == ["api", "repos", "create"]:
            asked = json.loads(body)
            kind = f"{asked.get('type') or 'model'}s"
            repo_id = "/".join(filter(None, (asked.get("organization"), asked["name"])))
            url = f"{hub.url}/{'datasets/' if kind == 'datasets' else ''}{repo_id}"
            if (kind, repo_id) in hub.repos:
                return self.json(409, {"error": f"You already created this {kind[:-1]} repo", "url": url})
            hub.add(repo_id, {".gitattributes": GITATTRIBUTES}, repo_type=kind[:-1])
            return self.json(200, {"url": url, "name": repo_id})
        if segments[:1] == ["api"] and len(segments) == 6 and segments[4] in ("preupload", "commit"):
            kind, repo_segments, revision = segments[1], segments[2:4], segments[5]
            repo_id, commit, files = self.resolve(kind, repo_segments, revision)
            if commit is None:
                return
            if segments[4] == "preupload":
                asked = json.loads(body)["files"]
                return self.json(200, {"files": [self.upload_mode(entry, files) for entry in asked]})
            return self.commit(kind, repo_id, unquote(revision), files, body)
        kind, rest = ("datasets", segments[1:]) if segments[:1] == ["datasets"] else ("models", segments)
        if len(rest) == 6 and rest[1].endswith(".git") and rest[2:] == ["info", "lfs", "objects", "batch"]:
            objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                        **({} if o["oid"] in hub.blobs else
                           {"actions": {"upload": {"href": f"{hub.cdn_url}/lfs/{o['oid']}"}}})}
                       for o in json.loads(body)["objects"]]
            return self.json(200, {"transfer": "basic", "objects": objects})
        return self.error(404, None, f"no such path: /{'/'.join(segments)}")

    @staticmethod
    def upload_mode(entry, files):
        """How the client is to send a file, and the oid of the file now at that path (the client skips a file
        whose oid it has already)."""
        sample = base64.b64decode(entry["sample"])
        lfs = entry["path"].endswith(LFS_SUFFIXES) or b"\0" in sample
        mode = {"path": entry["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
        old = files.get(entry["path"])
        if old is not None:
            mode["oid"] = hashlib.sha256(old).hexdigest() if lfs else git_oid(old)
        return mode

    def commit(self, kind, repo_id, revision, files, body):
        """A new commit of revision: its files, changed by the NDJSON lines of body."""
        files = dict(files)
        for line in body.splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.hub.blobs:
                    return self.error(422, None, f"{value['path']}: no uploaded object {value['oid']}")
                files[value["path"]] = self.hub.blobs[value["oid"]]
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
            elif item["key"] != "header":
                return self.error(400, None, f"{item['key']} is not spoken here")
        commit = self.hub.add(repo_id, files, revision, repo_type=kind[:-1])
        prefix = "datasets/" if kind == "datasets" else ""
        self.json(200, {"commitUrl": f"{self.hub.url}/{prefix}{repo_id}/commit/{commit}", "commitOid": commit,
                        "success": True})

    def resolve(self, kind, repo_segments, quoted_revision):
        """(repo id, commit, files) of a repo at a revision (a ref or a commit); (.., None, ..) once answered 404."""
        repo_id, revision = "/".join(repo_segments), unquote(quoted_revision)
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            self.error(404, "RepoNotFound", f"Repository not found: {repo_id}")
            return repo_id, None, None
        commit = repo["refs"].get(revision, revision if revision in repo["commits"] else None)
        if commit is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return repo_id, None, None
        return repo_id, commit, repo["commits"][commit]

    def tree(self, files, folder, cursor, path, query):
        """A page of the recursive listing of folder (all of the repo when empty): its files and subfolders."""
        prefix = folder.rstrip("/") + "/" if folder else ""
        entries = {}
        for name in sorted(f for f in files if f.startswith(prefix)):
            parts = name[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder_path = prefix + "/".join(parts[:depth])
                entries[folder_path] = {"type": "directory", "path": folder_path, "size": 0,
                                        "oid": hashlib.sha1(folder_path.encode()).hexdigest()}
            entries[name] = {"type": "file", "path": name, "size": len(files[name]), "oid": git_oid(files[name]),
                             "lfs": {"oid": hashlib.sha256(files[name]).hexdigest(), "size": len(files[name]),
                                     "pointerSize": 134}}
        if folder and not entries:
            return self.error(404, "EntryNotFound", f"{folder} does not exist")
        headers = {}
        if cursor + PAGE < len(entries):
            query = dict(query, cursor=[str(cursor + PAGE)])
            next_url = f"{self.hub.url}{path}?" + "&".join(f"{k}={quote(v[0])}" for k, v in query.items())
            headers["Link"] = f'<{next_url}>; rel="next"'
        self.json(200, list(entries.values())[cursor:cursor + PAGE], headers)

    def download(self, sha256):
        """The blob's bytes, from the Range's start when one is asked; a cut armed with Hub.cut drops them part way."""
        data, start = self.hub.blobs[sha256], 0
        asked = self.headers.get("Range", "")
        if asked.startswith("bytes=") and asked.endswith("-"):
            start = int(asked[len("bytes="):-1])
        headers = {"Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        with self.hub.lock:
            cut = self.hub._cut if self.hub._cut and self.hub._cut[0] == sha256 else None
            if cut:
                self.hub._cut = None
        if cut is None:
            return self.send(206 if start else 200, body, headers)
        _, after, then_status = cut
        self.hub.status = then_status
        self.send(206 if start else 200, body[:after], dict(headers, **{"Content-Length": str(len(body))}))
        self.close_connection = True  # fewer bytes than Content-Length, then the connection ends

    def error(self, status, code, message, commit=None):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self.json(status, {"error": message}, headers)

    def json(self, status, obj, headers=None):
        self.send(status, json.dumps(obj).encode(), dict(headers or {}, **{"Content-Type": "application/json"}))

    def send(self, status, body, headers):
        self.send_response(status)
        headers = {"Content-Length": str(len(body)), **headers}
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def git_oid(data):
    """The id git gives a blob: the hub's "oid" of a file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class CurrentStderr:
    """sys.stderr as it is at each write (run_script swaps it, and pytest closes each test's own): what a logging
    handler of the hub's client can write to across tests."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()
