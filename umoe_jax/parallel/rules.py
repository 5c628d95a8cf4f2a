"""Logical axis names and the rules that map them onto mesh axes (MaxText's approach).

Every parameter is created with a tuple of logical names (one per dimension); activations are pinned
with the same names. A rules table, part of the config, maps each logical name to a mesh axis (or a
tuple of mesh axes, or None = replicated). Changing the parallelism is a change of rules and mesh
shape, never of model code.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

from jax.sharding import PartitionSpec

# Parameter axes.
VOCAB = "vocab"            # vocabulary rows of the embedding / columns of the LM head
EMBED = "embed"            # model width D
MLP = "mlp"                # dense MLP hidden width
HEADS = "heads"            # attention heads (fused with head_dim in projections: heads x head_dim)
KV_HEADS = "kv_heads"      # key/value heads
HEAD_DIM = "head_dim"      # per-head width
EXPERT = "expert"          # routed experts E
EXPERT_MLP = "expert_mlp"  # expert hidden width F
LORA = "lora"              # low-rank query code r
NORM = "norm"              # norm scales (always replicated)
ROUTER_OUT = "router_out"  # router logits (one per expert)

# Activation axes.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"

MeshAxes = Union[None, str, tuple[str, ...]]

# Default: batch over every data-like axis, FSDP over the model width, tensor parallel over heads
# and hidden widths, experts over the expert axis.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    (BATCH, ("data", "fsdp", "expert")),
    (LENGTH, None),
    (ACT_EMBED, None),
    (VOCAB, "tensor"),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (HEADS, "tensor"),
    (KV_HEADS, None),
    (HEAD_DIM, None),
    (EXPERT, "expert"),
    (EXPERT_MLP, "tensor"),
    (LORA, None),
    (NORM, None),
    (ROUTER_OUT, None),
)


def logical_to_mesh(logical: Optional[Sequence[Optional[str]]],
                    rules: Iterable[tuple[str, MeshAxes]] = DEFAULT_RULES,
                    mesh_axis_names: Optional[Sequence[str]] = None) -> PartitionSpec:
  """Maps a tuple of logical names to a PartitionSpec.

  A mesh axis is used at most once per spec (the first dimension claiming it wins), and axes absent
  from `mesh_axis_names` (when given) are dropped, so one rules table serves every mesh shape.
  """
  if logical is None:
    return PartitionSpec()
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in logical:
    target = table.get(name) if name is not None else None
    if target is None:
      out.append(None)
      continue
    axes = (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if a not in used and (mesh_axis_names is None or a in mesh_axis_names))
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)
