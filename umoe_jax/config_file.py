"""`--config=FILE[:arg]` files (ml_collections config_flags) that do not load: one error naming the file.

config_flags reports such a file in three ways, none naming it plainly: a missing file only at the
first use of the config (an object that raises IOError, after the flags are parsed), a syntax error
or an exception of `get_config()` from inside the flag parser (a traceback), a TypeError /
ValueError there with the whole traceback as its message. `load(path)` turns each into one
ConfigError, `check_argv(argv)` does it for a command line before its flags are parsed:

    try:
      config_file.check_argv(argv)    # --config=configs/umoe_tiny.py (or --config PATH)
    except ConfigError as e:
      print(f"error: {e}")            # --config=configs/nope.py: no such file

Loading the file twice (here and by the flag) is cheap: a config file only builds a ConfigDict.
"""
from __future__ import annotations

import os
import sys
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
    config.keys()  # a file that failed to load is an object that raises on first use
  except Exception as e:  # pylint: disable=broad-except  (whatever the config file raised)
    # config_flags re-raises a TypeError / ValueError of get_config() with its traceback as text.
    cause = e.__context__ if str(e).startswith("Error whilst parsing") and e.__context__ else e
    raise ConfigError(f"--config={file} does not load ({type(cause).__name__}: "
                      f"{' '.join(str(cause).split())})") from e
  return config


def check_argv(argv: Sequence[str], name: str = "config") -> None:
  """ConfigError (`load`'s) when argv's `--<name>` file does not load; nothing without one."""
  path = config_path(argv, name)
  if path:
    load(path)
