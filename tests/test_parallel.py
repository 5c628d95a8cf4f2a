"""Parallel layer: mesh sizes, rules, multi-process arguments (in process), and every multi-device
check in a subprocess with 8 virtual CPU devices (XLA_FLAGS must be set before jax starts, and other
test modules of this pytest process have already imported jax)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from umoe_jax.parallel import distributed, mesh, rules, sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "parallel_scripts"


def run_script(name: str, *args: str, devices: int = 8, timeout: int = 240) -> str:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={devices}").strip()
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


def test_rules_round_trip_through_config():
  import configs.umoe_tiny as tiny
  cfg = tiny.get_config()
  assert sharding.normalize_rules(cfg.sharding_rules) == rules.DEFAULT_RULES
  assert dict(cfg.mesh) == dict(data=-1, fsdp=1, tensor=1, expert=1)


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
  ip = distributed.distributed_args(dict(SLURM_NTASKS="2", SLURM_PROCID="0",
                                         SLURM_LAUNCH_NODE_IPADDR="10.1.1.1",
                                         SLURM_JOB_NODELIST="a,b", JAX_COORDINATOR_PORT="999"))
  assert ip["coordinator_address"] == "10.1.1.1:999" and "local_device_ids" not in ip
  assert distributed.distributed_args(dict(SLURM_NTASKS="1", SLURM_PROCID="0")) is None
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    distributed.distributed_args(dict(JAX_COORDINATOR_ADDRESS="h:1", JAX_NUM_PROCESSES="2"))


# ----------------------------------------------------------------------------------------------
# Multi-device tests (8 virtual CPU devices, one subprocess each).


def test_shardings_on_8_devices():
  out = run_script("shardings.py")
  assert "OK" in out
