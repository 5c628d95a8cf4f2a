"""Shared pieces of the multi-device test scripts: a tiny float32 UMoE, its loss, an AdamW step.

The step is written here (not taken from umoe_jax.train) so that these tests pin the parallel layer
alone: params are a pure dict (as the trainer keeps them), shardings come from
`sharding.state_shardings(..., params=abstract nnx params)`, and the model is traced under
`sharding.use_mesh`.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import configs.common  # noqa: E402
from umoe_jax.config import model_config  # noqa: E402
from umoe_jax.model.lm import CausalLM  # noqa: E402
from umoe_jax.parallel import sharding  # noqa: E402

BATCH, SEQ = 8, 16


def tiny_cfg(family: str = "umoe", **moe):
  """One UMoE layer: 16 experts of width 32 (so expert=8 leaves 2 per shard < k_ffn=4), float32."""
  m = configs.common.model(family, "tiny")
  m.n_layers, m.max_seq_len, m.vocab_size, m.d_model = 1, SEQ, 128, 64
  m.compute_dtype, m.gmm_backend = "float32", "xla"
  m.attention.head_dim = m.attention.v_head_dim = 16
  m.moe.update(moe)
  return model_config(m)


def large_structure_cfg():
  """UMoE-large's structure (configs/umoe_large.py: 64 experts, FFN top-10, attention top-3, low-rank
  queries, 4 heads) at toy widths, one layer, float32. On expert=8 a shard holds 8 experts < K=10."""
  m = configs.common.model("umoe", "large")
  m.n_layers, m.max_seq_len, m.vocab_size, m.d_model = 1, SEQ, 128, 64
  m.compute_dtype, m.gmm_backend = "float32", "xla"
  m.attention.head_dim = m.attention.v_head_dim = 16
  m.attention.q_lora_rank, m.moe.d_expert = 4, 16
  return model_config(m)


def model_parts(cfg):
  abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  return graphdef, abstract_params


def init_params(cfg, seed: int = 0) -> dict:
  """Pure-dict params with well-spread router weights (so routing is decisive, not near-uniform)."""
  model = CausalLM(cfg, rngs=nnx.Rngs(params=seed))
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(seed)

  def spread(path, x):
    keys = [getattr(k, "key", None) for k in path]
    if "router" in keys:
      return jnp.asarray(rng.standard_normal(x.shape) * 2.0 / np.sqrt(x.shape[0]), x.dtype)
    if keys[-1] == "w_a":   # AoE's codes [E, D, r] score the experts: spread their norms too
      scale = np.linspace(0.5, 2.0, x.shape[0])[:, None, None] / np.sqrt(x.shape[1])
      return jnp.asarray(rng.standard_normal(x.shape) * scale, x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(spread, pure)


def tokens(seed: int = 1, batch: int = BATCH, vocab: int = 128) -> np.ndarray:
  return np.asarray(jax.random.randint(jax.random.key(seed), (batch, SEQ + 1), 0, vocab))


def loss_fn(params, batch, graphdef, remat="none"):
  model = nnx.merge(graphdef, params)
  logits, aux = model(batch[:, :-1], remat=remat)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))
  return ce + aux["balance_loss"] + sum(aux.get("router_losses", {}).values())


TX = optax.adamw(1e-2, eps=1e-6, weight_decay=0.1)


def make_step(graphdef):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, graphdef)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads
  return step


def sharded_step(graphdef, abstract_params, mesh, rules=None):
  """(jitted step with explicit in/out shardings, param shardings, opt-state shardings)."""
  pure_abs = jax.eval_shape(lambda: nnx.to_pure_dict(abstract_params))
  p_sh = sharding.state_shardings(pure_abs, mesh, rules, params=abstract_params)
  o_sh = sharding.state_shardings(jax.eval_shape(TX.init, pure_abs), mesh, rules,
                                  params=abstract_params)
  b_sh = sharding.batch_sharding(mesh, rules)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step = jax.jit(make_step(graphdef), in_shardings=(p_sh, o_sh, b_sh),
                 out_shardings=(p_sh, o_sh, rep, p_sh))
  return step, p_sh, o_sh


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_abs(a) -> float:
  return max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(a))


def parse_layout(layout: str) -> dict:
  """"data=2,expert=4" -> {"data": 2, "expert": 4}: a mesh config for `mesh.make_mesh`."""
  return {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}


def loss_and_grads_fn(graphdef):
  """(params, batch) -> (loss, grads) of `loss_fn`."""
  return jax.value_and_grad(lambda p, b: loss_fn(p, b, graphdef))


def rel_diff(a, b) -> float:
  """||a - b|| / ||b|| over all leaves of two pytrees, in float64."""
  num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
  return (num / den) ** 0.5
