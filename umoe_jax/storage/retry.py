"""Retries of remote storage operations: which errors are transient, backoff, the final error.

A remote operation (open, stat, list, read, write, move, delete of a gs:// / s3:// / hf:// URL) that
fails with a transient error (a timeout, a reset or refused connection, HTTP 408 / 429 / 5xx) is
tried again after 0.5, 1, 2, 4, ... s (at most 30 s apart, +-25% jitter so that many workers do not
retry in step), `UMOE_STORAGE_RETRIES` (default 6) attempts in all; each retry is logged as a
warning naming the operation, the URL and the error. Then, or at once for an error that retrying
cannot fix (no such object, permission, credentials, a missing client library), the operation
raises: FileNotFoundError naming the URL for a missing object or bucket, else `StorageError`.
`UMOE_STORAGE_RETRY_DELAY` sets the first delay in seconds (the tests make it small).

The storage clients retry some errors themselves (gcsfs, s3fs / botocore, huggingface_hub); this
outer loop also covers what they pass on, e.g. a connection reset while a row group is streamed.
"""
from __future__ import annotations

import errno
import os
import random
import time
from typing import Callable, TypeVar

from absl import logging

T = TypeVar("T")

TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
TRANSIENT_ERRNO = frozenset({errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE,
                             errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED})
# Exception classes of the storage clients (aiohttp, requests / urllib3, botocore, http.client) that
# mean "the connection or the server failed", matched by name so that none of them must be installed.
TRANSIENT_NAMES = frozenset({
    "ServerDisconnectedError", "ClientConnectionError", "ClientOSError", "ClientPayloadError",
    "ServerTimeoutError", "ReadTimeout", "ConnectTimeout", "ConnectTimeoutError",
    "ReadTimeoutError", "ChunkedEncodingError", "IncompleteRead", "ProtocolError",
    "RemoteDisconnected", "EndpointConnectionError", "ConnectionClosedError",
    "ResponseStreamingError", "TransportError"})
# Errors no retry fixes: reported at once.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
             FileExistsError, NotImplementedError, ImportError, ValueError, TypeError, KeyError)

CREDENTIAL_HINTS = {
    "gs": "Cloud Storage credentials: GOOGLE_APPLICATION_CREDENTIALS=<service account key file>, or "
          "`gcloud auth application-default login` (on a GCE / TPU VM its service account is used)",
    "gcs": "Cloud Storage credentials: GOOGLE_APPLICATION_CREDENTIALS=<service account key file>, "
           "or `gcloud auth application-default login`",
    "s3": "S3 credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN), or "
          "AWS_PROFILE with ~/.aws/credentials (AWS_ENDPOINT_URL for other S3 stores)",
    "hf": "Hugging Face: HF_TOKEN=<token> (or `huggingface-cli login`) for gated or private "
          "repositories; public datasets need none",
}
LIBRARY_HINT = "pip install -r requirements-cloud.txt (gcsfs, s3fs, huggingface_hub, google-cloud-storage)"


class StorageError(OSError):
  """A remote storage operation failed (after its retries); the message names the URL. `hint`
  says what to check."""

  def __init__(self, message: str, url: str = "", hint: str = ""):
    super().__init__(message)
    self.url = url
    self.hint = hint

  def __str__(self) -> str:
    return self.args[0]


class ObjectNotFoundError(FileNotFoundError):
  """A file or object (or its bucket) does not exist; the message names the URL."""

  def __str__(self) -> str:
    return self.args[0]


def scheme_of(url: str) -> str:
  return url.split("://", 1)[0] if "://" in url else ""


def _chain(error: BaseException, limit: int = 8):
  """`error`, its __cause__ / __context__, and so on (the clients wrap their transport errors)."""
  seen = set()
  while error is not None and id(error) not in seen and len(seen) < limit:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _status(error: BaseException):
  for holder in (error, getattr(error, "response", None)):
    for attr in ("status_code", "status", "code"):
      value = getattr(holder, attr, None)
      if isinstance(value, int) and 100 <= value < 600:
        return value
  return None


def is_transient(error: BaseException) -> bool:
  """Whether retrying `error` can help: timeouts, dropped connections, HTTP 408 / 429 / 5xx."""
  for e in _chain(error):
    if isinstance(e, (TimeoutError, ConnectionError)):
      return True
    if _status(e) in TRANSIENT_HTTP:
      return True
    if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNO:
      return True
    if any(cls.__name__ in TRANSIENT_NAMES for cls in type(e).__mro__):
      return True
  return False


def _one_line(error: BaseException, limit: int = 300) -> str:
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _is_credentials(error: BaseException) -> bool:
  return any("Credential" in cls.__name__ or cls.__name__ in ("RefreshError", "GatedRepoError")
             for e in _chain(error) for cls in type(e).__mro__) or _status(error) in (401, 403)


def final_error(what: str, url: str, error: BaseException, attempts: int = 1,
                seconds: float = 0.0) -> BaseException:
  """The error to raise for operation `what` on `url` that failed with `error`."""
  scheme = scheme_of(url)
  if isinstance(error, FileNotFoundError):
    return ObjectNotFoundError(f"{url}: no such file or object (or its bucket does not exist or is "
                             f"not visible with these credentials)")
  if isinstance(error, ImportError):
    return StorageError(f"{what} {url}: the client library for {scheme}:// is not installed "
                        f"({_one_line(error, 200)})", url, LIBRARY_HINT)
  if isinstance(error, PermissionError) or _is_credentials(error):
    return StorageError(f"{what} {url}: access denied or no credentials ({_one_line(error)})", url,
                        CREDENTIAL_HINTS.get(scheme, "check the credentials of this store"))
  tries = f" after {attempts} attempts over {seconds:.0f} s" if attempts > 1 else ""
  hint = ("a transient error persisted: check the network and the store's status, then run the "
          "same command again" if is_transient(error) else CREDENTIAL_HINTS.get(scheme, ""))
  return StorageError(f"{what} {url} failed{tries} ({_one_line(error)})", url, hint)


def attempts() -> int:
  return max(1, int(os.environ.get("UMOE_STORAGE_RETRIES", "6")))


def first_delay() -> float:
  return float(os.environ.get("UMOE_STORAGE_RETRY_DELAY", "0.5"))


CLIENT_MODULES = frozenset({"gcsfs", "s3fs", "botocore", "aiobotocore", "huggingface_hub",
                            "aiohttp", "requests", "urllib3", "google", "fsspec", "pyarrow"})


def _storage_failure(error: BaseException) -> bool:
  """Whether `error` is the store's (rewrapped naming the URL), not the caller's (e.g. a DataError
  raised by the function being retried, passed on as it is)."""
  return (isinstance(error, (OSError, ImportError)) or is_transient(error)
          or _is_credentials(error) or type(error).__module__.split(".")[0] in CLIENT_MODULES)


def call(fn: Callable[[], T], what: str, url: str, *, transient_only: bool = False) -> T:
  """fn(), retried on transient errors (module docstring); the final error names `what` and `url`.

  Errors that are not the store's (a ValueError of the caller's own checks) pass unchanged; with
  `transient_only`, so do all but transient ones (a reader that tells damaged data apart itself)."""
  n, delay, start = attempts(), first_delay(), time.monotonic()
  for attempt in range(1, n + 1):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except  (classified below)
      if attempt < n and is_transient(e) and not isinstance(e, PERMANENT):
        wait = min(delay, 30.0) * random.uniform(0.75, 1.25)
        logging.warning("storage: %s %s failed (%s); retry %d of %d in %.1f s", what, url,
                        _one_line(e, 200), attempt, n - 1, wait)
        time.sleep(wait)
        delay *= 2
        continue
      if transient_only and not is_transient(e):
        raise
      if (isinstance(e, (StorageError, ObjectNotFoundError, FileExistsError, IsADirectoryError,
                         NotADirectoryError)) or not _storage_failure(e)):
        raise
      raise final_error(what, url, e, attempt, time.monotonic() - start) from e
  raise AssertionError("unreachable")
