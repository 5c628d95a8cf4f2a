"""`--config=FILE[:arg]` files and `--config.<key>` overrides of every command: one error each.

config_flags reports such a file in three ways, none naming it plainly: a missing file only at the
first use of the config (an object that raises IOError, after the flags are parsed), a syntax error
or an exception of `get_config()` from inside the flag parser (a traceback), a TypeError /
ValueError there with the whole traceback as its message; and an override of a key the config
lacks (`--config.train.stepz=5`) as a bare AttributeError from inside the flag parser. `load(path)`
turns each file error into one ConfigError, `check_override` each bad key, and `check_argv(argv)`
does both for a command line before its flags are parsed:

    try:
      config_file.check_argv(argv)    # --config=configs/umoe_tiny.py (or --config PATH)
    except ConfigError as e:
      print(f"error: {e}")            # --config=configs/nope.py: no such file

Loading the file twice (here and by the flag) is cheap: a config file only builds a ConfigDict.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Sequence

from umoe_jax.config import ConfigError

HINT = "pass a file of configs/, e.g. --config=configs/umoe_tiny.py"


def config_path(argv: Sequence[str], name: str = "config") -> str:
  """The value of `--<name>=PATH` / `--<name> PATH` in argv ("" if absent)."""
  for i, arg in enumerate(argv):
    for prefix in (f"--{name}=", f"-{name}="):
      if arg.startswith(prefix):
        return arg[len(prefix):]
    if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def load(path: str) -> Any:
  """The ConfigDict of `FILE[:arg]` (unlocked), as config_flags loads it; ConfigError naming the
  file when it is missing or does not load (a syntax error, no get_config, get_config raising)."""
  from ml_collections.config_flags.config_flags import ConfigFileFlagParser
  file = path.split(":", 1)[0]
  if not os.path.isfile(file):
    raise ConfigError(f"--config={file}: no such file")
  # config_flags execs every file into the module "config_config", reusing it: a file without
  # get_config() would call the one of a file loaded before.
  sys.modules.pop("config_config", None)
  try:
    config = ConfigFileFlagParser(name="config", lock_config=False).parse(path)
    if config is not None:  # (None: get_config() without a return, named below)
      config.keys()  # a file that failed to load is an object that raises on first use
  except Exception as e:  # pylint: disable=broad-except  (whatever the config file raised)
    # config_flags re-raises a TypeError / ValueError of get_config() with its traceback as text.
    cause = e.__context__ if str(e).startswith("Error whilst parsing") and e.__context__ else e
    line = _line_in(file, cause)
    at = f" at line {line}" if line else ""
    raise ConfigError(f"--config={file} does not load ({type(cause).__name__}{at}: "
                      f"{' '.join(str(cause).split())})") from e
  if config is None:
    raise ConfigError(f"--config={file} does not load (its get_config() returned None: a missing "
                      "return?)")
  return config


def _line_in(file: str, error: BaseException) -> int | None:
  """The line of `file` that raised `error` (its innermost frame there: the call into
  configs/common.py of a bad scale, say); None for a SyntaxError (its message has the line)."""
  if isinstance(error, SyntaxError):
    return None
  target = os.path.abspath(file)
  lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
           if os.path.abspath(frame.filename) == target]
  return lines[-1] if lines else None


def check_override(config: Any, path: str, name: str = "config") -> None:
  """ConfigError unless `path` ("train.num_steps") names a key of `config`: what a
  `--<name>.<path>=value` override may set (config_flags raises a bare AttributeError / KeyError
  from inside the flag parser)."""
  node, done = config, []
  for part in path.split("."):
    if not hasattr(node, "keys"):
      raise ConfigError(f"{'.'.join(done)} is a value (={node!r}), not a section: no key {path}")
    if part not in node:
      if not done:
        raise ConfigError(f"unknown config key {part!r} (in --{name}.{path}); valid top-level "
                          f"keys: {', '.join(config.keys())}")
      section = ".".join(done)
      raise ConfigError(f"unknown key {section}.{part} (in --{name}.{path}); valid keys of "
                        f"{section}: {', '.join(sorted(node.keys()))}")
    node = node[part]
    done.append(part)


def check_argv(argv: Sequence[str], name: str = "config") -> None:
  """ConfigError when argv's `--<name>` file does not load (`load`) or a `--<name>.<key>=value`
  override names no key of it (`check_override`); nothing without a `--<name>`."""
  path = config_path(argv, name)
  if not path:
    return
  config = load(path)
  for arg in argv:
    for prefix in (f"--{name}.", f"-{name}.", f"--no{name}.", f"-no{name}."):
      if arg.startswith(prefix):
        check_override(config, arg.split("=", 1)[0][len(prefix):], name)
