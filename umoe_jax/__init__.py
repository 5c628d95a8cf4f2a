"""umoe-jax: Mixture-of-Experts language models in JAX/Flax NNX, with UMoE as the headline model.

Axis letters used in docstrings and shape comments:
  B batch, T sequence length (tokens), D model width, E routed experts, K experts per token (top-k),
  F expert hidden width (d_e), H attention heads (or query heads), Dh head dim, V vocabulary,
  N rows handed to a grouped matmul (tokens x K), G groups (experts) of a grouped matmul.
"""

__version__ = "0.1.0"
