"""Path and file operations on local paths and remote URLs alike (see the package docstring).

Every function takes a local path or a URL (`gs://bucket/a/b`, `s3://...`, `hf://datasets/...`, any
fsspec protocol) and returns paths of the same kind: local paths stay `os` / `open` calls with
their usual errors; URLs go through fsspec with retries (`retry.call`), and their errors name the URL.
"""
from __future__ import annotations

import builtins
import glob as glob_lib
import io
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from typing import IO, Any, Optional

from umoe_jax.storage import retry

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(path: str) -> bool:
  """Whether `path` is a URL (`scheme://...`; a Windows drive letter is not a scheme)."""
  return bool(_URL.match(os.fspath(path)))


def scheme(path: str) -> str:
  """"gs", "s3", "hf", ... of a URL; "" for a local path."""
  return path.split("://", 1)[0].lower() if is_url(path) else ""


class UnknownUserError(FileNotFoundError, ValueError):
  """A local path `~user/...` of no user of this machine (os.path.expanduser leaves it as it is, and
  the path is then looked up relative to the working directory: "no such file" naming `~user`).
  A FileNotFoundError (what a missing input is) and a ValueError (what a bad flag value is), so
  the commands' handlers of either print its one line."""


def _expand_local(path: str) -> str:
  """os.path.expanduser of a local path; UnknownUserError when `~user` names no user."""
  expanded = os.path.expanduser(path)
  if expanded.startswith("~"):
    user = expanded[1:].split(os.sep, 1)[0]
    raise UnknownUserError(f"unknown user {user!r} in {path!r} (~{user} is the home directory of "
                           f"user {user!r}; ~/ is yours)")
  return expanded


def expand(path: str) -> str:
  """A local path with `~` expanded; a URL without a trailing slash. UnknownUserError (a
  FileNotFoundError and a ValueError) when a `~user` path names no user of this machine."""
  path = os.fspath(path)
  if is_url(path):
    head, rest = path.split("://", 1)
    return f"{head}://{rest.rstrip('/')}"
  return _expand_local(path)


def expand_user(path: str, flag: str) -> str:
  """`path` with a leading `~` / `~user` expanded (a URL as it is); ValueError naming `flag` when
  `~user` names no user of this machine, which os.path.expanduser leaves as it is (a command would
  make a directory literally named `~user`)."""
  path = os.fspath(path)
  if is_url(path):
    return path
  try:
    return _expand_local(path)
  except UnknownUserError as e:
    raise ValueError(f"{flag}={path!r}: {e}") from None


def abspath(path: str) -> str:
  """The absolute form of a local path (`~` expanded); a URL as `expand` gives it.
  UnknownUserError as `expand`."""
  return expand(path) if is_url(path) else os.path.abspath(_expand_local(os.fspath(path)))


def normpath(path: str) -> str:
  """os.path.normpath of a local path; a URL without a trailing slash (its "//" kept)."""
  return expand(path) if is_url(path) else os.path.normpath(path)


def join(base: str, *parts: str) -> str:
  return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def dirname(path: str) -> str:
  if not is_url(path):
    return os.path.dirname(path)
  head, rest = expand(path).split("://", 1)
  return f"{head}://{posixpath.dirname(rest)}"


def basename(path: str) -> str:
  return posixpath.basename(expand(path)) if is_url(path) else os.path.basename(path)


def has_magic(path: str) -> bool:
  return glob_lib.has_magic(path)


# ----------------------------------------------------------------------------------------------
# Remote plumbing.


def filesystem(url: str):
  """(fsspec file system, its path of `url`); a missing client library is a StorageError."""
  import fsspec
  try:
    return fsspec.core.url_to_fs(url)
  except ImportError as e:
    raise retry.final_error("opening", url, e) from e
  except ValueError as e:  # "Protocol not known: xyz"
    raise retry.StorageError(f"{url}: unknown storage protocol {scheme(url)!r} ({e})", url,
                             retry.LIBRARY_HINT) from e


def _remote(what: str, url: str, fn):
  """fn(fs, path) for `url`, retried (retry.call)."""
  fs, path = filesystem(url)
  return retry.call(lambda: fn(fs, path), what, url)


def _urls(fs, url: str, paths) -> list[str]:
  """fsspec's protocol-less paths back as URLs of `url`'s scheme (as the user spelled it)."""
  prefix = url.split("://", 1)[0] + "://"
  out = []
  for p in paths:
    p = fs.unstrip_protocol(p)
    out.append(prefix + p.split("://", 1)[1] if "://" in p else prefix + p.lstrip("/"))
  return out


# ----------------------------------------------------------------------------------------------
# Queries.


BUCKET_SCHEMES = ("gs", "gcs", "s3")


def bucket_url(url: str) -> str:
  """`gs://bucket` of `gs://bucket/a/b` (stores with buckets; "" for others and local paths)."""
  if scheme(url) not in BUCKET_SCHEMES:
    return ""
  head, rest = expand(url).split("://", 1)
  return f"{head}://{rest.split('/')[0]}"


def check_bucket(url: str) -> None:
  """ObjectNotFoundError naming the bucket of `url` if it does not exist (or is not visible with
  these credentials), before anything is written there. Nothing for stores without buckets."""
  bucket = bucket_url(url)
  if bucket and not exists(bucket):
    raise retry.ObjectNotFoundError(f"{url}: bucket {bucket} does not exist (or is not visible "
                                    "with these credentials)")


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  return _remote("checking", path, lambda fs, p: fs.exists(p))


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(path)
  return _remote("checking", path, lambda fs, p: fs.isdir(p))


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(path)
  return _remote("checking", path, lambda fs, p: fs.isfile(p))


def size(path: str) -> int:
  if not is_url(path):
    return os.path.getsize(path)
  return int(_remote("reading the size of", path, lambda fs, p: fs.size(p)))


def listdir(path: str) -> list[str]:
  """Sorted names of the entries of directory (prefix) `path`."""
  if not is_url(path):
    return sorted(os.listdir(path))
  names = _remote("listing", path, lambda fs, p: fs.ls(p, detail=False))
  base = expand(path).split("://", 1)[1]
  return sorted({posixpath.basename(n.rstrip("/")) for n in names
                 if n.rstrip("/").split("://")[-1] != base})


def find_files(path: str, suffixes: tuple[str, ...] = ()) -> list[str]:
  """Sorted files below directory `path` (recursively), hidden names (".x") skipped at any level
  below it, and only names ending in one of `suffixes` when given."""
  def keep(rel: str) -> bool:
    parts = rel.split("/")
    return not any(p.startswith(".") for p in parts) and (not suffixes or
                                                          parts[-1].endswith(suffixes))

  if not is_url(path):
    files = []
    for root, dirs, names in os.walk(path):
      dirs[:] = [d for d in dirs if not d.startswith(".")]
      files += [os.path.join(root, n) for n in names if keep(n)]
    return sorted(files)
  found = _remote("listing", path, lambda fs, p: (fs, fs.find(p)))
  fs, names = found
  urls = _urls(fs, path, names)
  base = expand(path) + "/"
  return sorted(u for u in urls if u.startswith(base) and keep(u[len(base):]))


def glob(pattern: str, files_only: bool = False) -> list[str]:
  """Sorted matches of a glob pattern (`*`, `?`, `[...]`; `**` spans directories); with
  `files_only`, files only (remotely from the listing itself: no request per match)."""
  if not is_url(pattern):
    found = sorted(glob_lib.glob(os.path.expanduser(pattern), recursive=True))
    return [f for f in found if os.path.isfile(f)] if files_only else found
  if not files_only:
    fs, names = _remote("listing", pattern, lambda fs, p: (fs, fs.glob(p)))
  else:
    fs, entries = _remote("listing", pattern, lambda fs, p: (fs, fs.glob(p, detail=True)))
    names = [n for n, e in entries.items() if e.get("type") != "directory"]
  return sorted(u for u in _urls(fs, pattern, names) if not _hidden_match(pattern, u))


def _hidden_match(pattern: str, url: str) -> bool:
  """Whether a wildcard matched a hidden name (".x"), which Python's glob never does."""
  wanted = pattern.split("://", 1)[1].split("/")
  got = url.split("://", 1)[1].split("/")
  if "**" in wanted:
    literal = set(wanted)
    return any(g.startswith(".") and g not in literal for g in got)
  return any(g.startswith(".") and not w.startswith(".") for w, g in zip(wanted, got))


# ----------------------------------------------------------------------------------------------
# Reading and writing.


def open(path: str, mode: str = "r", *, encoding: Optional[str] = None,  # pylint: disable=redefined-builtin
         errors: Optional[str] = None, newline: Optional[str] = None) -> IO[Any]:
  """A file object, as the builtin `open` gives. Remote files: "r" / "rb" stream (seekable, read in
  blocks); "w" / "wb" upload when closed (the object appears whole, or not at all if the write
  fails). Appending is local only: object stores cannot append (`AppendFile` emulates it)."""
  if not is_url(path):
    return builtins.open(path, mode, encoding=encoding, errors=errors, newline=newline)
  if "a" in mode or "+" in mode:
    raise ValueError(f"{path}: mode {mode!r}: object stores cannot append or update in place "
                     "(use umoe_jax.storage.AppendFile)")
  binary = mode.replace("t", "")
  binary = binary if "b" in binary else binary + "b"
  what = "opening" if "r" in mode else "writing"
  f = _remote(what, path, lambda fs, p: fs.open(p, binary))
  if "b" in mode:
    return f
  return io.TextIOWrapper(f, encoding=encoding or "utf-8", errors=errors, newline=newline)


def read_bytes(path: str) -> bytes:
  if not is_url(path):
    with builtins.open(path, "rb") as f:
      return f.read()
  return _remote("reading", path, lambda fs, p: fs.cat_file(p))


def read_text(path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
  return read_bytes(path).decode(encoding, errors)


def write_bytes(path: str, data: bytes) -> None:
  """Writes `path` atomically: a reader (or a crash) sees the old content or the new, never a part.

  Local: a temporary sibling, fsync, then os.replace over `path` (parent directories are made).
  Remote: one upload of the whole object (object stores replace an object atomically), retried.
  """
  if is_url(path):
    def put(fs, p):
      with fs.open(p, "wb") as f:
        f.write(data)
    _remote("writing", path, put)
    return
  path = expand(path)  # "~/r.png" is below $HOME, as `abspath` and output.check_output_path read it
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
  try:
    with builtins.open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_text(path: str, text: str, encoding: str = "utf-8") -> None:
  """`write_bytes` of the encoded text (atomic)."""
  write_bytes(path, text.encode(encoding))


def upload_file(local_path: str, path: str) -> None:
  """Copies local file `local_path` to `path` (local or remote), streamed, as `write_bytes` would."""
  if not is_url(path):
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
      shutil.copyfile(local_path, tmp)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    return

  def put(fs, p):
    with builtins.open(local_path, "rb") as src, fs.open(p, "wb") as dst:
      shutil.copyfileobj(src, dst, 8 << 20)
  _remote("uploading to", path, put)


def upload_tree(local_dir: str, path: str) -> list[str]:
  """Copies every file below `local_dir` to the same relative place below `path`; the copies."""
  out = []
  for root, _, names in os.walk(local_dir):
    for name in sorted(names):
      src = os.path.join(root, name)
      rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
      dst = join(path, *rel.split("/"))
      upload_file(src, dst)
      out.append(dst)
  return out


# ----------------------------------------------------------------------------------------------
# Directories, moves, deletion.


def makedirs(path: str) -> None:
  """Local: os.makedirs (exist_ok). Remote: nothing; object stores have no directories (a prefix
  exists once an object below it does), and a file system call here could create a bucket."""
  if not is_url(path):
    os.makedirs(expand(path), exist_ok=True)


def remove(path: str, missing_ok: bool = False) -> None:
  if not is_url(path):
    try:
      os.remove(path)
    except FileNotFoundError:
      if not missing_ok:
        raise
    return
  if missing_ok and not exists(path):
    return
  _remote("deleting", path, lambda fs, p: fs.rm_file(p))


def rmtree(path: str, missing_ok: bool = True) -> None:
  """Deletes directory (prefix) `path` with everything below it."""
  if not is_url(path):
    if os.path.exists(path) or not missing_ok:
      shutil.rmtree(path)
    return
  if missing_ok and not exists(path):
    return
  _remote("deleting", path, lambda fs, p: fs.rm(p, recursive=True))


def move(src: str, dst: str) -> None:
  """Moves file or directory `src` to `dst` (both local, or both URLs of one store). Local: a
  rename (parents made). Remote: the store's move; on object stores a copy of every object, then
  the delete: not atomic (a reader may see both for a while)."""
  if is_url(src) != is_url(dst):
    raise ValueError(f"cannot move {src!r} to {dst!r}: one is local, the other remote")
  if not is_url(src):
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    shutil.move(src, dst)
    return
  _, dst_path = filesystem(dst)
  _remote("moving", src, lambda fs, p: fs.mv(p, dst_path, recursive=True))


# ----------------------------------------------------------------------------------------------
# Adapters for libraries that take file systems.


def arrow_filesystem(path: str):
  """(pyarrow file system or None, the path to give it): None for local paths (pyarrow's own),
  else fsspec's file system of the URL wrapped for pyarrow (files are read by ranges, in blocks)."""
  if not is_url(path):
    return None, path
  from pyarrow import fs as pafs
  fs, p = filesystem(path)
  return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), p


def local_temp_dir(prefix: str = "umoe-") -> str:
  """A fresh local temporary directory (for staging files that a library can only write locally)."""
  return tempfile.mkdtemp(prefix=prefix)
