"""Removed config keys and values (umoe_jax/config/removed.py): an older run's config.json that
names one still loads, with one warning naming it; a command line that sets one is one error line
saying what runs now."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import ml_collections
import pytest

from conftest import ROOT
from umoe_jax import load
from umoe_jax.config import ConfigError, files as config_file, model_config
from umoe_jax.config import removed


def _saved_workdir(tmp_path) -> str:
  """A workdir whose config.json was written before `router.one_pass` and the "stored" backward
  were removed: the keys as that version wrote them (sub-layer overrides None = inherit)."""
  config = config_file.load("configs/umoe_tiny.py")
  saved = json.loads(json.dumps(config.to_dict(), default=str))
  saved["model"]["router"]["one_pass"] = True
  saved["model"]["attention"]["router"]["one_pass"] = None
  saved["model"]["ffn"]["router"]["one_pass"] = False
  saved["model"]["attention"]["core_backward"] = "stored"
  (tmp_path / "config.json").write_text(json.dumps(saved))
  return str(tmp_path)


def test_a_saved_config_with_removed_keys_loads_with_one_warning(tmp_path, caplog, monkeypatch):
  monkeypatch.setattr(removed, "_warned", set())
  saved = load.read_checkpoint_config(_saved_workdir(tmp_path))
  with caplog.at_level(logging.WARNING, logger=removed.__name__):
    cfg = model_config(ml_collections.ConfigDict(saved["model"]))
    model_config(saved["model"])  # built again (another command in the same process): no repeat
  warnings = [r.getMessage() for r in caplog.records if r.name == removed.__name__]
  assert len(warnings) == 1, warnings
  assert "model.router.one_pass=True" in warnings[0]
  assert "model.ffn.router.one_pass=False" in warnings[0]
  assert "model.attention.router.one_pass" not in warnings[0]  # None: nothing was asked of it
  assert "model.attention.core_backward='stored'" in warnings[0]
  assert cfg.attention.core_backward == "stored_pairs"  # the form that stores the same scores
  # The architecture builds from it as `load_model` builds a checkpoint's (random parameters here).
  model, section, ref = load.load_model(config=ml_collections.ConfigDict(saved))
  assert ref is None and model.cfg.attention.core_backward == "stored_pairs"


def test_a_removed_key_on_the_command_line_is_one_error():
  argv = ["prog", "--config=configs/umoe_tiny.py", "--config.model.router.one_pass=true"]
  with pytest.raises(ConfigError, match="^" + re.escape(
      "--config.model.router.one_pass was removed: the routers compute softmax, top-k and balance "
      "statistics as separate ops, as one_pass=false did; drop the flag") + "$"):
    config_file.check_argv(argv)
  proc = subprocess.run([sys.executable, "train.py", "--config=configs/umoe_tiny.py",
                         "--workdir=/nonexistent/never-made",
                         "--config.model.ffn.router.one_pass=true"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.splitlines()[0].startswith(
      "config error: --config.model.ffn.router.one_pass was removed: the routers"), proc.stderr
