"""Top-k routers over x W_r: softmax (UMoE / DeepSeekMoE) and sigmoid (SwitchHead) gates."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import RouterConfig
from umoe_jax.kinds import ROUTERS
from umoe_jax.model.layers import kaiming_uniform_init, make_param
from umoe_jax.model.routers.base import RouterOutput, RouterStats, probs_route, topk_gates
from umoe_jax.model.routers.losses import BALANCE_LOSSES
from umoe_jax.parallel import rules as ax


@ROUTERS.register("topk_softmax")
class TopKSoftmaxRouter(RouterStats, nnx.Module):
  """softmax(x W_r) over all experts in float32, top-k (the official UMoE / DeepSeekMoE router).

  W_r [D, E] is initialised like PyTorch's kaiming_uniform_(a=sqrt(5)); no bias.
  """

  kernel_axes = (ax.EMBED, ax.ROUTER_OUT)  # logical axes of W_r

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg
    self.kernel = make_param(rngs, kaiming_uniform_init(d_model), (d_model, n_experts),
                             self.kernel_axes, param_dtype)

  def logits(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> float32 logits [B, T, E]."""
    return jnp.dot(x.astype(jnp.float32), self.kernel.value.astype(jnp.float32))

  def __call__(self, x: jax.Array, **context) -> RouterOutput:
    del context
    probs = jax.nn.softmax(self.logits(x), axis=-1)                                    # [B, T, E]
    return probs_route(probs, self.top_k, self.cfg, self.n_experts)


@ROUTERS.register("topk_sigmoid")
class TopKSigmoidRouter(TopKSoftmaxRouter):
  """Non-competitive gates (SwitchHead, Csordás et al. 2024): s = sigmoid(x W_r), top-k of s, gates = s.

  `probs` (for the balance loss and the logged entropy) is s normalised to sum to 1; the original
  SwitchHead trains without a balance loss (`router.balance_loss="none"`).
  """

  def __call__(self, x: jax.Array, **context) -> RouterOutput:
    del context
    scores = jax.nn.sigmoid(self.logits(x))                                            # [B, T, E]
    gates, ids = topk_gates(scores, self.top_k, self.cfg.renormalize)                  # [B, T, K]
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    loss = BALANCE_LOSSES[self.cfg.balance_loss](probs, jax.lax.stop_gradient(ids), self.n_experts)
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs,
                        balance_loss=self.cfg.balance_coef * loss)
