"""The paper's model family and the defaults every experiment shares.

Each `configs/<family>_<scale>.py` is `get_config()` = `experiment(family, scale)`. Families follow
Table 1 of the UMoE paper (official configs in github.com/ysngki/UMoE, `model_libs/configs/`):

  dense     multi-head attention + dense MLP                       (small-GPT / 1B-GPT-1024)
  ffn_moe   multi-head attention + fine-grained MoE FFN + 1 shared (small-vanilla-ffnMoE / 1B-ffnMoE)
  umoe      pre-mixing attention MoE + MoE FFN, one expert pool    (small-vanilla-UMoE / 1B-UMoE)
  umoe_att  pre-mixing attention MoE + dense MLP                   (small-vanilla-UMoE-Att / 1B-UMoE-Att)
  moa       MoA: K of E expert heads (own W_q, W_o), shared single-head k, v, + 1 always-on head,
            dense MLP                                              (small-moa-1024 / 1B-moa-1024)
  switchhead  SwitchHead, UMoE repository's baseline: 4 heads, per-head MoE V and O projections
            (top-1 softmax routers, seq aux 0.001), dense MLP      (1B-switchhead-1024; base: below)
  switchhead_sigmoid  the original SwitchHead gating: sigmoid gates, top-2 of 4 experts per head,
            no balance loss (same head shapes as `switchhead`)
  umoe_mla  umoe with MLA-style latent values (cache a latent of head_dim) (small-mla-UMoE-1024)

Ablations are switches of a family's config (umoe_jax/config/schema.py documents each key):
  attention.kind="postmix" (post-mixing), moe.activation="none", moe.gated (SwiGLU experts),
  attention.top_k / ffn.top_k (expert allocation), ffn.kind="none" (all experts to attention),
  moe.share_always_on, router.share_att_ffn, moe.share_pool, moe.share_across_layers,
  attention.latent_dim (MLA values), attention.n_shared_experts=0 on moa (the original MoA).

SwitchHead base is not in the official repository (the paper reports 533M parameters, 542G MACs).
We keep the head shapes of every other base model (4 heads, q/k and v head dim 192, so the active
V/O compute equals dense attention's) and the repository's gating (top-1 softmax per head), and choose
the experts per head to match the parameters: E=29 gives 532.6M (E=28: 518.4M, E=30: 546.8M). Its
MACs are 534.6G, 1.4% under the paper's 542G; matching both numbers to 0.2% needs odd shapes (a search
over heads, head dims, E and top-k finds e.g. 4 heads, d_k=208, d_v=192, E=29: 533.8M / 542.7G).

Scales: base (d=768, 12 layers), large (d=2048, 24 layers), tiny (trains on a CPU in minutes).
"""
from __future__ import annotations

import ml_collections

from umoe_jax.config import default_config_dict
from umoe_jax.config.fields import optional
from umoe_jax.parallel.rules import DEFAULT_RULES

# Shape of each scale: width, depth, attention head dim, dense FFN width, MoE pool.
SCALES = {
    "tiny": dict(d_model=128, n_layers=4, max_seq_len=256, vocab_size=512, head_dim=32,
                 d_ff=512, n_experts=16, d_expert=32, k_ffn=4, k_att=2, q_lora_rank=8,
                 att_experts=15, sh_experts=4),
    "base": dict(d_model=768, n_layers=12, max_seq_len=1024, vocab_size=32000, head_dim=192,
                 d_ff=3072, n_experts=128, d_expert=192, k_ffn=15, k_att=3, q_lora_rank=16,
                 att_experts=116, sh_experts=29),
    "large": dict(d_model=2048, n_layers=24, max_seq_len=1024, vocab_size=32000, head_dim=512,
                  d_ff=5632, n_experts=64, d_expert=512, k_ffn=10, k_att=3, q_lora_rank=36,
                  att_experts=57, sh_experts=15),
}


FAMILIES = ("dense", "ffn_moe", "umoe", "umoe_att", "moa", "switchhead", "switchhead_sigmoid",
            "umoe_mla")


def model_defaults() -> ml_collections.ConfigDict:
  """Every model key with its default: `umoe_jax.config.ModelConfig`'s, as a ConfigDict."""
  return default_config_dict()


def model(family: str, scale: str) -> ml_collections.ConfigDict:
  """The model section for one row of the paper's Table 1 at one scale."""
  if scale not in SCALES:
    raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
  s = SCALES[scale]
  m = model_defaults()
  m.vocab_size, m.d_model, m.n_layers, m.max_seq_len = (
      s["vocab_size"], s["d_model"], s["n_layers"], s["max_seq_len"])
  # Dense multi-head attention: 4 heads of head_dim (q/k and v), as in every official config.
  m.attention.n_heads = 4
  m.attention.head_dim = s["head_dim"]
  m.attention.v_head_dim = s["head_dim"]
  m.ffn.d_ff = s["d_ff"]
  if family == "dense":
    pass
  elif family == "ffn_moe":
    m.ffn.kind = "moe"
    m.ffn.top_k = s["k_ffn"]
    m.moe.n_experts, m.moe.d_expert = s["n_experts"], s["d_expert"]
  elif family in ("umoe", "umoe_att", "umoe_mla"):
    m.attention.kind = "premix"
    m.attention.top_k = s["k_att"]
    m.attention.q_lora_rank = s["q_lora_rank"]
    m.moe.d_expert = s["d_expert"]
    if family in ("umoe", "umoe_mla"):
      m.ffn.kind = "moe"
      m.ffn.top_k = s["k_ffn"]
      m.moe.n_experts = s["n_experts"]
      if family == "umoe_mla":  # official small-mla-UMoE-1024: latent 192 = head_dim at base
        m.attention.latent_dim = s["head_dim"]
    else:  # attention-only MoE: a dense FFN, more attention experts to match parameters
      m.moe.n_experts = s["att_experts"]
  elif family == "moa":  # expert heads of head_dim (q/k and v), as many experts as UMoE-Att
    m.attention.kind = "moa"
    m.attention.top_k = s["k_att"]
    m.attention.n_experts = s["att_experts"]
  elif family in ("switchhead", "switchhead_sigmoid"):
    m.attention.kind = "switchhead"
    if family == "switchhead":  # the UMoE repository's baseline
      m.attention.n_experts, m.attention.top_k = s["sh_experts"], 1
    else:  # the original paper's gating
      m.attention.n_experts, m.attention.top_k = 4, 2
      m.router.kind, m.router.balance_loss = "topk_sigmoid", "none"
  else:
    raise ValueError(f"unknown model family {family!r}; valid: {', '.join(FAMILIES)}")
  return m


# Training defaults per scale, over umoe_jax.train.config.default_train_config() (the official
# recipe: AdamW 4e-4, b2 0.95, wd 0.01, 5% warmup, cosine, clip 1.0). base / large follow the
# official run: 1024 sequences x 1024 tokens per step (~1M tokens), 50k steps (~52B tokens),
# gradient checkpointing, 8 accumulation steps. tiny trains on a CPU in minutes on the built-in
# byte-level corpus (a larger peak LR: a few hundred steps only).
TRAIN_SCALES = {
    "tiny": dict(global_batch_size=8, seq_len=128, num_steps=300, learning_rate=2e-3,
                 log_every=10, eval_every=100, eval_batches=4),
    "base": dict(global_batch_size=1024, seq_len=1024, num_steps=50_000, grad_accum_steps=8,
                 remat="block"),
    "large": dict(global_batch_size=1024, seq_len=1024, num_steps=50_000, grad_accum_steps=8,
                  remat="block"),
}
CHECKPOINT_SCALES = {
    "tiny": dict(every=100, keep=2),
    "base": dict(every=1000, keep=3),
    "large": dict(every=1000, keep=3),
}


def experiment(family: str, scale: str) -> ml_collections.ConfigDict:
  """A full experiment config: model, data, training, checkpoint, log and parallelism sections."""
  from umoe_jax import data
  from umoe_jax.train import config as train_config

  config = ml_collections.ConfigDict()
  config.model = model(family, scale)
  config.data = data.default_data_config()
  config.train = train_config.default_train_config()
  config.train.update(TRAIN_SCALES[scale])
  config.checkpoint = train_config.default_checkpoint_config()
  config.checkpoint.update(CHECKPOINT_SCALES[scale])
  config.log = train_config.default_log_config()
  # Parallelism (umoe_jax.parallel): the device mesh, one size per axis.
  config.mesh = dict(
      data=-1,     # data-parallel ways: the batch is split; -1 = the devices the other axes leave
      fsdp=1,      # FSDP ways: the batch and the parameters / optimizer state are split
      tensor=1,    # tensor-parallel ways: attention heads and MLP / expert widths are split
      expert=1,    # expert-parallel ways: the routed experts are split, tokens exchanged between them
  )
  # The logical-axis -> mesh-axes table as [name, axes] pairs (axes: a mesh axis, a list or None);
  # change it to shard a kind of dimension differently (umoe_jax/parallel/rules.py names them).
  config.sharding_rules = [[name, list(axes) if isinstance(axes, tuple) else axes]
                           for name, axes in DEFAULT_RULES]
  # Expert parallelism (umoe_jax/parallel/expert_parallel.py).
  config.expert_parallel = dict(
      capacity_factor=optional(float),  # None = dropless, buffers for the worst case; c = buffers
                                        # of c x the balanced load, overflow dropped and counted
      exchange="auto",  # how tokens reach their experts: "all_to_all", "all_gather", "ragged" or
                        # "auto" (all_gather when top-k >= the expert axis, else all_to_all)
      chunks=1,         # token chunks per device exchanged separately, so that exchange and
                        # expert compute can overlap
  )
  return config
