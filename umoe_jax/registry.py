"""One registry type for every pluggable piece: routers, attention variants, gmm backends, ...

A new variant is one class (or function) plus one decorator line::

    ROUTERS = Registry("router", names=ROUTER_KINDS)      # umoe_jax/kinds.py

    @ROUTERS.register("topk_softmax")
    class TopKSoftmaxRouter(...): ...

The registries of model classes live in the leaf module `umoe_jax.kinds` beside the tables of their
names, which config validation reads (so validating a config never imports the model); `get` of an
unknown name fails with an error that lists the registered ones.

Backend registries (gmm, attention cores, top-k) hold entries with `platforms`, `auto_priority` and
`available()`; `ranked(platform)` is what their "auto" takes, best first, so every such choice
follows one rule.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Iterable, Optional, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """A name -> object table with a readable error for unknown names."""

  def __init__(self, kind: str, names: Optional[Iterable[str]] = None):
    """`names`: the only names that may be registered (a table of a leaf module, `umoe_jax.kinds`);
    None = any."""
    self.kind = kind
    self._allowed = None if names is None else frozenset(names)
    self._entries: dict[str, T] = {}

  def register(self, name: str) -> Callable[[T], T]:
    if self._allowed is not None and name not in self._allowed:
      raise ValueError(f"{self.kind} {name!r} is not in its table of names: add it to "
                       f"umoe_jax/kinds.py first (known: {', '.join(sorted(self._allowed))})")

    def decorator(obj: T) -> T:
      if name in self._entries:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._entries[name] = obj
      return obj
    return decorator

  def get(self, name: str) -> T:
    try:
      return self._entries[name]
    except KeyError:
      raise ValueError(
          f"unknown {self.kind} {name!r}; valid choices: {', '.join(sorted(self._entries))}"
      ) from None

  def ranked(self, platform: str) -> list[str]:
    """Names of the entries "auto" may take on `platform`, best first: those that run there
    (`entry.platforms`), take part in the choice (`entry.auto_priority >= 0`) and whose
    `entry.available()` probe says yes, by descending `auto_priority` (ties: by name)."""
    names = [n for n, e in self._entries.items()
             if platform in e.platforms and e.auto_priority >= 0 and e.available()]
    return sorted(names, key=lambda n: (-self._entries[n].auto_priority, n))

  def names(self) -> list[str]:
    return sorted(self._entries)

  def __contains__(self, name: Any) -> bool:
    return name in self._entries
