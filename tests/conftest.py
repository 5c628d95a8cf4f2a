"""Shared test helpers: repo root on sys.path, tiny configs, randomised parameters, float64 params.

JAX stays in its default float32 mode; the float64 oracles in `reference.py` are pure numpy.
Test modules import the helpers below with `from conftest import ...`.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
from typing import Any, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
for _p in (ROOT, TESTS):
  if _p not in sys.path:
    sys.path.insert(0, _p)

# CPU machines: XLA's backend at optimisation level 0 (set before jax starts; subprocesses inherit
# it). The tests' programs are tiny, so compiling dominates their time and level 0 cuts it by about a
# quarter (measured on test_scan_layers + test_remat). The tolerances already allow XLA reordering.
# A GPU machine keeps its flags: the kernels' tests there run the code as users do.
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()
# Several test processes share one GPU (`pytest -n 4 tests/gpu`): none may take most of its memory up
# front, as JAX does by default; the tests' arrays are small.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import configs.common  # noqa: E402
from umoe_jax.config import ModelConfig, model_config  # noqa: E402

import reference  # noqa: E402,F401
from ci_checks import pytest_runtest_makereport, pytest_runtest_setup  # noqa: E402,F401  (extras)
import gpu_report  # noqa: E402
import gpu_tiers  # noqa: E402


@pytest.fixture(autouse=True)
def every_fp8_product():
  """The FP8 tests run at small widths, where `fp8_gmm.MIN_CONTRACTION` would give every product
  bf16 operands: every product takes FP8 here, so they reach the FP8 forms. The threshold's own
  tests (test_fp8_min_contraction.py) set it. Not through the test's `monkeypatch`, whose `undo()`
  some tests call between their runs."""
  from umoe_jax.ops import fp8_gmm
  before, fp8_gmm.MIN_CONTRACTION = fp8_gmm.MIN_CONTRACTION, 0
  yield
  fp8_gmm.MIN_CONTRACTION = before


def pytest_addoption(parser):
  gpu_tiers.add_options(parser)


def pytest_configure(config):
  config.pluginmanager.register(gpu_report, "umoe_gpu_report")
  config.pluginmanager.register(gpu_tiers, "umoe_gpu_tiers")
  # flax 0.12 deprecates `Variable.value`, which the model code still uses: one warning per call site
  # and trace would drown the report.
  config.addinivalue_line("filterwarnings",
                          "ignore:'.value' access is now deprecated:DeprecationWarning")


# Tiny shapes shared by the module tests: small enough for numpy loops, big enough to be non-trivial
# (several experts per token, more experts than slots, T > every top-k).
TINY = dict(vocab_size=40, d_model=24, n_layers=1, max_seq_len=16, compute_dtype="float32",
            gmm_backend="xla")
TINY_ATT = dict(n_heads=2, head_dim=8, v_head_dim=6, top_k=2, q_lora_rank=4)
TINY_FFN = dict(d_ff=20, top_k=3)
TINY_MOE = dict(n_experts=6, d_expert=10)


def tiny_config(family: str, **overrides: Any) -> ModelConfig:
  """A validated ModelConfig of `family` ("dense", "ffn_moe", "umoe", "umoe_att") at test size.

  `overrides` use dotted keys for sections: `tiny_config("umoe", **{"attention.top_k": 3})`.
  """
  m = configs.common.model(family, "tiny").to_dict()
  m.update(TINY)
  m["attention"].update(TINY_ATT if family.startswith("umoe") else
                        {k: v for k, v in TINY_ATT.items() if k != "q_lora_rank"})
  m["ffn"].update(TINY_FFN)
  if family != "dense":
    m["moe"].update(TINY_MOE)
  for key, value in overrides.items():
    node = m
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return model_config(m)


def randomize_params(module: nnx.Module, seed: int, router_std_times_sqrt_d: float = 2.0) -> None:
  """Replaces every parameter with well-scaled random values, in place.

  The real init (std 0.02) makes attention near-uniform and routing near-uniform, which would hide
  errors; here every matrix gets N(0, 1/fan_in) (so activations stay O(1) and attention is peaked),
  embeddings N(0, 1), norm scales 1 + U(-0.5, 0.5) (so a wrong norm weight shows), and routers
  N(0, (c/sqrt(D))^2) so that logits have std ~c and the top-k is decisive.
  """
  rng = np.random.default_rng(seed)
  state = nnx.state(module, nnx.Param)
  pure = nnx.to_pure_dict(state)

  def fill(tree, path):
    if isinstance(tree, Mapping):
      return {k: fill(v, path + (str(k),)) for k, v in tree.items()}
    shape, dtype = tree.shape, tree.dtype
    name = path[-1]
    if name == "scale":
      new = 1.0 + rng.uniform(-0.5, 0.5, shape)
    elif name == "selection_bias":   # balancing state, not a weight: starts at zero
      new = np.zeros(shape)
    elif len(shape) < 2:             # e.g. X-MoE's log temperature
      new = rng.uniform(-0.5, 0.5, shape)
    elif name == "embed":
      new = rng.standard_normal(shape)
    elif "router" in path:
      new = rng.standard_normal(shape) * router_std_times_sqrt_d / np.sqrt(shape[-2])
    else:
      new = rng.standard_normal(shape) / np.sqrt(shape[-2])
    return jnp.asarray(new, dtype)

  nnx.replace_by_pure_dict(state, fill(pure, ()))
  nnx.update(module, state)


def random_module(factory, seed: int, **kw) -> nnx.Module:
  """`factory()` built abstractly (no init compilation) and filled by `randomize_params`."""
  module = nnx.eval_shape(factory)
  randomize_params(module, seed, **kw)
  return module


def numpy_params(module: nnx.Module) -> dict:
  """The module's parameters as a nested dict of float64 numpy arrays (layout of `to_pure_dict`)."""
  return reference.tree_f64(nnx.to_pure_dict(nnx.state(module, nnx.Param)))


def rel_err(out, ref) -> float:
  return reference.rel_err(out, ref)


def with_dtype(cfg: ModelConfig, compute_dtype: str) -> ModelConfig:
  import dataclasses
  return dataclasses.replace(cfg, compute_dtype=compute_dtype)


def bf16_round(x) -> np.ndarray:
  """x rounded to bfloat16 (what a bf16 module sees), back in float32."""
  import ml_dtypes
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def positions_for(b: int, t: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


# Triton's interpreter keeps a launch's grid in module state, and XLA's CPU runtime may run two
# independent host callbacks at once: every interpreted launch inside a callback takes this lock.
INTERPRETER_LOCK = threading.Lock()


def interpreter_loop_bounds() -> None:
  """Lets Triton's interpreter (TRITON_INTERPRET=1) take tensors as loop bounds: under numpy >= 2
  it calls int() on a size-1 array, which numpy refuses. Call it before running a kernel there."""
  import triton.runtime.interpreter as interp
  orig = interp._patch_lang_tensor
  if getattr(orig, "takes_loop_bounds", False):
    return

  def patched(tensor, scope):
    orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
  patched.takes_loop_bounds = True
  interp._patch_lang_tensor = patched


def exact_interpreter_cast(dst_name: str, np_dtype, seen: list | None = None) -> None:
  """Makes Triton's interpreter cast float32 to `dst_name` ("float8e4nv", "bfloat16") correctly
  rounded, through numpy's `np_dtype` (ml_dtypes' round to nearest even, as a GPU and XLA do): its
  own rounds otherwise (e4m3: the first dropped bit added, ties away from zero, a mantissa carry ORed
  into the exponent; bfloat16: toward zero). Every other cast is left alone; `seen` collects the
  sizes of the casts taken."""
  import triton.language as tl
  import triton.runtime.interpreter as interp
  convert = interp._convert_float
  dst, bits = getattr(tl, dst_name), np.dtype(f"uint{np.dtype(np_dtype).itemsize * 8}")

  def exact(data, src, to, rounding_mode):
    if src == tl.float32 and to == dst:
      if seen is not None:
        seen.append(data.size)
      return np.asarray(data, np.float32).astype(np_dtype).view(bits)
    return convert(data, src, to, rounding_mode)
  interp._convert_float = exact


def run_in_triton_interpreter(module: str, check: str, marker: str, timeout: int = 300) -> None:
  """Runs `<module>.<check>()` of a test module in a fresh CPU process with TRITON_INTERPRET=1 (it
  must be set before Triton is imported) and asserts that it printed `marker`."""
  import subprocess
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", f"import {module} as t; t.{check}()"],
                     env=env, capture_output=True, text=True, timeout=timeout)
  assert marker in r.stdout, r.stdout[-2000:] + r.stderr[-5000:]


def jaxpr_avals(jaxpr):
  """The avals of every array a Jaxpr creates, with those of the jaxprs inside it (scans, jits,
  conds, ...): what a memory claim ("no [N, V] array") is checked against."""
  for eqn in jaxpr.eqns:
    yield from (v.aval for v in eqn.outvars)
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)   # a ClosedJaxpr's Jaxpr, or a Jaxpr
        if hasattr(inner, "eqns"):
          yield from jaxpr_avals(inner)


def micro_umoe(seed: int = 0):
  """A one-layer float32 UMoE (d_model 16, 4 experts) whose train step compiles in seconds, with
  random parameters: (model config, `state.model_parts`, the parameters as a pure dict)."""
  from umoe_jax.model.lm import CausalLM
  from umoe_jax.train import state as state_lib
  c = configs.common.experiment("umoe", "tiny").model
  c.update(dict(n_layers=1, d_model=16, compute_dtype="float32"))
  c.moe.update(dict(n_experts=4, d_expert=8))
  c.ffn.top_k, c.attention.top_k, c.attention.head_dim, c.attention.q_lora_rank = 2, 1, 8, 4
  cfg = model_config(c)
  params = nnx.to_pure_dict(nnx.state(random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), seed),
                                      nnx.Param))
  return cfg, state_lib.model_parts(cfg), params
