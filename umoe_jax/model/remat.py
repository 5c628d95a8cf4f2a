"""Rematerialisation of the decoder blocks (`train.remat`): what the forward pass keeps for the
backward pass, and what the backward pass recomputes from each block's input.

  none           keep every intermediate (no recomputation; the most memory)
  block          keep only each block's input, recompute the whole block (the least memory)
  dots           keep every matmul output (`jax.checkpoint_policies.dots_saveable`); recompute the
                 norms, activations, softmax and routing between them
  dots_no_batch  keep only matmuls without batch dimensions (the weight projections); recompute the
                 attention scores / mixes too (`dots_with_no_batch_dims_saveable`)

Kernels reached through custom calls (the Triton / Mosaic grouped matmuls, the fused attention
cores) are not `dot_general`s, so the dots policies recompute them like any other op.
"""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "block": None,  # jax.checkpoint's default: nothing inside the block is saveable
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def policy_name(remat: bool | str) -> str:
  """A `train.remat` value as a name of POLICIES; a bool (configs from before the policies) means
  True = "block", False = "none"."""
  if isinstance(remat, bool):
    return "block" if remat else "none"
  if remat not in POLICIES:
    raise ValueError(f"remat policy {remat!r}; valid: {', '.join(POLICIES)}")
  return remat


def rematerialise(fn: Callable, remat: bool | str, *, in_scan: bool = False) -> Callable:
  """fn (a block application) wrapped in `nnx.remat` with the policy's saveable rule. `in_scan`: fn
  is a lax.scan's body (`model.scan_layers`), whose loop already keeps XLA from merging the
  recomputation back into the forward pass, so the CSE barriers jax.checkpoint adds are left out."""
  name = policy_name(remat)
  if name == "none":
    return fn
  return nnx.remat(fn, policy=POLICIES[name], prevent_cse=not in_scan)
