"""The train state: one pytree of arrays (params, optimizer state, step, RNG), and how it is built
and placed on a mesh.

A checkpoint holds `checkpoint_tree(state)`: every field but the run-local `halted`, which every run
starts False (`from_checkpoint_tree`), so a halt of one run never carries over into the next.

The model is split once into a static `graphdef` (module structure, no arrays) and its parameters as
a pure nested dict (`nnx.to_pure_dict`); the jitted step merges them back (`nnx.merge`). A pure dict
keeps optax, Orbax and the sharding plan free of NNX wrappers; the logical axis names the sharding
plan needs come from the abstract model (`ModelParts.abstract_params`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from umoe_jax.config import ModelConfig
from umoe_jax.model.lm import CausalLM, abstract_model


@struct.dataclass
class TrainState:
  step: jax.Array        # [] int32: steps taken (a skipped non-finite step counts)
  params: Any            # pure dict of param_dtype (float32) arrays
  opt_state: Any         # optax state over `params`
  rng: jax.Array         # [2] uint32 base key; step s may use jax.random.fold_in(rng, s)
  skipped: jax.Array     # [] int32: steps whose update was dropped (non-finite loss or gradient)
  halted: jax.Array      # [] bool: this run met a non-finite step under on_nonfinite="stop", so
                         # every later update of the run is dropped. Run-local: not checkpointed.


# The fields a checkpoint holds (all but `halted`), in the layout written before `halted` existed.
CHECKPOINT_FIELDS = ("step", "params", "opt_state", "rng", "skipped")


def checkpoint_tree(state: TrainState) -> dict:
  """What a checkpoint holds of `state` (arrays, or ShapeDtypeStructs for a restore target)."""
  return {name: getattr(state, name) for name in CHECKPOINT_FIELDS}


def from_checkpoint_tree(tree: dict, halted: jax.Array) -> TrainState:
  """The state of a run that starts from a restored `checkpoint_tree`; `halted` is a fresh False
  (placed like the state's scalars, e.g. `Programs.not_halted_fn()`)."""
  return TrainState(**{name: tree[name] for name in CHECKPOINT_FIELDS}, halted=halted)


def not_halted() -> jax.Array:
  return jnp.zeros((), jnp.bool_)


@dataclasses.dataclass(frozen=True)
class ModelParts:
  """What the trainer needs of the model besides its arrays."""
  cfg: ModelConfig
  graphdef: Any          # nnx.GraphDef: static, hashable
  abstract_params: Any   # nnx.State of nnx.Param(ShapeDtypeStruct) with logical axis metadata


def _key(seed) -> jax.Array:
  return jax.random.key(jnp.asarray(seed, jnp.uint32))


def _build(cfg: ModelConfig, seed) -> CausalLM:
  return CausalLM(cfg, rngs=nnx.Rngs(params=_key(seed)))


def split_params(model: nnx.Module):
  """(graphdef, params nnx.State). Fails if the model holds variables other than nnx.Param."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise NotImplementedError(
        f"the trainer keeps only nnx.Param state, but the model also holds {nnx.to_pure_dict(rest)}")
  return graphdef, params


def model_parts(cfg: ModelConfig) -> ModelParts:
  graphdef, abstract_params = split_params(abstract_model(cfg))
  return ModelParts(cfg=cfg, graphdef=graphdef, abstract_params=abstract_params)


def merge(graphdef: Any, params: Any) -> CausalLM:
  """The model for a pure-dict params tree (inside jit: arrays are tracers)."""
  return nnx.merge(graphdef, params)


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> TrainState:
  """A fresh state (pure function of `seed`; call it under jit with out_shardings)."""
  _, params = split_params(_build(cfg, seed))
  return state_with_params(nnx.to_pure_dict(params), tx, seed)


def state_with_params(params: Any, tx: optax.GradientTransformation, seed: int) -> TrainState:
  """A step-0 state around given params (`checkpoint.init_from`): fresh optimizer state."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=jax.random.key_data(_key(seed)).astype(jnp.uint32),
                    skipped=jnp.zeros((), jnp.int32), halted=not_halted())


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> TrainState:
  return jax.eval_shape(lambda: init_state(cfg, tx, seed))


def state_shardings(abstract: TrainState, parts: ModelParts, mesh: jax.sharding.Mesh,
                    rules: Optional[Any] = None) -> TrainState:
  """NamedSharding for every leaf: params by their logical axes and `rules`, optimizer moments like
  their params, scalars (step, counts, RNG) replicated."""
  from umoe_jax.parallel import sharding
  return sharding.state_shardings(abstract, mesh, rules, params=parts.abstract_params)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying shardings: the restore target on the current mesh."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)
