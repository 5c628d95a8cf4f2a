"""The built-in corpus: real text that ships with every CPython install, so training needs no download.

Documents, enumerated in a fixed order (sorted names):
  1. `pydoc_data.topics.topics`: the help() topics, i.e. the Python Language Reference chapters as plain
     English prose (~80 documents, ~0.45 MB on CPython 3.11). Name "pydoc_topics/<topic>".
  2. The top-level modules of the standard library, `<stdlib>/*.py` (~170 files, ~4.7 MB on 3.11): Python
     source with docstrings and comments. Name "stdlib/<file>.py". Sub-packages and tests are left out
     to keep the corpus a few MB.
About 5 MB / 5 M byte tokens in all. The exact content depends on the Python version (3.11 and 3.12
differ), but for one installation it is fixed, so runs are reproducible on one machine.

Split: a document is held out for validation when crc32(name) % 20 == 0 (~5%, ~12 documents);
everything else is training data. Hashing the name keeps the split stable if files come or go.
"""
from __future__ import annotations

import functools
import pathlib
import sysconfig
import zlib

_HOLDOUT_MODULUS = 20


@functools.lru_cache(maxsize=None)
def _all_documents() -> tuple[tuple[str, str], ...]:
  """All (name, locator) pairs, sorted by name. A locator is a file path or a pydoc topic key."""
  docs = []
  try:
    from pydoc_data import topics  # Part of the stdlib; absent only on stripped installs.
    docs += [(f"pydoc_topics/{k}", k) for k in topics.topics]
  except ImportError:
    pass
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  docs += [(f"stdlib/{p.name}", str(p)) for p in stdlib.glob("*.py") if p.is_file()]
  if not docs:
    raise FileNotFoundError(
        f"builtin data source found no text: no pydoc_data and no *.py files under {stdlib}")
  return tuple(sorted(docs))


def document_names(split: str) -> list[tuple[str, str]]:
  """(name, locator) pairs of the "train" or "validation" split, in a fixed order."""
  if split not in ("train", "validation"):
    raise ValueError(f"builtin split must be 'train' or 'validation', got {split!r}")
  want_holdout = split == "validation"
  return [(n, loc) for n, loc in _all_documents()
          if (zlib.crc32(n.encode()) % _HOLDOUT_MODULUS == 0) == want_holdout]


def read_document(name_and_locator: tuple[str, str]) -> str:
  """The text of one document from `document_names`."""
  name, locator = name_and_locator
  if name.startswith("pydoc_topics/"):
    from pydoc_data import topics
    return topics.topics[locator]
  # A few stdlib files are not UTF-8 clean in every version; never fail on them.
  return pathlib.Path(locator).read_text(encoding="utf-8", errors="replace")
