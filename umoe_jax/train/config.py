"""The trainer's config sections (`train`, `checkpoint`, `log`) and the up-front check of a whole config.

An experiment config (`configs/common.py: experiment()`) is a ConfigDict with the sections

  model        umoe_jax.config.ModelConfig fields (validated by `umoe_jax.config.model_config`)
  data         umoe_jax.data.default_data_config() fields
  train        default_train_config() below
  checkpoint   default_checkpoint_config() below
  log          default_log_config() below
  mesh, sharding_rules   parallelism (umoe_jax.parallel), optional
  expert_parallel        capacity_factor, exchange, chunks (umoe_jax/parallel/expert_parallel.py), optional

`validate(config)` runs before anything is built or read, and raises `ConfigError` naming the key and
value for: an unknown key in any section, a missing data file, a tokenizer larger than the model's
vocabulary, a sequence length past the model's RoPE limit (`model.max_seq_len`), impossible
training values (batch not divisible by accumulation steps, ...) and train.precision='fp8' where it
cannot run (`umoe_jax.train.precision`).
"""
from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections import config_dict

from umoe_jax import storage
from umoe_jax.config.fields import optional

from umoe_jax.config import PRECISIONS, ConfigError, ModelConfig, model_config
from umoe_jax.parallel.sharding import EXPERT_EXCHANGES
from umoe_jax.train import wandb_writer

# Top-level sections an experiment config may have. `mesh`, `sharding_rules` belong to
# umoe_jax.parallel and are checked there; `expert_parallel` is checked here (check_expert_parallel).
SECTIONS = ("model", "data", "train", "checkpoint", "log", "mesh", "sharding_rules", "expert_parallel")
NONFINITE_POLICIES = ("stop", "skip")
MU_DTYPES = ("float32", "bfloat16")     # train.mu_dtype


def default_train_config() -> ml_collections.ConfigDict:
  """Optimisation and loop defaults: the official UMoE recipe (umoe.md §2.3) at base scale."""
  return ml_collections.ConfigDict(dict(
      seed=0,                      # parameter init, data order and the RNG carried in the state
      global_batch_size=1024,      # sequences per optimizer step, over all processes and
                                   # micro-batches
      seq_len=1024,                # tokens per training sequence (at most model.max_seq_len)
      num_steps=50_000,            # optimizer steps; the cosine schedule ends here, and a larger
                                   # value on resume extends the run
      learning_rate=4e-4,          # peak learning rate (the official recipe's)
      warmup_steps=optional(int),  # linear warmup steps; None = warmup_ratio * num_steps
      warmup_ratio=0.05,           # warmup as a share of num_steps, when warmup_steps is None
      min_lr_ratio=1e-4,           # the cosine decay's floor, as a fraction of the peak
      b1=0.9,                      # AdamW's first-moment decay
      b2=0.95,                     # AdamW's second-moment decay (0.95, as the official recipe)
      eps=1e-8,                    # AdamW's epsilon
      weight_decay=0.01,           # AdamW's decoupled weight decay; never applied to norm scales
      mu_dtype="float32",          # AdamW's first moment: "bfloat16" halves its memory; the second
                                   # moment and the parameters stay float32
      grad_clip=1.0,               # global gradient-norm clipping; 0 disables it
      grad_accum_steps=1,          # micro-batches per step, accumulated inside the compiled step:
                                   # a large global batch in less device memory
      # Operand precision of the large matmuls: "bf16", or "fp8": the expert grouped matmuls, the
      # dense FFN and the always-on experts take FP8 (e4m3) operands, float32-scaled per 1 x 128
      # tile of activations and gradients and per 128 x 128 block of weights, in the forward and
      # input-gradient products (float32 accumulation; the weight gradients take bf16 operands);
      # the attention projections, router, norms, attention core, LM head, parameters and
      # optimizer state are as in bf16. On NVIDIA GPUs of compute capability 8.9+ (Ada, Hopper),
      # emulated on CPU, not on TPU (docs/training.md).
      precision="bf16",
      # What each decoder block keeps for the backward pass: "none" (everything, fastest),
      # "block" (recompute the block, least memory), "dots", "dots_no_batch"; True / False = block / none.
      remat=config_dict.FieldReference("none", field_type=object),
      on_nonfinite="stop",         # a NaN / Inf loss or gradient: "stop" names the step and exits,
                                   # "skip" drops that update and goes on
      loss_chunk_tokens=0,         # > 0: the LM head and loss run in chunks of this many tokens, so
                                   # the float32 [tokens, vocab] logits never exist; 0 = off
      fused_loss_head=True,        # the LM head and cross-entropy as one op that forms the logit
                                   # gradient in one pass: less memory, the same values
      max_consecutive_skips=10,    # with on_nonfinite="skip": stop (non-zero exit) after this many
                                   # skipped steps in a row; 0 = no limit
      compilation_cache_dir="",    # JAX's persistent compilation cache (a local dir or gs://): a
                                   # restart loads the compiled step instead of compiling it; "" = off
      log_every=50,                # steps between console / TensorBoard / metrics.jsonl records
      eval_every=1000,             # steps between held-out evaluations; 0 disables them
      eval_batches=20,             # held-out batches per evaluation
      eval_batch_size=optional(int),  # sequences per evaluation batch; None = global_batch_size //
                                   # grad_accum_steps
  ))


def default_checkpoint_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      every=1000,                  # steps between saves; a last one is always written at the end
      keep=3,                      # newest checkpoints kept on disk
      async_save=True,             # write in a background thread while training continues
      init_from="",                # a converted official checkpoint or another run whose parameters
                                   # start this one, when the workdir has no checkpoint yet
      restore_step=optional(int),  # resume from this step instead of the latest (newer steps are
                                   # moved aside); None = the latest
      # Save guard: a state whose parameter norm grew more than this many times since the last
      # checkpoint that passed is not saved; 0 disables the check.
      max_param_norm_ratio=10.0,
      # Save guard: a state whose recent mean loss is more than this many times the median of the
      # steps before is not saved; 0 disables the check.
      max_loss_ratio=3.0,
  ))


def default_log_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      tensorboard=True,            # TensorBoard event files in `WORKDIR/tensorboard`
      jsonl=True,                  # `WORKDIR/metrics.jsonl`, one JSON object per record
      peak_flops=optional(float),  # a device's peak FLOP/s for MFU; None = looked up by device
                                   # kind (set it for a chip the table lacks)
      routing_probe_batches=1,     # size of the routing probe: the first this many held-out batches
                                   # (at most train.eval_batches), whose routing change is logged
                                   # at every evaluation; 0 disables it
      profile_steps=(),            # steps to trace with jax.profiler into `WORKDIR/tensorboard`,
                                   # e.g. `--config.log.profile_steps=10,11,12` (not step 1: it compiles)
      dead_expert_window=100,      # steps over which an expert that received no token counts as
                                   # dead (moe/<router>/dead_experts, logged once that many steps
                                   # ran); 0 disables it
      wandb=False,                 # also log to Weights & Biases: the same scalars, histograms and
                                   # images as TensorBoard (pip install -r requirements-wandb.txt)
      wandb_project="umoe-jax",    # the W&B project of the run
      wandb_name="",               # the W&B run name; "" = the workdir's directory name
      wandb_mode="online",         # "online", "offline" (the run under WORKDIR/wandb, for `wandb
                                   # sync` later) or "disabled"
  ))


def _check(cond: bool, message: str) -> None:
  if not cond:
    raise ConfigError(message)


def _check_keys(section: Any, defaults: ml_collections.ConfigDict, name: str) -> None:
  keys = set(section.keys()) if hasattr(section, "keys") else set()
  unknown = sorted(keys - set(defaults.keys()))
  if unknown:
    raise ConfigError(f"unknown key {name}.{unknown[0]} (={section[unknown[0]]!r}); "
                      f"valid keys of {name}: {', '.join(sorted(defaults.keys()))}")
  missing = sorted(set(defaults.keys()) - keys)
  if missing:
    raise ConfigError(f"config section {name} lacks key {name}.{missing[0]} "
                      f"(build configs with configs/common.py: experiment())")


def _path_exists(path: str) -> bool:
  path = storage.expand(path)  # local or a URL (gs://, s3://, hf://, ...)
  if not storage.is_url(path) and storage.exists(path):  # a local name may hold "[" literally
    return True
  if storage.has_magic(path):
    return bool(storage.glob(path))
  return storage.exists(path)


def _check_files(data_cfg: Any, key: str) -> None:
  """ConfigError unless data.<key> resolves to files of data.source (a directory or glob without
  any, e.g. no .parquet file below a parquet source's directory, is as bad as a missing path)."""
  from umoe_jax.data import sources
  suffixes = {"parquet": (".parquet",),
              "arrayrecord": (sources.ARRAYRECORD_SUFFIX,)}.get(data_cfg.source, ())
  try:
    sources.resolve_files(data_cfg[key], suffixes, key=f"data.{key}")
  except (FileNotFoundError, ValueError) as e:  # a StorageError (the store failed) passes as it is
    raise ConfigError(str(e)) from None


def check_train(train: Any, model: ModelConfig) -> None:
  t = train
  _check(t.seq_len > 0, f"train.seq_len={t.seq_len!r} must be positive")
  _check(t.seq_len <= model.max_seq_len,
         f"train.seq_len={t.seq_len} exceeds model.max_seq_len={model.max_seq_len} (the RoPE / "
         f"position limit of the model); lower train.seq_len or raise model.max_seq_len")
  _check(t.num_steps > 0, f"train.num_steps={t.num_steps!r} must be positive")
  _check(t.grad_accum_steps >= 1, f"train.grad_accum_steps={t.grad_accum_steps!r} must be >= 1")
  _check(t.global_batch_size > 0 and t.global_batch_size % t.grad_accum_steps == 0,
         f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
         f"train.grad_accum_steps={t.grad_accum_steps}")
  _check(t.learning_rate > 0, f"train.learning_rate={t.learning_rate!r} must be positive")
  _check(t.warmup_steps is None or 0 <= t.warmup_steps <= t.num_steps,
         f"train.warmup_steps={t.warmup_steps!r} must be in [0, train.num_steps={t.num_steps}]")
  _check(0 <= t.warmup_ratio <= 1, f"train.warmup_ratio={t.warmup_ratio!r} must be in [0, 1]")
  _check(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio!r} must be in [0, 1]")
  _check(0 <= t.b1 < 1 and 0 <= t.b2 < 1, f"train.b1={t.b1!r}, train.b2={t.b2!r} must be in [0, 1)")
  _check(t.eps > 0, f"train.eps={t.eps!r} must be positive")
  _check(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay!r} must be >= 0")
  _check(t.precision in PRECISIONS,
         f"train.precision={t.precision!r}; valid: {', '.join(PRECISIONS)}")
  _check(t.mu_dtype in MU_DTYPES,
         f"train.mu_dtype={t.mu_dtype!r}; valid: {', '.join(MU_DTYPES)}")
  _check(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip!r} must be >= 0 (0 disables clipping)")
  from umoe_jax.model.remat import POLICIES as REMAT_POLICIES  # (lazy: the model package)
  _check(isinstance(t.remat, bool) or (isinstance(t.remat, str) and t.remat in REMAT_POLICIES),
         f"train.remat={t.remat!r}; valid: {', '.join(REMAT_POLICIES)}")
  n = t.loss_chunk_tokens
  _check(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
         f"train.loss_chunk_tokens={n!r} must be an integer >= 0 (0: the full logits, no chunks)")
  _check(isinstance(t.fused_loss_head, bool),
         f"train.fused_loss_head={t.fused_loss_head!r} must be true or false")
  _check(t.on_nonfinite in NONFINITE_POLICIES,
         f"train.on_nonfinite={t.on_nonfinite!r}; valid: {', '.join(NONFINITE_POLICIES)}")
  _check(t.max_consecutive_skips >= 0,
         f"train.max_consecutive_skips={t.max_consecutive_skips!r} must be >= 0 (0: no limit)")
  _check(t.log_every >= 1, f"train.log_every={t.log_every!r} must be >= 1")
  _check(t.eval_every >= 0, f"train.eval_every={t.eval_every!r} must be >= 0 (0 disables)")
  _check(t.eval_every == 0 or t.eval_batches >= 1,
         f"train.eval_batches={t.eval_batches!r} must be >= 1 when train.eval_every > 0")
  _check(t.eval_batch_size is None or t.eval_batch_size > 0,
         f"train.eval_batch_size={t.eval_batch_size!r} must be positive (or None)")


def check_log_analysis(log: Any, train: Any) -> None:
  """log.routing_probe_batches (int >= 0, at most train.eval_batches), log.dead_expert_window
  (int >= 0), log.wandb_* (`wandb_writer.check`) and log.profile_steps (steps in [1,
  train.num_steps])."""
  n = log.routing_probe_batches
  _check(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
         f"log.routing_probe_batches={n!r} must be an integer >= 0 (0 disables)")
  _check(not n or not train.eval_every or n <= train.eval_batches,
         f"log.routing_probe_batches={n!r} exceeds train.eval_batches={train.eval_batches!r}: the "
         f"probe is taken from the held-out batches (raise train.eval_batches)")
  w = log.dead_expert_window
  _check(isinstance(w, int) and not isinstance(w, bool) and w >= 0,
         f"log.dead_expert_window={w!r} must be an integer >= 0 (0 disables)")
  wandb_writer.check(log)
  steps = log.profile_steps
  _check(isinstance(steps, (tuple, list)), f"log.profile_steps={steps!r} must be a tuple of steps, "
         "e.g. (10, 11) or --config.log.profile_steps=10,11")
  for s in steps:
    _check(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= train.num_steps,
           f"log.profile_steps={tuple(steps)!r}: step {s!r} is not an integer in [1, "
           f"train.num_steps={train.num_steps}]")


def check_checkpoint(ckpt: Any) -> None:
  _check(ckpt.every >= 1, f"checkpoint.every={ckpt.every!r} must be >= 1")
  _check(ckpt.keep >= 1, f"checkpoint.keep={ckpt.keep!r} must be >= 1")
  try:
    init_from_found = not ckpt.init_from or storage.isdir(storage.expand(ckpt.init_from))
  except FileNotFoundError as e:  # ~user of no user (storage.UnknownUserError)
    raise ConfigError(f"checkpoint.init_from={ckpt.init_from!r}: {e}") from None
  _check(init_from_found, f"checkpoint.init_from={ckpt.init_from!r}: no such directory")
  _check(ckpt.restore_step is None or ckpt.restore_step >= 0,
         f"checkpoint.restore_step={ckpt.restore_step!r} must be a step >= 0 (or None: the latest)")
  for key in ("max_param_norm_ratio", "max_loss_ratio"):
    _check(ckpt[key] == 0 or ckpt[key] > 1,
           f"checkpoint.{key}={ckpt[key]!r} must be > 1 (or 0: no check)")


def check_expert_parallel(section: Any) -> None:
  """`expert_parallel` (optional; keys optional, so configs saved before a key existed still load):
  capacity_factor None or > 0, exchange one of EXPERT_EXCHANGES, chunks an int >= 1."""
  if section is None:
    return
  valid = ("capacity_factor", "exchange", "chunks")
  _check(hasattr(section, "keys"), f"expert_parallel={section!r} must be a dict with keys {valid}")
  for key in sorted(section.keys()):
    _check(key in valid, f"unknown key expert_parallel.{key} (={section[key]!r}); valid keys of "
                         f"expert_parallel: {', '.join(valid)}")
  cf = section.get("capacity_factor")
  _check(cf is None or (isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf > 0),
         f"expert_parallel.capacity_factor={cf!r} must be a number > 0 (or None = dropless)")
  exchange = section.get("exchange", "auto")
  _check(isinstance(exchange, str) and exchange in EXPERT_EXCHANGES,
         f"expert_parallel.exchange={exchange!r} must be one of {', '.join(EXPERT_EXCHANGES)}")
  chunks = section.get("chunks", 1)
  _check(isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1,
         f"expert_parallel.chunks={chunks!r} must be an int >= 1 (token chunks per device)")


def check_data(data_cfg: Any, train: Any, model: ModelConfig):
  """Data paths exist and the tokenizer fits the model; returns the tokenizer."""
  from umoe_jax import data as data_lib

  _check_keys(data_cfg, data_lib.default_data_config(), "data")
  _check(data_cfg.source in data_lib.SOURCES,
         f"data.source={data_cfg.source!r}; valid: {', '.join(data_lib.SOURCES)}")
  _check(data_cfg.num_epochs is None or data_cfg.num_epochs >= 1,
         f"data.num_epochs={data_cfg.num_epochs!r} must be >= 1 (or None: repeat forever)")
  for key in ("read_threads", "worker_count", "prefetch_batches", "shuffle_window"):
    _check(data_cfg[key] >= 0, f"data.{key}={data_cfg[key]!r} must be >= 0")
  policies = data_lib.sources.BAD_RECORD_POLICIES
  _check(data_cfg.on_bad_record in policies,
         f"data.on_bad_record={data_cfg.on_bad_record!r}; valid: {', '.join(policies)}")
  for key in ("train_path", "eval_path"):  # else a run on a file trains on the built-in corpus
    _check(data_cfg.source != "builtin" or not data_cfg[key],
           f"data.{key}={data_cfg[key]!r} is set but data.source='builtin' (the default) reads no "
           f"files; set data.source to one of "
           f"{', '.join(s for s in data_lib.SOURCES if s != 'builtin')}")
  if data_cfg.source != "builtin":
    _check(bool(data_cfg.train_path), f"data.train_path is empty; data.source={data_cfg.source!r} "
           "needs a file, directory or glob")
    _check(_path_exists(data_cfg.train_path),
           f"data.train_path={data_cfg.train_path!r}: no such file, directory or glob match")
    _check_files(data_cfg, "train_path")
    if data_cfg.source == "arrayrecord":
      for key in ("train_path", "eval_path"):
        try:
          data_lib.sources.check_arrayrecord_location(data_cfg[key], f"data.{key}")
        except ValueError as e:
          raise ConfigError(str(e)) from None
    if train.eval_every > 0:
      _check(bool(data_cfg.eval_path), f"data.eval_path is empty but train.eval_every="
             f"{train.eval_every}; set data.eval_path to held-out data or train.eval_every=0")
      _check(_path_exists(data_cfg.eval_path),
             f"data.eval_path={data_cfg.eval_path!r}: no such file, directory or glob match")
      _check_files(data_cfg, "eval_path")
  try:
    tokenizer = data_lib.load_tokenizer(data_cfg)
    data_lib.check_vocab(tokenizer, model.vocab_size)
  except (ValueError, OSError) as e:
    raise ConfigError(f"data.tokenizer={data_cfg.tokenizer!r}: {e}") from e
  return tokenizer


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
  """Checks a whole experiment config before anything is built; returns the ModelConfig.

  The ModelConfig carries train.precision (`umoe_jax.train.precision`). Raises ConfigError (a
  ValueError) naming the offending key and value.
  """
  unknown = sorted(set(config.keys()) - set(SECTIONS))
  if unknown:
    raise ConfigError(f"unknown config key {unknown[0]!r}; valid top-level keys: {', '.join(SECTIONS)}")
  for name in ("model", "data", "train", "checkpoint", "log"):
    _check(name in config, f"config lacks the {name!r} section (use configs/common.py: experiment())")
  model = model_config(config.model)
  _check_keys(config.train, default_train_config(), "train")
  _check_keys(config.checkpoint, default_checkpoint_config(), "checkpoint")
  _check_keys(config.log, default_log_config(), "log")
  check_train(config.train, model)
  from umoe_jax.train import precision  # (lazy: the device and the gmm backends, for fp8 only)
  model = precision.model_with_precision(model, config.train.precision)
  check_checkpoint(config.checkpoint)
  check_expert_parallel(config.get("expert_parallel"))
  _check(config.log.peak_flops is None or config.log.peak_flops > 0,
         f"log.peak_flops={config.log.peak_flops!r} must be positive (or None)")
  check_log_analysis(config.log, config.train)
  check_data(config.data, config.train, model)
  return model
