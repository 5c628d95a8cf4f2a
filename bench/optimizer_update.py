"""The training step's update after the backward pass, alone: gradient norm, clip, AdamW, the
keep-or-skip select and the parameter norm, on a model's real parameter shapes.

Forms of the two global norms (the rest is the trainer's own `umoe_jax.train.optimizer.adamw`):
  optax         `optax.tree.norm` and `optax.clip_by_global_norm`, as the trainer computes them
  rows          each leaf summed over its last axis, the row sums of all leaves finished together
  rows_barrier  the same with the row sums behind `lax.optimization_barrier`
XLA on GPU compiles `rows` to the same program as `optax` (its simplifier folds a sum of a
concatenation of row sums back into one reduction a leaf); the barrier keeps the form, and adds
kernels on an H200. The trainer keeps optax's norms.
First checks every form against the first on fresh random inputs (new parameters, both norms;
relative error), then reports the median wall time of `--iters` calls and the number of kernels
(the compiled program's top-level operations that launch work).

  python bench/optimizer_update.py [--config=umoe_base] [--forms=optax,rows,rows_barrier] [--iters=20]
      [--out=$OUT]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import timing  # noqa: E402  (bench/timing.py)
from checks import rel_err  # noqa: E402
from umoe_jax.train import optimizer as optimizer_lib  # noqa: E402
from umoe_jax.train.step import keep_if  # noqa: E402


def _rows_norm(tree, barrier: bool = False):
  parts = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1).reshape(-1) if x.ndim else
           jnp.square(x.astype(jnp.float32)).reshape(1) for x in jax.tree.leaves(tree) if x.size]
  if barrier:
    parts = jax.lax.optimization_barrier(parts)
  return jnp.sqrt(jnp.sum(jnp.concatenate(parts)))


def _clip_with(norm_fn, max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm with another norm."""
  def update(updates, state, params=None):
    del params
    n = norm_fn(updates)
    small = n < max_norm
    return jax.tree.map(lambda t: jax.lax.select(small, t, (t / n) * max_norm), updates), state
  return optax.GradientTransformation(optax.init_empty_state, update)


# The global norm of each form; "optax" also clips with optax's own transform, as the trainer does.
FORMS = {
    "optax": optax.tree.norm,
    "rows": _rows_norm,
    "rows_barrier": functools.partial(_rows_norm, barrier=True),
}


def update_fn(form: str, train, mask):
  """(params, opt_state, grads) -> (params, opt_state, grad_norm, param_norm), as in train_step."""
  if form not in FORMS:
    raise ValueError(f"unknown form {form!r}; valid: {', '.join(FORMS)}")
  norm_fn = FORMS[form]
  max_norm = float(train.grad_clip)
  clip = (optax.clip_by_global_norm(max_norm) if form == "optax" else
          _clip_with(norm_fn, max_norm))
  tx = optax.chain(clip, optimizer_lib.adamw(train, mask))

  def f(params, opt_state, grads):
    grad_norm = norm_fn(grads)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    apply = jnp.isfinite(grad_norm)
    new_params = keep_if(apply, new_params, params)
    return new_params, keep_if(apply, new_opt, opt_state), grad_norm, norm_fn(new_params)
  return tx, jax.jit(f)


def launched_ops(hlo_text: str) -> int:
  """Top-level operations of the compiled program's entry computation that launch device work."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  skip = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")
  count = 0
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(", line)
    if m and m.group(1) not in skip:
      count += 1
  return count


def model_tree(config_name: str, seed: int = 0):
  """(params, grads, decay mask, train config) of configs/CONFIG_NAME.py (loaded as
  bench/train_step.py loads it): random float32 trees of the model's shapes, the gradient's global
  norm 2 (so the clip at the recipe's 1.0 scales it)."""
  from flax import nnx

  from umoe_jax import stats
  from umoe_jax.model.lm import abstract_model
  cfg = stats.load_config_file(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "configs", f"{config_name}.py"))
  abstract = nnx.state(abstract_model(cfg.model), nnx.Param)
  mask = optimizer_lib.decay_mask(abstract)
  shapes = nnx.to_pure_dict(jax.tree.map(lambda v: v.value, abstract,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), 2 * len(leaves))
  params = [0.02 * jax.random.normal(k, s.shape, jnp.float32) for k, s in zip(keys, leaves)]
  scale = 2.0 / sum(s.size for s in leaves) ** 0.5
  grads = [scale * jax.random.normal(k, s.shape, jnp.float32)
           for k, s in zip(keys[len(leaves):], leaves)]
  return (jax.tree.unflatten(treedef, params), jax.tree.unflatten(treedef, grads), mask,
          cfg.train)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="umoe_base", help="a file of configs/, without .py")
  ap.add_argument("--forms", default=",".join(FORMS))
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  forms = [f for f in args.forms.split(",") if f]
  unknown = [f for f in forms if f not in FORMS]
  if unknown or not forms:
    raise ValueError(f"unknown form {(unknown[0] if unknown else args.forms)!r}; valid: "
                     f"{', '.join(FORMS)}")
  params, grads, mask, train = model_tree(args.config)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"{args.config}: {len(jax.tree.leaves(params))} leaves, {n_params / 1e6:.1f}M parameters, "
        f"{jax.devices()[0].device_kind}", flush=True)
  rows, first = [], None
  for form in forms:
    tx, f = update_fn(form, train, mask)
    opt_state = tx.init(params)
    opt_state = f(params, opt_state, grads)[1]   # non-zero moments for the timed calls
    compiled = f.lower(params, opt_state, grads).compile()
    out = f(params, opt_state, grads)
    if first is None:
      first = out
    err_p = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(first[0])))
    row = dict(form=form, ms=timing.wall_ms(f, params, opt_state, grads, iters=args.iters),
               kernels=launched_ops(compiled.as_text()), grad_norm=float(out[2]),
               param_norm=float(out[3]), rel_err_params=err_p,
               rel_err_grad_norm=rel_err(out[2], first[2]),
               rel_err_param_norm=rel_err(out[3], first[3]))
    rows.append(row)
    print(json.dumps(row), flush=True)
    del out, opt_state
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optimizer_update.json"), "w") as fh:
      json.dump(dict(config=args.config, device=jax.devices()[0].device_kind, rows=rows), fh,
                indent=1)
  print(f"{'form':12s} {'ms':>7s} {'kernels':>7s} {'err params':>10s} {'err |g|':>8s}")
  for r in rows:
    print(f"{r['form']:12s} {r['ms']:7.2f} {r['kernels']:7d} {r['rel_err_params']:10.1e} "
          f"{r['rel_err_grad_norm']:8.1e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
