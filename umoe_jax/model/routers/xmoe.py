"""X-MoE (Chi et al. 2022, "On the Representation Collapse of Sparse Mixture of Experts"): cosine
routing in a low-dimensional space with a learned temperature."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import RouterConfig
from umoe_jax.kinds import ROUTERS
from umoe_jax.model.layers import kaiming_uniform_init, make_param
from umoe_jax.model.routers.matmul import router_matmul
from umoe_jax.model.routers.scoring import ScoreRouter
from umoe_jax.parallel import rules as ax
from umoe_jax.counting import linear


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
  """x / max(||x||_2, eps) over the last axis (PyTorch's F.normalize)."""
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
  return x / jnp.maximum(norm, eps)


def orthogonal_init(scale: float):
  init = jax.nn.initializers.orthogonal(scale=scale)
  return lambda key, shape, dtype: init(key, shape, dtype)


@ROUTERS.register("xmoe")
class XMoERouter(ScoreRouter):
  """X-MoE (Chi et al. 2022, Eqs. 6-8): cosine routing in a low-dimensional space.

    z = x W_proj                         W_proj [D, d_r] (router.xmoe_dim = d_r, default 16)
    s_e = <z / |z|, e_e / |e_e|>         expert embeddings [E, d_r], learned; s in [-1, 1]
    probs = softmax(s / tau)  (float32), top-k of probs (renormalised if router.renormalize)

  tau: learned (the paper; `router.xmoe_learn_temperature`, stored as log tau, initialised to
  `router.xmoe_temperature`) or fixed at `router.xmoe_temperature` (torchscale / LibMoE: 0.3). The
  balance loss always uses softmax(s / tau_0) with the fixed tau_0 = `router.xmoe_temperature`
  (paper Eq. 8). Unlike torchscale, both z and e are normalised (the paper's cosine).
  Init: W_proj like PyTorch's Linear (kaiming_uniform, a=sqrt(5)); embeddings orthogonal, gain 0.32
  (torchscale).
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    super().__init__(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)
    d_r = cfg.xmoe_dim
    # d_r is small and replicated like the low-rank codes (logical axis LORA).
    self.proj = make_param(rngs, kaiming_uniform_init(d_model), (d_model, d_r), (ax.EMBED, ax.LORA),
                           param_dtype)
    self.expert_embed = make_param(rngs, orthogonal_init(0.32), (n_experts, d_r),
                                   (ax.ROUTER_OUT, ax.LORA), param_dtype)
    if cfg.xmoe_learn_temperature:
      log_t0 = math.log(cfg.xmoe_temperature)
      # [1] tagged NORM: replicated and, like the norm scales, never weight-decayed.
      self.log_temperature = make_param(rngs, lambda key, shape, dtype: jnp.full(shape, log_t0, dtype),
                                        (1,), (ax.NORM,), param_dtype)
    else:
      self.log_temperature = None

  def scores(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> float32 cosine scores [B, T, E] in [-1, 1]."""
    z = router_matmul(x, self.proj.value, self.cfg.logits_dtype)                       # [B, T, d_r]
    e = l2_normalize(self.expert_embed.value.astype(jnp.float32))                    # [E, d_r]
    return jnp.dot(l2_normalize(z), e.T)

  def temperature(self) -> jax.Array:
    """The gating temperature tau [] float32."""
    if self.log_temperature is None:
      return jnp.float32(self.cfg.xmoe_temperature)
    return jnp.exp(self.log_temperature.value.astype(jnp.float32)[0])

  def logits(self, x: jax.Array, **context) -> jax.Array:
    """The gating logits s / tau [B, T, E]."""
    del context
    return self.scores(x) / self.temperature()

  def balance_probs(self, probs: jax.Array, x: jax.Array) -> jax.Array:
    """softmax(s / tau_0) with the fixed tau_0 (paper Eq. 8; no gradient to the learned tau)."""
    if self.log_temperature is None:
      return probs
    return jax.nn.softmax(self.scores(x) / self.cfg.xmoe_temperature, axis=-1)

  @classmethod
  def param_count(cls, cfg, router, n_experts):
    """The D x d_r projection, the E x d_r expert embeddings and the learned temperature."""
    return (linear(cfg.d_model, router.xmoe_dim) + linear(n_experts, router.xmoe_dim)
            + int(router.xmoe_learn_temperature))

  @classmethod
  def token_mac_count(cls, cfg, router, n_experts):
    return linear(cfg.d_model, router.xmoe_dim) + linear(n_experts, router.xmoe_dim)
