"""An offline stand-in for Google Cloud Storage: `gs://BUCKET/...` served from a local directory.

Each client the project uses on gs:// is pointed at the same directory ROOT (`ROOT/BUCKET/object`):

* Python (the storage layer, etils.epath under Orbax, pyarrow through fsspec): `FakeGCSFileSystem`,
  an fsspec file system registered for the "gs" and "gcs" protocols in place of gcsfs. It keeps the
  object-store behaviours the code must not rely on away: no directories (makedirs is a no-op, a
  prefix exists while an object is below it), no appending, objects appear whole when a write is
  closed, writes into a bucket that does not exist fail.
* C++ (TensorStore under Orbax, array_record's reader), google-cloud-storage and the storage layer's
  conditional writes (the workdir lock; `HTTPConditional`): `FakeGCSServer`, a small HTTP server with
  the subset of the GCS JSON API they use (media / multipart uploads, ranged downloads, listing,
  deletion, generation preconditions), reached through their test endpoints
  (TENSORSTORE_GCS_HTTP_URL, CLOUD_STORAGE_EMULATOR_ENDPOINT, STORAGE_EMULATOR_HOST).

Orbax asks the GCS API (google-cloud-storage) whether a bucket has a hierarchical namespace; the
fake answers "flat" (as a default bucket is). `install()` sets all this up in this process;
`environment()` gives a subprocess the same (its sitecustomize, in fake_gcs_site/, calls
`install_from_env()`).

Faults: `FakeGCSFileSystem.fail(op, times, error, after=0)` makes `times` calls of `op` ("open",
"info", "ls", "rm", "mv"), after the next `after` ones, raise `error`, for retry tests; `UMOE_FAKE_GCS_FAULTS="open=2,ls=1"`
does it in a subprocess (ConnectionResetError).
"""
from __future__ import annotations

import collections
import datetime
import http.server
import io
import json
import os
import shutil
import sys
import threading
import urllib.parse
import uuid

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

ROOT_ENV = "UMOE_FAKE_GCS_ROOT"
URL_ENV = "UMOE_FAKE_GCS_URL"
FAULTS_ENV = "UMOE_FAKE_GCS_FAULTS"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_gcs_site")
TMP_MARK = ".fakegcs-tmp-"


def _generation(st: os.stat_result) -> int:
  """Changes with every write (a write is a rename of a new file: a new inode and mtime)."""
  return (hash((st.st_ino, st.st_mtime_ns, st.st_size)) & ((1 << 62) - 1)) + 1


def _atomic_write(path: str, data_source) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = os.path.join(os.path.dirname(path), f"{TMP_MARK}{uuid.uuid4().hex}")
  with open(tmp, "wb") as f:
    if isinstance(data_source, bytes):
      f.write(data_source)
    else:
      shutil.copyfileobj(data_source, f)
  os.replace(tmp, path)


def _prune_empty_parents(path: str, bucket_dir: str) -> None:
  """Object stores have no empty directories: remove those a deletion left behind."""
  d = os.path.dirname(path)
  while len(d) > len(bucket_dir) and d.startswith(bucket_dir):
    try:
      os.rmdir(d)
    except OSError:
      return
    d = os.path.dirname(d)


# ----------------------------------------------------------------------------------------------
# The Python side: an fsspec file system.


class _CountingFile(io.FileIO):
  """A local file that adds the bytes read to FakeGCSFileSystem.bytes_read[path]."""

  def __init__(self, path: str, key: str):
    super().__init__(path, "rb")
    self._key = key

  def readinto(self, b):
    n = super().readinto(b)
    FakeGCSFileSystem.bytes_read[self._key] += n or 0
    return n

  def read(self, size=-1):
    data = super().read(size)
    FakeGCSFileSystem.bytes_read[self._key] += len(data or b"")
    return data

  def readall(self):
    data = super().readall()
    FakeGCSFileSystem.bytes_read[self._key] += len(data)
    return data


class _ObjectWriter(io.BytesIO):
  """Collects the bytes; the object appears (atomically) on close."""

  def __init__(self, path: str):
    super().__init__()
    self._path = path

  def close(self):
    if not self.closed:
      _atomic_write(self._path, self.getvalue())
    super().close()


class FakeGCSFileSystem(DirFileSystem):
  """gs:// on a local directory ($UMOE_FAKE_GCS_ROOT), for fsspec, epath and pyarrow."""

  protocol = ("gs", "gcs")
  root_marker = ""
  faults: dict = {}                                   # op -> [after, times, error]
  bytes_read: collections.Counter = collections.Counter()  # "bucket/object" -> bytes read
  calls: collections.Counter = collections.Counter()       # op -> calls

  def __init__(self, *args, finalize_on_close=None, **kwargs):
    del args, finalize_on_close, kwargs  # gcsfs's options
    super().__init__(path=os.environ[ROOT_ENV], fs=LocalFileSystem())

  @classmethod
  def fail(cls, op: str, times: int, error: BaseException, after: int = 0) -> None:
    """The `times` calls of `op` after the next `after` ones raise `error`."""
    cls.faults[op] = [after, times, error]

  def _op(self, op: str, path) -> None:
    FakeGCSFileSystem.calls[op] += 1
    fault = FakeGCSFileSystem.faults.get(op)
    if fault and fault[0] > 0:
      fault[0] -= 1
    elif fault and fault[1] > 0:
      fault[1] -= 1
      raise fault[2]

  def _bucket_dir(self, path: str) -> str:
    return os.path.join(self.path, self._strip_protocol(path).split("/")[0])

  def open(self, path, mode="rb", **kwargs):
    if "b" not in mode:
      text = {k: kwargs.pop(k) for k in ("encoding", "errors", "newline") if k in kwargs}
      return io.TextIOWrapper(self.open(path, mode.replace("t", "") + "b", **kwargs), **text)
    self._op("open", path)
    if "a" in mode or "+" in mode:
      raise NotImplementedError(f"{path}: mode {mode!r} is not supported by object stores")
    key = self._strip_protocol(path)
    local = self._join(path)
    if "w" in mode or "x" in mode:
      if not os.path.isdir(self._bucket_dir(path)):
        raise FileNotFoundError(f"bucket of {path} does not exist")
      if os.path.isdir(local):
        raise IsADirectoryError(path)
      return _ObjectWriter(local)
    if not os.path.isfile(local):
      raise FileNotFoundError(path)
    return io.BufferedReader(_CountingFile(local, key), buffer_size=64 << 10)

  def cat_file(self, path, start=None, end=None, **kwargs):
    with self.open(path, "rb") as f:
      f.seek(start or 0)
      return f.read(None if end is None else end - (start or 0))

  def pipe_file(self, path, value, **kwargs):
    with self.open(path, "wb") as f:
      f.write(value)

  def info(self, path, **kwargs):
    self._op("info", path)
    return super().info(path, **kwargs)

  def exists(self, path, **kwargs):
    try:
      self.info(path)
      return True
    except FileNotFoundError:
      return False

  def ls(self, path, detail=True, **kwargs):
    self._op("ls", path)
    out = super().ls(path, detail=detail, **kwargs)
    name = (lambda e: e["name"]) if detail else (lambda e: e)
    return [e for e in out if TMP_MARK not in name(e)]

  def find(self, path, *args, **kwargs):
    self._op("ls", path)
    out = super().find(path, *args, **kwargs)
    if isinstance(out, dict):
      return {p: e for p, e in out.items() if TMP_MARK not in p}
    return [p for p in out if TMP_MARK not in p]

  def glob(self, path, **kwargs):
    self._op("ls", path)
    out = super().glob(path, **kwargs)
    if isinstance(out, dict):
      return {p: e for p, e in out.items() if TMP_MARK not in p}
    return [p for p in out if TMP_MARK not in p]

  def mkdir(self, path, create_parents=True, **kwargs):
    if "/" not in self._strip_protocol(path).strip("/"):  # a bucket
      os.makedirs(self._join(path), exist_ok=True)

  def makedirs(self, path, exist_ok=False):
    self.mkdir(path)

  def rm(self, path, recursive=False, maxdepth=None):
    self._op("rm", path)
    paths = [path] if isinstance(path, str) else list(path)
    for p in paths:
      local = self._join(p)
      if os.path.isdir(local):
        if not recursive:
          raise IsADirectoryError(p)
        shutil.rmtree(local)
      elif os.path.exists(local):
        os.remove(local)
      else:
        raise FileNotFoundError(p)
      _prune_empty_parents(local, self._bucket_dir(p))

  def rm_file(self, path, **kwargs):
    self.rm(path)

  def rmdir(self, path):
    local = self._join(path)
    if os.path.isdir(local) and not os.listdir(local):
      os.rmdir(local)

  def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
    self._op("mv", path1)
    src, dst = self._join(path1), self._join(path2)
    if not os.path.exists(src):
      raise FileNotFoundError(path1)
    if not os.path.isdir(self._bucket_dir(path2)):
      raise FileNotFoundError(f"bucket of {path2} does not exist")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.isdir(src):  # object stores: a copy of every object, then the deletion
      shutil.copytree(src, dst, dirs_exist_ok=True)
      shutil.rmtree(src)
    else:
      shutil.copyfile(src, dst)
      os.remove(src)
    _prune_empty_parents(src, self._bucket_dir(path1))

  def cp_file(self, path1, path2, **kwargs):
    with self.open(path1, "rb") as src, self.open(path2, "wb") as dst:
      shutil.copyfileobj(src, dst)


# ----------------------------------------------------------------------------------------------
# The C++ side: a GCS JSON API subset over HTTP.


def _rfc3339(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  root = ""
  requests: collections.Counter = collections.Counter()
  writing = threading.Lock()  # uploads and deletions with their preconditions

  def log_message(self, *args):  # quiet
    pass

  # -- helpers -----------------------------------------------------------------------------------

  def _send(self, code: int, body: bytes = b"", headers: dict | None = None,
            content_type: str = "application/json") -> None:
    self.send_response(code)
    for k, v in (headers or {}).items():
      self.send_header(k, str(v))
    if code not in (204, 304):
      self.send_header("Content-Type", content_type)
      self.send_header("Content-Length", str(len(body)))
    else:
      self.send_header("Content-Length", "0")
    self.end_headers()
    if body and code not in (204, 304):
      self.wfile.write(body)

  def _error(self, code: int, message: str) -> None:
    self._send(code, json.dumps({"error": {"code": code, "message": message}}).encode())

  def _body(self) -> bytes:
    n = int(self.headers.get("Content-Length") or 0)
    return self.rfile.read(n) if n else b""

  def _parse(self):
    parts = urllib.parse.urlsplit(self.path)
    query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
    return parts.path, query

  def _local(self, bucket: str, name: str) -> str:
    return os.path.join(self.root, bucket, *name.split("/"))

  def _resource(self, bucket: str, name: str, path: str) -> dict:
    st = os.stat(path)
    return {"kind": "storage#object", "bucket": bucket, "name": name,
            "id": f"{bucket}/{name}/{_generation(st)}", "generation": str(_generation(st)),
            "metageneration": "1", "size": str(st.st_size),
            "contentType": "application/octet-stream", "updated": _rfc3339(st.st_mtime),
            "timeCreated": _rfc3339(st.st_mtime)}

  def _precondition(self, query: dict, path: str) -> bool:
    """Whether ifGenerationMatch holds (0: the object must not exist)."""
    want = query.get("ifGenerationMatch")
    if want is None:
      return True
    current = _generation(os.stat(path)) if os.path.isfile(path) else 0
    return int(want) == current

  # -- verbs -----------------------------------------------------------------------------------

  def do_GET(self):  # noqa: N802
    path, query = self._parse()
    _Handler.requests["GET"] += 1
    if path.startswith("/download/"):  # google-cloud-storage's media downloads
      path = path[len("/download"):]
    parts = path.split("/")
    # /storage/v1/b/{bucket}[/o[/{object}]]
    if len(parts) < 5 or parts[1:4] != ["storage", "v1", "b"]:
      return self._error(404, f"no route {path}")
    bucket = urllib.parse.unquote(parts[4])
    if not os.path.isdir(os.path.join(self.root, bucket)):
      return self._error(404, f"bucket {bucket} not found")
    if len(parts) == 5:
      return self._send(200, json.dumps({"kind": "storage#bucket", "name": bucket}).encode())
    if len(parts) == 6:
      return self._list(bucket, query)
    name = urllib.parse.unquote("/".join(parts[6:]))
    local = self._local(bucket, name)
    if not os.path.isfile(local):
      return self._error(404, f"object {bucket}/{name} not found")
    st = os.stat(local)
    gen = _generation(st)
    if not self._precondition(query, local):
      return self._error(412, "precondition failed")
    if query.get("ifGenerationNotMatch") is not None and int(query["ifGenerationNotMatch"]) == gen:
      return self._send(304, headers={"x-goog-generation": gen})
    if query.get("alt") != "media":
      return self._send(200, json.dumps(self._resource(bucket, name, local)).encode())
    with open(local, "rb") as f:
      data = f.read()
    headers = {"x-goog-generation": gen, "x-goog-metageneration": 1,
               "x-goog-stored-content-length": len(data), "x-goog-stored-content-encoding":
               "identity"}
    rng = self.headers.get("Range") or self.headers.get("range")
    if rng and rng.startswith("bytes="):
      lo, _, hi = rng[6:].partition("-")
      if lo == "":
        lo, hi = max(0, len(data) - int(hi)), len(data) - 1
      else:
        lo, hi = int(lo), (int(hi) if hi else len(data) - 1)
      hi = min(hi, len(data) - 1)
      if lo >= len(data) and len(data) > 0:
        return self._send(416, headers={"Content-Range": f"bytes */{len(data)}"})
      headers["Content-Range"] = f"bytes {lo}-{hi}/{len(data)}"
      return self._send(206, data[lo:hi + 1], headers, "application/octet-stream")
    return self._send(200, data, headers, "application/octet-stream")

  def _list(self, bucket: str, query: dict) -> None:
    base = os.path.join(self.root, bucket)
    names = []
    for root, _, files in os.walk(base):
      for f in files:
        if TMP_MARK in f:
          continue
        names.append(os.path.relpath(os.path.join(root, f), base).replace(os.sep, "/"))
    names.sort()
    prefix, delim = query.get("prefix", ""), query.get("delimiter")
    start, end = query.get("startOffset"), query.get("endOffset")
    items, prefixes = [], set()
    for n in names:
      if not n.startswith(prefix) or (start and n < start) or (end and n >= end):
        continue
      rest = n[len(prefix):]
      if delim and delim in rest:
        prefixes.add(prefix + rest.split(delim)[0] + delim)
        continue
      items.append(self._resource(bucket, n, os.path.join(base, *n.split("/"))))
    body = {"kind": "storage#objects", "items": items}
    if prefixes:
      body["prefixes"] = sorted(prefixes)
    self._send(200, json.dumps(body).encode())

  def do_POST(self):  # noqa: N802
    path, query = self._parse()
    _Handler.requests["POST"] += 1
    parts = path.split("/")
    # /upload/storage/v1/b/{bucket}/o
    if len(parts) != 7 or parts[1:5] != ["upload", "storage", "v1", "b"] or parts[6] != "o":
      return self._error(404, f"no route {path}")
    bucket = urllib.parse.unquote(parts[5])
    body = self._body()
    if not os.path.isdir(os.path.join(self.root, bucket)):
      return self._error(404, f"bucket {bucket} not found")
    kind = query.get("uploadType", "media")
    if kind == "media":
      name, data = query.get("name", ""), body
    elif kind == "multipart":
      boundary = self.headers.get_content_type() and self.headers.get_param("boundary")
      pieces = body.split(b"--" + boundary.encode())
      meta_part, data_part = pieces[1], pieces[2]
      meta = json.loads(meta_part.split(b"\r\n\r\n", 1)[1])
      name = meta.get("name") or query.get("name", "")
      data = data_part.split(b"\r\n\r\n", 1)[1]
      data = data[:-2] if data.endswith(b"\r\n") else data
    else:
      return self._error(400, f"uploadType={kind} not supported by the fake")
    local = self._local(bucket, name)
    with _Handler.writing:  # the check and the write, atomically (as the store does)
      if not self._precondition(query, local):
        return self._error(412, "precondition failed")
      _atomic_write(local, data)
      resource = self._resource(bucket, name, local)
    self._send(200, json.dumps(resource).encode())

  def do_DELETE(self):  # noqa: N802
    path, query = self._parse()
    _Handler.requests["DELETE"] += 1
    parts = path.split("/")
    if len(parts) < 7 or parts[1:4] != ["storage", "v1", "b"]:
      return self._error(404, f"no route {path}")
    bucket = urllib.parse.unquote(parts[4])
    name = urllib.parse.unquote("/".join(parts[6:]))
    local = self._local(bucket, name)
    with _Handler.writing:
      if not os.path.isfile(local):
        return self._error(404, f"object {bucket}/{name} not found")
      if not self._precondition(query, local):
        return self._error(412, "precondition failed")
      os.remove(local)
      _prune_empty_parents(local, os.path.join(self.root, bucket))
    self._send(204)


class HTTPConditional:
  """The storage layer's conditional writes on gs:// (umoe_jax/storage/conditional.py, the workdir
  lock's object) as plain JSON API requests to the fake server, so that processes racing on one
  object meet its atomic precondition checks; google-cloud-storage, which the storage layer uses,
  is an optional package (tests/test_workdir_lock.py runs it against the server where present)."""

  def __init__(self, server_url: str):
    self.server_url = server_url

  def _request(self, method: str, path: str, query: dict, data: bytes | None = None) -> bytes:
    import urllib.request
    url = f"{self.server_url}{path}?{urllib.parse.urlencode(query)}"
    req = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:  # HTTPError (.code 412, 404) on failure
      return r.read()

  @staticmethod
  def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return urllib.parse.quote(bucket, safe=""), key

  def _upload(self, url: str, data: bytes, generation: int) -> int:
    bucket, key = self._split(url)
    out = self._request("POST", f"/upload/storage/v1/b/{bucket}/o",
                        {"uploadType": "media", "name": key, "ifGenerationMatch": generation}, data)
    return int(json.loads(out)["generation"])

  def create(self, url: str, data: bytes) -> int:
    return self._upload(url, data, 0)

  def read(self, url: str) -> tuple[bytes, int]:
    bucket, key = self._split(url)
    path = f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"
    generation = int(json.loads(self._request("GET", path, {}))["generation"])
    return self._request("GET", path, {"alt": "media", "ifGenerationMatch": generation}), generation

  def replace(self, url: str, data: bytes, generation: int) -> int:
    return self._upload(url, data, generation)

  def delete(self, url: str, generation: int) -> None:
    bucket, key = self._split(url)
    self._request("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}",
                  {"ifGenerationMatch": generation})


class FakeGCSServer:
  """The HTTP side, in a daemon thread of this process (subprocesses reach it on localhost)."""

  def __init__(self, root: str):
    handler = type("Handler", (_Handler,), {"root": root})
    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  def close(self) -> None:
    self.httpd.shutdown()
    self.httpd.server_close()


# ----------------------------------------------------------------------------------------------
# Installation.


def environment(root: str, url: str) -> dict:
  """Environment variables that point every client of a (sub)process at the fake."""
  return {ROOT_ENV: root, URL_ENV: url, "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token", "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
          "STORAGE_EMULATOR_HOST": url}  # google-cloud-storage (storage/conditional.py)


def subprocess_env(root: str, url: str, base: dict | None = None) -> dict:
  """`base` (os.environ) plus `environment`, with fake_gcs_site/ on PYTHONPATH (its sitecustomize
  installs the fake in the subprocess)."""
  env = dict(os.environ if base is None else base)
  env.update(environment(root, url))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, os.path.dirname(SITE_DIR),
                                                  env.get("PYTHONPATH", "")) if p)
  return env


class _FlatBucket:
  hierarchical_namespace_enabled = False


def install(root: str, url: str) -> None:
  """Points this process's gs:// clients at the fake (module docstring)."""
  os.environ.update(environment(root, url))
  for protocol in FakeGCSFileSystem.protocol:
    fsspec.register_implementation(protocol, FakeGCSFileSystem, clobber=True)
  FakeGCSFileSystem.clear_instance_cache()
  from etils.epath import backend
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  from orbax.checkpoint._src.path import gcs_utils
  gcs_utils.get_bucket = lambda name: _FlatBucket()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if repo not in sys.path:  # (a subprocess's sitecustomize runs before its script's path is set)
    sys.path.append(repo)
  from umoe_jax.storage import conditional
  conditional.BACKENDS["gs"] = conditional.BACKENDS["gcs"] = HTTPConditional(url)
  faults = os.environ.get(FAULTS_ENV, "")
  for item in filter(None, faults.split(",")):
    op, times = item.split("=")
    FakeGCSFileSystem.fail(op, int(times), ConnectionResetError(104, "Connection reset by peer "
                                                                "(injected by fake_gcs)"))


def install_from_env() -> None:
  if os.environ.get(ROOT_ENV) and os.environ.get(URL_ENV):
    install(os.environ[ROOT_ENV], os.environ[URL_ENV])


if __name__ == "__main__":  # python tests/fake_gcs.py ROOT: serve ROOT until interrupted
  server = FakeGCSServer(sys.argv[1])
  print(server.url, flush=True)
  threading.Event().wait()


# ----------------------------------------------------------------------------------------------
# The pytest fixture.

BUCKET = "umoe-test"


class FakeGCS:
  """What the `fake_gcs` fixture gives a test: URLs in the bucket, their local files, the
  environment for subprocesses."""

  def __init__(self, root: str, url: str):
    self.root, self.url = root, url

  def new_url(self, name: str) -> str:
    """gs://umoe-test/<name>-<unique>: a fresh prefix for one test."""
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"

  def local(self, url: str) -> str:
    """The file behind gs:// URL `url`."""
    return os.path.join(self.root, *url.split("://", 1)[1].split("/"))

  def env(self, base: dict | None = None) -> dict:
    return subprocess_env(self.root, self.url, base)


def fixture():
  import pytest

  @pytest.fixture(scope="session")
  def fake_gcs(tmp_path_factory):
    """gs://umoe-test/ on a local directory for this test session (module docstring)."""
    root = str(tmp_path_factory.mktemp("fake_gcs_root"))
    os.makedirs(os.path.join(root, BUCKET))
    server = FakeGCSServer(root)
    install(root, server.url)
    yield FakeGCS(root, server.url)
    server.close()

  return fake_gcs


if "pytest" in sys.modules:  # `from fake_gcs import fake_gcs` in a test module: the fixture
  fake_gcs = fixture()
