"""The compiled programs of a training run: the model's static parts, the optimizer, the train
state's layout and shardings, and the jitted init / eval / train-step functions.

    progs = config_programs(config, model_cfg, mesh, rules)
    state = progs.init_fn(seed)                        # born sharded (progs.shardings)
    state, metrics = progs.train_fn(state, batch)      # batch: {"inputs", "targets"}: int32 [B, T]

Built once per (model, optimizer keys, step keys, mesh, rules, expert-parallel settings) and
cached, so a second run in one process (a notebook, the tests) reuses the compilations.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Optional

import jax

from umoe_jax.eval import perplexity
from umoe_jax.parallel import sharding as sharding_lib
from umoe_jax.train import optimizer as optimizer_lib
from umoe_jax.train import state as state_lib
from umoe_jax.train import step as step_lib


# config.train keys that shape the compiled programs (the others only steer the loop): those of
# the optimizer (state layout, init, eval are shared by runs that differ only in the step keys).
OPTIMIZER_KEYS = ("num_steps", "learning_rate", "warmup_steps", "warmup_ratio", "min_lr_ratio",
                  "b1", "b2", "eps", "weight_decay", "mu_dtype", "grad_clip")
STEP_KEYS = ("grad_accum_steps", "remat", "on_nonfinite", "loss_chunk_tokens", "fused_loss_head")


@dataclasses.dataclass(frozen=True)
class Programs:
  """The model's static parts, the optimizer, the state layout and the jitted functions."""
  parts: state_lib.ModelParts
  tx: Any
  schedule: Any
  abstract: state_lib.TrainState        # ShapeDtypeStructs
  shardings: state_lib.TrainState       # NamedShardings on the mesh
  init_fn: Callable                     # seed -> TrainState (born sharded)
  from_params_fn: Callable              # (params, seed) -> step-0 TrainState
  not_halted_fn: Callable               # () -> `halted` (False) of a resumed TrainState, placed
  eval_fn: Callable                     # (params, batch) -> (nll sum, tokens)
  train_fn: Optional[Callable] = None   # (state, batch) -> (state, metrics); state donated


# Cached, so that a second run in one process (a notebook, the tests) reuses the compilations.
# `capacity_factor`, `exchange` and `chunks` are part of the keys because the model reads them from
# `use_mesh` while tracing.
@functools.lru_cache(maxsize=4)
def _state_programs(model_cfg: Any, optimizer_items: tuple, mesh: Any, rules: tuple,
                    capacity_factor: Optional[float], exchange: str = "auto",
                    chunks: int = 1) -> Programs:
  del capacity_factor, exchange, chunks
  t = types.SimpleNamespace(**dict(optimizer_items))
  parts = state_lib.model_parts(model_cfg)
  tx = optimizer_lib.make_optimizer(t, optimizer_lib.decay_mask(parts.abstract_params))
  abstract = state_lib.abstract_state(model_cfg, tx, 0)
  shardings = state_lib.state_shardings(abstract, parts, mesh, rules)
  batch = sharding_lib.batch_sharding(mesh, rules)  # a prefix: every [B, T] leaf of the batch
  return Programs(
      parts=parts, tx=tx, schedule=optimizer_lib.learning_rate_schedule(t), abstract=abstract,
      shardings=shardings,
      init_fn=jax.jit(lambda seed: state_lib.init_state(model_cfg, tx, seed),
                      out_shardings=shardings),
      from_params_fn=jax.jit(lambda params, seed: state_lib.state_with_params(params, tx, seed),
                             out_shardings=shardings),
      not_halted_fn=jax.jit(state_lib.not_halted, out_shardings=shardings.halted),
      eval_fn=jax.jit(functools.partial(perplexity.eval_step, graphdef=parts.graphdef),
                      in_shardings=(shardings.params, batch)))


@functools.lru_cache(maxsize=8)
def programs(model_cfg: Any, optimizer_items: tuple, step_items: tuple, mesh: Any, rules: tuple,
             capacity_factor: Optional[float], exchange: str = "auto", chunks: int = 1) -> Programs:
  """Everything compiled for one (model, optimizer, step options, mesh) combination."""
  base = _state_programs(model_cfg, optimizer_items, mesh, rules, capacity_factor, exchange, chunks)
  t = dict(step_items)
  train = functools.partial(step_lib.train_step, graphdef=base.parts.graphdef, tx=base.tx,
                            schedule=base.schedule, accum_steps=t["grad_accum_steps"],
                            remat=t["remat"], on_nonfinite=t["on_nonfinite"],
                            loss_chunk_tokens=t["loss_chunk_tokens"],
                            fused_loss_head=t["fused_loss_head"])
  batch = sharding_lib.batch_sharding(mesh, rules)
  train_fn = jax.jit(train, in_shardings=(base.shardings, batch),
                     out_shardings=(base.shardings, None), donate_argnums=0)
  return dataclasses.replace(base, train_fn=train_fn)


def expert_parallel_settings(config: Any) -> tuple[Optional[float], str]:
  """(capacity_factor, exchange) of `config.expert_parallel` (defaults: dropless, "auto"): what
  `use_mesh(..., expert_capacity_factor=, expert_exchange=)` takes."""
  ep = config.get("expert_parallel") or {}
  return ep.get("capacity_factor"), ep.get("exchange", "auto")


def expert_chunks(config: Any) -> int:
  """`config.expert_parallel.chunks` (default 1): what `use_mesh(..., expert_chunks=)` takes."""
  return (config.get("expert_parallel") or {}).get("chunks", 1)


def config_programs(config: Any, model_cfg: Any, mesh: Any, rules: tuple) -> Programs:
  """`programs` of a whole config: its OPTIMIZER_KEYS / STEP_KEYS of config.train and its
  expert_parallel settings."""
  t = config.train
  return programs(model_cfg, tuple((k, t[k]) for k in OPTIMIZER_KEYS),
                  tuple((k, t[k]) for k in STEP_KEYS), mesh, rules,
                  *expert_parallel_settings(config), expert_chunks(config))
