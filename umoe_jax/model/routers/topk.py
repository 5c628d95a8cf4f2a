"""Top-k routers over x W_r: softmax (UMoE / DeepSeekMoE) and sigmoid (SwitchHead) gates, and the
shorthand kinds of top-k softmax with `router.mixing` (similarity_aware, attention_aware)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import RouterConfig
from umoe_jax.kinds import ROUTERS
from umoe_jax.model.layers import kaiming_uniform_init, make_param
from umoe_jax.model.routers.base import RouterOutput, jitter
from umoe_jax.model.routers.matmul import router_matmul
from umoe_jax.model.routers.scoring import ScoreRouter
from umoe_jax.model.routers.selection import biased_top_k
from umoe_jax.parallel import rules as ax


@ROUTERS.register("topk_softmax")
class TopKSoftmaxRouter(ScoreRouter):
  """softmax(x W_r) over all experts in float32, top-k (the official UMoE / DeepSeekMoE router).

  W_r [D, E] is initialised like PyTorch's kaiming_uniform_(a=sqrt(5)); no bias.
  """

  kernel_axes = (ax.EMBED, ax.ROUTER_OUT)  # logical axes of W_r

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    super().__init__(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)
    self.kernel = make_param(rngs, kaiming_uniform_init(d_model), (d_model, n_experts),
                             self.kernel_axes, param_dtype)

  def logits(self, x: jax.Array, **context) -> jax.Array:
    """x [B, T, D] -> float32 logits [B, T, E]."""
    del context
    return router_matmul(x, self.kernel.value, self.cfg.logits_dtype)


@ROUTERS.register("topk_sigmoid")
class TopKSigmoidRouter(TopKSoftmaxRouter):
  """Non-competitive gates (SwitchHead, Csordás et al. 2024): s = sigmoid(x W_r), top-k of s, gates = s.

  `probs` (for the balance loss and the logged entropy) is s normalised to sum to 1; the original
  SwitchHead trains without a balance loss (`router.balance_loss="none"`).
  """

  def __call__(self, x: jax.Array, *, rng=None, **context) -> RouterOutput:
    logits = self.logits(jitter(x, self.cfg.jitter_eps, rng))                          # [B, T, E]
    scores = jax.nn.sigmoid(logits)
    ids, gates = biased_top_k(scores, self.top_k, self.cfg.renormalize, self.bias(),
                              topk_backend=self.cfg.topk_backend)                # [B, T, K]
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return self.output(logits, probs, ids, gates, balance_probs=probs)


@ROUTERS.register("similarity_aware")
class SimilarityAwareRouter(TopKSoftmaxRouter):
  """kind="similarity_aware": topk_softmax with router.mixing="similarity" (`mutual_inform.similarity_mix`)."""


@ROUTERS.register("attention_aware")
class AttentionAwareRouter(TopKSoftmaxRouter):
  """kind="attention_aware": topk_softmax with router.mixing="attention" (`mutual_inform.attention_mix`): the FFN
  router of an MHA block."""
