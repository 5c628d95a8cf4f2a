"""`python -m umoe_jax.eval speed` (umoe_jax/eval/speed.py) on CPU: the decoding loop it times
emits the tokens greedy `generate()` emits; the KV-cache bytes it measures on the cache arrays equal
a count by hand from the attention kind's layout and `umoe_jax.stats`' prediction; its rates are the
arithmetic of its medians; the command prints a table and --json for batch 1 and 32 ("n/a" peak
memory on CPU); bad flags are one error line."""
from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, random_module, tiny_config
from umoe_jax.eval import cli, speed
from umoe_jax.model import CausalLM
from umoe_jax.model.decode import generate

TINY_CONFIG = f"{ROOT}/configs/umoe_tiny.py"


def _model(family, seed=0, **over):
  cfg = tiny_config(family, n_layers=2, **over)
  return cfg, random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), seed)


def test_decode_loop_tokens_equal_greedy_generate():
  cfg, model = _model("umoe", seed=3)
  row = speed.measure(model, 3, prompt_len=5, new_tokens=7, warmup=0, repeats=1, seed=4)
  prompts = speed.random_prompts(cfg.vocab_size, 3, 5, seed=4)
  assert prompts.min() >= 1 and prompts.max() < cfg.vocab_size
  want = generate(model, prompts.tolist(), max_new_tokens=7).tokens
  assert row["tokens"].shape == (3, 7)
  np.testing.assert_array_equal(row["tokens"], want)
  assert len({tuple(r) for r in want.tolist()}) > 1          # rows differ: not a constant output


@pytest.mark.parametrize("family, over, per_token_layer", [
    # MHA: a key [H, d_k] and a value [H, d_v] per token and layer
    ("dense", {}, lambda c: c.attention.n_heads * (c.attention.head_dim + c.attention.v_head_dim)),
    # pre-mixing: one key head [d_k] and the hidden state [d]
    ("umoe", {}, lambda c: c.attention.head_dim + c.d_model),
    # MoA: one shared key [d_k] and value [d_v]
    ("moa", {"attention.n_experts": 5}, lambda c: c.attention.head_dim + c.attention.v_head_dim),
])
@pytest.mark.parametrize("cache_dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_measured_kv_bytes_equal_the_hand_count_and_stats(family, over, per_token_layer,
                                                          cache_dtype, itemsize):
  cfg, model = _model(family, **over)
  batch, prompt_len, new = 2, 4, 3
  row = speed.measure(model, batch, prompt_len=prompt_len, new_tokens=new, warmup=0, repeats=1,
                      cache_dtype=cache_dtype)
  per_token = per_token_layer(cfg) * cfg.n_layers * itemsize
  assert row["cache_dtype"] == cache_dtype
  assert row["kv_cache_bytes"] == per_token * batch * (prompt_len + new)
  assert row["kv_bytes_per_token_measured"] == row["kv_bytes_per_token_stats"] == per_token
  assert row["kv_match"] is True


def test_params_cast_to_bfloat16_decode_as_generate_does(tmp_path, capsys, monkeypatch):
  cfg, model = _model("umoe", seed=5)
  cast = speed.cast_params(model, "bfloat16")
  assert speed.param_dtypes(model) == "float32" and speed.param_dtypes(cast) == "bfloat16"
  assert speed.param_bytes(cast) * 2 == speed.param_bytes(model)
  row = speed.measure(cast, 2, prompt_len=4, new_tokens=5, warmup=0, repeats=1)
  want = generate(cast, speed.random_prompts(cfg.vocab_size, 2, 4).tolist(), max_new_tokens=5)
  np.testing.assert_array_equal(row["tokens"], want.tokens)
  saved = {}
  for dtype in ("", "bfloat16"):
    code, _, err = run_cli(capsys, monkeypatch, "speed", f"--config={TINY_CONFIG}",
                           "--config.model.n_layers=1", "--batches=1", "--prompt_len=4",
                           "--new_tokens=2", "--warmup=0", "--repeats=1", f"--param_dtype={dtype}",
                           f"--json={tmp_path}/{dtype}.json")
    assert code == 0, err
    saved[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())["settings"]
  assert (saved[""]["param_dtype"], saved["bfloat16"]["param_dtype"]) == ("float32", "bfloat16")
  assert saved[""]["param_bytes"] == 2 * saved["bfloat16"]["param_bytes"]


def test_rates_are_the_arithmetic_of_the_medians():
  cfg, model = _model("dense")
  b, p, n = 4, 6, 5
  row = speed.measure(model, b, prompt_len=p, new_tokens=n, warmup=1, repeats=3)
  assert len(row["prefill_times_ms"]) == len(row["decode_times_ms"]) == 3
  assert row["prefill_ms"] == statistics.median(row["prefill_times_ms"]) > 0
  assert row["decode_total_ms"] == statistics.median(row["decode_times_ms"]) > 0
  assert row["prefill_tokens_per_s"] == pytest.approx(b * p / (row["prefill_ms"] / 1e3))
  assert row["decode_ms_per_step"] == pytest.approx(row["decode_total_ms"] / (n - 1))
  assert row["decode_tokens_per_s"] == pytest.approx(b / (row["decode_ms_per_step"] / 1e3))
  assert row["peak_bytes"] is None                 # CPU keeps no device memory statistics
  table = speed.format_table([row])
  assert "| 4 " in table and "n/a" in table and "MISMATCH" not in table
  with pytest.raises(ValueError, match="exceeds model.max_seq_len=16"):
    speed.measure(model, 1, prompt_len=12, new_tokens=5)


def run_cli(capsys, monkeypatch, *argv):
  """(exit status, stdout, stderr) of the command in-process; sys.argv as a real run has it
  (config_flags registers --config.<key> overrides from sys.argv)."""
  argv = [str(a) for a in argv]
  monkeypatch.setattr(sys, "argv", ["python -m umoe_jax.eval", *argv])
  code = cli.main(argv)
  out = capsys.readouterr()
  return code, out.out, out.err


def test_speed_command_batch_1_and_32_on_cpu(tmp_path, capsys, monkeypatch):
  out_json = tmp_path / "speed.json"
  code, table, err = run_cli(capsys, monkeypatch, "speed", f"--config={TINY_CONFIG}",
                             "--config.model.n_layers=1", "--prompt_len=8", "--new_tokens=3",
                             "--warmup=0", "--repeats=1", f"--json={out_json}")
  assert code == 0, err
  rows = [line for line in table.splitlines() if line.startswith(("| 1 ", "| 32 "))]
  assert len(rows) == 2 and all(line.rstrip().endswith("n/a      |") for line in rows), table
  assert "prompt 8 tokens, 3 new tokens" in table and "KV cache bfloat16" in table
  saved = json.loads(out_json.read_text())
  assert saved["command"] == "speed" and [r["batch"] for r in saved["results"]] == [1, 32]
  assert saved["settings"]["compute_dtype"] == "bfloat16"           # the config's, not float32
  for r in saved["results"]:
    assert r["kv_match"] and r["kv_cache_bytes"] == r["kv_bytes_per_token_stats"] * r["batch"] * 11
    assert r["peak_bytes"] is None and r["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--batches=1,0"], "--batches='1,0' must be comma-separated integers >= 1"),
    (["--batches=a"], "--batches='a' must be comma-separated integers >= 1"),
    (["--batch_size=4"], "not --batch_size"),
    (["--new_tokens=1"], "--new_tokens=1 must be >= 2"),
    (["--repeats=0"], "--repeats=0 must be >= 1"),
    (["--cache_dtype=int8"], "--cache_dtype='int8' is not a floating-point dtype"),
    (["--cache_dtype=nonsense"], "--cache_dtype='nonsense' is not a floating-point dtype"),
    (["--param_dtype=int32"], "--param_dtype='int32' is not a floating-point dtype"),
    (["--prompt_len=250", "--new_tokens=10"], "--prompt_len=250 + --new_tokens=10 must fit the "
     "model's max_seq_len=256"),
    (["--config.model.ffn.router.selection=expert_choice"], "cannot decode token by token"),
])
def test_bad_flags_are_one_error_line(flags, message, tmp_path, capsys, monkeypatch):
  code, out, err = run_cli(capsys, monkeypatch, "speed", f"--config={TINY_CONFIG}",
                           "--config.model.n_layers=1", *flags, f"--json={tmp_path}/s.json")
  assert code == 1 and out == "", err
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], err
  assert "Traceback" not in err and not (tmp_path / "s.json").exists()


def test_out_of_device_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
  import jax

  def oom(model, batch, **kw):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                     "8.00GiB.\nBufferAssignment OOM Debugging ...")

  monkeypatch.setattr(speed, "measure", oom)
  code, out, err = run_cli(capsys, monkeypatch, "speed", f"--config={TINY_CONFIG}",
                           "--config.model.n_layers=1", "--batches=64")
  assert code == 1 and out == "" and "Traceback" not in err, err
  assert ("error: batch 64 does not fit in device memory (prompt 128 + 128 tokens): "
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB.; try smaller "
          "--batches") in err


def test_a_stats_prediction_off_by_one_value_is_a_mismatch(monkeypatch):
  cfg, model = _model("dense")
  true = speed.stats.kv_cache_bytes_per_token
  monkeypatch.setattr(speed.stats, "kv_cache_bytes_per_token",
                      lambda c, dtype: {"total": true(c, dtype=dtype)["total"] + 2})
  row = speed.measure(model, 2, prompt_len=3, new_tokens=2, warmup=0, repeats=1)
  assert row["kv_match"] is False
  assert row["kv_bytes_per_token_stats"] == row["kv_bytes_per_token_measured"] + 2
  assert "MISMATCH" in speed.format_table([row])
