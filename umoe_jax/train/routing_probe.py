"""The trainer's routing probe: routing fluctuation on a fixed probe batch at every evaluation.

The probe is the first `log.routing_probe_batches` held-out batches (the same tokens at every
evaluation of a run). At each evaluation every router's picks on it are compared with those of the
previous evaluation of this run (the first evaluation of a run, fresh or resumed, sets the
baseline) and logged to TensorBoard and metrics.jsonl:

  routing/<layer>/<router>/top1_change   fraction of probe tokens whose top-1 expert changed
  routing/<layer>/<router>/jaccard       mean Jaccard overlap of their top-k sets
  routing/top1_change, routing/jaccard   the means over routers
  routing/previous_step                  the step compared with (the previous evaluation)
  routing/probe_tokens                   the probe's size in tokens
  routing/load_heatmap                   TensorBoard image: the probe's expert load, layers x experts

Definitions: `umoe_jax.analysis.routing`. Routing is read as in evaluation (no training step), in the
model's compute dtype (`model.compute_dtype`, as training; `python -m umoe_jax.analysis routing`
measures checkpoints in float32 on a probe of any size). The console line, the heatmap's title and
`python -m umoe_jax.plot` say the probe's size and the steps compared.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np
from absl import logging

from umoe_jax.analysis import routing
from umoe_jax.analysis.probe import route_outputs


def _to_host(x: Any) -> np.ndarray:
  import jax
  if jax.process_count() == 1:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.lru_cache(maxsize=8)
def probe_fn(graphdef: Any, mesh: Any, rules: Any, capacity_factor: Any, exchange: str):
  """jit((params, tokens [B, T]) -> {router: (expert_ids [B, T, K], picks per expert [E])}),
  shardings following the (committed) inputs. Cached per model and parallel context (what the
  model reads from `use_mesh` while tracing), so runs of one model in a process share it."""
  del mesh, rules, capacity_factor, exchange  # cache keys only
  import jax
  import jax.numpy as jnp

  def fn(params, tokens):
    routes = route_outputs(params, tokens, graphdef=graphdef)
    count = lambda ids, e: jnp.bincount(jnp.maximum(ids.reshape(-1), 0), length=e,
                                        weights=(ids.reshape(-1) >= 0).astype(jnp.int32))
    return {name: (ids, count(ids, probs.shape[-1])) for name, (ids, probs) in routes.items()}
  return jax.jit(fn)


class RoutingProbe:
  """Every router's picks on fixed probe batches, and their change since the previous call.

  `batches`: host batches {"inputs": [B, T]} of the training's batch layout on `mesh`; `dtype`
  names the compute dtype in the descriptions.
  """

  def __init__(self, graphdef: Any, batches: Sequence[dict], mesh: Any, rules: Any,
               capacity_factor: Optional[float] = None, exchange: str = "auto", dtype: str = ""):
    self.mesh, self.rules, self.dtype = mesh, rules, dtype
    self.batches = [{"inputs": np.asarray(b["inputs"])} for b in batches]
    self.fn = probe_fn(graphdef, mesh, rules, capacity_factor, exchange)
    self.previous: Optional[tuple[int, dict[str, np.ndarray]]] = None

  def routes(self, params: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """({router: expert_ids [N, K]}, {router: picks per expert [E]}) on the probe (N tokens)."""
    from umoe_jax.parallel import sharding as sharding_lib
    ids: dict[str, list] = {}
    counts: dict[str, np.ndarray] = {}
    for b in self.batches:
      out = self.fn(params, sharding_lib.global_batch(b, self.mesh, self.rules)["inputs"])
      for name, (x, c) in out.items():
        ids.setdefault(name, []).append(_to_host(x))
        counts[name] = counts.get(name, 0) + _to_host(c).astype(np.int64)
    return ({name: np.concatenate([p.reshape(-1, p.shape[-1]) for p in chunks])
             for name, chunks in ids.items()}, counts)

  @property
  def n_tokens(self) -> int:
    """The probe's tokens over all processes."""
    import jax
    return sum(b["inputs"].size for b in self.batches) * jax.process_count()

  def describe(self) -> str:
    """'8,192 tokens: 2 held-out batches of 8 x 512, bfloat16'."""
    import jax
    rows = sum(len(b["inputs"]) for b in self.batches) * jax.process_count()
    n = len(self.batches)
    seq = self.batches[0]["inputs"].shape[-1] if self.batches else 0
    return (f"{self.n_tokens:,} tokens: {n} held-out batch{'es' if n != 1 else ''} of "
            f"{rows // max(n, 1)} x {seq}" + (f", {self.dtype}" if self.dtype else ""))

  def measure(self, step: int, params: Any) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """(the change since the previous call as scalars (none at the first call), picks per
    expert {router: [E]} on the probe now)."""
    ids, counts = self.routes(params)
    scalars: dict[str, float] = {}
    if self.previous is not None and ids:
      fluct = routing.fluctuation(self.previous[1], ids)
      for name, f in fluct.items():
        scalars[f"routing/{name}/top1_change"] = f["top1_change"]
        scalars[f"routing/{name}/jaccard"] = f["jaccard"]
      scalars["routing/top1_change"] = float(np.mean([f["top1_change"] for f in fluct.values()]))
      scalars["routing/jaccard"] = float(np.mean([f["jaccard"] for f in fluct.values()]))
      scalars["routing/previous_step"] = float(self.previous[0])
      scalars["routing/probe_tokens"] = float(self.n_tokens)
    self.previous = (step, ids)
    return scalars, counts

  def log(self, step: int, params: Any, writer: Any) -> dict[str, float]:
    """measure(), written to `writer` (scalars + the load heatmap image) with a console line."""
    import jax

    from umoe_jax.train import metrics as metrics_lib
    previous = self.previous[0] if self.previous is not None else None
    scalars, counts = self.measure(step, params)
    if not counts:  # a model without routers
      return scalars
    if scalars:
      writer.scalars(step, scalars)
    if jax.process_index() == 0:
      try:  # a picture is not worth stopping a training run for
        from umoe_jax.plot import figures as plots
        fig = plots.load_heatmap(counts, f"Expert load on the routing probe at step {step}\n"
                                         f"({self.describe()})")
        writer.image(step, "routing/load_heatmap", plots.png_bytes(fig))
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("routing probe: no load heatmap image at step %d (%s: %s)", step,
                        type(e).__name__, e)
      if scalars:
        metrics_lib.log_line(
            f"routing step {step} vs step {previous}: top-1 changed "
            f"{100 * scalars['routing/top1_change']:.1f}% of {self.n_tokens:,} probe tokens | "
            f"top-k Jaccard {scalars['routing/jaccard']:.3f} (means of {len(counts)} routers)")
    return scalars


def make_routing_probe(s: Any) -> Optional[RoutingProbe]:
  """The probe of a trainer `Setup` (`umoe_jax.train.setup.setup`), or None: no evaluation or
  `log.routing_probe_batches=0`. (A model without routers gets a probe that logs nothing.)"""
  n = s.config.log.get("routing_probe_batches", 0)
  if not n or not s.eval_batches:
    return None
  return RoutingProbe(s.programs.parts.graphdef, s.eval_batches[:n], s.mesh, s.rules,
                      s.capacity_factor, s.exchange, dtype=s.model_cfg.compute_dtype)
