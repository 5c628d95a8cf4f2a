"""One registry type for every pluggable piece: routers, attention variants, gmm backends, ...

A new variant is one class (or function) plus one decorator line::

    ROUTERS = Registry("router")

    @ROUTERS.register("topk_softmax")
    class TopKSoftmaxRouter(...): ...

Config validation asks `ROUTERS.names()` for the valid choices, so an unknown name fails with an
error that lists them.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """A name -> object table with a readable error for unknown names."""

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: dict[str, T] = {}

  def register(self, name: str) -> Callable[[T], T]:
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

  def names(self) -> list[str]:
    return sorted(self._entries)

  def __contains__(self, name: Any) -> bool:
    return name in self._entries
