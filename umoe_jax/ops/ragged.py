"""XLA's grouped matmuls (`jax.lax.ragged_dot_general`) in the raw gmm / tgmm forms of
`umoe_jax.ops.gmm_backends.GmmBackend`: the portable backend, and what a kernel falls back to for a
shape it does not take."""
from __future__ import annotations

import jax


def xla_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
  """out[rows of g] = lhs[rows of g] @ rhs[g] (or @ rhs[g].T), float32 accumulation."""
  contract_rhs = 2 if transpose_rhs else 1
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [contract_rhs]), ([], [])),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(
      lhs, rhs, group_sizes, dims, preferred_element_type=out_dtype)


def xla_tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype):
  """out[g] = lhs[rows of g].T @ rhs[rows of g]."""
  del num_groups  # implied by group_sizes
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(
      lhs, rhs, group_sizes, dims, preferred_element_type=out_dtype)
