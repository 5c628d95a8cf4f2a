"""bench/profile_table.py: op names from compiled HLO, scope keys, kernel time by scope on CPU."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import profile_table  # noqa: E402


def test_scope_key_reads_passes_layers_and_drops_function_names():
  key = profile_table.scope_key
  assert key("jit(train_step)/transpose(jvp(layer_3))/ffn/router/dot_general") == (
      "layer_*/ffn/router", "bwd", "dot_general")
  assert key("jit(train_step)/jvp(layer_11)/attention/mix/bthd,bsd->bhts/dot_general") == (
      "layer_*/attention/mix", "fwd", "dot_general")
  assert key("jit(train_step)/optimizer/mul") == ("optimizer", "-", "mul")
  # a jitted helper's name is no scope; a scope inside it is
  assert key("jit(train_step)/jvp(jit(_where))/layer_0/ffn/select_n") == (
      "layer_*/ffn", "fwd", "select_n")
  assert key("jit(f)/add") == ("", "-", "add")
  # model.scan_layers: one scanned block, with remat's recomputation inside the scan's body
  assert key("jit(train_step)/transpose(jvp(layers))/while/body/closed_call/checkpoint/"
             "rematted_computation/ffn/expert_down/dot_general") == (
      "layer_*/ffn/expert_down", "bwd", "dot_general")
  assert key("jit(train_step)/jvp(layers)/while/body/closed_call/attention/mix/exp") == (
      "layer_*/attention/mix", "fwd", "exp")


def _program():
  def f(x, w):
    with jax.named_scope("big"):
      y = jnp.tanh(x @ w) @ w.T @ w          # three [256, 256] x [256, 256] matmuls
    with jax.named_scope("small"):
      z = jnp.sin(x[:4, :4]).sum()
    return jnp.sum(y) + z

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.float32)
  return jax.jit(jax.grad(f, argnums=(0, 1))), x, w


def test_op_names_cover_the_executed_ops_and_keep_scopes():
  fn, x, w = _program()
  compiled = fn.lower(x, w).compile()
  names = profile_table.op_names(compiled.as_text())
  assert names, "no op_name metadata read"
  scopes = {profile_table.scope_key(n)[:2] for n in names.values()}
  assert ("big", "fwd") in scopes and ("big", "bwd") in scopes and ("small", "bwd") in scopes
  # every instruction of the entry computation is named (own metadata, callee, or neighbour)
  entry = compiled.as_text().split("ENTRY", 1)[1]
  for line in entry.splitlines()[1:]:
    m = profile_table._INSTRUCTION.match(line)
    if m and " parameter(" not in line and "tuple(" not in line and "get-tuple-element(" not in line:
      assert m.group(2) in names, line[:200]


def test_profile_calls_puts_the_time_where_the_work_is():
  fn, x, w = _program()
  compiled = fn.lower(x, w).compile()
  run_once = lambda: jax.block_until_ready(compiled(x, w))
  rows, summary = profile_table.profile_calls(compiled, run_once, calls=3)
  assert summary["kernels"] > 0 and summary["kernel_ms"] > 0
  assert summary["unmatched_ms"] == 0.0
  by_scope = {}
  for r in rows:
    by_scope[r["scope"]] = by_scope.get(r["scope"], 0.0) + r["ms"]
  assert by_scope.get("big", 0.0) > 5 * by_scope.get("small", 0.0)
  assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-6
  grouped = profile_table.group_rows(rows, 1)
  assert abs(sum(r["ms"] for r in grouped) - summary["kernel_ms"]) < 1e-9
  text = profile_table.format_rows(grouped, title="t")
  assert "big" in text and text.startswith("t\n")


def test_scope_rows_keep_the_largest_kernels_per_scope():
  """scope_rows: a scope's time is its kernels' per call, its top_ops the TOP_OPS largest kernels
  (numbered copies of one kernel, one per layer, summed under one name), largest first."""
  names = {f"op{i}": f"jit(train_step)/jvp(layer_{i % 3})/ffn/mul" for i in range(12)}
  # 12 ops of one scope: op i runs kernel j = (i + 8) % 10 (its copy i) for 3^j ms, so kernels 8
  # and 9 run twice; two calls' worth of events
  kernel = lambda j: "fusion_" + "abcdefghij"[j]                  # ("fusion_c.7": copy 7 of c)
  js = [(i + 8) % 10 for i in range(12)]
  events = [(f"op{i}", f"{kernel(j)}.{i}", 3.0 ** j) for i, j in enumerate(js)] * 2
  (row,) = profile_table.scope_rows(events, names, calls=2)
  assert row["scope"] == "layer_*/ffn" and row["pass"] == "fwd" and row["kernels"] == 12
  assert abs(row["ms"] - sum(3.0 ** j for j in js)) < 1e-9
  want = list(range(9, 9 - profile_table.TOP_OPS, -1))             # kernels 9, 8, ..., largest first
  assert [op.rsplit(" ", 1)[0] for op in row["top_ops"]] == [f"mul:{kernel(j)}" for j in want]
  assert [float(op.rsplit(" ", 1)[1]) for op in row["top_ops"]] == [
      3.0 ** j * js.count(j) for j in want]


def test_diff_rows_pair_scopes_and_order_by_the_largest_change():
  """Two profiles' rows grouped to a depth and paired by (scope, pass): a scope in one profile
  only counts 0 ms in the other; the rows run largest |delta| first; the totals line sums them."""
  row = lambda scope, phase, ms: dict(scope=scope, **{"pass": phase}, ms=ms, kernels=1, share=0.0)
  bf16 = [row("layer_*/ffn/expert_up", "fwd", 1.0), row("layer_*/ffn/expert_down", "fwd", 2.0),
          row("layer_*/ffn/expert_up", "bwd", 3.0), row("optimizer", "-", 0.5)]
  fp8 = [row("layer_*/ffn/expert_up/quantize", "fwd", 0.25), row("layer_*/ffn/expert_up", "fwd", 0.5),
         row("layer_*/ffn/expert_down", "fwd", 1.0), row("layer_*/ffn/expert_up", "bwd", 6.0),
         row("loss", "fwd", 0.125)]
  diff = profile_table.diff_rows(bf16, fp8, depth=3)
  got = [(d["scope"], d["pass"], d["base_ms"], d["ms"], d["delta_ms"]) for d in diff]
  assert got == [("layer_*/ffn/expert_up", "bwd", 3.0, 6.0, 3.0),
                 ("layer_*/ffn/expert_down", "fwd", 2.0, 1.0, -1.0),
                 ("optimizer", "-", 0.5, 0.0, -0.5),
                 ("layer_*/ffn/expert_up", "fwd", 1.0, 0.75, -0.25),
                 ("loss", "fwd", 0.0, 0.125, 0.125)]
  text = profile_table.format_diff(diff, names=("bf16", "fp8")).splitlines()
  assert text[0].split()[:3] == ["bf16", "fp8", "delta"]
  assert text[-1].split() == ["6.500", "7.875", "+1.375", "all"]
