"""Running an attention kernel on each device's own rows under a mesh (`on_local_shards`): how the
fused cores (attention/cores.py, the splash kernel) work on the data-, FSDP- and expert-parallel
layouts."""
from __future__ import annotations

import math

import jax


def on_local_shards(attend, q: jax.Array, k: jax.Array, v: jax.Array):
  """attend(q, k, v) on each device's own rows while a mesh of several devices is active
  (`parallel.use_mesh`), else on the arrays as they are: how the fused cores run on the data-,
  FSDP- and expert-parallel layouts (XLA does not partition the Triton and splash kernels' custom
  calls; jax partitions cuDNN's by batch and heads itself, and this gives it the same layout).

  The batch is split as the activations are (BATCH's mesh axes) and the query heads over HEADS'
  axes where they divide them (a shared key head, Hk = 1, stays whole on every head shard); the
  sequence and the widths stay whole, since a causal core needs every earlier key. A mesh axis that
  divides neither is replicated: its devices repeat the same work, and the backward sums the
  input gradients over it.

  Args:
    attend: (q, k, v) -> [B, T, H, Dv], or None where it cannot take the (local) shapes.
    q [B, T, H, Dk], k [B, T, Hk, Dk], v [B, T, Hk, Dv] with Hk == H or Hk == 1.
  Returns:
    attend's [B, T, H, Dv] (sharded like q), or None where attend declines the local shapes.
  """
  from jax.sharding import PartitionSpec as P
  from umoe_jax.parallel import rules as ax
  from umoe_jax.parallel import sharding
  ctx = sharding.current_context()
  if ctx is None or ctx.mesh.size == 1:
    return attend(q, k, v)
  mesh = ctx.mesh
  q_spec = sharding.spec_for_shape((ax.BATCH, None, ax.HEADS, None), q.shape, mesh, ctx.rules)
  kv_spec = P(q_spec[0], None, q_spec[2] if k.shape[2] == q.shape[2] else None, None)

  def shards(entry) -> int:  # devices one dimension is split over
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[a] for a in axes)

  def local(x, spec):  # the part of x one device holds
    return jax.ShapeDtypeStruct(tuple(d // shards(e) for d, e in zip(x.shape, spec)), x.dtype)

  if jax.eval_shape(attend, local(q, q_spec), local(k, kv_spec), local(v, kv_spec)) is None:
    return None
  # check_vma=False is required, not a convenience: the kernels' VJPs type dK / dV like k and v,
  # which do not vary over the head axes, so with the check on, shard_map would not sum a shared key
  # head's gradient over the head shards. With it off, the transpose sums every input's cotangent
  # over the mesh axes its spec leaves out.
  return sharding.shard_map(attend, mesh, (q_spec, kv_spec, kv_spec), q_spec, check_vma=False)(q, k, v)
