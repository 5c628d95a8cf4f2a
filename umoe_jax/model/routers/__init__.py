"""Routers: pick K of E experts per token and give each pick a gate weight.

The contract every router keeps (the dispatch code relies on nothing else):
  __call__(x [B, T, D], **context) -> RouterOutput
with `expert_ids [B, T, K]`, `gates [B, T, K]`, the full routing distribution `probs [B, T, E]` and a
scalar `balance_loss` (already multiplied by its coefficient); optionally `aux_losses` (other named
losses, coefficients applied: "z_loss", "entropy_loss") and `slot_mask [B, T, K]` (the slots that
carry a pick; top-P and expert choice leave some empty, with gate 0). `context` carries optional
extras a router may use (token ids for hash routing, attention probabilities for attention-informed
routing, the jitter key in training); routers ignore what they do not need.

The route context: `CausalLM` builds one dict (`route_context`) and hands it through every block to
every sub-layer, which calls `self.router(x, **route_context)`:
  "token_ids"        [B, T] int32, always (during cached decoding: the ids of the new tokens);
  "step"             [] int32, the training step, when the caller passes `CausalLM(..., step=)`
                     (schedules of smoe_dropout and stablemoe; the trainer's `train_step` passes
                     the applied updates, the learning-rate schedule's count; absent = as at the
                     end of training: evaluation, decoding);
  "decoding"         True during cached decoding (the mixing routers refuse it);
  "attention_probs"  [B, H, T, S] float32, added by the block to its FFN router's context when that
                     router mixes by attention (`router.mixing='attention'`, kind attention_aware).
  "expert_pool"      the FFN's expert pool, added by the block when the router class sets
                     `needs_expert_pool` (aoe: the experts score themselves).
A router that needs another extra adds a key there; no call site changes.

A new router is one class registered in `ROUTERS` (`umoe_jax.kinds`, where its name and the traits
config validation checks are one row of `ROUTER_KINDS`); `model.router.kind` selects it. Its
constructor is `(d_model, n_experts, top_k, cfg: RouterConfig, *, param_dtype, rngs)` (`base.Router`'s,
which it subclasses, usually through `ScoreRouter`); its parameter and MAC counts are the
`RouterStats` class methods it inherits or overrides (`umoe_jax.stats` reads them by kind).

One module per family:
  topk           "topk_softmax", "topk_sigmoid": softmax / sigmoid of x W_r, top-k
  xmoe           "xmoe": X-MoE cosine routing in a low-dimensional space (Chi et al. 2022)
  hashing        "hash": fixed token-id hashing (Roller et al. 2021)
  smoe_dropout   "smoe_dropout": SMoE-Dropout (Chen et al. 2023): fixed random router, k grows
                 linearly with the step from `smoe_dropout_k_start` to the sub-layer's top_k
  stablemoe      "stablemoe": StableMoE (Dai et al. 2022): learned centroids distilled into a token-id
                 router (stage 1), routing frozen to that router from `stablemoe_stage2_step`
  mutual_inform  `router.mixing` (Nguyen et al. 2025, "Graph of Tokens" / Mutual-Inform SMoE) over
                 any router with a distribution: mixed over similar earlier tokens, or over the
                 tokens the block's MHA attends to (FFN router; MHA attention only); the kinds
                 "similarity_aware", "attention_aware" are topk_softmax with that mixing
  aoe            "aoe": Autonomy-of-Experts (Lv et al. 2025): no router; each expert's low-rank code
                 norm |x A^e| is its score (the block builds an `AoEExpertPool`)
  base, losses   the contract, the route context, the shared top-k tail, the balance losses and z-loss
  scoring        the shared path of the routers with scores: jitter, z-loss, the selection bias
  selection      `router.selection`: top-k (+ bias), top-P (with its entropy loss)
  expert_choice  `router.selection='expert_choice'`: each expert takes its top-C tokens of the batch
                 (sees future tokens: no cached decoding; FFN routers only)
  bias_balance   aux-loss-free balancing: the bias update the training step applies
The mixing is causal (a token mixes itself and earlier tokens) and refuses cached decoding.
"""
from umoe_jax.kinds import ROUTERS  # noqa: F401
from umoe_jax.model.routers.base import (ParameterFreeRouter, Router, RouterOutput, RouterStats,  # noqa: F401
                                         call_router, fold_rng, jitter, make_router,
                                         need_token_ids, pick_counts, route_context,
                                         router_macs, router_params, routing_stats)
from umoe_jax.model.routers.losses import (BALANCE_LOSSES, router_z_loss,  # noqa: F401
                                           seq_aux_balance_loss, switch_balance_loss)
from umoe_jax.model.routers.scoring import ScoreRouter  # noqa: F401
from umoe_jax.model.routers.selection import biased_top_k, entropy_loss, top_p_select  # noqa: F401
from umoe_jax.model.routers.expert_choice import expert_choice_select  # noqa: F401
from umoe_jax.model.routers.topk import (AttentionAwareRouter, SimilarityAwareRouter,  # noqa: F401
                                         TopKSigmoidRouter, TopKSoftmaxRouter)
from umoe_jax.model.routers.xmoe import XMoERouter, l2_normalize, orthogonal_init  # noqa: F401
from umoe_jax.model.routers.hashing import HashRouter, hash_expert_ids  # noqa: F401
from umoe_jax.model.routers.smoe_dropout import SMoEDropoutRouter, linear_k_schedule  # noqa: F401
from umoe_jax.model.routers.stablemoe import StableMoERouter, stablemoe_balance_loss  # noqa: F401
from umoe_jax.model.routers.mutual_inform import causal_softmax  # noqa: F401
from umoe_jax.model.routers.aoe import AoERouter  # noqa: F401
