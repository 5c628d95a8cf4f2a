"""SMoE-Dropout (Chen et al., ICLR 2023, "Sparse MoE as the New Dropout"): a fixed random router
whose number of active experts grows linearly over training."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from umoe_jax.kinds import ROUTERS
from umoe_jax.model.routers.matmul import router_matmul
from umoe_jax.model.routers.selection import biased_top_k
from umoe_jax.model.routers.topk import TopKSoftmaxRouter
from umoe_jax.parallel import rules as ax

# SMoE-Dropout (Chen et al., ICLR 2023). A fixed random router; the number of active experts grows
# linearly over training. Shapes must stay static under jit while the step is traced, so the router
# always returns the sub-layer's K slots and zeroes the gates of the slots beyond k(step).


def linear_k_schedule(step: jax.Array, k_start: int, k_end: int, steps: int) -> jax.Array:
  """k(t) = k_start + round((k_end - k_start) * min(t / steps, 1)), int32 [] (the paper's
  `linear_increase`; round half to even, like Python's round)."""
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / steps, 0.0, 1.0)
  return (k_start + jnp.round((k_end - k_start) * frac)).astype(jnp.int32)


@ROUTERS.register("smoe_dropout")
class SMoEDropoutRouter(TopKSoftmaxRouter):
  """SMoE-Dropout: probs = softmax(x W_r) with W_r [D, E] random and never trained; top-K of probs,
  of which only the first k(step) slots are active (the others get gate 0):

    k(step) = linear_k_schedule(step, min(router.smoe_dropout_k_start, K), K, router.smoe_dropout_steps)
    gates   = probs of the k(step) best experts (renormalised over them if router.renormalize;
              the paper's softmax over the top-k logits is renormalize=True), 0 for the rest

  K is the sub-layer's top_k (the schedule's end; the paper grows k to all E experts: top_k = E).
  Without a "step" in the route context (evaluation, decoding) k = K. No balance loss (the router is
  fixed, as in the paper; `router.balance_loss` is not used). The slots beyond k(step) are masked
  (`RouterOutput.slot_mask`): the logged expert counts and the selection bias's load see only the
  k(step) active ones, and the dispatch gives them no expert rows (`ops.dispatch.make_plan`: the
  grouped-matmul kernels skip them, expert parallelism neither sends them nor gives them buffer
  room); the layout stays static (K slots per token).
  W_r is initialised like `topk_softmax` (no bias, unlike the paper's nn.Linear) and tagged `norm`:
  replicated and never weight-decayed, so with its zero gradient Adam leaves it exactly as drawn.
  """

  kernel_axes = (ax.NORM, ax.ROUTER_OUT)

  balance_loss_applies = False   # the router is fixed: nothing to balance by gradient (the paper)

  def logits(self, x: jax.Array, **context) -> jax.Array:
    """x [B, T, D] -> float32 logits [B, T, E]; no gradient reaches W_r (fixed router)."""
    del context
    return router_matmul(x, jax.lax.stop_gradient(self.kernel.value), self.cfg.logits_dtype)

  def active_k(self, step: Optional[jax.Array]) -> jax.Array:
    """Active experts per token at `step` (None: the end of the schedule, K), int32 []."""
    if step is None:
      return jnp.asarray(self.top_k, jnp.int32)
    k_start = min(self.cfg.smoe_dropout_k_start, self.top_k)
    return linear_k_schedule(step, k_start, self.top_k, self.cfg.smoe_dropout_steps)

  def select(self, probs: jax.Array, *, step: Optional[jax.Array] = None, **context):
    """Top-K of probs (+ the selection bias); the slots beyond k(step) get gate 0 and are masked."""
    del context
    ids, top = biased_top_k(probs, self.top_k, False, self.bias(),
                            topk_backend=self.cfg.topk_backend)                   # [B, T, K]
    active = jnp.arange(self.top_k) < self.active_k(step)                              # [K]
    gates = jnp.where(active, top, 0.0)
    if self.cfg.renormalize:
      gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids, gates, jnp.broadcast_to(active, ids.shape)
