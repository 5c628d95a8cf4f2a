"""Typed, validated model configuration.

Config files (`configs/*.py`) are ml_collections ConfigDicts, convenient for command-line overrides.
Modules never read a ConfigDict: `model_config(cfg.model)` turns it into frozen dataclasses once,
rejecting unknown keys, wrong types and impossible combinations with an error that names the key and
the value (`ConfigError`). One module per idea:

  schema         the dataclasses (`ModelConfig`, `RouterConfig`, ...), every key documented where
                 it is declared; per sub-layer routers (`ModelConfig.router_for`)
  parsing        ConfigDict -> dataclasses (`model_config`), defaults -> ConfigDict
  checks         `validate`: model values and combinations, the checks per attention kind
  router_checks  the routers' values, placements and `check_cached_decoding`
  comments       the comment that documents each key, read from the source where it is declared
  docs           docs/configuration.md from those comments (`python3 -m umoe_jax.config.docs`)

Everything a caller needs is importable from here (`from umoe_jax.config import ModelConfig, ...`).
"""
from umoe_jax.config.schema import (ACTIVATIONS, DTYPES, PRECISIONS, ROPE_LAYOUTS,  # noqa: F401
                                    SUBLAYERS, AttentionConfig, ConfigError, FFNConfig, MoEConfig,
                                    ModelConfig, RouterConfig, RouterOverrides, resolve_router,
                                    router_mixing)
from umoe_jax.config.checks import validate  # noqa: F401
from umoe_jax.config.router_checks import check_cached_decoding  # noqa: F401
from umoe_jax.config.parsing import (default_config_dict, model_config, resolve,  # noqa: F401
                                     to_dict)
