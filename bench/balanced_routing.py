"""Bench-only forced-balanced routing (bench/train_step.py --routing=balanced): every router's pick
is replaced by round-robin expert ids, token t's K slots (t*K + j) mod E over the flattened [B*T]
tokens, with uniform gates 1/K, so each expert gets the same rows and the step shows the kernels'
ceiling beside real routing. The router still runs (its cost and its losses stay in the step); only
its ids, gates and slot mask are overwritten. Patched on the router classes of this process only."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_PATCHED: dict = {}


def round_robin_ids(batch: int, seq: int, n_experts: int, k: int) -> jax.Array:
  """[batch, seq, k] int32: (t*k + j) mod n_experts for flat token t = b*seq + s."""
  t = jnp.arange(batch * seq, dtype=jnp.int32)[:, None]
  j = jnp.arange(k, dtype=jnp.int32)[None, :]
  return ((t * k + j) % n_experts).reshape(batch, seq, k)


def balanced(out, n_experts: int):
  """A RouterOutput with round-robin ids, uniform gates (same shape and dtype) and every slot on."""
  b, s, k = out.expert_ids.shape
  ids = round_robin_ids(b, s, n_experts, k).astype(out.expert_ids.dtype)
  gates = jnp.full(out.gates.shape, 1.0 / k, out.gates.dtype)
  return out.replace(expert_ids=ids, gates=gates, slot_mask=None, sequence_counts=None)


def _wrap(call):
  @functools.wraps(call)
  def patched(self, x, *a, **kw):
    return balanced(call(self, x, *a, **kw), self.n_experts)
  patched._balanced_original = call
  return patched


def install() -> list[str]:
  """Patch __call__ of every router class (each class that defines one); returns the names of the
  patched classes (those patched before included)."""
  from umoe_jax.kinds import ROUTERS
  from umoe_jax.model import routers  # noqa: F401  (registers the router classes)
  from umoe_jax.model.routers.base import Router
  for name in ROUTERS.names():
    for cls in ROUTERS.get(name).__mro__:
      if (isinstance(cls, type) and issubclass(cls, Router) and "__call__" in cls.__dict__
          and cls not in _PATCHED):
        _PATCHED[cls] = cls.__dict__["__call__"]
        cls.__call__ = _wrap(_PATCHED[cls])
  return [cls.__name__ for cls in _PATCHED]


def uninstall() -> None:
  for cls, call in _PATCHED.items():
    cls.__call__ = call
  _PATCHED.clear()
