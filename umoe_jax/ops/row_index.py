"""The backends' grouped matmuls with the row-index extras (`GmmBackend.row_index`): operand rows read
through an index, output rows scaled, a row dot and an activation in the epilogue. A backend with the
extras takes them into its kernel; for the others XLA does them around it (a gather, an elementwise
pass), so every caller writes one call whatever the backend.
"""
from __future__ import annotations

import jax.numpy as jnp

from umoe_jax.ops import epilogue


def _in_kernel(backend, act) -> bool:
  return act is None or act in backend.fused_activations


def raw_gmm(backend, lhs, rhs, gs, *, transpose_rhs, out_dtype, lhs_index=None, row_scale=None,
            row_dot=None, epi_act=None, scaled_rows=False):
  """The backend's gmm with the row-index extras (see `GmmBackend.row_index`) and the fused
  epilogue activation (`GmmBackend.fused_activations`: `epi_act`, with `row_dot` holding
  pre-activations z, dots use act(z) and the output is multiplied by act'(z)); XLA does them
  around the kernel for other backends. With `row_dot` returns (out, dots [M] f32); with
  `scaled_rows` too (and `row_scale`) (out, dots, act(z) * row_scale in z's dtype), the kernel's
  epilogue writing the third where the backend can (`GmmBackend.scaled_row_dot`)."""
  if backend.row_index and _in_kernel(backend, epi_act) and (
      backend.scaled_row_dot or not scaled_rows):
    extra = {} if epi_act is None else {"epi_act": epi_act}
    if scaled_rows:
      extra["scaled_row_dot"] = True
    return backend.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                       lhs_index=lhs_index, row_scale=row_scale, row_dot=row_dot, **extra)
  if scaled_rows:  # the kernel for the rest, the scaled rows in an XLA pass (as gmm_combine's)
    out, dots = raw_gmm(backend, lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                        lhs_index=lhs_index, row_scale=row_scale, row_dot=row_dot,
                        epi_act=epi_act)
    return out, dots, epilogue.gate_scaled(row_dot, row_scale, epi_act)
  if lhs_index is not None:
    lhs = jnp.take(lhs, lhs_index, axis=0)
  if row_scale is None and row_dot is None:
    return backend.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
  u = backend.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32)
  out, dots = epilogue.row_dot_epilogue(u, row_scale, row_dot, epi_act, out_dtype)
  return out if row_dot is None else (out, dots)


def raw_tgmm(backend, lhs, rhs, gs, *, num_groups, out_dtype, lhs_index=None, rhs_index=None,
             lhs_scale=None):
  """The backend's tgmm with the row-index extras (see `GmmBackend.row_index`); XLA does them
  around the kernel for other backends."""
  if backend.row_index:
    return backend.tgmm(lhs, rhs, gs, num_groups=num_groups, out_dtype=out_dtype,
                        lhs_index=lhs_index, rhs_index=rhs_index, lhs_scale=lhs_scale)
  if lhs_index is not None:
    lhs = jnp.take(lhs, lhs_index, axis=0)
  if rhs_index is not None:
    rhs = jnp.take(rhs, rhs_index, axis=0)
  if lhs_scale is not None:
    lhs = (lhs.astype(jnp.float32) * lhs_scale[:, None]).astype(lhs.dtype)
  return backend.tgmm(lhs, rhs, gs, num_groups=num_groups, out_dtype=out_dtype)


def raw_fp8_gmm(backend, lhs_q, lhs_scale, rhs_q, rhs_scale, gs, *, transpose_rhs, out_dtype,
                lhs_index=None, quantize_out=None):
  """The backend's raw FP8 gmm (`GmmBackend.fp8_gmm`) with `lhs_index` [M]: the product's rows are
  lhs_q[lhs_index] (and their scales), read through the index by a backend with `row_index`,
  gathered by XLA for the others. `quantize_out` is handed on (one of the backend's
  `fp8_quantize_out`)."""
  extra = {} if quantize_out is None else {"quantize_out": quantize_out}
  if lhs_index is not None and backend.row_index:
    extra["lhs_index"] = lhs_index
  elif lhs_index is not None:
    lhs_q, lhs_scale = jnp.take(lhs_q, lhs_index, axis=0), jnp.take(lhs_scale, lhs_index, axis=0)
  return backend.fp8_gmm(lhs_q, lhs_scale, rhs_q, rhs_scale, gs, transpose_rhs=transpose_rhs,
                         out_dtype=out_dtype, **extra)
