"""The device mesh: four named axes, sizes from `config.mesh`.

Axes, outermost first (the outer ones cross hosts, the inner ones stay inside a host when the sizes
allow it, since `jax.devices()` lists devices process by process):

  data    pure data parallel: params replicated, batch split
  fsdp    data parallel with params and optimizer state split over the model width (ZeRO-3)
  tensor  tensor parallel: attention heads, dense MLP and expert hidden widths split
  expert  expert parallel: routed experts split; tokens travel by all-gather + reduce-scatter or
          all-to-all (`expert_parallel.py`)

The batch is split over data x fsdp x expert (see `rules.DEFAULT_RULES`).

Hierarchy on GPU clusters: the grid is `jax.devices()` sorted by id (process-major: a host's GPUs
are consecutive) reshaped to (data, fsdp, tensor, expert), so the innermost axes stay inside a host
(on NVLink) whenever their product divides the GPUs per host, and the outer ones cross hosts. E.g.
4 hosts x 8 GPUs: data=4, expert=8 keeps each expert exchange inside a node and only the gradient
all-reduce crosses nodes; data=4, fsdp=2, expert=4 adds FSDP inside the node (HSDP); fsdp=4,
expert=8 shards parameters across nodes. `within_host_axes` / `describe` say which axes stay inside
a process.

Several TPU slices (multi-slice, devices with distinct `slice_index`): "data" is the axis that crosses
slices, over the data-center network (DCN); every other axis stays inside a slice on ICI. `data` must
then be a multiple of the number of slices (its outer factor = the slice).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "expert")


def _as_dict(mesh_config: Any) -> dict[str, int]:
  if mesh_config is None:
    return {}
  if hasattr(mesh_config, "to_dict"):               # ml_collections.ConfigDict
    mesh_config = mesh_config.to_dict()
  if isinstance(mesh_config, Mapping):
    return {str(k): v for k, v in mesh_config.items()}
  return {str(k): v for k, v in mesh_config}        # [(axis, size), ...]


def mesh_shape(mesh_config: Any, num_devices: int) -> dict[str, int]:
  """Resolves `config.mesh` to one size per axis of `MESH_AXES` for `num_devices` devices.

  Missing axes default to 1; at most one size may be -1 (it takes the remaining devices); an empty
  or None config puts every device on "data".
  Raises ValueError naming the bad sizes.
  """
  given = _as_dict(mesh_config) or {"data": -1}
  unknown = sorted(set(given) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown mesh axis {unknown[0]!r} in mesh config {given}; "
                     f"valid axes: {', '.join(MESH_AXES)}")
  sizes = {a: int(given.get(a, 1)) for a in MESH_AXES}
  bad = {a: s for a, s in sizes.items() if s == 0 or s < -1}
  if bad:
    raise ValueError(f"mesh sizes must be >= 1 or -1 (fill); got {bad}")
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ValueError(f"at most one mesh axis may be -1; got {fill} in {sizes}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % fixed:
      raise ValueError(f"mesh {sizes}: the fixed sizes multiply to {fixed}, which does not divide "
                       f"the {num_devices} devices, so {fill[0]}=-1 cannot be filled")
    sizes[fill[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"mesh {sizes} has {fixed} devices but {num_devices} are available; "
                     f"set one axis to -1 or make the sizes multiply to {num_devices}")
  return sizes


def make_mesh(mesh_config: Any = None, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A `Mesh` with axes ("data", "fsdp", "tensor", "expert") over all (global) devices.

  Args:
    mesh_config: `config.mesh` (dict / ConfigDict / [(axis, size)]); None = all devices on "data".
    devices: defaults to `jax.devices()` (every process's devices after `jax.distributed`).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_config, len(devices))
  grid = device_grid(tuple(sizes[a] for a in MESH_AXES), devices)
  return Mesh(grid, MESH_AXES, **_auto_axis_types(len(MESH_AXES)))


def num_slices(devices: Sequence[Any]) -> int:
  """TPU slices the devices span (1 off TPU and on one slice)."""
  return len({getattr(d, "slice_index", 0) for d in devices})


def device_grid(shape: tuple[int, ...], devices: Sequence[Any]) -> np.ndarray:
  """Devices arranged as `shape` (axes MESH_AXES): topology-aware where JAX knows the topology;
  over several TPU slices, data's outer factor runs over the slices (DCN) and the rest over ICI."""
  from jax.experimental import mesh_utils
  slices = num_slices(devices)
  if slices > 1:
    if shape[0] % slices:
      raise ValueError(f"the devices span {slices} TPU slices, so mesh data={shape[0]} must be a "
                       f"multiple of {slices}: data parallelism is the axis that crosses slices "
                       f"(DCN); set --config.mesh.data={slices} (or a multiple)")
    ici = (shape[0] // slices,) + tuple(shape[1:])
    dcn = (slices,) + (1,) * (len(shape) - 1)
    try:
      return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                  allow_split_physical_axes=True)
    except Exception:  # pylint: disable=broad-except  (fall back to slice-major list order)
      key = lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id)
      return np.asarray(sorted(devices, key=key), dtype=object).reshape(shape)
  try:
    # Topology-aware order on TPU/GPU (keeps inner axes on fast links); a plain reshape elsewhere.
    return mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
  except Exception:  # pylint: disable=broad-except  (unusual topologies: fall back to list order)
    # Process-major order: inner axes stay inside one host whenever their product divides it.
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.asarray(ordered, dtype=object).reshape(shape)


def _auto_axis_types(n: int) -> dict:
  # GSPMD-style ("Auto") axes: shardings propagate from parameters, constraints pin activations.
  axis_type = getattr(jax.sharding, "AxisType", None)
  return {"axis_types": (axis_type.Auto,) * n} if axis_type is not None else {}


def axis_size(mesh: Mesh, axes: Any) -> int:
  """Product of the sizes of `axes` (a name, a tuple of names or None) in `mesh`."""
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def within_host_axes(grid: np.ndarray, axis_names: Sequence[str]) -> tuple[str, ...]:
  """The axes (of size > 1) along which every line of the device grid stays inside one process
  (one host when a process drives a host's GPUs): their collectives never leave the host."""
  owner = np.vectorize(lambda d: d.process_index)(grid)
  return tuple(name for i, name in enumerate(axis_names) if grid.shape[i] > 1 and
               np.all(owner == np.take(owner, [0], axis=i)))


def describe(mesh: Mesh) -> str:
  """'data=8 fsdp=1 tensor=1 expert=1 (8 devices, 1 process)'; with several processes also the
  axes that stay inside a process, e.g. '(32 devices, 4 processes; inside a process: expert)'."""
  sizes = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
  procs = len({d.process_index for d in mesh.devices.flat})
  text = f"{sizes} ({mesh.devices.size} devices, {procs} process{'es' if procs > 1 else ''}"
  if procs > 1:
    inside = within_host_axes(mesh.devices, mesh.axis_names)
    text += f"; inside a process: {', '.join(inside) if inside else 'none'}"
  return text + ")"
