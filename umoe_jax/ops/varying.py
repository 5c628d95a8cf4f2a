"""shard_map's "varying manual axes" type of an array, read and raised portably across jax versions.

Inside `shard_map(check_vma=True)` every value carries the set of mesh axes over which it may differ
between devices. Kernels called through custom calls (Triton, Mosaic) return values typed as
invariant even when their inputs vary, and a custom VJP must return each cotangent with its primal's
type; these helpers restore the types.
"""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """Mesh axes over which x varies inside shard_map (empty outside it).

  `aval.vma` on newer jax; `aval.manual_axis_type.varying` on jax 0.10.
  """
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return frozenset(vma or ())


def vary_like(x: jax.Array, axes: frozenset) -> jax.Array:
  """x marked as varying over `axes` too (values unchanged)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def match_varying(*xs: jax.Array) -> list[jax.Array]:
  """Casts arrays to the union of their varying axes.

  A weight that is invariant over the batch axes meeting rows that vary over them would get a varying
  weight gradient from a custom VJP; casting the weight to varying first puts the psum over the batch
  axes in the transpose of the cast, where JAX adds it itself.
  """
  union = frozenset().union(*(varying_axes(x) for x in xs))
  return [vary_like(x, union) for x in xs]
