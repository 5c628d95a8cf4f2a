"""The path layer: every file the project reads or writes, on local disks or remote stores.

    from umoe_jax import storage
    storage.glob("hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet")
    storage.write_text("gs://bucket/runs/a/config.json", text)      # atomic
    with storage.open("s3://bucket/data/x.jsonl", "rb") as f: ...   # streamed

Local paths are plain `os` / `open` calls (no extra install). URLs go through fsspec, with the
protocols' client libraries as optional dependencies (requirements-cloud.txt): `gs://` gcsfs,
`s3://` s3fs, `hf://` huggingface_hub's HfFileSystem. Credentials are the clients' own:
GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login` (a GCE / TPU VM's service
account by default), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, HF_TOKEN.

Who reads what:
  * parquet: pyarrow through `arrow_filesystem` (footer, then one row group's column chunks by
    byte range: bounded memory, no whole-file download); JSON lines: seek + line reads of a
    streamed file; text files and tokenizer.json: read whole (they are small).
  * ArrayRecord shards: array_record's C++ reader, which reads local paths and gs:// itself (not
    s3:// or hf://); `prepare` writes shards locally (its writer is local only) and uploads them.
  * checkpoints: Orbax, given the URL (through etils.epath and TensorStore): local paths and gs://.
  * config.json, metrics.jsonl, TensorBoard events, eval / analysis / interop outputs: this layer.

Atomicity: `write_bytes` / `write_text` write a temporary sibling and rename it over the target
locally, and upload the whole object remotely (GCS and S3 replace an object atomically: readers see
the old one or the new one). Directory-level commits on object stores use a marker object written
last (Orbax's commit_success.txt in a step; prepare's metadata.json). Moves of directories on object
stores copy then delete (not atomic). `AppendFile` emulates appending by re-uploading (append.py).

Conditional writes (conditional.py, gs:// only): create an object unless it exists, replace or
delete it only at the generation last read; what the workdir lock (umoe_jax/train/lock.py) needs so
that of two runs starting at once one wins.

Errors: remote operations are retried with exponential backoff on transient errors, each retry
logged (retry.py); a missing object or bucket raises FileNotFoundError naming the URL; anything
else raises StorageError (an OSError) naming the URL, with a hint on credentials where it applies.
"""
from umoe_jax.storage.append import AppendFile
from umoe_jax.storage.files import (
    UnknownUserError, abspath, arrow_filesystem, basename, bucket_url, check_bucket, dirname,
    exists, expand, expand_user, filesystem, find_files, glob, has_magic, is_url, isdir, isfile,
    join, listdir, local_temp_dir, makedirs, move, normpath, open, read_bytes, read_text, remove,
    rmtree, scheme, size, upload_file, upload_tree, write_bytes, write_text)
from umoe_jax.storage.retry import ObjectNotFoundError, StorageError, is_transient

__all__ = [
    "AppendFile", "ObjectNotFoundError", "StorageError", "UnknownUserError", "abspath", "arrow_filesystem", "basename",
    "bucket_url", "check_bucket",
    "dirname", "exists", "expand", "expand_user", "filesystem", "find_files", "glob", "has_magic", "is_transient",
    "is_url", "isdir", "isfile", "join", "listdir", "local_temp_dir", "makedirs", "move", "normpath", "open",
    "read_bytes", "read_text", "remove", "rmtree", "scheme", "size", "upload_file", "upload_tree",
    "write_bytes", "write_text",
]
