"""Hash layers (Roller et al. 2021): each token id always goes to the same K experts."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from umoe_jax.kinds import ROUTERS
from umoe_jax.model.routers.base import ParameterFreeRouter, RouterOutput, need_token_ids

# Hash routing. A fixed pseudo-random permutation of the experts per token id; the first K are the
# token's experts. Integer arithmetic of our own (murmur3's 32-bit finaliser), so the map never
# changes with the JAX version or the PRNG implementation, and needs no stored table.

_GOLDEN = 0x9E3779B1
_EXPERT_MUL, _EXPERT_ADD = 0x27D4EB2F, 0x165667B1


def _fmix32(h: jax.Array) -> jax.Array:
  """murmur3's finaliser on uint32 (a bijection of uint32 with full avalanche)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def hash_expert_ids(token_ids: jax.Array, n_experts: int, k: int, seed: int) -> jax.Array:
  """token ids [...] -> K distinct expert ids [..., K] int32, a fixed function of (id, seed).

    base    = fmix32(id * 0x9E3779B1 + fmix32(seed))                          (uint32 arithmetic)
    score_e = fmix32(base XOR (e * 0x27D4EB2F + 0x165667B1)) >> 1              e = 0 .. E-1
    ids     = top-k of score (K distinct experts; their order is part of the map)

  The K experts of a token are the first K of one pseudo-random ordering of all experts, so routers
  with different K (attention, FFN) give nested sets for the same token.
  """
  seed_mix = _fmix32(jnp.asarray(seed, jnp.uint32))
  base = _fmix32(token_ids.astype(jnp.uint32) * jnp.uint32(_GOLDEN) + seed_mix)      # [...]
  experts = jnp.arange(n_experts, dtype=jnp.uint32) * jnp.uint32(_EXPERT_MUL) + jnp.uint32(_EXPERT_ADD)
  scores = _fmix32(base[..., None] ^ experts)                                         # [..., E]
  _, ids = jax.lax.top_k((scores >> 1).astype(jnp.int32), k)
  return ids.astype(jnp.int32)


@ROUTERS.register("hash")
class HashRouter(ParameterFreeRouter):
  """Hash layers (Roller et al. 2021): each token id always goes to the same K distinct experts.

  No learned parameters and no state: the map is `hash_expert_ids(token_ids, E, K,
  router.hash_seed)` (default seed 42, as ParlAI's). Gates are 1/K each (the paper: top-1, weight 1);
  `probs` [B, T, E] is the one-hot mixture (1/K on each picked expert); the balance loss is 0 (nothing
  to balance by gradient). Needs `token_ids` [B, T] in the route context (`CausalLM` passes them).
  """

  def __call__(self, x: jax.Array, *, token_ids: Optional[jax.Array] = None, **context) -> RouterOutput:
    del context
    token_ids = need_token_ids("hash", token_ids, x)
    ids = hash_expert_ids(token_ids, self.n_experts, self.top_k, self.cfg.hash_seed)   # [B, T, K]
    gates = jnp.full(ids.shape, 1.0 / self.top_k, jnp.float32)
    probs = jax.nn.one_hot(ids, self.n_experts, dtype=jnp.float32).sum(axis=-2) / self.top_k
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs,
                        balance_loss=jnp.zeros((), jnp.float32))

  @classmethod
  def token_mac_count(cls, cfg, router, n_experts):
    return 0
