"""End-to-end training throughput: the trainer's own jitted step (forward, backward, clip, AdamW).

For each model config and mesh layout: builds the state and step exactly as `train.py` does
(`umoe_jax.train.loop.config_programs`), checks the first loss is near ln(V) and finite, then times
`--steps` steps on random tokens (never zeros) and reports median step time, tokens/s, MFU and peak
memory. Usage (GPU):

  python bench/train_step.py --configs=dense_base,umoe_base --batch=32 --seq_len=1024 \
      [--layouts=single,data,expert] [--gmm_backend=auto] [--remat[=block|dots|dots_no_batch]] [--out=$OUT] \
      [--capacity_factor=1.25] [--exchange=auto|all_to_all|all_gather|ragged] [--chunks=C]
      [--loss_chunk_tokens=N]   (train.loss_chunk_tokens: LM head + cross-entropy in N-token chunks)
      [--fused_loss_head=0|1]   (train.fused_loss_head: LM head + cross-entropy as one op, unchunked)
      [--mu_dtype=float32|bfloat16]   (train.mu_dtype: AdamW's first moment)
      [--compilation_cache_dir=DIR]   (JAX's persistent compilation cache: compile time only)
      [--compile_only]   (compile the rows into --compilation_cache_dir and time nothing)
      [--precompile=JOBS]   (first compile the rows' programs, JOBS --compile_only processes at a
                    time, into --compilation_cache_dir; then time the rows, loading them. A Zipf
                    row's program is its uniform row's, compiled once)
      [--gmm_tiles=FILE] [--attention_tiles=FILE]   (tile rows from bench/gmm.py / bench/attention_core.py sweeps)
      [--core_backward=recompute|stored_pairs]   (model.attention.core_backward)
      [--router_logits_dtype=float32|bfloat16]   (model.router.logits_dtype: x W_r's operands)
      [--fuse_activation=0|1] [--fuse_weight_rows=0|1]   (model.moe.fuse_activation / fuse_weight_rows)
      [--scan_layers=0|1]   (model.scan_layers: the blocks as one lax.scan; compile time)
      [--triton_launch=custom_call|ffi]   ($UMOE_TRITON_LAUNCH: how Triton kernels reach XLA)
      [--profile[=STEPS]]   (kernel time by named scope, bench/profile_table.py; no CUDA graphs;
                    an fp8 row profiled beside its bf16 row also prints where their times differ)
      [--trace_step=N]   (a jax.profiler trace of timed step N as it runs, CUDA graphs kept)
      [--freeze_heap=1|0]   (gc.freeze before the timed steps, as the trainer does; default 1)
      [--zipf=S]   (tokens drawn Zipf(S) over a shuffled vocabulary, as text's unigrams, instead of
                    uniformly: a fresh router's loads then skew as on real text; 0 = uniform)
      [--precision=bf16|fp8]   (train.precision: the matmuls' operands, docs/training.md)
      [--routing=router|balanced]   (balanced: every router's ids replaced by round-robin experts,
                    token t's K slots (t*K + j) mod E, gates 1/K: the kernels' ceiling beside real
                    routing; bench-only, bench/balanced_routing.py)
      [--tgmm_big_first_skew=N]   (kernels/triton_gmm.TGMM_BIG_FIRST_SKEW: the Triton weight
                    gradient's tiles largest groups first under skew >= N, N >= 1)
      [--fp8_one_block_scales=0|1] [--fp8_mosaic_products=0|1] [--fp8_block_quantiser=0|1]
                    (module switches of SWITCHES: kernels/gmm/triton_fp8_gmm.ONE_BLOCK_SCALES,
                    umoe_jax/ops/fp8_gmm.MOSAIC_PRODUCTS, umoe_jax/ops/fp8_gmm.KERNEL_BLOCKS)
      [--results=PATH]   (one JSON row a measured row, bench/results.py: default $OUT/rows.jsonl
                    when $OUT is set, else bench/results/<device>.jsonl; none: no rows)
  python bench/train_step.py --runs=umoe_base:single,umoe_base:data@4,umoe_base:expert@8:ragged:2

A row is CONFIG:LAYOUT[@N][:EXCHANGE[:CHUNKS[:CAPACITY_FACTOR]]][/FLAG=VALUE...]; a field left out or
"-" takes --exchange / --chunks / --capacity_factor, then the config's; /precision=, /zipf=,
/routing= and the module switches of SWITCHES (/KEY=) set those flags for that row
alone, so one run list holds uniform, Zipf-skewed and balanced rows in both precisions:
  --runs=umoe_base:single,umoe_base:single/zipf=1.1,umoe_base:single/routing=balanced/precision=fp8
Layouts over N devices (default: all; @N takes the first N):
  single       one device
  data         data parallel (mesh data=N)
  fsdp         FSDP (mesh fsdp=N: params and optimizer state split, batch split)
  expert       expert parallel (mesh expert=N; the batch is split over the expert axis too)
  fsdp_expert  FSDP x expert parallel (mesh fsdp=2, expert=N/2; UMoE-large on 8: fsdp=2 x expert=4)
The batch is --batch sequences per device. Every row reports its routing's load skew: per router,
the largest expert's picks over the mean in the last timed step (`routing_load`: median and max over
the routers). After the rows, the table gives each row's scaling
efficiency = (tokens/s per device) / (tokens/s of the same config's single row in this command).
`--time_limit_s` starts no row that the slowest row so far would carry past the limit (device
machines stop a command at their limit; the rows measured so far are in $OUT/train_step.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Any, NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import balanced_routing  # noqa: E402  (bench/balanced_routing.py)
import results  # noqa: E402  (bench/results.py)
from kernels import triton_launch  # noqa: E402
from kernels.gmm import triton_fp8_gmm  # noqa: E402
from umoe_jax.ops import fp8_gmm  # noqa: E402
from umoe_jax.train import host_gc  # noqa: E402

# The official PyTorch UMoE code's tokens/s (bf16, 32 x 1024 tokens a step) by device kind: on one
# H200, and on one H100 in the same run as this script's rows of 2026-12-05. A row is compared only
# with the official code on its own kind of device.
ANCHORS = {
    "NVIDIA H200": {"dense_base": 213.6e3, "ffn_moe_base": 71.2e3, "umoe_base": 58.2e3},
    "NVIDIA H100 80GB HBM3": {"dense_base": 180.7e3, "ffn_moe_base": 59.9e3, "umoe_base": 49.3e3},
}


def official_tokens_per_s(device_kind: str, config: str) -> float | None:
  """The official code's tokens/s for `config` on one `device_kind` device (None: not measured)."""
  return ANCHORS.get(device_kind, {}).get(config)


def log(*a):
  print(*a, flush=True)


LAYOUTS = ("single", "data", "fsdp", "expert", "fsdp_expert")
EXCHANGES = ("auto", "all_to_all", "all_gather", "ragged")  # umoe_jax.parallel.sharding's


def parse_layout(layout: str, available: int) -> tuple[str, int]:
  """'expert@4' -> ('expert', 4); 'data' -> ('data', available); 'single' -> ('single', 1)."""
  kind, _, count = layout.partition("@")
  if kind not in LAYOUTS:
    raise ValueError(f"unknown layout {kind!r} in {layout!r}; valid: {', '.join(LAYOUTS)}")
  n = 1 if kind == "single" else int(count) if count else available
  if n < 1 or n > available:
    raise ValueError(f"layout {layout!r} wants {n} devices; {available} available")
  if kind == "fsdp_expert" and (n < 4 or n % 2):
    raise ValueError(f"layout {layout!r}: fsdp_expert is fsdp=2 x expert=N/2, N even and >= 4")
  return kind, n


def layout_mesh(layout: str, n: int) -> dict:
  sizes = dict(data=1, fsdp=1, tensor=1, expert=1)
  if layout == "fsdp_expert":
    sizes.update(fsdp=2, expert=n // 2)
  elif layout != "single":
    sizes[layout] = n
  return sizes


PRECISIONS = ("bf16", "fp8")   # umoe_jax.config.schema.PRECISIONS (train.precision)
ROUTINGS = ("router", "balanced")
class Switch(NamedTuple):
  """A module switch a row may set: module.attr, the least value (None: a 0/1 boolean), and
  what it does (its flag's help)."""
  module: Any
  attr: str
  least: Optional[int]
  does: str


# The module switches awaiting their rows, by flag (--KEY for every row, /KEY= for one): a change
# not yet timed on a GPU lands behind a switch of its module, listed here, and is timed by rows with
# and without it before it becomes the module's only path or goes.
SWITCHES: dict[str, Switch] = {
    "fp8_one_block_scales": Switch(
        triton_fp8_gmm, "ONE_BLOCK_SCALES", None,
        "the Triton FP8 gmm scales each row once a chunk where a tile's column part lies in one "
        "weight block (one multiply-add an element in the promotion, not an outer product too)"),
    "fp8_mosaic_products": Switch(
        fp8_gmm, "MOSAIC_PRODUCTS", None,
        "the FP8 products on the Mosaic GPU kernel (kernels/gmm/mosaic_fp8_gmm.py: the promotion "
        "overlapped with the next chunk's wgmma), the rest on the gmm backend"),
    "fp8_block_quantiser": Switch(
        fp8_gmm, "KERNEL_BLOCKS", None,
        "the weights' FP8 blocks by the backend's one-pass kernel (kernels/gmm/triton_fp8_quant.py), "
        "not XLA's reduction"),
}


def switch_value(key: str) -> int:
  """A switch's setting now, as its flag writes it (0 / 1 for a boolean)."""
  return int(getattr(SWITCHES[key].module, SWITCHES[key].attr))


# The modules' own settings of the switches, before a row's flags change them: the table names a
# switch only where a row ran with another setting.
SWITCH_DEFAULTS = {key: switch_value(key) for key in SWITCHES}
# Flags a row may set for itself (CONFIG:LAYOUT/FLAG=VALUE): name -> parser of the value.
ROW_FLAGS = {"precision": str, "zipf": float, "routing": str, **{key: int for key in SWITCHES}}


def check_row_flag(key: str, value) -> None:
  if key == "precision" and value not in PRECISIONS:
    raise ValueError(f"precision={value!r}: one of {', '.join(PRECISIONS)}")
  if key == "routing" and value not in ROUTINGS:
    raise ValueError(f"routing={value!r}: one of {', '.join(ROUTINGS)}")
  if key == "zipf":
    check_zipf(value)
  if key in SWITCHES:
    least = SWITCHES[key].least
    if least is None and value not in (0, 1):
      raise ValueError(f"{key}={value}: 0 or 1")
    if least is not None and value < least:
      raise ValueError(f"{key}={value}: >= {least}")


def parse_row(row: str) -> dict:
  """'umoe_base:expert@8:ragged:2:1.5/zipf=1.1' -> {config, layout, exchange, chunks,
  capacity_factor, flags} (None = not given; flags = {name: value} of the /FLAG=VALUE parts)."""
  row, *flag_parts = row.split("/")
  flags = {}
  for part in flag_parts:
    key, eq, value = part.partition("=")
    if key not in ROW_FLAGS or not eq or not value:
      raise ValueError(f"row {row!r}: {part!r} is not FLAG=VALUE with FLAG one of {', '.join(ROW_FLAGS)}")
    try:
      flags[key] = ROW_FLAGS[key](value)
    except ValueError:
      raise ValueError(f"row {row!r}: {part!r}: {value!r} is not a number") from None
    try:
      check_row_flag(key, flags[key])
    except ValueError as e:
      raise ValueError(f"row {row!r}: {e}") from None
  parts = row.split(":")
  if len(parts) < 2 or len(parts) > 5 or not all(parts):
    raise ValueError(f"row {row!r} must be CONFIG:LAYOUT[@N][:EXCHANGE[:CHUNKS[:CAPACITY_FACTOR]]]")
  kind = parts[1].partition("@")[0]
  if kind not in LAYOUTS:  # (the device count is checked in the row's process: no GPU use here)
    raise ValueError(f"row {row!r}: unknown layout {kind!r}; valid: {', '.join(LAYOUTS)}")
  if len(parts) > 2 and parts[2] not in EXCHANGES + ("-",):
    raise ValueError(f"row {row!r}: unknown exchange {parts[2]!r}; valid: {', '.join(EXCHANGES)}")
  field = lambda i, cast: cast(parts[i]) if len(parts) > i and parts[i] != "-" else None
  return dict(config=parts[0], layout=parts[1], exchange=field(2, str), chunks=field(3, int),
              capacity_factor=field(4, float), flags=flags)


def row_args(args: argparse.Namespace, r: dict) -> argparse.Namespace:
  """The command's flags with row `r`'s own (/FLAG=VALUE) in their place."""
  return argparse.Namespace(**{**vars(args), **(r.get("flags") or {})})


def row_spec(r: dict) -> str:
  fields = [r.get("exchange"), r.get("chunks"), r.get("capacity_factor")]
  while fields and fields[-1] is None:
    fields.pop()
  return "/".join([":".join([r["config"], r["layout"]] + ["-" if f is None else str(f) for f in fields])]
                  + [f"{k}={v}" for k, v in sorted((r.get("flags") or {}).items())])


def check_zipf(zipf: float) -> None:
  if not (math.isfinite(zipf) and zipf >= 0):
    raise ValueError(f"--zipf={zipf}: an exponent >= 0 (0 = uniform tokens)")


def bench_tokens(rng: np.random.Generator, vocab: int, shape: tuple, zipf: float) -> np.ndarray:
  """int32 tokens of `shape` in [0, vocab): uniform for zipf == 0, else rank r (1-based) of a
  shuffled vocabulary drawn with probability proportional to r^-zipf (text's unigrams: ~1.0-1.2)."""
  check_zipf(zipf)
  if zipf == 0:
    return rng.integers(0, vocab, size=shape, dtype=np.int32)
  weights = np.arange(1, vocab + 1, dtype=np.float64) ** -zipf
  ranks = rng.choice(vocab, size=shape, p=weights / weights.sum())
  return rng.permutation(vocab).astype(np.int32)[ranks]


def routing_load(router_metrics: dict) -> dict:
  """{"median", "max", "per_router"} of each router's largest expert load over the mean (1 =
  balanced) from a step's metrics["routers"] ({name: {"expert_counts" [E], ...}}); {} without
  routers."""
  from umoe_jax.train import metrics as metrics_lib
  per = {name: metrics_lib.load_balance(np.asarray(r["expert_counts"]))[0]
         for name, r in sorted(router_metrics.items()) if "expert_counts" in r}
  if not per:
    return {}
  return dict(median=statistics.median(per.values()), max=max(per.values()), per_router=per)


def bench_one(name: str, layout: str, args, exchange=None, chunks=None,
              capacity_factor=None) -> dict:
  from umoe_jax import stats
  from umoe_jax.parallel import sharding as sharding_lib
  from umoe_jax.parallel import mesh as mesh_lib
  from umoe_jax.train import loop
  from umoe_jax.train import config as train_config
  from umoe_jax.train import metrics as metrics_lib

  config = stats.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  # Class-level patch of the routers, this process only; undone for a router-routed row after it.
  if args.routing == "balanced":
    log(f"  balanced routing: round-robin ids in {', '.join(balanced_routing.install())}")
  else:
    balanced_routing.uninstall()
  if args.attention_tiles:
    from kernels.attention import tiles as attention_tiles
    attention_tiles.load_table(args.attention_tiles)
  if args.gmm_tiles:
    from kernels.gmm import tuning
    log(f"gmm tiles from {args.gmm_tiles}: {tuning.load_table(args.gmm_tiles)}")
  layout_kind, n_dev = parse_layout(layout, jax.device_count())
  with config.unlocked():
    config.model.gmm_backend = args.gmm_backend
    if args.attention_core is not None:
      config.model.attention.core = args.attention_core
    if args.core_backward is not None:
      config.model.attention.core_backward = args.core_backward
    if args.router_topk is not None:
      config.model.router.topk_backend = args.router_topk
    if args.router_logits_dtype is not None:
      config.model.router.logits_dtype = args.router_logits_dtype
    if args.fuse_activation is not None:
      config.model.moe.fuse_activation = bool(args.fuse_activation)
    if args.fuse_weight_rows is not None:
      config.model.moe.fuse_weight_rows = bool(args.fuse_weight_rows)
    if args.scan_layers is not None:
      config.model.scan_layers = bool(args.scan_layers)
    config.train.global_batch_size = args.batch * n_dev
    config.train.seq_len = args.seq_len
    config.train.remat = args.remat
    config.train.loss_chunk_tokens = args.loss_chunk_tokens
    if args.fused_loss_head is not None:
      config.train.fused_loss_head = bool(args.fused_loss_head)
    if args.mu_dtype is not None:
      config.train.mu_dtype = args.mu_dtype
    config.train.grad_accum_steps = 1
    if args.precision != "bf16":  # (bf16: the key as the config has it, for a library without it)
      config.train.precision = args.precision
    config.train.eval_every = 0
    config.mesh = layout_mesh(layout_kind, n_dev)
  model_cfg = train_config.validate(config)
  mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:n_dev])
  rules = sharding_lib.normalize_rules(config.get("sharding_rules"))
  with config.unlocked():
    capacity_factor = capacity_factor or args.capacity_factor
    if capacity_factor is not None:
      config.expert_parallel.capacity_factor = capacity_factor
    exchange = exchange or args.exchange
    if exchange is not None:
      config.expert_parallel.exchange = exchange
    chunks = chunks or args.chunks
    if chunks is not None:
      config.expert_parallel.chunks = chunks
  train_config.check_expert_parallel(config.get("expert_parallel"))
  cf, exchange = loop.expert_parallel_settings(config)
  chunks = (config.get("expert_parallel") or {}).get("chunks", 1)
  progs = loop.config_programs(config, model_cfg, mesh, rules)

  if args.tgmm_big_first_skew is not None:
    from kernels.gmm import triton_gmm
    triton_gmm.TGMM_BIG_FIRST_SKEW = args.tgmm_big_first_skew
  fp8_switches(args)
  b, t, v = config.train.global_batch_size, args.seq_len, model_cfg.vocab_size
  tokens = bench_tokens(np.random.default_rng(0), v, (b, t + 1), args.zipf)
  batch_sharding = sharding_lib.batch_sharding(mesh, rules)
  batch = {"inputs": jax.device_put(tokens[:, :-1], batch_sharding),
           "targets": jax.device_put(tokens[:, 1:], batch_sharding)}

  with sharding_lib.use_mesh(mesh, rules, expert_capacity_factor=cf, expert_exchange=exchange,
                             expert_chunks=chunks):
    t0 = time.perf_counter()
    state = progs.init_fn(config.train.seed)
    if args.compile_only:
      progs.train_fn.lower(state, batch).compile()
      return dict(config=name, layout=layout, compile_only=True, compile_s=time.perf_counter() - t0)
    # With --profile the step is compiled ahead, so its HLO text names the profiled ops.
    step_fn = progs.train_fn.lower(state, batch).compile() if args.profile else progs.train_fn
    state, m = step_fn(state, batch)
    first_loss = float(m["loss"])
    compile_s = time.perf_counter() - t0
    # Correctness: a fresh model on uniform random tokens has loss ~ ln(V) (+ small balance loss).
    ok = math.isfinite(first_loss) and abs(first_loss - math.log(v)) < 0.15 * math.log(v)
    for _ in range(args.warmup):
      state, m = step_fn(state, batch)
    jax.block_until_ready(state)
    # The trainer's own freeze (train/host_gc.py): without it a collection of the compile's objects
    # can land in a timed step (223 against 86 ms on one H200); --freeze_heap=0 shows it.
    with host_gc.FrozenHeap() as heap:
      if args.freeze_heap:
        heap.freeze()
      times, trace_dir = [], None
      for i in range(args.steps):
        tracing = args.trace_step == i + 1  # CUDA graphs stay on, unlike --profile: the step as it runs
        if tracing:
          trace_dir = os.path.join(args.out, trace_name(name, layout, args, i + 1))
          jax.profiler.start_trace(trace_dir)
        s0 = time.perf_counter()
        state, m = step_fn(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - s0)
        if tracing:
          jax.profiler.stop_trace()
    last_loss = float(m["loss"])
    load = routing_load(jax.device_get(m.get("routers", {})))
    profile = None
    if args.profile:
      profile = _profile_steps(step_fn, state, batch, args.profile)
      state = profile.pop("state")
  step_s = statistics.median(times)
  tok_s = b * t / step_s
  flops_tok = stats.train_flops_per_token(model_cfg, t)
  peak = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind) or float("nan")
  mem = jax.devices()[0].memory_stats() or {}
  row = dict(config=name, layout=layout, devices=n_dev, device_kind=jax.devices()[0].device_kind, batch=b, seq_len=t, step_ms=1e3 * step_s,
             tokens_per_s=tok_s, tokens_per_s_per_device=tok_s / n_dev,
             mfu=flops_tok * tok_s / (peak * n_dev), compile_s=compile_s, first_loss=first_loss,
             last_loss=last_loss, loss_check=ok, peak_mem_gb=mem.get("peak_bytes_in_use", 0) / 2**30,
             gmm_backend=args.gmm_backend, remat=args.remat,
             loss_chunk_tokens=config.train.loss_chunk_tokens,
             fused_loss_head=config.train.fused_loss_head, mu_dtype=config.train.mu_dtype,
             capacity_factor=cf, exchange=exchange,
             chunks=chunks, mesh=dict(mesh.shape), xla_flags=os.environ.get("XLA_FLAGS", ""),
             attention_core=model_cfg.attention.core, core_backward=model_cfg.attention.core_backward,
             router_topk=model_cfg.router.topk_backend,
             router_logits_dtype=model_cfg.router.logits_dtype,
             fuse_activation=model_cfg.moe.fuse_activation,
             fuse_weight_rows=model_cfg.moe.fuse_weight_rows, scan_layers=model_cfg.scan_layers,
             triton_launch=triton_launch.route(), step_times_ms=[1e3 * x for x in times],
             trace_step=args.trace_step or None, trace_dir=trace_dir, freeze_heap=bool(args.freeze_heap),
             anchor_tokens_per_s=official_tokens_per_s(jax.devices()[0].device_kind, name),
             zipf=args.zipf, routing_load=load,
             precision=args.precision, routing=args.routing,
             tgmm_big_first_skew=_tgmm_skew(), **{key: switch_value(key) for key in SWITCHES})
  if profile is not None:
    row["profile"] = profile
  del state, m, batch
  gc.collect()
  jax.clear_caches()
  return row


def fp8_switches(args) -> None:
  """The module switches (SWITCHES) a row runs with (read when its step is traced). None: the module's own
  setting, also after an earlier --in_process row set another."""
  for key, switch in SWITCHES.items():
    value = getattr(args, key)
    value = SWITCH_DEFAULTS[key] if value is None else value
    setattr(switch.module, switch.attr, bool(value) if switch.least is None else value)


def _tgmm_skew():
  """The Triton weight gradient's TGMM_BIG_FIRST_SKEW the row ran with (None: no Triton here)."""
  try:
    from kernels.gmm import triton_gmm
  except Exception:  # noqa: BLE001
    return None
  return triton_gmm.TGMM_BIG_FIRST_SKEW


def _profile_steps(step_fn, state, batch, calls: int) -> dict:
  """Kernel time of `calls` traced steps by named scope (bench/profile_table.py), printed as
  tables (scopes cut to 2 components, then the 45 largest full paths); returns {"rows", "by_depth_2",
  "summary", "state"} (the state after the steps)."""
  import profile_table
  box = {"state": state}

  def run_once():
    box["state"], metrics = step_fn(box["state"], batch)
    jax.block_until_ready(metrics["loss"])

  rows, summary = profile_table.profile_calls(step_fn, run_once, calls)
  grouped = profile_table.group_rows(rows, 2)
  log(f"  profile: {summary['kernel_ms']:.1f} ms of kernels per step ({summary['kernels']} "
      f"kernels), {summary['wall_ms']:.1f} ms wall, {summary['unmatched_ms']:.2f} ms without op_name")
  log(profile_table.format_rows(grouped, 20, "  by scope (2 levels):"))
  log(profile_table.format_rows(rows, 45, "  by full scope:"))
  return dict(rows=rows, by_depth_2=grouped, summary=summary, state=box["state"])


def program_rows(runs: list) -> list:
  """The rows whose step programs `runs` need, each once: a row's Zipf exponent changes its tokens,
  not its program, so a Zipf row stands for the same row on uniform tokens (and is compiled as it)."""
  out, seen = [], set()
  for r in runs:
    flags = {k: v for k, v in (r.get("flags") or {}).items() if k != "zipf"}
    program = dict(r, flags=flags)
    if row_spec(program) not in seen:
      seen.add(row_spec(program))
      out.append(program)
  return out


def precompile(runs: list, jobs: int, out_dir: str) -> None:
  """Compiles the step programs of `runs` (`program_rows`) into the command's compilation cache,
  `jobs` processes at a time (this command's flags with --compile_only, one row each; their logs
  under out_dir/precompile), so the timed rows that follow load their executables instead of
  compiling one after the other."""
  import subprocess
  own = ("--runs", "--configs", "--layouts", "--out", "--results", "--precompile", "--trace_step")
  argv = [a for a in sys.argv[1:] if not a.startswith(own)]
  programs = program_rows(runs)
  logs = os.path.join(out_dir, "precompile")
  os.makedirs(logs, exist_ok=True)
  t0, pending, running = time.perf_counter(), list(enumerate(programs)), []
  while pending or running:
    while pending and len(running) < jobs:
      i, r = pending.pop(0)
      path = os.path.join(logs, f"{i}.log")
      cmd = [sys.executable, os.path.abspath(__file__), f"--runs={row_spec(r)}", "--compile_only",
             f"--out={os.path.join(logs, str(i))}", "--results=none", *argv]
      with open(path, "w") as f:  # (the child keeps its own descriptor)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
      running.append((r, proc, path))
    time.sleep(0.5)
    for item in [x for x in running if x[1].poll() is not None]:
      running.remove(item)
      r, proc, path = item
      if proc.returncode:
        with open(path) as f:
          tail = f.read()[-300:]
        log(f"{row_spec(r)}: precompile exited with {proc.returncode} ({path}): {tail} "
            "(the timed row compiles it)")
  log(f"precompiled {len(programs)} step programs, {jobs} at a time, in {time.perf_counter() - t0:.0f} s")


def trace_name(name: str, layout: str, args, step: int) -> str:
  """--trace_step's directory name: the row's config, layout and mode, so that rows of one
  command in other modes (bf16 / fp8, Zipf, balanced) keep their own traces."""
  mode = mode_text(dict(precision=args.precision, zipf=args.zipf, routing=args.routing,
                        **{key: switch_value(key) for key in SWITCHES}))
  return f"trace_{name}_{layout}_{re.sub(r'[^A-Za-z0-9.]+', '_', mode)}_step{step}"


def _bench_subprocess(row: dict, out_dir: str) -> dict:
  """One row in a fresh process: its peak memory and compile time are its own. Its trace
  (--trace_step) is moved under `out_dir`."""
  import glob
  import shutil
  import subprocess
  import tempfile
  own = ("--runs", "--configs", "--layouts", "--out", "--results", "--precompile")  # set per row below
  argv, words = [], iter(sys.argv[1:])
  for a in words:
    if a in own:
      next(words, None)  # "--out DIR": drop the value too
    elif not a.startswith(own):
      argv.append(a)
  with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--runs={row_spec(row)}",
                           f"--out={tmp}", "--results=none", *argv], check=False)
    path = os.path.join(tmp, "train_step.json")
    for trace in glob.glob(os.path.join(tmp, "trace_*")):  # --trace_step's, kept under --out
      shutil.copytree(trace, os.path.join(out_dir, os.path.basename(trace)), dirs_exist_ok=True)
    if not os.path.exists(path):
      raise RuntimeError(f"row {row_spec(row)} exited with {proc.returncode} and wrote no result")
    with open(path) as f:
      row = json.load(f)[0]
  if row.get("trace_dir"):
    row["trace_dir"] = os.path.join(out_dir, os.path.basename(row["trace_dir"]))
  if "error" in row:
    raise RuntimeError(row["error"])
  return row


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser()
  ap.add_argument("--configs", default="dense_base,ffn_moe_base,umoe_base")
  ap.add_argument("--layouts", default="single")
  ap.add_argument("--runs", default="", help="explicit config:layout list, e.g. umoe_base:single,umoe_base:data")
  ap.add_argument("--batch", type=int, default=32, help="sequences per device")
  ap.add_argument("--seq_len", type=int, default=1024)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--freeze_heap", type=int, choices=[0, 1], default=1,
                  help="gc.freeze the host heap before the timed steps, as the trainer does (0: not)")
  ap.add_argument("--zipf", type=float, default=0.0,
                  help="draw the tokens Zipf(S) over a shuffled vocabulary (text-like unigrams: a "
                       "fresh router's loads skew) instead of uniformly (0, the default)")
  ap.add_argument("--precision", default="bf16", choices=PRECISIONS,
                  help="train.precision: bf16, or fp8 (FP8 operands in the matmuls; an FP8 GPU)")
  ap.add_argument("--routing", default="router", choices=ROUTINGS,
                  help="balanced: every router's ids replaced by round-robin experts (token t's "
                       "K slots (t*K + j) mod E, gates 1/K), bench-only: the kernels' ceiling")
  ap.add_argument("--tgmm_big_first_skew", type=int, default=None,
                  help="kernels/triton_gmm.TGMM_BIG_FIRST_SKEW for every row (default: the "
                       "module's, 2): the weight gradient's tiles largest groups first where the "
                       "largest group holds at least this many times the mean group's rows")
  for key, switch in SWITCHES.items():   # (checked after parsing: check_row_flag)
    ap.add_argument(f"--{key}", type=int, default=None, metavar="{0,1}" if switch.least is None else "N",
                    help=f"{switch.module.__name__}.{switch.attr} (default: the module's): {switch.does}")
  ap.add_argument("--gmm_backend", default="auto")
  ap.add_argument("--remat", nargs="?", const="block", default="none",
                  help="train.remat policy (none|block|dots|dots_no_batch; a bare --remat = block)")
  ap.add_argument("--fused_loss_head", type=int, choices=[0, 1], default=None,
                  help="train.fused_loss_head (default: the config's, on)")
  ap.add_argument("--mu_dtype", choices=["float32", "bfloat16"], default=None,
                  help="train.mu_dtype (default: the config's, float32)")
  ap.add_argument("--loss_chunk_tokens", type=int, default=0,
                  help="train.loss_chunk_tokens: the LM head and cross-entropy in chunks of this many "
                       "tokens, never the full logits (0 = off, the default)")
  ap.add_argument("--attention_core", default=None, choices=["auto", "xla", "cudnn", "triton"],
                  help="model.attention.core (default: the config's)")
  ap.add_argument("--core_backward", default=None,
                  choices=["auto", "recompute", "stored_pairs"],
                  help="model.attention.core_backward: the Triton core's backward form")
  ap.add_argument("--triton_launch", default=None, choices=list(triton_launch.ROUTES),
                  help="$UMOE_TRITON_LAUNCH for every row (default: as set, else custom_call): "
                       "jax-triton's custom call or jaxlib's typed-FFI handler "
                       "(kernels/triton_launch.py)")
  ap.add_argument("--fuse_weight_rows", type=int, choices=[0, 1], default=None,
                  help="model.moe.fuse_weight_rows (default: the config's, off): the weight "
                       "gradient's gate-scaled rows from the dgrad matmul's epilogue")
  ap.add_argument("--scan_layers", type=int, choices=[0, 1], default=None,
                  help="model.scan_layers (default: the config's, off): the decoder blocks as one "
                       "lax.scan (one block to compile)")
  ap.add_argument("--fuse_activation", type=int, choices=[0, 1], default=None,
                  help="model.moe.fuse_activation (default: the config's, on): the experts' "
                       "activation derivative inside the grouped matmuls' backward")
  ap.add_argument("--router_topk", default=None, choices=["xla", "triton"],
                  help="model.router.topk_backend (default: the config's)")
  ap.add_argument("--router_logits_dtype", default=None, choices=["float32", "bfloat16"],
                  help="model.router.logits_dtype (default: the config's, float32)")
  ap.add_argument("--gmm_tiles", default=None,
                  help="JSON of grouped-matmul tile rows (bench/gmm.py --sweep-gathered's "
                       "gmm_tiles.json) added to kernels/tuning.TABLE first")
  ap.add_argument("--attention_tiles", default=None,
                  help="JSON of Triton attention tiles (bench/attention_core.py --sweep)")
  ap.add_argument("--capacity_factor", type=float, default=None,
                  help="expert-parallel buffer capacity factor (default: the config's; None = dropless)")
  ap.add_argument("--exchange", default=None,
                  choices=EXCHANGES,
                  help="expert-parallel token exchange (default: the config's, normally auto = "
                       "all_gather when top-k >= expert-axis size)")
  ap.add_argument("--chunks", type=int, default=None,
                  help="expert_parallel.chunks: token chunks per device exchanged separately, so "
                       "that exchange and expert compute can overlap (default: the config's, 1)")
  ap.add_argument("--time_limit_s", type=float, default=None,
                  help="start no row the slowest row so far would carry past this many seconds")
  ap.add_argument("--in_process", action="store_true",
                  help="run every row in this process (default: one subprocess per row, so that peak "
                       "memory and compile caches are per row)")
  ap.add_argument("--profile", type=int, nargs="?", const=2, default=0,
                  help="after timing, trace this many steps (a bare --profile = 2) and print / save "
                       "their kernel time by named scope (bench/profile_table.py)")
  ap.add_argument("--trace_step", type=int, default=0,
                  help="record a jax.profiler trace (TensorBoard / Perfetto) of this timed step, "
                       "1-based, CUDA graphs kept, under --out/trace_CONFIG_LAYOUT_stepN (its time "
                       "includes the tracer's overhead)")
  ap.add_argument("--compilation_cache_dir", default="",
                  help="train.compilation_cache_dir: JAX's persistent compilation cache (a row "
                       "compiled before, in this or an earlier command, loads its executable)")
  ap.add_argument("--compile_only", action="store_true",
                  help="lower and compile each row's step into --compilation_cache_dir and run "
                       "nothing (no rows written): rows compiled so by parallel commands load "
                       "their executables when a later command times them one at a time")
  ap.add_argument("--precompile", type=int, default=0, metavar="JOBS",
                  help="before timing, compile the rows' step programs into "
                       "--compilation_cache_dir, JOBS processes at a time (--compile_only each)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  results.add_flag(ap)
  return ap


# Flags that say how a command runs its rows, not what a row measures: never a row's overrides.
BOOKKEEPING = ("configs", "layouts", "runs", "steps", "warmup", "out", "results", "time_limit_s",
               "in_process", "compilation_cache_dir", "compile_only", "precompile")


def measurement(r: dict, args) -> dict | None:
  """The results row of a measured row `r` (bench/results.py; None for a failed row or one whose
  loss check failed): tokens/s, with step time, MFU, peak memory and the switches' values beside
  it; overrides = the
  flags that differ from their defaults, and the layout of a row over several devices; anchor = the
  official PyTorch code's tokens/s for a one-device row, linear scaling of this command's single row
  for one over several."""
  if "error" in r or r.get("compile_only") or not r["loss_check"]:
    return None
  defaults = vars(parser().parse_args([]))
  overrides = {k: v for k, v in sorted(vars(args).items())
               if k not in BOOKKEEPING and v != defaults.get(k)}
  if r["devices"] > 1:
    overrides.update(layout=r["layout"], exchange=r["exchange"], chunks=r["chunks"])
    if r.get("capacity_factor") is not None:
      overrides["capacity_factor"] = r["capacity_factor"]
  anchor, official = None, official_tokens_per_s(r["device_kind"], r["config"])
  if r["devices"] == 1 and official is not None:
    kind = r["device_kind"].removeprefix("NVIDIA ").split()[0]    # "H100" of "NVIDIA H100 80GB HBM3"
    anchor = results.anchor(f"official PyTorch code, one {kind}", official, "tokens/s",
                            "bench/train_step.py ANCHORS")
  elif r["devices"] > 1 and r.get("scaling_efficiency"):
    linear = r["tokens_per_s"] / r["scaling_efficiency"]
    anchor = results.anchor(f"linear scaling of this command's single row ({r['devices']} x)",
                            linear, "tokens/s", "the same command")
  extra = dict(step_ms=r["step_ms"], mfu=r["mfu"], peak_mem_gb=r["peak_mem_gb"],
               step_ms_range=[min(r["step_times_ms"]), max(r["step_times_ms"])],
               steps=len(r["step_times_ms"]), batch=r["batch"], seq_len=r["seq_len"],
               scaling_efficiency=r.get("scaling_efficiency"), vs_bf16=r.get("vs_bf16"),
               xla_flags=r.get("xla_flags") or None,
               mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
               # every switch as it ran, so a row still says what it ran once a switch's default
               # changes or the switch goes (bench/results.py RETIRED)
               switches={k: r[k] for k in SWITCHES if k in r} or None)
  return dict(config=r["config"], metric="tokens_per_s", value=r["tokens_per_s"],
              overrides=overrides, anchor=anchor, extra=extra, device=r["device_kind"],
              devices=r["devices"])


def main():
  ap = parser()
  args = ap.parse_args()
  if not 0 <= args.trace_step <= args.steps:
    ap.error(f"--trace_step={args.trace_step}: a timed step, 1 to --steps={args.steps} (0: none)")
  try:
    check_zipf(args.zipf)
  except ValueError as e:
    ap.error(str(e))
  for key in SWITCHES:
    if getattr(args, key) is not None:
      try:
        check_row_flag(key, getattr(args, key))
      except ValueError as e:
        ap.error(f"--{e}")
  if args.tgmm_big_first_skew is not None and args.tgmm_big_first_skew < 1:
    ap.error(f"--tgmm_big_first_skew={args.tgmm_big_first_skew}: >= 1 (largest group / mean)")
  if args.triton_launch is not None:  # (read when the kernels are traced, here or in a row's process)
    os.environ[triton_launch.ENV_VAR] = args.triton_launch
  if args.compilation_cache_dir:
    from umoe_jax.train import loop
    loop.use_compilation_cache(args.compilation_cache_dir)
  if (args.compile_only or args.precompile) and not args.compilation_cache_dir:
    ap.error(f"{'--compile_only' if args.compile_only else '--precompile'} keeps its executables in "
             "--compilation_cache_dir; give one")
  if args.precompile < 0 or (args.precompile and args.compile_only):
    ap.error(f"--precompile={args.precompile}: a count of processes >= 1, without --compile_only")
  if args.profile:  # kernels inside CUDA graphs are not attributed to their ops (profile_table.py)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
  rows = []
  try:
    runs = [parse_row(r) for r in args.runs.split(",")] if args.runs else [
        parse_row(f"{name}:{layout}") for layout in args.layouts.split(",")
        for name in args.configs.split(",")]
  except ValueError as e:
    ap.error(str(e))
  in_process = args.in_process or len(runs) == 1
  if args.precompile:
    precompile(runs, args.precompile, args.out)
  if in_process:
    log("devices:", jax.devices())  # (not in a parent of subprocesses: it would take the GPUs' memory)
  start, slowest = time.perf_counter(), 0.0
  for run in runs:
    name, layout = run["config"], run["layout"]
    elapsed = time.perf_counter() - start
    if args.time_limit_s is not None and elapsed + slowest > args.time_limit_s:
      log(f"{row_spec(run)}: skipped (time limit: {elapsed:.0f} s + slowest row {slowest:.0f} s "
          f"> {args.time_limit_s:.0f} s)")
      rows.append(dict(config=name, layout=layout, error="skipped: time limit"))
      continue
    t0 = time.perf_counter()
    args_r = row_args(args, run)
    try:
      rows.append(bench_one(name, layout, args_r, run["exchange"], run["chunks"],
                            run["capacity_factor"]) if in_process
                  else _bench_subprocess(run, args.out))
      r = rows[-1]
      if r.get("compile_only"):
        log(f"{row_spec(run)}: compiled in {r['compile_s']:.0f} s")
      else:
        log(f"{name:14s} {layout:14s} {r['exchange']:10s} c{r['chunks']} step {r['step_ms']:8.1f} ms  "
            f"{r['tokens_per_s'] / 1e3:8.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  "
            f"loss {r['first_loss']:.3f}->{r['last_loss']:.3f} "
            f"(check {'ok' if r['loss_check'] else 'FAILED'})  compile {r['compile_s']:.0f}s  "
            f"mem {r['peak_mem_gb']:.1f} GB"
            + (f"  loss chunks {r['loss_chunk_tokens']}" if r.get("loss_chunk_tokens") else "")
            + (f"  load max/mean {r['routing_load']['median']:.2f} (worst router "
               f"{r['routing_load']['max']:.2f})" if r.get("routing_load") else ""))
    except Exception as e:  # noqa: BLE001  (report and go on with the next row)
      log(f"{row_spec(run)}: FAILED {type(e).__name__}: {str(e)[:400]}")
      rows.append(dict(config=name, layout=layout, error=f"{type(e).__name__}: {e}"[:2000]))
    slowest = max(slowest, time.perf_counter() - t0)
    add_efficiency(rows)
    m = measurement(rows[-1], args_r)
    if m is not None:
      results.record(args.results, **m)
    os.makedirs(args.out, exist_ok=True)  # after every row: a run cut short keeps what it measured
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
      json.dump(rows, f, indent=1)
  print_table(rows)
  print_profile_diffs(rows)


def print_profile_diffs(rows: list, depth: int = 3) -> None:
  """For each profiled row beside a profiled bf16 row of the same config, layout and tokens:
  where its kernel time differs from the bf16 row's, by scope (bench/profile_table.py diff_rows)."""
  import profile_table
  profiled = [r for r in rows if "error" not in r and r.get("profile")]
  bf16 = {(r["config"], r["layout"], *mode(r)[1:]): r for r in profiled if mode(r)[0] == "bf16"}
  for r in profiled:
    base = bf16.get((r["config"], r["layout"], *mode(r)[1:]))
    if base is None or base is r:
      continue
    diff = profile_table.diff_rows(base["profile"]["rows"], r["profile"]["rows"], depth)
    log(profile_table.format_diff(diff, title=f"\n{r['config']} {r['layout']}: {mode_text(r)} "
                                  f"against bf16, kernel time by scope", names=("bf16", mode(r)[0])))


def mode(r: dict) -> tuple:
  """What a row measures besides its config and layout: (precision, zipf, routing)."""
  return r.get("precision", "bf16"), r.get("zipf", 0.0), r.get("routing", "router")


def mode_text(r: dict) -> str:
  precision, zipf, routing = mode(r)
  switches = [f"{k}={r[k]}" for k in SWITCHES
              if precision == "fp8" and r.get(k) not in (None, SWITCH_DEFAULTS[k])]
  return " ".join([precision] + ([f"zipf={zipf:g}"] if zipf else []) + ([routing] if routing != "router" else [])
                  + switches)


def add_efficiency(rows: list) -> None:
  """rows[i]["scaling_efficiency"] = tokens/s per device / the same config's single-device tokens/s
  in the same mode (rows of the same --batch and --seq_len: one command); rows[i]["vs_bf16"] = the
  row's step time / the bf16 row's of the same config, layout, tokens and routing."""
  ok = [r for r in rows if "error" not in r and not r.get("compile_only")]
  single = {(r["config"], mode(r)): r["tokens_per_s"] for r in ok
            if r["devices"] == 1 and r["layout"] == "single"}
  bf16 = {(r["config"], r["layout"], *mode(r)[1:]): r["step_ms"] for r in ok if mode(r)[0] == "bf16"}
  for r in ok:
    if (r["config"], mode(r)) in single:
      r["scaling_efficiency"] = r["tokens_per_s_per_device"] / single[(r["config"], mode(r))]
    base = bf16.get((r["config"], r["layout"], *mode(r)[1:]))
    if mode(r)[0] != "bf16" and base:
      r["vs_bf16"] = r["step_ms"] / base


def print_table(rows: list) -> None:
  rows = [r for r in rows if not r.get("compile_only")]
  if not rows:
    return
  log("\nconfig          layout          dev  mesh (d,f,t,e)  exchange    chunks  cf     step ms   "
      "tok/s (k)  per dev  efficiency  MFU    peak GB  anchor (k, official torch)  load   vs bf16  mode")
  for r in rows:
    if "error" in r:
      log(f"{r['config']:15s} {r['layout']:15s} FAILED ({r['error'][:60]})")
      continue
    anchor = r["anchor_tokens_per_s"]
    m = r["mesh"]
    eff = r.get("scaling_efficiency")
    log(f"{r['config']:15s} {r['layout']:15s} {r['devices']:3d}  "
        f"{m['data']},{m['fsdp']},{m['tensor']},{m['expert']:<10d} {r['exchange']:11s} "
        f"{r['chunks']:6d}  {r['capacity_factor'] or '-':5}  {r['step_ms']:8.1f} "
        f"{r['tokens_per_s'] / 1e3:10.1f} {r['tokens_per_s_per_device'] / 1e3:8.1f} "
        f"{'%9.1f%%' % (100 * eff) if eff is not None else '        -'}  {100 * r['mfu']:5.1f}%  "
        f"{r['peak_mem_gb']:7.1f}  {anchor / 1e3 if anchor else float('nan'):6.1f}"
        f"{'':22s}{r['routing_load']['median'] if r.get('routing_load') else float('nan'):5.2f}"
        f"  {'%6.2fx' % r['vs_bf16'] if r.get('vs_bf16') else '      -'}  {mode_text(r)}")
  log("(load: the median router's largest expert load over the mean in the last timed step; "
      "1 = balanced; vs bf16: step time over the bf16 row's of the same config, layout and mode)")


if __name__ == "__main__":
  main()
