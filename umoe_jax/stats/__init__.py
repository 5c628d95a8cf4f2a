"""Model statistics: parameters (total and active), forward MACs, FLOPs for MFU, KV-cache bytes.

Command line (run from the repository root)::

  python -m umoe_jax.stats --config=configs/umoe_base.py                  # readable table
  python -m umoe_jax.stats --config=configs/umoe_base.py --json           # one JSON object
  python -m umoe_jax.stats --config=configs/umoe_large.py --batch=4 --seq_len=1024 --causal
  python -m umoe_jax.stats --config=configs/umoe_base.py --config.model.n_layers=2
  python -m umoe_jax.stats --zoo                                          # markdown model zoo table

Library::

  from umoe_jax import stats
  stats.total_params(cfg); stats.active_params(cfg)
  stats.forward_macs(cfg, batch=4, seq_len=1024)          # the paper's "MACs" column
  stats.forward_flops(cfg, batch, seq_len)                # 2 x MACs
  stats.train_flops_per_token(cfg, seq_len)               # 3 x forward FLOPs per token (for MFU)
  stats.kv_cache_bytes_per_token(cfg, dtype="bfloat16")
  stats.model_stats(cfg, ...)                             # everything above as one JSON-ready dict

`cfg` is a `ModelConfig`, a `config.model` ConfigDict, or a whole experiment ConfigDict (its `.model`
is used).

Definitions
-----------
Total parameters
  Every parameter of the model, counted on the real model (`umoe_jax.model.abstract_model`, shapes
  only, no memory) and cross-checked, component by component, against the analytic count below.

Active parameters (per token)
  The parameters one token's forward pass reads, taking the largest value over routing decisions:
  every non-routed weight in full plus, for each routed weight set, the experts the token is sent
  to. Concretely:
  * routed experts: k of E per pool. In UMoE the attention (k_att picks) and the FFN (k_ffn picks)
    of a layer share one pool; a weight is counted once, so a layer's pool contributes
    min(E, k_att + k_ffn) experts (the two routers may pick the same expert, so this is an upper
    bound; it equals k_att + k_ffn, the per-pick count that the MACs use, whenever
    k_att + k_ffn <= E, as in every paper config);
  * routed low-rank expert queries (UMoE's W_a^i, W_b^i): k_att of E;
  * routers: in full (a token's logits use every column);
  * always-on (shared) experts, attention projections, norms, the LM head: in full;
  * the embedding table: in full, by the usual convention of MoE papers (Mixtral, DeepSeekMoE,
    OLMoE), although a token reads one row. `active_non_embedding` leaves out the embedding and
    the LM head.

Forward MACs (the paper's counting, Table 1 "MACs")
  Multiply-accumulates of the matrix products of one forward pass over B sequences of T tokens,
  as DeepSpeed's flops profiler counts the official "slow" modules (`tools/estimate_macs.py`,
  B=4, T=1024): every linear layer including the routers and the LM head; the attention products
  q.k^T and a.V over the full T x T matrix (the causal mask does not reduce the count); only the
  top-k routed low-rank queries of pre-mixing attention (the code dispatches them by expert).
  Element-wise work (norms, RoPE, softmax, activations, gating) and the embedding lookup count 0.
  `causal=True` counts only the T(T+1)/2 visible (query, key) pairs instead.

FLOPs
  `forward_flops` = 2 x forward MACs. `train_flops_per_token(cfg, seq_len)` = 3 x forward FLOPs
  per token (forward + backward w.r.t. activations + backward w.r.t. weights), with attention
  counted like the paper (full T x T, as in PaLM's 6N + 12LHQT MFU formula) unless `causal=True`,
  which halves (exactly: (T+1)/2T) the attention products. The trainer's MFU uses the default.

KV cache
  Values cached per token per layer, times the cache dtype's bytes: dense MHA caches keys and
  values, H (d_k + d_v); pre-mixing attention caches one key head and the normed hidden state
  (its values), d_k + d (d_k + latent with MLA-style values). The total per token is that times
  the number of layers. Cross-checked against the layout the model's decoding cache allocates
  (`cache_shapes` of the attention class, `umoe_jax.model.cache`) where the class declares one.

Scope
-----
Block-level options (`moe.gated`, `moe.share_across_layers`, `moe.share_always_on`,
`router.share_att_ffn`, `attention.latent_dim`, `ffn.kind="none"`) are accounted for, and the
cross-check against the real model confirms each. All layers are assumed identical (a per-layer
schedule such as "first k layers dense" needs `layer_params` per layer).

Adding an attention kind: the recipe is in `umoe_jax.stats.kinds` (one `AttentionStats` class,
carried by the model class as `stats` or registered in `ATTENTION_STATS`).

Modules
-------
  umoe_jax.counting   (a leaf, outside the package) `Count`, the building blocks' counts (linear,
                  mlp, routed / low-rank experts), the `AttentionStats` / `FFNStats` contracts;
                  the model imports it, so the model never imports this package
  real_model      what the real model holds, read lazily (building the abstract model on demand)
  router_counts   routers' parameters and MACs, read off the router classes
  kinds           the registries `ATTENTION_STATS`, `FFN_STATS` and the lookup by kind
  ffn_kinds       the statistics of the FFN kinds (the attention kinds' are on their model classes)
  params, macs, kv_cache       parameters (+ the cross-check), MACs and FLOPs, KV-cache sizes
  summary         `model_stats`: all of it as one JSON-ready dict
  report, zoo     the readable table, the markdown model zoo
  cli             `python -m umoe_jax.stats`
"""
# Imports run one way: this package imports the model, the model imports only the leaf
# `umoe_jax.counting` (re-exported here, so `stats.Count`, `stats.linear` keep working).
from umoe_jax.counting import (COMPONENTS, MAC_COMPONENTS, Count, as_model_config,  # noqa: F401
                               linear, low_rank_expert_count, mlp, routed_expert)
from umoe_jax.stats.real_model import _layer_routers, model_params  # noqa: F401
from umoe_jax.stats.router_counts import router_macs, router_pair_macs, router_params  # noqa: F401
from umoe_jax.stats.kinds import (ATTENTION_STATS, FFN_STATS, AttentionStats, FFNStats,  # noqa: F401
                                  attention_stats, ffn_stats)
from umoe_jax.model.attention.stats import MHAStats, PreMixStats  # noqa: F401
from umoe_jax.stats.ffn_kinds import DenseFFNStats, MoEFFNStats, NoFFNStats  # noqa: F401
from umoe_jax.stats.params import (active_params, analytic_params, layer_params,  # noqa: F401
                                   param_mismatches, total_params)
from umoe_jax.stats.macs import (forward_flops, forward_mac_breakdown, forward_macs,  # noqa: F401
                                 train_flops_per_token)
from umoe_jax.stats.kv_cache import (kv_cache_bytes_per_token, kv_cache_values_per_token,  # noqa: F401
                                     model_kv_cache_values_per_token)
from umoe_jax.stats.summary import model_stats  # noqa: F401
from umoe_jax.stats.report import format_table, human, human_bytes  # noqa: F401
from umoe_jax.stats.zoo import ZOO_PATTERNS, load_config_file, zoo_files, zoo_markdown, zoo_rows  # noqa: F401
from umoe_jax.stats.cli import run_cli  # noqa: F401
