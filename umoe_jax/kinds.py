"""Names and traits of the pluggable kinds: what config validation knows without the model.

A leaf module (it imports only the registry type, no JAX): `umoe_jax.config` validates names and
combinations against the tables here, and the model registers one class per name into the
registries here (`ATTENTIONS`, `ROUTERS`). A registry refuses a name its table lacks, so the tables
and the classes cannot drift apart; a new kind adds one table row and one registered class.
"""
from __future__ import annotations

import dataclasses

from umoe_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """What the config needs to know of an attention variant (`model.attention.kind`)."""
  uses_expert_pool: bool = False         # routes into the layer's expert pool (with the FFN)
  has_routers: bool = False              # owns routers (`model.router` / `model.attention.router`)
  exposes_attention_probs: bool = False  # can return its probabilities (attention-informed routing)


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "mha": AttentionKind(exposes_attention_probs=True),
    "premix": AttentionKind(uses_expert_pool=True, has_routers=True),
    "postmix": AttentionKind(uses_expert_pool=True, has_routers=True),
    "moa": AttentionKind(has_routers=True),
    "switchhead": AttentionKind(has_routers=True),
}
ATTENTION_CORES = ("auto", "xla", "cudnn", "triton", "splash")   # model.attention.core (attention/cores.py)
# model.attention.core_backward: the Triton core's backward (kernels/attention/tiles.BACKWARDS).
ATTENTION_BACKWARDS = ("auto", "recompute", "stored_pairs")

FFN_KINDS = ("dense", "moe", "none")

# Names of the grouped-matmul backends (`umoe_jax.ops.gmm_backends.BACKENDS`); the kernel backends
# register when a backend is first resolved. "auto" picks one at run time.
GMM_BACKENDS = ("xla", "masked", "triton", "mosaic", "megablox")

# `router.topk_backend`: how routers with scores take their top-k / top-P ids (`umoe_jax.ops.topk`).
TOPK_BACKENDS = ("auto", "xla", "triton")
ROUTER_LOGITS_DTYPES = ("float32", "bfloat16")   # umoe_jax.model.routers.matmul


@dataclasses.dataclass(frozen=True)
class RouterKind:
  """What the config needs to know of a router kind (`router.kind`).

  scores:       routes by scores (logits) of the router input: z-loss, jitter and the selection
                bias apply;
  distribution: its gates come from a distribution over all experts (softmax of the scores), which
                mixing (`router.mixing`) and the selections `top_p` / `expert_choice` act on;
  weights:      has weights of its own (`router.share_att_ffn` can share them);
  sublayers:    which sub-layers it can route ("attention", "ffn");
  decodes:      works with cached decoding (one new token per call);
  mixing:       mixes the routing of earlier tokens ("similarity" / "attention"; "none");
  selection_bias: takes the aux-loss-free balancing bias (`router.bias_update_rate`);
  selections:   the `router.selection` values it accepts;
  masks_slots:  can leave slots without a pick by itself (`RouterOutput.slot_mask`; the selections
                of `SLOT_MASKING_SELECTIONS` do so for any kind).
  """
  scores: bool = True
  distribution: bool = True
  weights: bool = True
  sublayers: tuple[str, ...] = ("attention", "ffn")
  decodes: bool = True
  mixing: str = "none"
  selection_bias: bool = True
  selections: tuple[str, ...] = ("top_k", "top_p", "expert_choice")
  masks_slots: bool = False


ROUTER_KINDS: dict[str, RouterKind] = {
    "topk_softmax": RouterKind(),
    # gates are sigmoid scores, not a distribution; `probs` is only their normalisation
    "topk_sigmoid": RouterKind(distribution=False, selections=("top_k",)),
    "xmoe": RouterKind(),
    "hash": RouterKind(scores=False, distribution=False, weights=False, selection_bias=False,
                       selections=("top_k",)),
    # its own selection: k grows with the step
    "smoe_dropout": RouterKind(selections=("top_k",), masks_slots=True),
    # its own routing: greedy top-k of affinities, then of a token-id table; sigmoid gates
    "stablemoe": RouterKind(distribution=False, selection_bias=False, selections=("top_k",)),
    # softmax-router distributions mixed over earlier tokens; attention_aware reads the block's MHA
    "similarity_aware": RouterKind(mixing="similarity", decodes=False),
    "attention_aware": RouterKind(mixing="attention", decodes=False, sublayers=("ffn",)),
    # the experts score themselves: an MoE FFN's pool of factorised experts
    "aoe": RouterKind(weights=False, sublayers=("ffn",)),
}

MIXINGS = ("none", "similarity", "attention")             # router.mixing
SELECTIONS = ("top_k", "top_p", "expert_choice")          # router.selection
BALANCE_LOSS_NAMES = ("seq_aux", "switch", "none")   # router.balance_loss
SLOT_MASKING_SELECTIONS = ("top_p", "expert_choice")  # selections that can leave slots empty


def router_masks_slots(router) -> bool:
  """Whether a router config (`ModelConfig.router_for`) can leave slots without a pick
  (`RouterOutput.slot_mask`): its selection is one of `SLOT_MASKING_SELECTIONS` or its kind
  `masks_slots` (SMoE-Dropout's schedule)."""
  return router.selection in SLOT_MASKING_SELECTIONS or ROUTER_KINDS[router.kind].masks_slots

ATTENTIONS: Registry[type] = Registry("attention kind", names=ATTENTION_KINDS)
ROUTERS: Registry[type] = Registry("router", names=ROUTER_KINDS)
