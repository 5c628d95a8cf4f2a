"""Conditional writes of one small object: create-if-absent, compare-and-replace, compare-and-delete.

What a lock on an object store needs (umoe_jax/train/lock.py): two writers that race on one object
must not both win. Each object has a generation that changes with every write; every call names the
generation it expects and fails with `PreconditionFailed` (a FileExistsError) when the object has
another one:

    generation = create_new(url, data)                   # fails if the object exists
    data, generation = read_versioned(url)               # FileNotFoundError if it does not
    generation = replace_if(url, new_data, generation)   # fails if written since
    delete_if(url, generation)                           # fails if written since

gs:// only: the GCS JSON API's `ifGenerationMatch` precondition (0: "must not exist") through
google-cloud-storage (requirements-cloud.txt), which the store checks atomically. Credentials are
the client's own (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`);
STORAGE_EMULATOR_HOST points it at an emulator. Other stores raise StorageError. Errors are those
of the path layer: retried when transient, FileNotFoundError naming a missing object or bucket,
StorageError naming the URL with a hint (a missing client library, no credentials).
"""
from __future__ import annotations

import functools

from umoe_jax.storage import files, retry


class PreconditionFailed(FileExistsError):
  """The object exists (create_new) or has another generation than the one expected."""

  def __str__(self) -> str:
    return self.args[0]


class GCSObjects:
  """The four operations on gs:// through google-cloud-storage (the JSON API's ifGenerationMatch)."""

  @functools.cached_property
  def client(self):
    from google.cloud import storage as gcs  # requirements-cloud.txt
    return gcs.Client()

  def _blob(self, url: str):
    bucket, _, key = files.expand(url).split("://", 1)[1].partition("/")
    if not key:
      raise ValueError(f"{url}: names a bucket, not an object")
    return self.client.bucket(bucket).blob(key)

  def create(self, url: str, data: bytes) -> int:
    blob = self._blob(url)
    blob.upload_from_string(data, if_generation_match=0)
    return int(blob.generation)

  def read(self, url: str) -> tuple[bytes, int]:
    blob = self._blob(url)
    blob.reload()
    generation = int(blob.generation)
    return blob.download_as_bytes(if_generation_match=generation), generation

  def replace(self, url: str, data: bytes, generation: int) -> int:
    blob = self._blob(url)
    blob.upload_from_string(data, if_generation_match=generation)
    return int(blob.generation)

  def delete(self, url: str, generation: int) -> None:
    self._blob(url).delete(if_generation_match=generation)


# scheme -> an object with create / read / replace / delete as GCSObjects' (errors: exceptions whose
# `code` is the HTTP status; 412 a failed precondition, 404 a missing object). Tests register a
# stand-in (tests/fake_gcs.py).
BACKENDS = {"gs": GCSObjects(), "gcs": None}
BACKENDS["gcs"] = BACKENDS["gs"]


def _backend(url: str):
  backend = BACKENDS.get(files.scheme(url))
  if backend is None:
    raise retry.StorageError(f"{url}: conditional writes (a lock object) need gs://, not "
                             f"{files.scheme(url) or 'a local path'}", url)
  return backend


def _code(error: BaseException):
  code = getattr(error, "code", None)
  return code if isinstance(code, int) else None


def _call(what: str, url: str, op: str, *args, precondition: str):
  """backend.op(url, *args), retried; HTTP 412 is PreconditionFailed(precondition), 404
  FileNotFoundError."""
  def attempt():
    try:
      return getattr(_backend(url), op)(url, *args)
    except Exception as e:  # pylint: disable=broad-except  (the client's errors, by status)
      if _code(e) == 412:
        raise PreconditionFailed(f"{url}: {precondition}") from None
      if _code(e) == 404:
        raise FileNotFoundError(url) from e
      raise
  return retry.call(attempt, what, url)


def create_new(url: str, data: bytes) -> int:
  """Creates object `url` holding `data` unless it exists (PreconditionFailed); its generation.

  A retried attempt whose first try did succeed fails as "exists": the caller tells its own
  object apart by its content."""
  return _call("creating", url, "create", data, precondition="exists already")


def read_versioned(url: str) -> tuple[bytes, int]:
  """(content, generation) of object `url`, read together."""
  for _ in range(5):  # replaced between the metadata and the content: read the new one
    try:
      return _call("reading", url, "read", precondition="changed while read")
    except PreconditionFailed:
      continue
  raise retry.StorageError(f"reading {url}: it changes faster than it can be read", url)


def replace_if(url: str, data: bytes, generation: int) -> int:
  """Replaces object `url` with `data` if its generation is `generation`; the new generation."""
  return _call("writing", url, "replace", data, generation,
               precondition=f"written by another process since generation {generation}")


def delete_if(url: str, generation: int) -> None:
  """Deletes object `url` if its generation is `generation`."""
  _call("deleting", url, "delete", generation,
        precondition=f"written by another process since generation {generation}")
