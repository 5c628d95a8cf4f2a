"""Shardings from logical names: parameters, optimizer state, batches and activations.

Every `nnx.Param` carries a tuple of logical axis names in its `out_sharding` metadata
(`umoe_jax.model.layers.make_param`); a rules table (`rules.DEFAULT_RULES`, or `config.sharding_rules`)
maps each name to mesh axes. This module turns that into `NamedSharding`s:

  state_shardings(abstract_state, mesh, rules)   any pytree holding params (an nnx.State, a pure dict,
                                                 an optax state built from either, a train-state
                                                 dataclass) -> same tree of NamedSharding; leaves that
                                                 mirror a param (Adam mu / nu) get its sharding,
                                                 everything else (step counts) is replicated
  shard_params(model_or_state, mesh, rules)      moves existing values onto their shardings
  create_sharded_model(make_model, mesh, rules)  builds a model directly on its shardings
  batch_sharding(mesh, rules)                    batch dim over data x fsdp x expert
  with_logical_constraint(x, names)              pins an activation; a no-op outside `use_mesh`
  use_mesh(mesh, rules, ...)                     the context the model reads (constraints, expert
                                                 parallelism); wraps `jax.set_mesh`
  shard_map(f, mesh, in_specs, out_specs)        `jax.shard_map` on every jax this library supports

A mesh axis that does not divide a dimension is dropped for that dimension (it stays replicated),
so one rules table serves every model size (e.g. a 16-expert pool on expert=32 would be replicated).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from umoe_jax.parallel import rules as ax

Rules = Sequence[tuple[str, ax.MeshAxes]]


# ----------------------------------------------------------------------------------------------
# Rules and the active context.


def normalize_rules(rules: Optional[Iterable[Any]]) -> tuple[tuple[str, ax.MeshAxes], ...]:
  """Accepts DEFAULT_RULES, `config.sharding_rules` ([[name, axes], ...], lists for tuples) or None."""
  if rules is None:
    return ax.DEFAULT_RULES
  if hasattr(rules, "to_dict"):
    rules = rules.to_dict().items()
  elif isinstance(rules, dict):
    rules = rules.items()
  out = []
  for entry in rules:
    if len(entry) != 2:
      raise ValueError(f"a sharding rule is [logical_name, mesh_axes]; got {entry!r}")
    name, target = entry
    if target is not None and not isinstance(target, str):
      target = tuple(target)
      target = target if target else None
    out.append((str(name), target))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class ParallelContext:
  """What the model reads while tracing under `use_mesh`.

  expert_capacity_factor: None = dropless expert parallelism (worst-case buffers); a float c caps
    the expert buffers at c x their balanced size and drops the overflow (counted; see
    `expert_parallel.py`).
  expert_exchange: how expert parallelism moves tokens, one of `EXPERT_EXCHANGES`: "all_to_all"
    (each (token, slot) row to its expert's shard), "all_gather" (each token once to every shard,
    partial outputs reduce-scattered back), "ragged" (exact-size ragged all-to-all of the
    all_to_all rows), "auto" (all_gather when top-k >= expert-axis size).
  expert_chunks: token chunks per device exchanged one after another, so that the exchange of one
    overlaps the experts of another (1 = no chunking).
  """
  mesh: Mesh
  rules: tuple[tuple[str, ax.MeshAxes], ...]
  expert_capacity_factor: Optional[float] = None
  expert_exchange: str = "auto"
  expert_chunks: int = 1


EXPERT_EXCHANGES = ("auto", "all_to_all", "all_gather", "ragged")


_CONTEXT: contextvars.ContextVar[Optional[ParallelContext]] = contextvars.ContextVar(
    "umoe_parallel_context", default=None)


def _set_jax_mesh(mesh: Mesh):
  if hasattr(jax, "set_mesh"):
    return jax.set_mesh(mesh)
  if hasattr(jax.sharding, "use_mesh"):
    return jax.sharding.use_mesh(mesh)
  return mesh  # legacy `with mesh:`


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Optional[Iterable[Any]] = None, *,
             expert_capacity_factor: Optional[float] = None, expert_exchange: str = "auto",
             expert_chunks: int = 1):
  """Makes `mesh` and `rules` active: trace (call or first-call) the jitted train step inside it.

  Activation constraints and the expert-parallel path of `ExpertPool.route` only act inside this
  context; outside it the model runs its single-device code.
  """
  if expert_capacity_factor is not None and expert_capacity_factor <= 0:
    raise ValueError(f"expert_capacity_factor={expert_capacity_factor!r} must be > 0 or None")
  if expert_exchange not in EXPERT_EXCHANGES:
    raise ValueError(f"expert_exchange={expert_exchange!r} must be one of {EXPERT_EXCHANGES}")
  if isinstance(expert_chunks, bool) or not isinstance(expert_chunks, int) or expert_chunks < 1:
    raise ValueError(f"expert_chunks={expert_chunks!r} must be an int >= 1")
  ctx = ParallelContext(mesh=mesh, rules=normalize_rules(rules),
                        expert_capacity_factor=expert_capacity_factor,
                        expert_exchange=expert_exchange, expert_chunks=expert_chunks)
  token = _CONTEXT.set(ctx)
  try:
    with _set_jax_mesh(mesh):
      yield ctx
  finally:
    _CONTEXT.reset(token)


def current_context() -> Optional[ParallelContext]:
  """The innermost `use_mesh` context, or None."""
  return _CONTEXT.get()


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs, *, check_vma: bool = True) -> Callable:
  """`jax.shard_map(f, ...)`, or `jax.experimental.shard_map` (jax < 0.7, where the check of
  replicated / varying values is called `check_rep`). check_vma=False for bodies whose custom calls
  drop the varying-axes type: then the transpose sums each input's cotangent over the mesh axes its
  in_spec leaves out, whatever the body's types say (`attention.local_shards.on_local_shards` needs that)."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
  from jax.experimental.shard_map import shard_map as legacy_shard_map  # jax < 0.7
  return legacy_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


# ----------------------------------------------------------------------------------------------
# Logical names -> PartitionSpec for one array.


def spec_for_shape(logical: Optional[Sequence[Optional[str]]], shape: Sequence[int], mesh: Mesh,
                   rules: Optional[Iterable[Any]] = None) -> PartitionSpec:
  """`rules.logical_to_mesh`, then drops mesh axes that do not divide their dimension."""
  if logical is None or len(shape) == 0:
    return PartitionSpec()
  if len(logical) != len(shape):
    raise ValueError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
  spec = ax.logical_to_mesh(logical, normalize_rules(rules), mesh.axis_names)
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept, prod = [], 1
    for a in axes:
      if dim % (prod * mesh.shape[a]) == 0:
        kept.append(a)
        prod *= mesh.shape[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def _logical_of(var: nnx.Variable) -> Optional[tuple]:
  meta = var.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = meta.get(key)
    if names is not None:
      return tuple(names)
  return None


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _shape_of(x) -> tuple:
  if isinstance(x, nnx.Variable):
    x = x.get_value() if hasattr(x, "get_value") else x.value
  return tuple(getattr(x, "shape", ()))


def _key_str(k) -> Optional[str]:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      v = str(getattr(k, attr))
      return None if v in ("value", "raw_value") else v
  return str(k)


def _norm_path(path) -> tuple[str, ...]:
  return tuple(s for s in (_key_str(k) for k in path) if s is not None)


def param_logical_axes(state: Any) -> Any:
  """Same tree as `state`, each nnx.Variable replaced by a PartitionSpec of its logical names.

  Leaves without logical names (and plain arrays) map to an empty PartitionSpec.
  """
  def one(x):
    names = _logical_of(x) if _is_var(x) else None
    return PartitionSpec(*names) if names is not None else PartitionSpec()
  return jax.tree.map(one, state, is_leaf=_is_var)


# ----------------------------------------------------------------------------------------------
# Pytree shardings.


def _collect_named(tree: Any) -> dict[str, list[tuple[tuple[str, ...], tuple, tuple]]]:
  """Every Variable with logical names: last path key -> [(path, shape, names)]."""
  named: dict[str, list] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_var):
    if _is_var(leaf) and _logical_of(leaf) is not None:
      p = _norm_path(path)
      if p:
        named.setdefault(p[-1], []).append((p, _shape_of(leaf), _logical_of(leaf)))
  return named


def _match(path: tuple[str, ...], shape: tuple, named, params) -> Optional[tuple]:
  """Logical names of the param that `path` mirrors (longest path suffix, same shape)."""
  best, best_len = None, -1
  for source in (named, params):
    for p, s, names in source.get(path[-1] if path else "", ()):
      if s == shape and len(p) <= len(path) and path[len(path) - len(p):] == p and len(p) > best_len:
        best, best_len = names, len(p)
  return best


def state_shardings(abstract_state: Any, mesh: Mesh, rules: Optional[Iterable[Any]] = None, *,
                    params: Any = None) -> Any:
  """A NamedSharding for every leaf of `abstract_state` (same tree; Variables keep their wrapper).

  Args:
    abstract_state: arrays or ShapeDtypeStructs: an nnx.State, a pure dict, an optax state, or any
      container of them (e.g. {"params": ..., "opt_state": ...}).
    mesh, rules: the mesh and the logical rules (default `DEFAULT_RULES`).
    params: optional tree of params with logical names (an nnx.State of the model) used to shard
      leaves of `abstract_state` that carry no names themselves (optimizer state of a pure-dict
      params tree): a leaf gets the sharding of the param whose path is the longest suffix of its
      path and whose shape equals its shape. Scalars and unmatched leaves are replicated.
  """
  rules = normalize_rules(rules)
  named = _collect_named(abstract_state)
  extra = _collect_named(params) if params is not None else {}

  def one(path, x):
    shape = _shape_of(x)
    names = _logical_of(x) if _is_var(x) else None
    if names is None and shape:
      names = _match(_norm_path(path), shape, named, extra)
    sharding = NamedSharding(mesh, spec_for_shape(names, shape, mesh, rules)
                             if names is not None else PartitionSpec())
    return x.replace(sharding) if _is_var(x) else sharding

  return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=_is_var)


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying `shardings`: the target tree for an Orbax restore onto a mesh."""
  def one(x, s):
    if _is_var(x):
      v = x.get_value() if hasattr(x, "get_value") else x.value
      sv = s.get_value() if hasattr(s, "get_value") else s.value
      return x.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sv))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.map(one, abstract_state, shardings, is_leaf=_is_var)


def _put(x, sharding: NamedSharding):
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.jit(lambda a: a, out_shardings=sharding)(x)
  host = np.asarray(x)   # every process holds the full value (same seed): cut out the local shards
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(model_or_state: Any, mesh: Mesh, rules: Optional[Iterable[Any]] = None) -> Any:
  """Places every array of a model (in place; returns the model) or of a state (returns a new one)."""
  if isinstance(model_or_state, nnx.Module):
    state = nnx.state(model_or_state)
    nnx.update(model_or_state, shard_params(state, mesh, rules))
    return model_or_state
  shardings = state_shardings(model_or_state, mesh, rules)
  return jax.tree.map(_put, model_or_state, shardings)


def create_sharded_model(make_model: Callable[[], nnx.Module], mesh: Mesh,
                         rules: Optional[Iterable[Any]] = None) -> nnx.Module:
  """Builds `make_model()` (a pure function, rngs inside) with every param born on its shard.

  Works with several processes: no process ever holds the full model.
  """
  abstract = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.split(make_model())[1]

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------
# Batches and activations.


def batch_spec(mesh: Mesh, rules: Optional[Iterable[Any]] = None, ndim: int = 2) -> PartitionSpec:
  """PartitionSpec of a [B, ...] batch: B over the BATCH rule's axes (data x fsdp x expert)."""
  first = ax.logical_to_mesh((ax.BATCH,), normalize_rules(rules), mesh.axis_names)
  return PartitionSpec(*(tuple(first) + (None,) * (ndim - 1)))


def batch_sharding(mesh: Mesh, rules: Optional[Iterable[Any]] = None, ndim: int = 2) -> NamedSharding:
  """NamedSharding of a [B, ...] batch (the global batch size must divide by data*fsdp*expert)."""
  return NamedSharding(mesh, batch_spec(mesh, rules, ndim))


def batch_shards(mesh: Mesh, rules: Optional[Iterable[Any]] = None) -> int:
  """Number of ways the batch dimension is split (the global batch must be a multiple)."""
  entry = batch_spec(mesh, rules, 1)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[a] for a in axes)


def global_batch(local_batch: Any, mesh: Mesh, rules: Optional[Iterable[Any]] = None) -> Any:
  """Assembles each process's slice of the batch (a pytree of [B_local, ...] arrays) into global
  arrays sharded by `batch_sharding` (`jax.make_array_from_process_local_data`)."""
  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(batch_sharding(mesh, rules, x.ndim), x)
  return jax.tree.map(one, local_batch)


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[Optional[str]],
                            rules: Optional[Iterable[Any]] = None) -> jax.Array:
  """`jax.lax.with_sharding_constraint` by logical names; returns x unchanged outside `use_mesh`."""
  ctx = current_context()
  if ctx is None:
    return x
  spec = spec_for_shape(logical_axes, x.shape, ctx.mesh, rules if rules is not None else ctx.rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))
