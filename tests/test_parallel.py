"""Parallel layer: mesh sizes, rules, multi-process arguments (in process), and every multi-device
check in a subprocess with 8 virtual CPU devices (XLA_FLAGS must be set before jax starts, and other
test modules of this pytest process have already imported jax)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from fake_gcs import fake_gcs  # noqa: F401  (the fixture: a gs:// bucket, offline)
from umoe_jax.parallel import distributed, mesh, rules, sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "parallel_scripts"


def run_script(name: str, *args: str, devices: int = 8, timeout: int = 900) -> str:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={devices}").strip()
  # Opt level 0 halves CPU compile time; numerics stay float32 (tolerances below allow reordering).
  env["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    pytest.fail(f"{name} {' '.join(args)} failed (rc={proc.returncode}):\n"
                f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
  return proc.stdout


# ----------------------------------------------------------------------------------------------
# In-process unit tests (no devices needed).


def test_mesh_shape_fill_and_errors():
  assert mesh.mesh_shape(dict(data=-1, expert=2), 8) == dict(data=4, fsdp=1, tensor=1, expert=2)
  assert mesh.mesh_shape(None, 4) == dict(data=4, fsdp=1, tensor=1, expert=1)
  assert mesh.mesh_shape([("fsdp", 4), ("tensor", 2)], 8)["fsdp"] == 4
  with pytest.raises(ValueError, match="3 devices but 8"):
    mesh.mesh_shape(dict(data=3), 8)
  with pytest.raises(ValueError, match="does not divide"):
    mesh.mesh_shape(dict(data=-1, expert=3), 8)
  with pytest.raises(ValueError, match="at most one"):
    mesh.mesh_shape(dict(data=-1, fsdp=-1), 8)
  with pytest.raises(ValueError, match="unknown mesh axis 'pipe'"):
    mesh.mesh_shape(dict(pipe=2), 8)


def test_hierarchical_layout_keeps_inner_axes_inside_a_host():
  """4 hosts x 8 GPUs (device ids process-major, as on GPU clusters): the default order keeps
  expert (and tensor x expert) inside a host and puts data / fsdp across hosts."""
  import types
  devices = [types.SimpleNamespace(id=i, process_index=i // 8) for i in range(32)]
  grid = lambda **sizes: mesh.device_grid(tuple(mesh.mesh_shape(sizes, 32)[a]
                                                for a in mesh.MESH_AXES), devices)
  assert mesh.within_host_axes(grid(data=4, expert=8), mesh.MESH_AXES) == ("expert",)
  assert mesh.within_host_axes(grid(data=4, fsdp=2, expert=4), mesh.MESH_AXES) == ("fsdp",
                                                                                     "expert")
  assert mesh.within_host_axes(grid(fsdp=4, tensor=2, expert=4), mesh.MESH_AXES) == ("tensor",
                                                                                      "expert")
  assert mesh.within_host_axes(grid(data=2, expert=16), mesh.MESH_AXES) == ()   # 16 > 8 per host


def test_rules_round_trip_through_config():
  import configs.umoe_tiny as tiny
  cfg = tiny.get_config()
  assert sharding.normalize_rules(cfg.sharding_rules) == rules.DEFAULT_RULES
  assert dict(cfg.mesh) == dict(data=-1, fsdp=1, tensor=1, expert=1)


def test_every_umoe_parameter_maps_to_its_mesh_axes():
  """Each UMoE parameter's logical names and the default rules give its mesh layout: experts over
  `expert`, widths D over `fsdp`, hidden widths and the vocabulary over `tensor`, the key head, low-rank
  codes, routers and norms unsplit. A wrong name or rule still runs on one device and passes the
  numerics on 8, so the whole table is pinned here (in process: names only, no devices)."""
  import jax
  from flax import nnx
  from jax.sharding import PartitionSpec as P
  from conftest import tiny_config
  from umoe_jax.model.lm import CausalLM
  cfg = tiny_config("umoe", **{"moe.gated": True})
  model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
  logical = sharding.param_logical_axes(nnx.state(model, nnx.Param))
  specs = {jax.tree_util.keystr(p): rules.logical_to_mesh(tuple(v), rules.DEFAULT_RULES, mesh.MESH_AXES)
           for p, v in jax.tree_util.tree_leaves_with_path(
               logical, is_leaf=lambda x: isinstance(x, P))}
  layer = "['layers'][0]"
  head_dim = P("fsdp", None)    # k_proj, q_res_proj, shared_q_proj: one key head, not over tensor
  expected = {
      "['embed']": P("tensor", "fsdp"), "['lm_head']": P("fsdp", "tensor"),
      "['final_norm']['scale']": P(None),
      f"{layer}['attention_norm']['scale']": P(None), f"{layer}['ffn_norm']['scale']": P(None),
      f"{layer}['attention']['q_a_norm']['scale']": P(None),
      f"{layer}['attention']['k_proj']['kernel']": head_dim,
      f"{layer}['attention']['q_res_proj']['kernel']": head_dim,
      f"{layer}['attention']['shared_q_proj']['kernel']": head_dim,
      f"{layer}['attention']['q_a']": P("expert", "fsdp", None),
      f"{layer}['attention']['q_b']": P("expert", None, None),
      f"{layer}['attention']['router']['kernel']": P("fsdp", None),
      f"{layer}['ffn']['router']['kernel']": P("fsdp", None),
      f"{layer}['experts']['w_up']": P("expert", "fsdp", "tensor"),
      f"{layer}['experts']['w_gate']": P("expert", "fsdp", "tensor"),
      f"{layer}['experts']['w_down']": P("expert", "tensor", "fsdp"),
  }
  for sub in ("attention", "ffn"):
    for name in ("up", "gate"):
      expected[f"{layer}['{sub}']['shared_expert']['{name}']['kernel']"] = P("fsdp", "tensor")
    expected[f"{layer}['{sub}']['shared_expert']['down']['kernel']"] = P("tensor", "fsdp")
  assert specs == expected


def test_distributed_args_from_env():
  assert distributed.distributed_args({}) is None
  manual = distributed.distributed_args(dict(JAX_COORDINATOR_ADDRESS="10.0.0.1:1234",
                                             JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="2"))
  assert manual == dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2)
  slurm = distributed.distributed_args(dict(SLURM_NTASKS="16", SLURM_PROCID="5", SLURM_LOCALID="5",
                                            SLURM_JOB_NODELIST="gpu[003-004,010]",
                                            SLURM_NTASKS_PER_NODE="8(x2)", SLURM_GPUS_ON_NODE="8"))
  assert slurm == dict(coordinator_address="gpu003:12345", num_processes=16, process_id=5,
                       local_device_ids=[5])
  # Task 0 runs on the first node of the step; the launch node (salloc: a login node) is a fallback.
  step = distributed.distributed_args(dict(SLURM_NTASKS="2", SLURM_PROCID="0",
                                           SLURM_LAUNCH_NODE_IPADDR="10.1.1.1",
                                           SLURM_STEP_NODELIST="n7,n8", SLURM_JOB_NODELIST="n[1-8]",
                                           JAX_COORDINATOR_PORT="999"))
  assert step["coordinator_address"] == "n7:999" and "local_device_ids" not in step
  ip = distributed.distributed_args(dict(SLURM_NTASKS="2", SLURM_PROCID="1",
                                         SLURM_LAUNCH_NODE_IPADDR="10.1.1.1"))
  assert ip["coordinator_address"] == "10.1.1.1:12345"
  assert distributed.distributed_args(dict(SLURM_NTASKS="1", SLURM_PROCID="0")) is None
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    distributed.distributed_args(dict(JAX_COORDINATOR_ADDRESS="h:1", JAX_NUM_PROCESSES="2"))


def test_expert_buffer_sizes():
  """Buffer rows by hand (n tokens per device, K slots, EP shards, E_local experts per shard):
  all_to_all per pair, all_gather per shard (all EP senders)."""
  from umoe_jax.parallel.expert_parallel import capacity
  n, k, ep, e_local = 8, 3, 8, 2
  assert capacity(n, k, ep, e_local, None, "all_to_all") == 8 * 2          # n * min(K, E_local)
  assert capacity(n, k, ep, e_local, 0.5, "all_to_all") == 2               # ceil(0.5 * n*K / EP)
  assert capacity(n, k, ep, e_local, None, "all_gather") == 8 * 8 * 2      # EP * n * min(K, E_l)
  assert capacity(n, k, ep, e_local, 0.5, "all_gather") == 12              # ceil(0.5 * n*K)
  assert capacity(n, k, ep, e_local, 100.0, "all_gather") == 128           # never past dropless
  assert capacity(n, k, 1, 16, 0.5, "local") == n * k                      # no exchange, no drop
  # UMoE-base FFN pool on 2 GPUs (32 x 1024 tokens each, K=15, 64 experts per shard).
  assert capacity(32768, 15, 2, 64, None, "all_gather") == 2 * 32768 * 15
  # ragged: a receive buffer per shard, like all_gather (only the real rows are sent).
  assert capacity(n, k, ep, e_local, None, "ragged") == 8 * 8 * 2
  assert capacity(n, k, ep, e_local, 0.5, "ragged") == 12


def test_ragged_layout_by_hand():
  """Offsets and sizes of the ragged exchange from a count matrix worked out by hand: 2 shards of
  2 experts, receive buffers of 6 rows; sender 1's rows for shard 0 overflow it by 2."""
  import jax
  import jax.numpy as jnp
  from umoe_jax.parallel.exchange import ragged_layout, ragged_layout_by_expert
  counts = jnp.array([[[3, 1], [0, 2]],     # sender 0: 4 rows for shard 0 (3 + 1), 2 for shard 1
                      [[4, 0], [1, 1]]])    # sender 1: 4 for shard 0, 2 for shard 1
  expected = {
      0: dict(input_offsets=[0, 4], send_sizes=[4, 2], output_offsets=[0, 0], recv_offsets=[0, 4],
              recv_sizes=[4, 2], recv_counts=[[3, 1], [2, 0]], back_offsets=[0, 0], dropped=0),
      # Shard 0 has 4 rows from sender 0, so only 2 of sender 1's 4 fit (its expert-0 rows first).
      1: dict(input_offsets=[0, 4], send_sizes=[2, 2], output_offsets=[4, 2], recv_offsets=[0, 2],
              recv_sizes=[2, 2], recv_counts=[[0, 2], [1, 1]], back_offsets=[4, 4], dropped=2),
  }
  layout = jax.jit(ragged_layout, static_argnums=2)
  for me, want in expected.items():
    got = layout(counts, me, 6)._asdict()
    assert {k: np.asarray(v).tolist() for k, v in got.items()} == want, (me, got)
  # A buffer large enough for everything (the dropless worst case): nothing dropped.
  lay = layout(counts, 1, 8)
  assert np.asarray(lay.send_sizes).tolist() == [4, 2] and int(lay.dropped) == 0
  # One slice per (peer, expert), flattened d*2 + e: the rows land in expert order. Shard 0's
  # buffer: expert 0 = sender 0's 3 rows [0, 3) then sender 1's 2 [3, 5), expert 1 = sender 0's 1
  # [5, 6); shard 1's: expert 0 = sender 1's 1 [0, 1), expert 1 = sender 0's 2 [1, 3), sender 1's 1.
  by_expert = {
      0: dict(input_offsets=[0, 3, 4, 4], send_sizes=[3, 1, 0, 2], output_offsets=[0, 5, 0, 1],
              recv_offsets=[0, 5, 3, 6], recv_sizes=[3, 1, 2, 0], recv_counts=[[3, 1], [2, 0]],
              back_offsets=[0, 3, 0, 4], dropped=0),
      1: dict(input_offsets=[0, 4, 4, 5], send_sizes=[2, 0, 1, 1], output_offsets=[3, 6, 0, 3],
              recv_offsets=[0, 1, 0, 3], recv_sizes=[0, 2, 1, 1], recv_counts=[[0, 2], [1, 1]],
              back_offsets=[4, 4, 4, 5], dropped=2),
  }
  layout = jax.jit(ragged_layout_by_expert, static_argnums=2)
  for me, want in by_expert.items():
    got = layout(counts, me, 6)._asdict()
    assert {k: np.asarray(v).tolist() for k, v in got.items()} == want, (me, got)


def test_ragged_receive_plan_by_hand():
  """Sender-major receive buffer -> local-expert-major rows without a sort. Buffer of 8 rows:
  r0-2 sender 0 expert 0, r3 sender 0 expert 1, r4-5 sender 1 expert 0, r6-7 unused."""
  import jax
  import jax.numpy as jnp
  from umoe_jax.ops import dispatch
  from umoe_jax.parallel.exchange import receive_plan
  plan = jax.jit(receive_plan, static_argnums=1)(jnp.array([[3, 1], [2, 0]]), 8)
  assert np.asarray(plan.order).tolist() == [0, 1, 2, 4, 5, 3, 6, 7]
  assert np.asarray(plan.inverse).tolist() == [0, 1, 2, 5, 3, 4, 6, 7]
  assert np.asarray(plan.group_sizes).tolist() == [5, 1]
  # Random counts (empty senders and experts included) against a stable sort by (expert, sender).
  rng = np.random.default_rng(0)
  rows = 40                                   # >= 4 senders x 3 experts x 3 rows

  @jax.jit
  def plan_and_round_trip(c, x):
    plan = receive_plan(c, rows)
    return plan.order, dispatch.unpermute(dispatch.permute(x, plan, 1), plan)
  for _ in range(20):
    c = rng.integers(0, 4, (4, 3)) * (rng.random((4, 3)) < 0.7)
    sender = np.repeat(np.arange(4), c.sum(1))
    expert = np.concatenate([np.repeat(np.arange(3), c[s]) for s in range(4)])
    want = np.lexsort((np.arange(len(expert)), sender, expert))       # (expert, sender, row)
    x = rng.standard_normal((rows, 2)).astype(np.float32)
    order, back = plan_and_round_trip(jnp.asarray(c, jnp.int32), x)
    order = np.asarray(order)
    assert order[:len(want)].tolist() == want.tolist(), c
    assert order[len(want):].tolist() == list(range(len(want), rows))
    assert np.array_equal(np.asarray(back), x)


def test_resolve_exchange_and_chunks_settings(monkeypatch):
  from umoe_jax.parallel import expert_parallel
  from umoe_jax.train import config as train_config
  assert expert_parallel.resolve_exchange("auto", 3, 8, "gpu") == "all_to_all"   # until measured
  assert expert_parallel.resolve_exchange("auto", 15, 8, "gpu") == "all_gather"
  assert expert_parallel.resolve_exchange("ragged", 15, 8, "cpu") == "ragged"
  assert expert_parallel.resolve_exchange("ragged", 3, 1, "gpu") == "local"
  monkeypatch.setattr(expert_parallel, "AUTO_RAGGED_PLATFORMS", ("gpu",))
  assert expert_parallel.resolve_exchange("auto", 3, 8, "gpu") == "ragged"
  assert expert_parallel.resolve_exchange("auto", 3, 8, "cpu") == "all_to_all"
  with pytest.raises(ValueError, match="'ragged_a2a' must be one of"):
    expert_parallel.resolve_exchange("ragged_a2a", 3, 8)
  train_config.check_expert_parallel(dict(exchange="ragged", chunks=4, capacity_factor=None))
  for bad in (0, 2.0, True):
    with pytest.raises(ValueError, match=f"expert_parallel.chunks={bad!r} must be an int >= 1"):
      train_config.check_expert_parallel(dict(chunks=bad))
  one = mesh.make_mesh(dict(data=1), devices=__import__("jax").devices()[:1])
  with pytest.raises(ValueError, match="expert_chunks=0 must be an int >= 1"):
    with sharding.use_mesh(one, expert_chunks=0):
      pass


# ----------------------------------------------------------------------------------------------
# Multi-device tests: one subprocess with 8 virtual CPU devices runs every section
# (tests/parallel_scripts/multi_device.py) and writes a JSON report; each test reads its section.

# Single-device reference vs each layout, float32 compute. Gradients of one step match to ~2e-8
# (XLA only reorders float32 sums); AdamW (lr 1e-2) amplifies that into params after 3 steps.
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-6, 2e-4


@pytest.fixture(scope="module")
def multi_device_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("parallel") / "report.json"
  run_script("multi_device.py", str(out))
  return json.loads(out.read_text())


def _section(report, name):
  section = report[name]
  assert section["ok"], section.get("error")
  return section


def test_state_shardings(multi_device_report):
  _section(multi_device_report, "shardings")


def test_expert_map_matches_oracle_and_counts_drops(multi_device_report):
  section = _section(multi_device_report, "expert_map")
  cases = {k: v for k, v in section.items() if isinstance(v, dict) and "strategy" in v}
  for strategy in ("all_to_all", "all_gather", "ragged"):
    ran = {k: v for k, v in cases.items() if v["strategy"] == strategy}
    assert any(v["dropped"] > 0 for k, v in ran.items() if "cf=0.5" in k), strategy
    # Dropless under skewed routing (90% of tokens on one shard's experts): nothing dropped.
    skewed = [v for k, v in ran.items() if "/skewed/" in k]
    assert skewed and all(v["dropped"] == 0 for v in skewed), strategy
  for exchange in ("auto", "all_gather"):
    assert sum(section[f"model_sown_dropped_rows/{exchange}"]) > 0
  assert section["train_step_dropped_rows"] > 0   # the trainer's metrics report them


def test_masked_slots_take_no_expert_capacity(multi_device_report):
  """Slots without a pick (gate 0, `slot_mask`) are not rows: with the capacity factor that exactly
  fits the real picks (counting the masked slots would overflow it), no exchange drops a row and the
  output equals the dropless one, for every exchange, chunked too, both call forms. In the model
  (top-P attention and FFN routers) each of the three capped exchanges drops exactly its real picks'
  overflow at a small factor, and none, with dropless logits, at the factor that fits them."""
  section = _section(multi_device_report, "masked_slots")
  cases = {k: v for k, v in section.items() if k != "model" and isinstance(v, dict)}
  assert len(cases) == 16, sorted(cases)
  for key, case in cases.items():
    assert case["dropped"] == 0 and case["err_dropless"] < 1e-5 and case["err"] < 1e-5, (key, case)
  small, fit = section["model"]["cf=0.5"], section["model"]["fit"]
  assert small["sown"] == small["real_overflow"] and min(small["sown"]) > 0, small
  assert fit["sown"] == [0, 0, 0] and fit["logit_err"] < 1e-5, fit


def test_expert_map_auto_exchange(multi_device_report):
  """auto: all_to_all when K=3 < EP (expert=8, data=2,expert=4), all_gather when K >= EP (expert=2):
  the values (checked against the oracle in the script) and the collectives in the program."""
  section = _section(multi_device_report, "expert_map")
  auto = {k.split("/")[0]: v["strategy"] for k, v in section.items()
          if isinstance(v, dict) and k.endswith("/auto->" + v.get("strategy", ""))}
  assert auto == {"expert=8": "all_to_all", "data=2,expert=4": "all_to_all",
                  "data=4,expert=2": "all_gather"}, auto
  assert section["expert=8/auto_collectives"] == ["all_to_all"]
  assert section["data=4,expert=2/auto_collectives"] == ["all_gather", "reduce_scatter"]
  grads = sorted(k for k in section if "/grad/" in k)
  # expert=8 and data=2,expert=4: all five (exchange, chunks); data=4,expert=2: the two it keeps.
  # Each within 1e-5 of one device.
  assert len(grads) == 12, grads
  assert [k for k in grads if k.startswith("data=4,expert=2/")] == [
      "data=4,expert=2/grad/all_gather", "data=4,expert=2/grad/ragged"], grads


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8", "tensor=8", "expert=8", "data=2,expert=4",
                                    "fsdp=2,tensor=2,expert=2"])
def test_layout_matches_single_device(multi_device_report, layout):
  result = _section(multi_device_report, "layouts")[layout]
  assert result["step1_loss_diff"] < LOSS_TOL, result
  assert result["grad_diff"] < GRAD_TOL, result
  assert result["loss_diff"] < LOSS_TOL, result          # AdamW steps 2 and 3
  assert result["param_diff"] < PARAM_TOL, result


def test_scanned_layers_match_single_device(multi_device_report):
  """`model.scan_layers` on fsdp x tensor x expert: the scanned step (a while loop in the program)
  trains as the looped single-device one."""
  result = _section(multi_device_report, "scan_layers")
  assert result["scanned"], result
  assert result["loss_diff"] < LOSS_TOL and result["grad_diff"] < GRAD_TOL, result
  assert result["param_diff"] < PARAM_TOL, result


@pytest.mark.parametrize("layout,exchange", [("expert=8", "all_gather"),
                                             ("data=2,expert=4", "all_gather"),
                                             ("data=2,expert=4", "all_to_all")])
def test_exchange_matches_single_device(multi_device_report, layout, exchange):
  """One step with the exchange forced (both call sites: FFN pool K=4, pre-mixing queries K=2)."""
  result = _section(multi_device_report, "layouts")[f"{layout}/{exchange}"]
  assert result["step1_loss_diff"] < LOSS_TOL, result
  assert result["grad_diff"] < GRAD_TOL, result


def test_ragged_all_to_all_emulation(multi_device_report):
  """The CPU emulation of ragged_all_to_all follows jax's documented example and a numpy loop; the
  native collective (GPU / TPU) lowers, there and back, forward and backward (4 ops)."""
  section = _section(multi_device_report, "ragged")
  assert section["doc_example"] == [[1, 3, -1, -1], [2, 2, 4, -1]]
  assert section["random_rows"] > 0
  assert section["native_ragged_ops/None"] == section["native_ragged_ops/('data', 'expert')"] == 4
  assert section["native_ragged_ops/None/expert"] == 4
  assert section["native_ragged_ops/None/chunks=2"] == 8     # two independent exchanges
  assert "chunks=3 must be >= 1 and divide the 8" in section["chunks_error"]


@pytest.mark.parametrize("run", ["fsdp=2,expert=4/auto/chunks=1", "fsdp=2,expert=4/ragged/chunks=2",
                                 "fsdp=-1,expert=8/ragged/chunks=1"])
def test_large_structure_fsdp_x_expert(multi_device_report, run):
  """UMoE-large's structure (64 experts, FFN top-10, attention top-3, block remat) with FSDP x
  expert parallelism, one forward + backward vs one device; experts split over "expert" and the
  model width over "fsdp"; auto runs all_gather for the FFN (K=10 >= EP) and all_to_all for the
  queries, ragged replaces both (no reduce-scatter of partial outputs)."""
  result = _section(multi_device_report, "large_structure")[run]
  assert result["step1_loss_diff"] < LOSS_TOL, result
  assert result["grad_diff"] < GRAD_TOL, result
  assert result["w_up_spec"].startswith("P('expert', 'fsdp'"), result
  if "/auto/" in run:
    assert result["collectives"] == ["all_gather", "all_to_all", "reduce_scatter"], result
  else:   # the counts' all-gather and the (emulated) ragged all-to-all
    assert result["collectives"] == ["all_gather", "all_to_all"], result


# The other attention variants of the zoo (no expert-parallel route of their own: their routed
# experts run through the XLA partitioner), one forward + backward each vs one device. A variant that
# is wrong under a mesh gets pytest.param(..., marks=pytest.mark.xfail(strict=True, reason=<bug>)).
VARIANTS = ["moa", "switchhead", "switchhead_sigmoid", "umoe_att", "postmix", "umoe_mla",
            # routing methods (issue 14): AoE's pool with expert choice and attention mixing; per
            # sub-layer routers with similarity mixing / bias / z-loss, top-P over an AoE FFN
            "aoe_expert_choice", "umoe_routing"]
VARIANT_LAYOUTS = ["data=2,expert=4", "tensor=8"]


@pytest.mark.parametrize("layout", VARIANT_LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_variant_matches_single_device(multi_device_report, variant, layout):
  section = _section(multi_device_report, "variants")
  if "expert" in layout:   # the variant's routed expert weights really are split over "expert"
    assert section[variant]["expert_split"], section[variant]
  result = section[f"{variant}/{layout}"]
  assert "error" not in result, result.get("error")
  assert result["step1_loss_diff"] < LOSS_TOL, result
  assert result["grad_diff"] < GRAD_TOL, result


@pytest.mark.extras("triton")
def test_fused_attention_cores_run_on_each_devices_rows(tmp_path, monkeypatch):
  """`attention.core="triton"` on 8 virtual devices (the kernels in the Triton interpreter): the
  custom calls run inside shard_map on one device's batch rows and query heads, and the loss and
  gradients match the XLA core on one device; `on_local_shards` itself with as many key heads as
  query heads and with replicated mesh axes (tests/parallel_scripts/fused_core_layouts.py)."""
  monkeypatch.setenv("TRITON_INTERPRET", "1")
  out = tmp_path / "fused_core_layouts.json"
  run_script("fused_core_layouts.py", str(out), timeout=600)
  report = json.loads(out.read_text())
  assert len(report["wrapper"]) == 4, report["wrapper"]
  for name, r in report["wrapper"].items():
    assert r["local"] == r["want_local"] and r["rel"] < 1e-5, (name, r)
  assert report["single"]["loss_diff"] < LOSS_TOL and report["single"]["grad_rel"] < 1e-5, report
  assert set(report["layouts"]) == {"data=8", "expert=8", "fsdp=2,tensor=2,expert=2",
                                    "data=2,tensor=4"}, report
  for layout, r in report["layouts"].items():
    assert r["kernels"] == report["single"]["kernels"], (layout, r)
    assert r["local"] == r["want_local"], (layout, r)   # [local batch, local query heads]
    assert r["loss_diff"] < LOSS_TOL and r["grad_rel"] < 1e-5, (layout, r)


def test_restore_onto_another_mesh(multi_device_report):
  section = _section(multi_device_report, "restore")
  assert section["value_diff"] == 0.0 and section["next_loss_diff"] < LOSS_TOL, section


# ----------------------------------------------------------------------------------------------
# The trainer (umoe_jax.train.loop.run) in two processes joined by jax.distributed (localhost
# coordinator, 4 CPU devices each) vs one process on one device.


def _worker_env(pid=None, port=None, devices=4, base=None):
  env = dict(base or os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                       "--xla_backend_optimization_level=0",
             PYTHONPATH=os.pathsep.join([str(ROOT), (base or os.environ).get("PYTHONPATH", "")]))
  for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(key, None)
  if pid is not None:
    env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(pid))
  return env


def _train(workdir, num_steps: int, layout: str, processes: int, timeout: int = 900,
           base_env=None) -> list[dict]:
  """Runs train_worker.py in `processes` processes; `workdir` is local (a Path) or a URL of the
  store that `base_env` reaches (the fake bucket)."""
  import portpicker
  port = portpicker.pick_unused_port()
  envs = ([_worker_env(devices=1, base=base_env)] if processes == 1 else
          [_worker_env(pid, port, base=base_env) for pid in range(processes)])
  procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "train_worker.py"), str(workdir),
                             str(num_steps), layout], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for env in envs]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for pid, (p, log) in enumerate(zip(procs, logs)):
    if p.returncode != 0:
      pytest.fail(f"train worker {pid} ({layout}, {num_steps} steps) failed (rc={p.returncode}):\n"
                  f"{log[-6000:]}")
  from umoe_jax import storage
  return [json.loads(storage.read_text(f"{workdir}/summary_{pid}.json")) for pid in range(processes)]


def _losses(workdir: pathlib.Path) -> dict[int, float]:
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    rec = json.loads(line)
    if "train/loss" in rec:
      out[rec["step"]] = rec["train/loss"]
  return out


def test_two_processes_train_checkpoint_resume(tmp_path, fake_gcs):
  """The two-process run keeps its workdir in a gs:// bucket (issue 19): every process writes its
  checkpoint shards there, only process 0 the logs; the one-process reference is local."""
  ref_dir = tmp_path / "one_process"
  ref_dir.mkdir()
  run_url = fake_gcs.new_url("two_processes")
  run_dir = pathlib.Path(fake_gcs.local(run_url))
  _train(ref_dir, 4, "data=1", processes=1)
  ref = _losses(ref_dir)
  # Steps 1-2 on expert=8 across both processes with the ragged exchange (crossing processes),
  # checkpoint at 2; then fresh processes resume from it onto another mesh, fsdp=2 x expert=4 with
  # the auto exchange (all_to_all: K=2 < EP=4), for steps 3-4.
  first = _train(run_url, 2, "expert=8,exchange=ragged", processes=2, base_env=fake_gcs.env())
  assert all(w["info"]["process_count"] == 2 and w["info"]["global_devices"] == 8 for w in first)
  assert all(w["summary"]["start"] == "scratch" and w["summary"]["step"] == 2 for w in first)
  second = _train(run_url, 4, "fsdp=2,expert=4", processes=2, base_env=fake_gcs.env())
  assert all(w["summary"]["start"] == "workdir" and w["summary"]["step"] == 4 for w in second)
  # one writer of the logs: one event file per run, one metrics record per step
  assert len(list((run_dir / "tensorboard").iterdir())) == 2
  steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
           if "train/loss" in l]
  assert steps == [1, 2, 3, 4], steps
  assert not (tmp_path / "gs:").exists() and not (ROOT / "gs:").exists()
  losses = _losses(run_dir)
  assert sorted(ref) == sorted(losses) == [1, 2, 3, 4], (ref, losses)
  assert max(abs(ref[s] - losses[s]) for s in ref) < LOSS_TOL, (ref, losses)
