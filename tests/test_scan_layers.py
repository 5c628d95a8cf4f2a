"""`model.scan_layers`: the decoder blocks run as one lax.scan over their stacked parameters give
the loop's logits, aux and gradients (float32; router kinds with schedules, jitter, mixing and
extra losses; remat policies), the parameter layout (so checkpoints) does not change (that XLA
gets one block's program whatever the depth: tests/test_compile_time_bench.py), a decode with a KV cache runs the loop, and blocks of
different structure are refused naming the layer."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import random_module, tiny_config
from umoe_jax.model.cache import init_cache
from umoe_jax.model.lm import CausalLM

# (family, router kind, remat): router kinds with state of their own (a step schedule, a token
# table and a distillation loss, mixing over earlier tokens, a hash table) on UMoE's shared pool and
# the FFN pool, one pool shared by every layer (its gradient summed over them), and SwitchHead
# (several routers in one sub-layer).
CASES = [("umoe", "stablemoe", "block", {}), ("umoe", "smoe_dropout", "dots", {}),
         ("umoe", "topk_softmax", "none", {"moe.share_across_layers": True}),
         ("ffn_moe", "similarity_aware", "none", {}), ("ffn_moe", "hash", "none", {}),
         ("switchhead", "topk_softmax", "none", {})]


def _model(family, kind=None, n_layers=2, seed=1, **overrides):
  keys = {"router.kind": kind} if kind else {}
  if kind not in (None, "hash"):
    keys["router.jitter_eps"] = 0.1   # the rng folded with the layer index matters
  cfg = tiny_config(family, n_layers=n_layers, **keys, **overrides)
  return random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), seed)


def _with_scan(model, scan: bool):
  model.cfg = dataclasses.replace(model.cfg, scan_layers=scan)
  return model


@pytest.mark.parametrize("family,kind,remat,overrides", CASES,
                         ids=[f"{f}-{k}-{r}" + ("-shared" if o else "") for f, k, r, o in CASES])
def test_scan_matches_the_loop(family, kind, remat, overrides):
  model = _model(family, kind, **overrides)
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, model.cfg.vocab_size)

  def objective(state, scan):
    logits, aux = _with_scan(nnx.merge(graphdef, state), scan)(
        tokens, remat=remat, step=jnp.int32(7), rng=jax.random.key(5), return_routes=True)
    value = (jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux["balance_loss"]
             + sum(aux["router_losses"].values()))
    return value, (logits, aux)

  both = jax.jit(lambda s: [jax.value_and_grad(objective, has_aux=True)(s, scan)
                            for scan in (False, True)])
  ((loop_value, (loop_logits, loop_aux)), loop_grads), ((value, (logits, aux)), grads) = both(state)
  np.testing.assert_allclose(logits, loop_logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(value, loop_value, rtol=1e-6)
  assert jax.tree.structure(aux) == jax.tree.structure(loop_aux)
  assert len(loop_aux["routes"]) == 2 * len(model.layers[0].named_routers()) > 0
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(loop_aux), jax.tree.leaves(aux)):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  leaves = jax.tree_util.tree_leaves_with_path(loop_grads)
  assert max(float(jnp.max(jnp.abs(g))) for _, g in leaves) > 0
  for (path, want), got in zip(leaves, jax.tree.leaves(grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_a_looped_models_parameters_load_into_a_scanned_one():
  """The same modules either way (the checkpoint layout): a model built with scan_layers takes the
  parameters of one built without, and gives its logits."""
  loop, scan = _model("umoe", seed=1), _model("umoe", seed=2, scan_layers=True)
  assert scan.cfg.scan_layers and not loop.cfg.scan_layers
  a, b = nnx.state(loop, nnx.Param), nnx.state(scan, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert [x.shape for x in jax.tree.leaves(a)] == [x.shape for x in jax.tree.leaves(b)]
  tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, loop.cfg.vocab_size)
  scan_graphdef, _ = nnx.split(scan)
  scanned_logits = jax.jit(lambda state: nnx.merge(scan_graphdef, state)(tokens)[0])
  want = jax.jit(lambda state: nnx.merge(nnx.split(loop)[0], state)(tokens)[0])(nnx.state(loop))
  assert not np.allclose(scanned_logits(nnx.state(scan)), want)   # two models before the load
  nnx.update(scan, nnx.state(loop))
  np.testing.assert_allclose(scanned_logits(nnx.state(scan)), want, rtol=1e-5, atol=1e-5)


def test_decoding_with_a_cache_runs_the_loop():
  model = _model("umoe")
  tokens = jax.random.randint(jax.random.key(3), (2, 5), 0, model.cfg.vocab_size)
  graphdef, state = nnx.split(model)

  def prefill(state, scan):
    logits, _, cache = _with_scan(nnx.merge(graphdef, state), scan)(
        tokens, cache=init_cache(model.cfg, 2, 8))
    return logits, cache.layers
  outs = jax.jit(lambda s: [prefill(s, scan) for scan in (False, True)])(state)
  np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
  assert len(outs[1][1]) == len(model.layers)


def test_blocks_of_different_structure_are_refused():
  model = _with_scan(_model("umoe"), True)
  model.layers[1] = _model("umoe", **{"moe.d_expert": 12}).layers[1]   # wider experts in layer 1
  tokens = jnp.zeros((1, 4), jnp.int32)
  graphdef, state = nnx.split(model)
  with pytest.raises(ValueError, match="model.scan_layers=True needs decoder blocks of one "
                                       "structure; layer 1 differs"):
    jax.eval_shape(lambda s: nnx.merge(graphdef, s)(tokens), state)
  # the loop takes them
  jax.eval_shape(lambda s: _with_scan(nnx.merge(graphdef, s), False)(tokens), state)


def test_remat_inside_the_scan_leaves_out_the_cse_barriers():
  """In a scan's body the loop keeps XLA from merging the recomputation into the forward pass, so
  the blocks' checkpoints drop jax.checkpoint's CSE barriers there (prevent_cse=False), and keep
  them in the loop, once per block."""
  tokens = jnp.zeros((1, 4), jnp.int32)
  counts = {}
  for scan in (False, True):
    graphdef, state = nnx.split(_model("umoe", scan_layers=scan))
    text = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens, remat="block")[0])(state))
    counts[scan] = (text.count("prevent_cse=True"), text.count("prevent_cse=False"))
  assert counts == {False: (2, 0), True: (0, 1)}, counts
