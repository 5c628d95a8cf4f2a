"""The decoder-only language model: embed -> blocks -> final RMSNorm -> untied LM head."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig, model_config
from umoe_jax.model.block import DecoderBlock, make_expert_pools
from umoe_jax.model.cache import DecodeCache
from umoe_jax.model.layers import RMSNorm, logits_dot, make_param, normal_init
from umoe_jax.model.remat import rematerialise
from umoe_jax.model.routers import RouterOutput, fold_rng, route_context, routing_stats
from umoe_jax.parallel import rules as ax
from umoe_jax.parallel.sharding import with_logical_constraint


# The residual stream [B, T, D]: batch split over data x fsdp x expert, the rest replicated.
_ACTIVATION_AXES = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)


class CausalLM(nnx.Module):
  """Returns float32 logits and an aux record of every router of every layer."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg = model_config(cfg)
    self.cfg = cfg
    self.embed = make_param(rngs, normal_init(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                            (ax.VOCAB, ax.EMBED), cfg.param_dtype)
    # moe.share_across_layers: one pool (pair) built here, the same modules in every block.
    pools = make_expert_pools(cfg, rngs) if cfg.moe.share_across_layers else None
    self.layers = nnx.List([DecoderBlock(cfg, rngs=rngs, pools=pools) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    self.lm_head = make_param(rngs, normal_init(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                              (ax.EMBED, ax.VOCAB), cfg.param_dtype)

  def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None, *,
               cache: Optional[DecodeCache] = None, remat: bool | str = False,
               step: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
               last_logits_only: bool = False, return_routes: bool = False):
    """tokens [B, T] int -> (logits [B, T, V] float32, aux).

    aux = {"balance_loss": [] float32 (sum over routers, coefficients applied),
           "router_losses": {name: [] float32}, the routers' other losses ("z_loss", ...) summed
                            over routers (coefficients applied); only those some router has,
           "routers": {"layer_{i}/{attention|ffn}": {"balance_loss", "expert_counts" [E], "entropy",
                                                     + that router's other losses by name}}}
    `return_routes=True` adds aux["routes"] = {"layer_{i}/<router>": RouterOutput} (every router's
    expert_ids [B, T, K] and probs [B, T, E]; for routing analysis, `umoe_jax.analysis`).

    With a `cache` (`umoe_jax.model.cache.init_cache`) the tokens are the next T of every sequence:
    they are written into the cache's slots [index, index + T), attend over the whole cache, and the
    updated cache is returned third. `positions` then default to index + arange(T); a negative
    position marks a padding token (never attended).

    Every router receives `route_context(tokens, step=step, decoding=cache is not None)`
    ({"token_ids": tokens}, with a cache the new tokens'; "step" when given; "decoding" with a
    cache), passed through the blocks as `route_context`. `step` [] int: the training step, for
    routers with a schedule (router.kind smoe_dropout, stablemoe); None = as at the end of training.
    `rng`: a PRNG key in training only (`router.jitter_eps`: the router-input noise), folded with the
    layer index here and the sub-layer in the block; None (evaluation, decoding) = no noise.

    `remat` (training only): a policy of `umoe_jax.model.remat.POLICIES` ("none", "block", "dots",
    "dots_no_batch") for what each decoder block keeps for the backward pass; True = "block"
    (recompute the whole block), False = "none".
    `last_logits_only=True` returns the logits of the last position only, [B, 1, V] (decoding's
    prefill: XLA does not narrow the LM head to a slice of its output, e.g. 4 GiB of float32 logits
    for 32 x 1024 tokens of a 32k vocabulary).
    """
    h, aux, new_cache = self._decoder(tokens, positions, cache=cache, remat=remat, step=step,
                                      rng=rng, return_routes=return_routes)
    if last_logits_only:
      h = h[:, -1:]
    with jax.named_scope("lm_head"):
      logits = logits_dot(h, self.lm_head.value.astype(self.cfg.compute_dtype))    # [B, T, V]
    if cache is None:
      return logits, aux
    return logits, aux, new_cache

  def hidden_states(self, tokens: jax.Array, positions: Optional[jax.Array] = None, *,
                    remat: bool | str = False, step: Optional[jax.Array] = None,
                    rng: Optional[jax.Array] = None, return_routes: bool = False):
    """tokens [B, T] int -> (h [B, T, D] in compute_dtype, aux): the decoder's output after the final
    norm, without the LM head (what a task head reads, e.g. `umoe_jax.finetune`). `aux`, `remat`
    `step`, `rng` and `return_routes` as in `__call__`; no cache."""
    h, aux, _ = self._decoder(tokens, positions, cache=None, remat=remat, step=step, rng=rng,
                              return_routes=return_routes)
    return h, aux

  def _decoder(self, tokens, positions, *, cache, remat, step, rng=None, return_routes=False):
    """Embedding, blocks and final norm: (h [B, T, D], aux, updated cache or None)."""
    cfg = self.cfg
    b, t = tokens.shape
    if cache is None and t > cfg.max_seq_len:
      raise ValueError(f"sequence length {t} exceeds model.max_seq_len={cfg.max_seq_len}")
    if positions is None:
      start = 0 if cache is None else cache.index
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    if cache is not None:
      key_positions = jax.lax.dynamic_update_slice(cache.key_positions,
                                                   positions.astype(jnp.int32), (0, cache.index))
      new_layers = []
    with jax.named_scope("embed"):
      h = jnp.take(self.embed.value, tokens, axis=0).astype(cfg.compute_dtype)      # [B, T, D]
    h = with_logical_constraint(h, _ACTIVATION_AXES)   # no-op outside parallel.use_mesh
    context = route_context(tokens.astype(jnp.int32), step=step, decoding=cache is not None,
                            rng=rng)                                                # router extras
    routes: dict[str, RouterOutput] = {}
    scanned = cfg.scan_layers and cache is None
    block = rematerialise(_apply_block, remat, in_scan=scanned)
    if scanned:
      h, routes = _scanned_blocks(list(self.layers), block, h, positions, context)
    else:
      for i, layer in enumerate(self.layers):
        layer_context = fold_rng(context, i)
        with jax.named_scope(f"layer_{i}"):  # profiles group a layer's ops by it (bench/profile_table.py)
          if cache is None:
            h, layer_routes = block(layer, h, positions, layer_context)
          else:
            h, layer_routes, layer_cache = layer(h, positions, cache=cache.layer(i, key_positions),
                                                 route_context=layer_context)
            new_layers.append(layer_cache.arrays)
        h = with_logical_constraint(h, _ACTIVATION_AXES)
        routes.update({f"layer_{i}/{name}": r for name, r in layer_routes.items()})
    h = self.final_norm(h)
    with jax.named_scope("routing_stats"):
      stats = {name: routing_stats(r, r.probs.shape[-1]) for name, r in routes.items()}
    total = sum((s["balance_loss"] for s in stats.values()), jnp.zeros((), jnp.float32))
    losses: dict[str, jax.Array] = {}
    for r in routes.values():
      for name, value in r.aux_losses.items():
        losses[name] = losses.get(name, jnp.zeros((), jnp.float32)) + value
    aux = {"balance_loss": total, "router_losses": losses, "routers": stats}
    if return_routes:
      aux["routes"] = routes
    if cache is None:
      return h, aux, None
    return h, aux, DecodeCache(index=cache.index + t, key_positions=key_positions,
                               layers=tuple(new_layers))


  def named_routers(self) -> dict[str, nnx.Module]:
    """{route name as in aux["routers"] ("layer_{i}/ffn", ...): router module} of every router."""
    return {f"layer_{i}/{name}": router for i, layer in enumerate(self.layers)
            for name, router in layer.named_routers().items()}


def _apply_block(layer: DecoderBlock, h: jax.Array, positions: jax.Array, context: dict):
  return layer(h, positions, route_context=context)


def _scanned_blocks(layers: list, block, h: jax.Array, positions: jax.Array, context: dict):
  """`model.scan_layers`: the blocks applied as one lax.scan, so XLA compiles one block. Their
  parameters stay separate modules (the checkpoint layout); each step stacks them [L, ...] for the
  scan (its transpose hands each layer its own gradient). h [B, T, D] -> (h, {"layer_{i}/<router>":
  RouterOutput}), the same values as the loop, with each layer's rng folded with its index."""
  graphdef, first = nnx.split(layers[0])
  states = [first]
  for i, layer in enumerate(layers[1:], start=1):
    layer_graphdef, state = nnx.split(layer)
    if layer_graphdef != graphdef:
      raise ValueError(f"model.scan_layers=True needs decoder blocks of one structure; layer {i} "
                       "differs from layer 0 (set model.scan_layers=False)")
    states.append(state)
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

  def body(h, layer_and_index):
    state, i = layer_and_index
    h, layer_routes = block(nnx.merge(graphdef, state), h, positions, fold_rng(context, i))
    return with_logical_constraint(h, _ACTIVATION_AXES), layer_routes

  with jax.named_scope("layers"):
    h, stacked_routes = jax.lax.scan(body, h, (stacked, jnp.arange(len(layers), dtype=jnp.int32)))
  return h, {f"layer_{i}/{name}": jax.tree.map(lambda leaf: leaf[i], r)
             for i in range(len(layers)) for name, r in stacked_routes.items()}


def build_model(cfg, seed: int = 0) -> CausalLM:
  """Builds and initialises a model from a ModelConfig or a `config.model` ConfigDict."""
  return CausalLM(model_config(cfg), rngs=nnx.Rngs(params=seed))


class _ShapeOnlyRngs:
  """Stands in for nnx.Rngs when only shapes matter: one constant key and no counter.

  Under `nnx.eval_shape` every `nnx.Rngs` draw updates a traced counter, which made building the
  abstract large models take tens of seconds; shapes never depend on key values.
  """

  def __call__(self):
    return jax.random.key(0)

  params = __call__


def abstract_model(cfg) -> CausalLM:
  """The model with ShapeDtypeStruct parameters: no memory, for statistics and sharding plans."""
  cfg = model_config(cfg)
  return nnx.eval_shape(lambda: CausalLM(cfg, rngs=_ShapeOnlyRngs()))
