"""Rematerialisation policies (`train.remat`, umoe_jax/model/remat.py): every policy gives the
gradients and loss of no remat (a tiny UMoE, float32, all policies in one compilation), each keeps
fewer residuals for the backward pass than the one before it (counted with
`jax.ad_checkpoint.print_saved_residuals`), and a bad policy is refused naming key and value."""
from __future__ import annotations

import jax
from jax.ad_checkpoint import print_saved_residuals
import numpy as np
import pytest

import configs.common
from conftest import micro_umoe
from umoe_jax.config import ConfigError
from umoe_jax.model.remat import POLICIES, policy_name
from umoe_jax.train import config as train_config
from umoe_jax.train import step as step_lib

ORDER = ("none", "dots", "dots_no_batch", "block")  # most kept first


def _tiny():
  cfg, parts, params = micro_umoe()
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
  return parts, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_every_policy_gives_the_same_loss_and_gradients():
  assert set(ORDER) == set(POLICIES)
  parts, params, batch = _tiny()

  def all_policies(p, b):
    return {name: step_lib.grads_and_stats(p, b, graphdef=parts.graphdef, accum_steps=1, remat=name)
            for name in ORDER}

  out = jax.jit(all_policies)(params, batch)
  grads0, stats0 = out["none"]
  for name in ORDER[1:]:
    grads, stats = out[name]
    np.testing.assert_allclose(stats["nll_sum"], stats0["nll_sum"], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(stats["balance_loss"], stats0["balance_loss"], rtol=1e-6, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads0), jax.tree.leaves(grads)):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=f"{name} {path}")
  assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads0))


def test_policies_keep_fewer_residuals_in_order(capsys):
  parts, params, batch = _tiny()
  counts = {}
  for name in ORDER:
    loss = lambda p: step_lib._forward(p, batch, graphdef=parts.graphdef, remat=name,
                                       total_tokens=16.0, accum_steps=1, step=None)[0]
    print_saved_residuals(loss, params)
    counts[name] = len([l for l in capsys.readouterr().out.splitlines() if l.strip()])
  assert counts["none"] > counts["dots"] > counts["dots_no_batch"] > counts["block"] > 0, counts


def test_remat_config_values():
  assert policy_name(True) == "block" and policy_name(False) == "none"  # configs of before
  assert configs.common.experiment("umoe", "base").train.remat == "block"
  config = configs.common.experiment("umoe", "tiny")
  for name in POLICIES:
    config.train.remat = name
    train_config.validate(config)
  config.train.remat = "dot"
  with pytest.raises(ConfigError, match=r"train\.remat='dot'.*dots_no_batch"):
    train_config.validate(config)
  with pytest.raises(ValueError, match="'dot'"):
    policy_name("dot")
  config.train.remat = 1
  with pytest.raises(ConfigError, match=r"train\.remat=1"):
    train_config.validate(config)


def test_remat_keeps_the_bool_form_of_older_configs(tmp_path):
  """A config file written before the policies (`c.train.remat = True`) and the flag
  --config.train.remat=True|False still load and validate, as block / none."""
  from absl import flags
  from ml_collections import config_flags
  config = configs.common.experiment("umoe", "tiny")
  for old, name in ((True, "block"), (False, "none")):
    config.train.remat = old
    train_config.validate(config)
    assert policy_name(config.train.remat) == name
  path = tmp_path / "old_config.py"
  path.write_text("import configs.common\n\ndef get_config():\n"
                  "  c = configs.common.experiment('umoe', 'tiny')\n  c.train.remat = True\n  return c\n")
  for flag, want in (([], True), (["--config.train.remat=False"], False),
                     (["--config.train.remat=dots"], "dots")):
    argv = ["train.py", f"--config={path}", *flag]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    assert fv.config.train.remat == want and type(fv.config.train.remat) is type(want), flag
    train_config.validate(fv.config)
