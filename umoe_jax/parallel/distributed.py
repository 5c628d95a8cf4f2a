"""Multi-process start-up: one JAX process per host (or per GPU), joined by `jax.distributed`.

`initialize_from_env()` must run before anything touches a device. It reads, in order:

  1. JAX_COORDINATOR_ADDRESS (host:port), JAX_NUM_PROCESSES, JAX_PROCESS_ID
     [optional JAX_LOCAL_DEVICE_IDS="0,1"]: manual launches, one command per process;
  2. SLURM (srun): SLURM_NTASKS, SLURM_PROCID; coordinator host = JAX_COORDINATOR_HOST, else the
     first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (where task 0 runs), else
     SLURM_LAUNCH_NODE_IPADDR; port JAX_COORDINATOR_PORT (default 12345). (The launch node is the
     last resort: under `salloc` it is the login node, which runs no task.) With one task per GPU
     (SLURM_NTASKS_PER_NODE == SLURM_GPUS_ON_NODE) each process gets its SLURM_LOCALID GPU;
  3. a TPU pod slice (TPU_WORKER_HOSTNAMES / a multi-host TPU VM) or several slices
     (MEGASCALE_NUM_SLICES > 1, set by the multi-slice runtime): `jax.distributed.initialize()`
     with no arguments (JAX discovers the slices itself);
  4. otherwise nothing (one process).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Mapping, Optional

import jax

DEFAULT_PORT = 12345
_INITIALIZED = False


def _first_slurm_host(nodelist: str) -> str:
  """'gpu[003-005,010],cpu1' -> 'gpu003' (SLURM's compressed host lists, first host only)."""
  first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
  if first is None:
    raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
  prefix, ranges = first.group(1), first.group(3)
  if not ranges:
    return prefix
  return prefix + ranges.split(",")[0].split("-")[0]


def distributed_args(env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
  """The keyword arguments for `jax.distributed.initialize` implied by `env` (None: single process;
  {} : let JAX auto-detect, as on TPU pods)."""
  env = os.environ if env is None else env
  if "JAX_COORDINATOR_ADDRESS" in env:
    missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
    if missing:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not")
    args = dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                num_processes=int(env["JAX_NUM_PROCESSES"]), process_id=int(env["JAX_PROCESS_ID"]))
    if env.get("JAX_LOCAL_DEVICE_IDS"):
      args["local_device_ids"] = [int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(",")]
    return args if args["num_processes"] > 1 else None
  if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and int(env["SLURM_NTASKS"]) > 1:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    host = (env.get("JAX_COORDINATOR_HOST") or (_first_slurm_host(nodelist) if nodelist else None)
            or env.get("SLURM_LAUNCH_NODE_IPADDR"))
    if not host:
      raise ValueError("SLURM run without SLURM_JOB_NODELIST or SLURM_LAUNCH_NODE_IPADDR: set "
                       "JAX_COORDINATOR_HOST")
    port = int(env.get("JAX_COORDINATOR_PORT", DEFAULT_PORT))
    args = dict(coordinator_address=f"{host}:{port}", num_processes=int(env["SLURM_NTASKS"]),
                process_id=int(env["SLURM_PROCID"]))
    gpus = env.get("SLURM_GPUS_ON_NODE")
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if gpus and per_node and int(per_node) == int(gpus) > 1 and "SLURM_LOCALID" in env:
      args["local_device_ids"] = [int(env["SLURM_LOCALID"])]   # one task per GPU
    return args
  if env.get("TPU_WORKER_HOSTNAMES") and len(env["TPU_WORKER_HOSTNAMES"].split(",")) > 1:
    return {}
  if int(env.get("MEGASCALE_NUM_SLICES", "1") or 1) > 1:  # multi-slice (even of one-host slices)
    return {}
  return None


def initialize_from_env(env: Optional[Mapping[str, str]] = None) -> bool:
  """Calls `jax.distributed.initialize` when the environment describes several processes.

  Returns True if it initialised (or had already), False for a single process. Idempotent.
  """
  global _INITIALIZED
  if _INITIALIZED:
    return True
  args = distributed_args(env)
  if args is None:
    return False
  logging.info("jax.distributed.initialize(%s)", args)
  jax.distributed.initialize(**args)
  _INITIALIZED = True
  return True


def process_info() -> dict:
  """{"process_index", "process_count", "local_devices", "global_devices", "platform"}."""
  return dict(process_index=jax.process_index(), process_count=jax.process_count(),
              local_devices=jax.local_device_count(), global_devices=jax.device_count(),
              platform=jax.devices()[0].platform)


def is_main_process() -> bool:
  """True on process 0 (the one that writes logs, metrics and config files)."""
  return jax.process_index() == 0
