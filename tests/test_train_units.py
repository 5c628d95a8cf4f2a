"""Trainer pieces without the loop: config errors, optimizer, step options, resume order,
checkpoint fallback and atomicity, init_from."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import configs.common
from conftest import jaxpr_avals, micro_umoe, random_module, rel_err
from umoe_jax.config import ConfigError, model_config
from umoe_jax.model.lm import CausalLM
from umoe_jax.train import checkpoint as ckpt_lib
from umoe_jax.train import config as train_config
from umoe_jax.train import loop
from umoe_jax.train import optimizer as opt_lib
from umoe_jax.train import programs as programs_lib
from umoe_jax.train import setup as setup_lib
from umoe_jax.train import state as state_lib
from umoe_jax.train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
GPT2 = os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json")


def tiny():
  return configs.common.experiment("umoe", "tiny")


# ----------------------------------------------------------------------------------------------
# Errors before training.


def test_default_configs_validate():
  for family in ("dense", "ffn_moe", "umoe"):
    for scale in ("tiny", "base", "large"):
      train_config.validate(configs.common.experiment(family, scale))


@pytest.mark.parametrize("where, match", [
    ("top", r"unknown config key 'bogus'"),
    ("train", r"unknown key train\.bogus"),
    ("checkpoint", r"unknown key checkpoint\.bogus"),
    ("log", r"unknown key log\.bogus"),
    ("data", r"unknown key data\.bogus"),
    ("model", r"bogus"),
])
def test_unknown_key(where, match):
  c = tiny()
  section = c if where == "top" else c[where]
  section.bogus = 1
  with pytest.raises(ConfigError, match=match):
    train_config.validate(c)


def test_missing_data_path(tmp_path):
  c = tiny()
  c.data.source = "parquet"
  c.data.train_path = str(tmp_path / "nowhere" / "train.parquet")
  with pytest.raises(ConfigError, match=r"data\.train_path=.*nowhere.*no such file"):
    train_config.validate(c)
  # A directory (or glob) with no file of the source: named before anything is read (it was a
  # FileNotFoundError traceback from the data pipeline).
  (tmp_path / "notes.txt").write_text("not parquet")
  c.data.train_path = str(tmp_path)
  with pytest.raises(ConfigError, match=re.escape(f"data.train_path='{tmp_path}': directory has no "
                                                  ".parquet files")):
    train_config.validate(c)
  c.data.train_path = str(tmp_path / "nowh*")  # matches the directory "nowhere" only
  (tmp_path / "nowhere").mkdir()
  with pytest.raises(ConfigError, match=r"data\.train_path=.*nowh\*': glob matches no files"):
    train_config.validate(c)
  c.data.source = "text"
  c.data.train_path = str(tmp_path / "nowhere")
  with pytest.raises(ConfigError, match=r"nowhere': directory has no files"):
    train_config.validate(c)
  c.data.train_path = str(tmp_path)
  c.data.eval_path = ""
  with pytest.raises(ConfigError, match=r"data\.eval_path is empty but train\.eval_every"):
    train_config.validate(c)
  c.data.eval_path = str(tmp_path / "nowhere")
  with pytest.raises(ConfigError, match=r"data\.eval_path=.*nowhere': directory has no files"):
    train_config.validate(c)


def test_tokenizer_larger_than_vocab():
  c = tiny()
  c.model.vocab_size = 200  # the byte tokenizer has 257 ids
  with pytest.raises(ConfigError, match=r"data\.tokenizer='byte'.*257.*vocab_size is 200"):
    train_config.validate(c)


@pytest.mark.skipif(not os.path.isfile(GPT2), reason=f"shared data not found at {SHARED}")
def test_gpt2_tokenizer_larger_than_vocab():
  c = tiny()
  c.data.tokenizer = GPT2  # 50257 ids; tiny's vocab is 512
  with pytest.raises(ConfigError, match=r"50257.*vocab_size is 512"):
    train_config.validate(c)


def test_seq_len_over_rope_limit(tmp_path):
  c = tiny()
  c.train.seq_len = c.model.max_seq_len + 1
  with pytest.raises(ConfigError, match=r"train\.seq_len=257 exceeds model\.max_seq_len=256"):
    train_config.validate(c)
  workdir = tmp_path / "never"
  with pytest.raises(ConfigError):
    loop.run(c, str(workdir))
  assert not workdir.exists()  # nothing was written before the check


@pytest.mark.parametrize("key, value, match", [
    ("train.grad_accum_steps", 3, r"global_batch_size=8 must be a positive multiple of "
                                  r"train\.grad_accum_steps=3"),
    ("train.on_nonfinite", "ignore", r"on_nonfinite='ignore'; valid: stop, skip"),
    ("checkpoint.keep", 0, r"checkpoint\.keep=0"),
    ("checkpoint.init_from", "/no/such/dir", r"init_from='/no/such/dir': no such directory"),
    # the default source reads no files: a path given without data.source trained on it silently
    ("data.train_path", "/data/x.parquet", r"data\.train_path='/data/x\.parquet' is set but "
                                           r"data\.source='builtin' \(the default\) reads no files"),
    ("data.eval_path", "/data/v.jsonl", r"data\.eval_path='/data/v\.jsonl' is set but "),
    # (were grain's ValueErrors from inside the pipeline, naming no key)
    ("data.num_epochs", 0, r"data\.num_epochs=0 must be >= 1 \(or None: repeat forever\)"),
    ("data.read_threads", -2, r"data\.read_threads=-2 must be >= 0"),
])
def test_bad_values(key, value, match):
  c = tiny()
  section, name = key.split(".")
  c[section][name] = value
  with pytest.raises(ConfigError, match=match):
    train_config.validate(c)


def test_cli_errors(tmp_path):
  """train.py: a misspelled override fails at flag parsing; a bad value exits with a message."""
  base = [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/umoe_tiny.py",
          f"--workdir={tmp_path / 'w'}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  bad_key = subprocess.run(base + ["--config.train.bogus=1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env)
  assert bad_key.returncode != 0 and "bogus" in bad_key.stderr
  bad_len = subprocess.run(base + ["--config.train.seq_len=4096"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env)
  assert bad_len.returncode != 0
  assert "config error: train.seq_len=4096 exceeds model.max_seq_len=256" in bad_len.stderr
  assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------------------------
# Optimizer.


def test_schedule_warmup_cosine_floor():
  t = tiny().train
  t.update(dict(num_steps=100, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1))
  lr = opt_lib.learning_rate_schedule(t)
  np.testing.assert_allclose([float(lr(s)) for s in (0, 5, 10, 55, 100, 200)],
                             [0.0, 5e-4, 1e-3, 1e-3 * (0.1 + 0.9 * 0.5), 1e-4, 1e-4], rtol=1e-5)
  t.warmup_steps = None
  t.warmup_ratio = 0.05
  assert opt_lib.warmup_steps(t) == 5


def test_resuming_with_another_schedule_warns(tmp_path, caplog):
  """A resume whose schedule keys differ from the run's config.json warns once, naming the keys,
  both values and the learning rate at the resumed step before and after; an unchanged schedule
  (or an unused key) logs nothing. It used to reshape the schedule silently."""
  import math
  cfg = tiny()
  cfg.train.update(dict(num_steps=40, warmup_steps=None, warmup_ratio=0.05, learning_rate=1e-3,
                        min_lr_ratio=0.1))
  ckpt_lib.write_config(str(tmp_path), cfg)
  # warmup_ratio * num_steps warmup steps, then cosine from 1e-3 down to 1e-4 at num_steps
  cosine = lambda t, warm, total: 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * (t - warm) /
                                                                     (total - warm))))

  def warnings(train, step, count):
    c = tiny()
    c.train.update(cfg.train.to_dict())
    c.train.update(train)
    caplog.clear()
    with caplog.at_level("WARNING"):
      loop.warn_schedule_change(str(tmp_path), c, step, count)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

  assert warnings({}, 25, 25) == []
  assert warnings({"log_every": 7, "seed": 3}, 25, 25) == []  # not schedule keys
  assert warnings({"num_steps": 60}, 25, 25) == [
      f"resuming with another learning-rate schedule than {tmp_path}/config.json: train.num_steps "
      f"40 -> 60: the learning rate at step 25, where this run resumes, becomes "
      f"{cosine(25, 3, 60):.2e} (was {cosine(25, 2, 40):.2e})"]
  # One warning for several keys; the schedule reads the updates applied (skipped steps excluded).
  [message] = warnings({"warmup_steps": 4, "min_lr_ratio": 0.0}, 25, 24)
  assert message.endswith(
      "train.warmup_steps None -> 4, train.min_lr_ratio 0.1 -> 0.0: the learning rate at step 25, "
      f"where this run resumes, becomes {1e-3 * 0.5 * (1 + math.cos(math.pi * 20 / 36)):.2e} "
      f"(was {cosine(24, 2, 40):.2e})"), message
  # warmup_ratio is unused while warmup_steps is set
  cfg.train.warmup_steps = 2
  ckpt_lib.write_config(str(tmp_path), cfg)
  assert warnings({"warmup_ratio": 0.5}, 25, 25) == []
  assert len(warnings({"learning_rate": 2e-3}, 25, 25)) == 1


def test_no_weight_decay_on_norm_scales():
  cfg = model_config(tiny().model)
  parts = state_lib.model_parts(cfg)
  mask = opt_lib.decay_mask(parts.abstract_params)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
  assert {k for k, v in flat.items() if not v} == {k for k in flat if k.endswith("['scale']")}
  assert sum(not v for v in flat.values()) == 1 + cfg.n_layers * 3  # final + 2 per layer + q_a_norm

  t = tiny().train
  t.update(dict(warmup_steps=0, weight_decay=0.1, learning_rate=1.0))
  tx = opt_lib.make_optimizer(t, mask)
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype),
                        nnx.to_pure_dict(parts.abstract_params))
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zero, tx.init(params), params)
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    key = jax.tree_util.keystr(path)
    expected = 0.0 if key.endswith("['scale']") else -0.1  # -lr * wd * p
    np.testing.assert_allclose(np.asarray(u), expected, err_msg=key)


def test_grad_accumulation_and_remat_match_plain_step():
  """Same gradient with 2 micro-batches and every block rematerialised as in one plain pass
  (float32; both options in one compilation to keep the test cheap)."""
  cfg, parts, params = micro_umoe()
  tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, cfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  def grads(**kw):
    fn = jax.jit(lambda p, b: step_lib.grads_and_stats(p, b, graphdef=parts.graphdef, **kw))
    return fn(params, batch)

  g1, s1 = grads(accum_steps=1, remat=False)
  g2, s2 = grads(accum_steps=2, remat=True)
  # The balance loss is per micro-batch (per sequence for seq_aux): equal over 1 or 2 micro-batches.
  np.testing.assert_allclose(s2["nll_sum"], s1["nll_sum"], rtol=1e-5)
  np.testing.assert_allclose(s2["balance_loss"], s1["balance_loss"], rtol=1e-5)
  for name in s1["routers"]:
    np.testing.assert_array_equal(s2["routers"][name]["expert_counts"],
                                  s1["routers"][name]["expert_counts"])
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-6)


def test_loss_chunk_tokens_step_matches_plain_step():
  """train.loss_chunk_tokens > 0 (the LM head and the cross-entropy in token chunks,
  umoe_jax/ops/chunked_loss.py) and train.fused_loss_head (the two as one op, unchunked) take the
  same step as the full logits: loss, gradient norm and updated parameters (float32, a loss mask,
  16 tokens in 3 chunks of 6 with padding; the steps in one compilation; SGD so the update is the
  gradient itself)."""
  cfg, parts, params = micro_umoe()
  tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, cfg.vocab_size)
  mask = (jax.random.uniform(jax.random.key(5), (2, 8)) > 0.25).astype(jnp.float32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
  tx = optax.sgd(1.0)
  state = state_lib.state_with_params(params, tx, 0)

  forms = {"plain": dict(loss_chunk_tokens=0), "chunked": dict(loss_chunk_tokens=6),
           "fused": dict(fused_loss_head=True)}

  def steps(st, b):
    return {name: step_lib.train_step(st, b, graphdef=parts.graphdef, tx=tx,
                                      schedule=optax.constant_schedule(1.0), **kw)
            for name, kw in forms.items()}

  out = jax.jit(steps)(state, batch)
  plain, m0 = out["plain"]
  assert float(m0["tokens"]) == float(mask.sum()) < mask.size
  old = jax.tree_util.tree_leaves_with_path(params)
  for form in ("chunked", "fused"):
    other, m1 = out[form]
    assert int(m0["applied"]) == int(m1["applied"]) == 1
    for key in ("loss", "lm_loss", "balance_loss", "grad_norm", "tokens"):
      np.testing.assert_allclose(m1[key], m0[key], rtol=1e-6, err_msg=(form, key))
    for (path, p0), p1, p in zip(jax.tree_util.tree_leaves_with_path(plain.params),
                                 jax.tree.leaves(other.params), [x for _, x in old]):
      key = jax.tree_util.keystr(path)
      assert rel_err(p1, p0) < 1e-6, (form, key)
      step0, step1 = np.float64(p0) - np.float64(p), np.float64(p1) - np.float64(p)
      if np.abs(step0).max() > 1e-6:    # the update (the gradient) itself, where there is one
        assert rel_err(step1, step0) < 1e-5, (form, key, rel_err(step1, step0))
    assert rel_err(other.params["lm_head"], params["lm_head"]) > 1e-3  # the step moved the head


def test_loss_chunk_tokens_reaches_the_trainers_step():
  """config.train.loss_chunk_tokens reaches the step train.py builds (loop.config_programs): that
  program holds no [B, T, V] logits, the default's does (traced only, not compiled)."""
  from umoe_jax.parallel import mesh as mesh_lib, sharding
  c = tiny()
  c.model.update(dict(n_layers=1, d_model=16))
  c.train.update(dict(global_batch_size=4, seq_len=8))   # 32 tokens: not d_model (the head [D, V])
  model_cfg = train_config.validate(c)
  mesh = mesh_lib.make_mesh(c.get("mesh"), devices=jax.devices()[:1])
  rules = sharding.normalize_rules(c.get("sharding_rules"))
  batch = {k: jax.ShapeDtypeStruct((4, 8), jnp.int32) for k in ("inputs", "targets")}
  logits_shapes = {(4, 8, model_cfg.vocab_size), (32, model_cfg.vocab_size)}

  def avals(loss_chunk_tokens, fused_loss_head=False):
    c.train.loss_chunk_tokens, c.train.fused_loss_head = loss_chunk_tokens, fused_loss_head
    progs = loop.config_programs(c, model_cfg, mesh, rules)
    return list(jaxpr_avals(progs.train_fn.trace(progs.abstract, batch).jaxpr.jaxpr))

  has_logits = lambda *a: any(tuple(getattr(x, "shape", ())) in logits_shapes for x in avals(*a))
  assert has_logits(0) and not has_logits(4)
  # train.fused_loss_head: the head + loss as one op (its flattened [32, V] logits; the plain
  # head's cotangent of the [B, T, V] logits, a scatter of the target's, is not built)
  fused = [tuple(getattr(x, "shape", ())) for x in avals(0, True)]
  plain = [tuple(getattr(x, "shape", ())) for x in avals(0)]
  assert (4, 8, model_cfg.vocab_size) in plain and (4, 8, model_cfg.vocab_size) not in fused
  assert (32, model_cfg.vocab_size) in fused
  assert not has_logits(4, True)        # chunks win over the unchunked fused head (no [32, V])
  assert tiny().train.fused_loss_head is True and train_config.default_train_config().fused_loss_head



def test_fused_loss_head_config_check():
  c = tiny()
  c.train.fused_loss_head = True
  train_config.validate(c)
  with c.train.ignore_type():
    c.train.fused_loss_head = 1
  with pytest.raises(ConfigError, match=re.escape("train.fused_loss_head=1 must be true or false")):
    train_config.validate(c)
  # Both: the chunked head (fused already) is the one the step runs (the test above).
  c.train.fused_loss_head, c.train.loss_chunk_tokens = True, 4096
  train_config.validate(c)


def test_mu_dtype_keeps_the_first_moment_in_bfloat16():
  """train.mu_dtype="bfloat16": AdamW's first moment is held in bf16 (the second and the
  parameters in float32), and a few updates on fresh random gradients stay within bf16 rounding
  of the float32-moment optimizer's (and differ from them: the switch does something); a bad value
  is refused naming the field."""
  # A small tree (a matrix, an expert stack, a norm scale without decay): the optimizer is per leaf.
  shapes = {"w": (16, 24), "experts": (4, 8, 12), "norm": {"scale": (16,)}}
  mask = {"w": True, "experts": True, "norm": {"scale": False}}
  is_shape = lambda x: isinstance(x, tuple)
  params = jax.tree.map(lambda sh: jax.random.normal(jax.random.key(len(sh)), sh), shapes,
                        is_leaf=is_shape)
  grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(10 + i), p.shape), params)
           for i in range(3)]
  out = {}
  for mu_dtype in ("float32", "bfloat16"):
    c = tiny()
    c.train.update(dict(warmup_steps=0, learning_rate=1e-3, mu_dtype=mu_dtype))
    train_config.validate(c)
    # (the fields the trainer's compiled programs are keyed by and hand the optimizer, as it does)
    fields = types.SimpleNamespace(**{k: c.train[k] for k in loop.OPTIMIZER_KEYS})
    tx = opt_lib.make_optimizer(fields, mask)
    state = tx.init(params)
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)
    adam = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
    assert len(adam) == 1
    assert {x.dtype for x in jax.tree.leaves(adam[0].mu)} == {jnp.dtype(mu_dtype)}
    assert {x.dtype for x in jax.tree.leaves(adam[0].nu)} == {jnp.dtype(jnp.float32)}
    update = jax.jit(tx.update)
    for g in grads:
      updates, state = update(g, state, params)
    out[mu_dtype] = jax.tree.leaves(updates)
    assert {u.dtype for u in out[mu_dtype]} == {jnp.dtype(jnp.float32)}
  errs = [rel_err(a, b) for a, b in zip(out["bfloat16"], out["float32"])]
  assert max(errs) < 1e-2 and max(errs) > 0, errs
  c = tiny()
  c.train.mu_dtype = "float16"
  with pytest.raises(ConfigError,
                     match=re.escape("train.mu_dtype='float16'; valid: float32, bfloat16")):
    train_config.validate(c)

@pytest.mark.parametrize("value", [-1, True, 2.5, "4096"])
def test_loss_chunk_tokens_config_check(value):
  c = tiny()
  c.train.loss_chunk_tokens = 4096
  train_config.validate(c)
  with c.train.ignore_type():   # (ml_collections refuses a float or str itself, naming the field)
    c.train.loss_chunk_tokens = value
  with pytest.raises(ConfigError, match=re.escape(f"train.loss_chunk_tokens={value!r} must be an "
                                                  "integer >= 0")):
    train_config.validate(c)


def test_train_step_passes_the_step_to_scheduled_routers():
  """train_step hands the applied steps (as the learning-rate schedule counts them) to the routers:
  StableMoE distils (a positive balance + distillation loss) before its stage-2 step and is frozen
  (no loss) from it; SMoE-Dropout's active experts grow with the step."""
  c = tiny().model
  c.update(dict(n_layers=1, d_model=16, compute_dtype="float32"))
  c.attention.update(dict(kind="mha", n_heads=2, head_dim=8, v_head_dim=8))
  c.ffn.update(dict(kind="moe", top_k=3))
  c.moe.update(dict(n_experts=4, d_expert=8, share_pool=False))
  tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, c.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  compiled = {}   # one program per router config: the step is an input, not a constant

  def stats_at(router, step):
    key = tuple(sorted(router.items()))
    if key not in compiled:
      c.router.update(router)
      cfg = model_config(c)
      parts = state_lib.model_parts(cfg)
      params = nnx.to_pure_dict(nnx.state(random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 0),
                                          nnx.Param))
      tx = optax.sgd(1e-3)
      fn = jax.jit(lambda st, b: step_lib.train_step(st, b, graphdef=parts.graphdef, tx=tx,
                                                     schedule=optax.constant_schedule(1e-3)))
      compiled[key] = (fn, state_lib.state_with_params(params, tx, 0))
    fn, state = compiled[key]
    # 2 of the steps were skipped (non-finite): the routers see the applied steps, like the schedule
    state = state.replace(step=jnp.asarray(step + 2, jnp.int32), skipped=jnp.asarray(2, jnp.int32))
    metrics = fn(state, batch)[1]
    return {"balance_loss": metrics["balance_loss"], "nll_sum": metrics["lm_loss"]}

  stable = dict(kind="stablemoe", stablemoe_stage2_step=5, balance_coef=0.01)
  assert float(stats_at(stable, 0)["balance_loss"]) > 0
  assert float(stats_at(stable, 4)["balance_loss"]) > 0   # state.step is 6 here
  assert float(stats_at(stable, 5)["balance_loss"]) == 0
  dropout = dict(kind="smoe_dropout", smoe_dropout_k_start=1, smoe_dropout_steps=10)
  # k(0) = 1 of 3 slots carries a gate, k(10) = 3: the same weights give another loss (the logged
  # expert counts include inactive slots, so they cannot tell).
  nll = lambda s: float(stats_at(dropout, s)["nll_sum"])
  assert nll(0) != nll(10) and nll(10) == nll(20)


def _trainer_steps(accum_steps, batches, **train):
  """Runs the trainer's compiled step (loop.config_programs) from micro_umoe's parameters over
  `batches` with train.grad_accum_steps=accum_steps, the optimizer of `train` (AdamW, warmup then
  cosine) and on_nonfinite="skip": (the schedule, [(params, metrics)] on the host after each step)."""
  from umoe_jax.parallel import mesh as mesh_lib, sharding
  model_cfg, _, params = micro_umoe()
  c = tiny()
  c.train.update(dict(global_batch_size=4, seq_len=8, grad_accum_steps=accum_steps,
                      on_nonfinite="skip", **train))
  mesh = mesh_lib.make_mesh(c.get("mesh"), devices=jax.devices()[:1])
  progs = loop.config_programs(c, model_cfg, mesh, sharding.normalize_rules(c.get("sharding_rules")))
  state = progs.from_params_fn(params, 0)
  out = []
  for batch in batches:
    state, metrics = progs.train_fn(state, batch)
    out.append(jax.device_get((state.params, metrics)))
  return opt_lib.learning_rate_schedule(c.train), out


def _token_batches(seed, n, vocab):
  batches = []
  for i in range(n):
    tokens = jax.random.randint(jax.random.key(seed + i), (4, 9), 0, vocab)
    batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  return batches


def test_grad_accumulation_keeps_the_schedule_and_the_update():
  """train.grad_accum_steps=2 takes the step of grad_accum_steps=1 on the same tokens: each step
  logs the learning rate of the schedule at the updates applied so far (one per step, however many
  micro-batches), and the parameters move alike (float32) through the warmup and into the cosine."""
  vocab = micro_umoe()[0].vocab_size
  batches = _token_batches(20, 5, vocab)
  train = dict(num_steps=8, warmup_steps=3, learning_rate=1e-2, min_lr_ratio=0.1)
  schedule, one = _trainer_steps(1, batches, **train)
  _, two = _trainer_steps(2, batches, **train)
  want = [float(schedule(t)) for t in range(len(batches))]
  assert want[1] < want[2] < want[3] and want[4] < want[3]   # warmup, peak, cosine
  np.testing.assert_allclose([float(m["learning_rate"]) for _, m in one], want, rtol=1e-6)
  np.testing.assert_allclose([float(m["learning_rate"]) for _, m in two], want, rtol=1e-6)
  params = micro_umoe()[2]
  moved = lambda new: jax.tree.map(lambda a, b: np.float64(a) - np.float64(b), new, params)
  for t, ((p1, m1), (p2, m2)) in enumerate(zip(one, two)):
    assert int(m1["applied"]) == int(m2["applied"]) == 1
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    d1, d2 = jax.tree.leaves(moved(p1)), jax.tree.leaves(moved(p2))
    total = np.sqrt(sum(np.sum(x ** 2) for x in d1))
    assert t == 0 or total > 1e-3                     # (the first step's learning rate is 0)
    err = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(d1, d2)))
    assert err <= 1e-5 * total, (t, err, total)


def test_logged_learning_rate_counts_applied_updates():
  """Steps dropped for a non-finite loss (on_nonfinite="skip"; out-of-vocabulary inputs make it
  NaN) do not advance the schedule: every step logs the schedule at the updates applied before it,
  not at the step number, and a dropped step leaves the parameters as they were."""
  vocab = micro_umoe()[0].vocab_size
  batches = _token_batches(40, 7, vocab)
  poisoned = {1, 2, 5}
  for i in poisoned:
    batches[i] = dict(batches[i], inputs=jnp.full_like(batches[i]["inputs"], 10 * vocab))
  schedule, out = _trainer_steps(2, batches, num_steps=8, warmup_steps=4, learning_rate=1e-2,
                                 min_lr_ratio=0.1)
  applied = 0
  previous = micro_umoe()[2]
  logged = [float(m["learning_rate"]) for _, m in out]
  # past the first dropped step the schedule at the step number is another learning rate
  assert logged != pytest.approx([float(schedule(i)) for i in range(len(batches))], rel=1e-3)
  for i, (params, metrics) in enumerate(out):
    assert int(metrics["nonfinite"]) == int(i in poisoned) == 1 - int(metrics["applied"])
    assert logged[i] == pytest.approx(float(schedule(applied)), rel=1e-6)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                    jax.tree.leaves(previous)))
    assert same == (i in poisoned or applied == 0)   # (the first update's learning rate is 0)
    applied += int(i not in poisoned)
    previous = params


# ----------------------------------------------------------------------------------------------
# Resume order and checkpoints.


def _tree(v):
  return {"w": jnp.full((8, 4), float(v)), "step": jnp.asarray(v, jnp.int32)}


def _target():
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, _tree(0))


def test_resume_source_precedence(tmp_path):
  ckpt_dir, init = str(tmp_path / "w" / "checkpoints"), tmp_path / "converted"
  init.mkdir()
  with pytest.raises(ConfigError, match="holds neither params/"):  # checked before anything runs
    ckpt_lib.resume_source(ckpt_dir, str(init))
  (init / "params").mkdir()  # the layout of a converted checkpoint
  assert ckpt_lib.resume_source(ckpt_dir, "") == ckpt_lib.ResumeSource("scratch")
  assert ckpt_lib.resume_source(ckpt_dir, str(init)) == ckpt_lib.ResumeSource("init_from", str(init))
  # An unfinished save (tmp directory only) is not a checkpoint.
  os.makedirs(os.path.join(ckpt_dir, "3.orbax-checkpoint-tmp-123"))
  assert ckpt_lib.resume_source(ckpt_dir, str(init)).kind == "init_from"
  ck = ckpt_lib.Checkpointer(ckpt_dir, keep=2, async_save=False)
  ck.save(2, _tree(2))
  ck.close()
  assert ckpt_lib.resume_source(ckpt_dir, str(init)) == ckpt_lib.ResumeSource("workdir", ckpt_dir)
  assert ckpt_lib.resume_source(ckpt_dir, "").kind == "workdir"
  with pytest.raises(ConfigError, match="no such directory"):
    ckpt_lib.resume_source(str(tmp_path / "empty"), str(tmp_path / "missing"))
  # A fine-tuning workdir (classifier.json beside checkpoints/ and best/) holds a classifier, whose
  # parameters a language model cannot start from: named as such, not as missing parameters.
  finetuned = tmp_path / "sst2"
  (finetuned / "best").mkdir(parents=True)
  (finetuned / "classifier.json").write_text("{}")
  (finetuned / "config.json").write_text('{"init_from": "runs/umoe_base"}')
  for arg in (finetuned, finetuned / "best"):
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint.init_from='{arg}' is ") + ".*"
                       + re.escape("(classifier.json): a text classifier, not a language model; ")
                       + ".*" + re.escape("or use its backbone, runs/umoe_base")):
      ckpt_lib.resume_source(str(tmp_path / "empty"), str(arg))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete", "remove_item", "no_metadata"])
def test_damaged_checkpoint_fallback(tmp_path, damage, caplog):
  d = str(tmp_path / "checkpoints")
  ck = ckpt_lib.Checkpointer(d, keep=5, async_save=False)
  for s in (1, 2, 3):
    ck.save(s, _tree(s))
  ck.close()
  if damage == "remove_item":
    import shutil
    shutil.rmtree(os.path.join(d, "3", "state"))
  elif damage == "no_metadata":  # Orbax's restore: a bare "pytree structure error" of the TrainState
    os.remove(os.path.join(d, "3", "state", "_METADATA"))
  else:
    for f in glob.glob(os.path.join(d, "3", "state", "**", "d", "*"), recursive=True):
      if damage == "truncate":
        with open(f, "r+b") as fh:
          fh.truncate(os.path.getsize(f) // 2)
      else:
        os.remove(f)
  ck = ckpt_lib.Checkpointer(d, keep=5, async_save=False)
  with caplog.at_level("WARNING"):
    state, step = ck.restore_latest(_target())
  assert step == 2 and int(state["step"]) == 2 and float(state["w"][0, 0]) == 2.0
  assert any("step 3" in r.getMessage() and "cannot be restored" in r.getMessage()
             for r in caplog.records)
  if damage == "remove_item":
    assert any(f"{d}/3 has no state/ (the parameters): the step is incomplete" in r.getMessage()
               for r in caplog.records)
  if damage == "no_metadata":
    assert any(f"{d}/3/state: no readable _METADATA" in r.getMessage() for r in caplog.records)
  assert ck.steps() == [1, 2] and len(glob.glob(str(tmp_path / "checkpoints_damaged" / "3-*"))) == 1
  ck.save(3, _tree(30))  # the step can be written again
  ck.close()
  assert ckpt_lib.complete_steps(d) == [1, 2, 3]


def test_checkpoint_of_another_shape_is_an_error(tmp_path):
  d = str(tmp_path / "checkpoints")
  ck = ckpt_lib.Checkpointer(d, keep=5, async_save=False)
  ck.save(1, _tree(1))
  ck.close()
  wrong = {"w": jax.ShapeDtypeStruct((3, 3), jnp.float32),
           "step": jax.ShapeDtypeStruct((), jnp.int32)}
  # Found from the metadata, before any read: a config change, not damage.
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"checkpoint step 1 in .* does not fit this config: w is \(8, 4\) on disk, "
                           r"\(3, 3\) here\. A run resumes with the model and optimizer config"):
    ckpt_lib.Checkpointer(d, keep=5).restore_latest(wrong)
  assert ckpt_lib.complete_steps(d) == [1]  # nothing moved aside


def test_data_position_of_another_data_config_is_an_error(tmp_path):
  """A data iterator position saved by another data pipeline (data.worker_count, data.source, ...
  changed) is a config change named by its keys, not damage: it was grain's bare KeyError, with
  every step "damaged" and the advice to restore the model or optimizer config."""
  from umoe_jax import data as data_lib
  d = str(tmp_path / "checkpoints")
  cfg = data_lib.default_data_config()
  make = lambda c: data_lib.make_train_iterator(c, seq_len=16, global_batch_size=2, seed=0)
  it = make(cfg)
  next(it)
  with ckpt_lib.Checkpointer(d, keep=5, async_save=False) as ck:
    for s in (1, 2):
      ck.save(s, _tree(s), it)
  it.close()
  (tmp_path / "config.json").write_text(json.dumps({"data": cfg.to_dict()}))
  other = data_lib.default_data_config()
  other.worker_count = 1
  it = make(other)
  with ckpt_lib.Checkpointer(d, keep=5, data_config=other) as ck:
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match=re.escape(
        f"checkpoint step 2 in {d} holds the position of another data pipeline (KeyError: ") +
        r".*\): data\.worker_count=0 when saved, 1 now\. A run resumes with the data config it was "
        + re.escape(f"started with ({tmp_path}/config.json)")):
      ck.restore_latest(_target(), it)
  it.close()
  assert ckpt_lib.complete_steps(d) == [1, 2]  # nothing moved aside
  # The same data config restores (the position and the state).
  it = make(cfg)
  with ckpt_lib.Checkpointer(d, keep=5, data_config=cfg) as ck:
    state, step = ck.restore_latest(_target(), it)
  assert step == 2 and float(state["w"][0, 0]) == 2.0
  fresh = make(cfg)
  next(fresh)
  np.testing.assert_array_equal(next(it)["inputs"], next(fresh)["inputs"])
  it.close()
  fresh.close()


_CRASH_MID_SAVE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    import jax, jax.numpy as jnp
    from umoe_jax.train import checkpoint as c
    ck = c.Checkpointer(sys.argv[1], keep=1, async_save=True)
    ck.save(1, {{"w": jnp.full((8, 4), 1.0), "step": jnp.asarray(1, jnp.int32)}})
    ck.wait()
    big = jax.random.normal(jax.random.key(0), (4096, 4096))   # 64 MiB, incompressible
    ck.save(2, {{"w": jnp.full((8, 4), 2.0), "step": jnp.asarray(2, jnp.int32), "big": big}})
    os._exit(3)   # killed while the background thread writes step 2
""")


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
  d = str(tmp_path / "checkpoints")
  proc = subprocess.run([sys.executable, "-c", _CRASH_MID_SAVE.format(root=ROOT), d],
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 3, proc.stderr[-2000:]
  assert glob.glob(os.path.join(d, "2.orbax-checkpoint-tmp*")), os.listdir(d)  # crashed mid-save
  assert ckpt_lib.complete_steps(d) == [1]  # keep=1, yet step 1 survived
  ck = ckpt_lib.Checkpointer(d, keep=1, async_save=False)
  state, step = ck.restore_latest(_target())
  assert step == 1 and float(state["w"][0, 0]) == 1.0
  ck.save(2, _tree(2))
  ck.close()
  assert ckpt_lib.complete_steps(d) == [2]


def test_init_from_converted_and_from_run(tmp_path):
  c = tiny().model
  c.update(dict(n_layers=1, d_model=16))
  c.moe.update(dict(n_experts=4, d_expert=8))
  c.ffn.top_k, c.attention.top_k, c.attention.head_dim, c.attention.q_lora_rank = 2, 1, 8, 4
  cfg = model_config(c)
  parts = state_lib.model_parts(cfg)
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 3)
  want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: replicated, want)

  converted = tmp_path / "converted"  # the layout of umoe_jax.interop.official.save_converted
  writer = ocp.StandardCheckpointer()
  writer.save(str(converted / "params"), nnx.state(model, nnx.Param))
  writer.wait_until_finished()
  got = ckpt_lib.load_init_params(str(converted), parts.abstract_params, shardings)
  jax.tree.map(np.testing.assert_array_equal, got, want)

  run = tmp_path / "run"  # another training run: its latest state's params
  ck = ckpt_lib.Checkpointer(str(run / "checkpoints"), keep=2, async_save=False)
  older = jax.tree.map(lambda x: x + 1, want)
  ck.save(4, {"params": older, "opt_state": {"mu": older}, "step": jnp.asarray(4)})
  ck.save(5, {"params": want, "opt_state": {"mu": want}, "step": jnp.asarray(5)})
  ck.close()
  got = ckpt_lib.load_init_params(str(run), parts.abstract_params, shardings)
  jax.tree.map(np.testing.assert_array_equal, got, want)

  # Parameters of another shape: named from the metadata, before a read (Orbax's own error names
  # no parameter and came as a traceback).
  c.d_model = 24
  other = state_lib.model_parts(model_config(c))
  for path in (converted, run):
    with pytest.raises(ckpt_lib.CheckpointMismatchError,
                       match=re.escape(f"checkpoint.init_from='{path}' does not fit this model: "
                                       "parameter embed is (512, 16) on disk, (512, 24) here; ")):
      ckpt_lib.load_init_params(str(path), other.abstract_params, shardings)
  # A damaged latest step (truncated files): the previous one, as a resume does; none readable is a
  # CheckpointError naming the directory (both were TensorStore tracebacks), as is a damaged
  # converted checkpoint.
  def truncate(directory):
    for f in glob.glob(os.path.join(directory, "**", "d", "*"), recursive=True):
      with open(f, "r+b") as fh:
        fh.truncate(1)
  truncate(run / "checkpoints" / "5")
  got = ckpt_lib.load_init_params(str(run), parts.abstract_params, shardings)
  jax.tree.map(np.testing.assert_array_equal, got, older)
  assert ckpt_lib.complete_steps(str(run / "checkpoints")) == [4, 5]  # left as it was
  truncate(run / "checkpoints" / "4")
  with pytest.raises(ckpt_lib.CheckpointError, match=re.escape(
      f"checkpoint.init_from='{run}': no checkpoint in {run}/checkpoints can be restored (step 5: ")
                     + ".*; step 4: "):
    ckpt_lib.load_init_params(str(run), parts.abstract_params, shardings)
  truncate(converted / "params")
  with pytest.raises(ckpt_lib.CheckpointError, match=re.escape(
      f"checkpoint.init_from='{converted}': {converted}/params cannot be restored (")):
    ckpt_lib.load_init_params(str(converted), parts.abstract_params, shardings)


# ----------------------------------------------------------------------------------------------
# Metrics.


def _host_metrics(loss, *, nonfinite=0, applied=None, counts=(3.0, 1.0)):
  applied = 1 - nonfinite if applied is None else applied
  return {"loss": loss, "lm_loss": loss - 0.5, "balance_loss": 0.5, "grad_norm": 2 * loss,
          "learning_rate": 1e-3, "tokens": 8.0, "nonfinite": nonfinite, "applied": applied,
          "routers": {"layer_0/ffn": {"balance_loss": loss / 10,
                                      "expert_counts": np.asarray(counts)}}}


def test_interval_means_skip_nonfinite_steps(tmp_path):
  from umoe_jax.train import metrics as metrics_lib
  nan = float("nan")
  steps = [_host_metrics(2.0), _host_metrics(nan, nonfinite=1, counts=(0.0, 0.0)),
           _host_metrics(4.0)]
  scalars, counts = metrics_lib.summarize(steps)
  assert scalars["train/loss"] == 3.0 and scalars["train/lm_loss"] == 2.5
  assert scalars["train/grad_norm"] == 6.0 and np.isclose(scalars["train/perplexity"], np.exp(2.5))
  assert np.isclose(scalars["moe/layer_0/ffn/balance_loss"], 0.3)
  assert scalars["moe/layer_0/ffn/load_max_mean"] == 1.5  # the NaN step's load is left out too
  assert scalars["train/interval_skipped_steps"] == 1.0
  np.testing.assert_array_equal(counts["layer_0/ffn"], [6.0, 2.0])
  # A finite update dropped anyway (a halted state) is counted, though its loss is averaged.
  scalars, _ = metrics_lib.summarize([_host_metrics(2.0, applied=0), _host_metrics(4.0)])
  assert scalars["train/interval_skipped_steps"] == 1.0 and scalars["train/loss"] == 3.0
  # Only non-finite steps: NaN, which the writers record as null (and TensorBoard leaves out).
  scalars, _ = metrics_lib.summarize([_host_metrics(nan, nonfinite=1)])
  assert np.isnan(scalars["train/loss"]) and scalars["train/interval_skipped_steps"] == 1.0
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
  writer.scalars(5, scalars)
  writer.close()
  record = json.loads(open(tmp_path / "metrics.jsonl").read())
  assert record["train/loss"] is None and record["train/interval_skipped_steps"] == 1.0


def test_session_start_drops_the_abandoned_branch(tmp_path):
  """Two runs writing into one workdir, the second resumed from step 4 of the first's 8 and logging
  every other step: TensorBoard (EventAccumulator, purging orphaned data by default) and
  `plot.read_metrics` both show steps 1-4 of the first run and 6, 8 of the second, once."""
  from tensorboard.backend.event_processing import event_accumulator
  from umoe_jax import plot
  from umoe_jax.train import metrics as metrics_lib
  with metrics_lib.MetricWriter(str(tmp_path)) as first:
    first.start_session(0)
    first.scalars(0, {"eval/loss": 9.0})
    for step in range(1, 9):
      first.scalars(step, {"train/loss": 10.0 - step, "train/grad_norm": 1.0})
    first.scalars(8, {"eval/loss": 2.5})
  with metrics_lib.MetricWriter(str(tmp_path)) as second:
    second.start_session(5)
    second.scalars(6, {"train/loss": 5.5, "train/grad_norm": float("nan")})  # null: no point
    second.scalars(8, {"train/loss": 3.5, "train/grad_norm": 2.0})
  acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"),
                                           size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  want = {"train/loss": ([1, 2, 3, 4, 6, 8], [9.0, 8.0, 7.0, 6.0, 5.5, 3.5]),
          "train/grad_norm": ([1, 2, 3, 4, 8], [1.0, 1.0, 1.0, 1.0, 2.0]),
          "eval/loss": ([0], [9.0])}
  assert {k: ([e.step for e in acc.Scalars(k)], [e.value for e in acc.Scalars(k)])
          for k in acc.Tags()["scalars"]} == want
  assert plot.read_metrics(str(tmp_path)) == want
  # The first record of each run marks its start.
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r for r in records if "session_start" in r] == [{"step": 0, "session_start": True},
                                                          {"step": 5, "session_start": True}]


def test_full_disk_in_the_workdir_names_the_file(tmp_path):
  """A write of the logs or config.json that fails (a full disk) is a WorkdirError naming the file,
  not a bare OSError; closing after it logs instead of raising again."""
  from umoe_jax.train import metrics as metrics_lib
  os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # every write: ENOSPC
  message = rf"writing {tmp_path}/metrics.jsonl failed \(No space left on device\)"
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
  with pytest.raises(ckpt_lib.WorkdirError, match=message):
    writer.scalars(1, {"train/loss": 1.0})
  writer.close(quiet=True)  # (the error above is being reported)
  with pytest.raises(ckpt_lib.WorkdirError, match=message):  # buffered, fails at close
    with metrics_lib.MetricWriter(str(tmp_path), tensorboard=False) as writer:
      writer._jsonl.write("{}\n")  # pylint: disable=protected-access
  # config.json (a temporary file renamed over it) and the event files: a full file system.
  disk = tmp_path / "disk"
  disk.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs",
                                          str(disk)], capture_output=True).returncode:
    return
  try:
    with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
      while True:
        f.write(b"x" * 1024)
    with pytest.raises(ckpt_lib.WorkdirError,
                       match=rf"writing {disk}/run/config.json failed \(No space left on device\)"):
      ckpt_lib.write_config(str(disk / "run"), configs.common.experiment("dense", "tiny"))
    with pytest.raises(ckpt_lib.WorkdirError, match=rf"writing {disk}/run/tensorboard/events.out"
                                                    r"\.tfevents\.\S+ failed \(No space left"):
      metrics_lib.MetricWriter(str(disk / "run"), jsonl=False)
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)


_CACHE_SCRIPT = """
import sys, jax, jax.numpy as jnp
from jax import monitoring
from umoe_jax.config import ConfigError
from umoe_jax.train import loop
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
loop.use_compilation_cache(sys.argv[1])
x = jnp.arange(12.0).reshape(3, 4) / 7
y = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0))(x)
try:
  loop.use_compilation_cache(sys.argv[1] + "_other")
except ConfigError as e:
  print("refused:", e)
print("hits", sum("cache_hits" in name for name in events), "out", [float(v) for v in y])
"""


def test_compilation_cache_dir_serves_a_second_process(tmp_path):
  """train.compilation_cache_dir: the first process writes its compiled program there and a
  second one compiling the same program loads it (JAX's cache-hit event; the same values); a
  second, different directory in one process and a path that cannot be a directory are refused,
  naming the key."""
  cache = tmp_path / "xla_cache"
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  outs = []
  for _ in range(2):
    r = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(cache)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    outs.append(r.stdout.strip().splitlines())
  assert any(cache.iterdir())
  (first_hits, first_out), (second_hits, second_out) = (o[-1].split(" out ") for o in outs)
  assert first_hits == "hits 0" and second_hits != "hits 0", (outs, first_hits, second_hits)
  assert first_out == second_out
  assert outs[0][0].startswith(f"refused: train.compilation_cache_dir='{cache}_other': this "
                               f"process already caches compilations in '{cache}'"), outs[0]
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(ConfigError, match=r"train\.compilation_cache_dir='.*a_file/cache': cannot create"):
    loop.use_compilation_cache(str(blocker / "cache"))


def test_setup_turns_the_compilation_cache_on(tmp_path, monkeypatch):
  """setup.setup takes train.compilation_cache_dir to `use_compilation_cache` before it builds the
  programs (and leaves JAX's cache alone when the key is empty, the default). The patches go where
  `setup` looks the names up: its own module and programs.py."""
  calls = []

  class Built(Exception):  # stops setup where the programs would be built
    pass

  def config_programs(*args, **kwargs):
    calls.append("programs")
    raise Built

  monkeypatch.setattr(setup_lib, "use_compilation_cache", calls.append)
  monkeypatch.setattr(programs_lib, "config_programs", config_programs)
  c = tiny()
  for value, want in (("", ["programs"]), (str(tmp_path / "cache"), [str(tmp_path / "cache"), "programs"])):
    c.train.compilation_cache_dir = value
    calls.clear()
    with pytest.raises(Built):
      setup_lib.setup(c, str(tmp_path / "wd"))
    assert calls == want
