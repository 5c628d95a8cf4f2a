"""`--config=FILE[:arg]` files and `--config.<key>` overrides of every command: one error each.

config_flags reports such a file in three ways, none naming it plainly: a missing file (or a
directory, or an empty --config=) only at the first use of the config (an object that raises
IOError, after the flags are parsed), a syntax error or an exception of `get_config()` from inside
the flag parser (a traceback), a TypeError / ValueError there with the whole traceback as its
message (get_config called with the wrong arguments: `--config=FILE:arg` passes one); a
get_config() that returns no ConfigDict (5, None) not at all, until the first use; and an override
of a key the config lacks (`--config.train.stepz=5`) as a bare AttributeError from inside the flag
parser, one of another type (`--config.train.num_steps=1.5`) in Python's words ("invalid literal
for int()"). `load(path)` turns each file error into one ConfigError naming the file (and the
line), `check_override` each bad key, `check_override_value` each value of another type, and
`check_argv(argv)` does all three for a command line before its flags are parsed:

    try:
      config_file.check_argv(argv)    # --config=configs/umoe_tiny.py (or --config PATH)
    except ConfigError as e:
      print(f"error: {e}")            # --config=configs/nope.py: no such file

Loading the file twice (here and by the flag) is cheap: a config file only builds a ConfigDict.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import traceback
from typing import Any, Sequence

import ml_collections

from umoe_jax.config.schema import ConfigError

MODULE_NAME = "config_config"  # config_flags' module of a --config file
HINT = "pass a file of configs/, e.g. --config=configs/umoe_tiny.py"


def config_path(argv: Sequence[str], name: str = "config") -> str | None:
  """The value of `--<name>=PATH` / `--<name> PATH` in argv (None if absent, "" if empty)."""
  for i, arg in enumerate(argv):
    for prefix in (f"--{name}=", f"-{name}="):
      if arg.startswith(prefix):
        return arg[len(prefix):]
    if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
      return argv[i + 1]
  return None


def load(path: str) -> Any:
  """The ConfigDict of `FILE[:arg]` (unlocked), as config_flags loads it (the file's
  `get_config()`, or `get_config(arg)`); a ConfigError naming the file when it is not a file (empty,
  missing, a directory), does not load (a syntax error, an exception, no get_config), when
  get_config takes other arguments than the command line passes, raises, or returns no
  ConfigDict."""
  if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", path):  # (else "--config=gs: no such file")
    raise ConfigError(f"--config={path}: a config file is Python, imported from a local path, not "
                      "a URL: copy it here first")
  file, args = split_config_arg(path)
  return load_file(file, args, path=path)


def load_file(file: str, args: tuple[str, ...] = (), *, label: str | None = None,
              path: str | None = None) -> Any:
  """`load` of `file` itself (no `:arg` split: a path may hold a colon), its `get_config(*args)`;
  the errors name the file as `label` ("zoo config configs/x_tiny.py"; default "--config=FILE").
  `path` is the `--config=` value (FILE:arg) that a get_config taking other arguments is told of."""
  label = label or f"--config={file}"
  check_is_file(file, label)
  module = _exec_config_file(file, label)
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise ConfigError(f"{label} defines no get_config() (a config file is Python whose "
                      f"get_config() returns its ConfigDict){_not_python(file)}")
  if not callable(get_config):
    raise ConfigError(f"{label}: its get_config is {_describe(get_config)}, not a function")
  _check_arguments(file, path or file, get_config, args, label)
  config = _call_in(file, get_config, args, label)
  _check_returned(config, label)
  return config


def split_config_arg(path: str) -> tuple[str, tuple[str, ...]]:
  """"configs/x.py:arg" -> ("configs/x.py", ("arg",)); "configs/x.py" -> ("configs/x.py", ())."""
  file, colon, arg = path.partition(":")
  return file, (arg,) if colon else ()


def check_is_file(file: str, label: str | None = None) -> None:
  """ConfigError unless `file` names a file: empty, missing, a directory (listing its configs);
  `label` names it (default "--config=FILE")."""
  label = label or f"--config={file}"
  if not file:
    raise ConfigError(f"{label} names no file")
  if os.path.isdir(file):
    configs = config_files_in(file)
    listing = (f"its config files: {', '.join(configs)}" if configs
               else "it holds no .py file with a get_config()")
    raise ConfigError(f"{label} is a directory, not a config file; {listing}")
  if not os.path.isfile(file):
    from umoe_jax.storage.files import UnknownUserError, expand
    try:
      expand(file)
    except UnknownUserError as e:  # ~user of no user (was "no such file", naming ~user)
      raise ConfigError(f"{label}: no such file: {e}") from None
    raise ConfigError(f"{label}: no such file")


def config_files_in(directory: str) -> list[str]:
  """The names of the .py files directly in `directory` that define a get_config (sorted)."""
  return [name for name in sorted(os.listdir(directory))
          if name.endswith(".py") and _defines_get_config(os.path.join(directory, name))]


def _defines_get_config(path: str) -> bool:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return re.search(r"^def get_config\b", f.read(), re.MULTILINE) is not None
  except OSError:  # (a directory named x.py, an unreadable file)
    return False


def _exec_config_file(file: str, label: str) -> Any:
  """The module of `file`, run as config_flags runs it (module "config_config"); ConfigError
  naming the file and line of a syntax error or of what raised while it ran."""
  # config_flags execs every file into the module "config_config", reusing it: a file without
  # get_config() would call the one of a file loaded before.
  sys.modules.pop(MODULE_NAME, None)
  loader = importlib.machinery.SourceFileLoader(MODULE_NAME, file)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(MODULE_NAME, loader))
  sys.modules[MODULE_NAME] = module  # (as config_flags does: dataclasses of the file look it up)
  try:
    loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f"{label} does not load (SyntaxError at line {e.lineno}: {e.msg})"
                      f"{_not_python(file)}") from e
  except Exception as e:  # pylint: disable=broad-except  (whatever the config file raised)
    raise _does_not_load(file, e, label) from e
  return module


def _check_arguments(file: str, path: str, get_config: Any, args: tuple[str, ...],
                     label: str) -> None:
  """ConfigError when get_config cannot take `args`: `--config=FILE:arg` passes one argument."""
  try:
    inspect.signature(get_config).bind(*args)
  except TypeError:
    if args:
      raise ConfigError(f"--config={path} passes {args[0]!r} to get_config(), but the get_config() "
                        f"of {file} takes no argument: drop ':{args[0]}'") from None
    raise ConfigError(f"{label}: its get_config() needs an argument: pass it as "
                      f"--config={file}:ARG (big_vision style)") from None
  except ValueError:  # no signature (a builtin): let the call tell
    pass


def _call_in(file: str, get_config: Any, args: tuple[str, ...], label: str) -> Any:
  try:
    return get_config(*args)
  except Exception as e:  # pylint: disable=broad-except  (whatever the config file raised)
    raise _does_not_load(file, e, label) from e


def _check_returned(config: Any, label: str) -> None:
  """ConfigError unless get_config() returned a ConfigDict (or a dict)."""
  if isinstance(config, (ml_collections.ConfigDict, dict)):
    return
  missing_return = " (a missing return?)" if config is None else ""
  raise ConfigError(f"{label} does not load: its get_config() returned "
                    f"{_describe(config)}, not a ConfigDict{missing_return}")


def _describe(value: Any) -> str:
  """5 -> "5 (an int)"; None -> "None"; long reprs are cut."""
  text = repr(value)
  text = text if len(text) <= 60 else text[:57] + "..."
  if value is None:
    return text
  return f"{text} ({_with_article(type(value).__name__)})"


def _not_python(file: str) -> str:
  """The note for a file that is not .py (a YAML or JSON config, say)."""
  return "" if file.endswith(".py") else "; it is not a .py file: --config takes configs/*.py"


def _does_not_load(file: str, error: BaseException, label: str) -> ConfigError:
  line = _line_in(file, error)
  at = f" at line {line}" if line else ""
  return ConfigError(f"{label} does not load ({type(error).__name__}{at}: "
                     f"{' '.join(str(error).split())}){_not_python(file)}")


def _line_in(file: str, error: BaseException) -> int | None:
  """The line of `file` that raised `error` (its innermost frame there: the call into
  configs/common.py of a bad scale, say)."""
  target = os.path.abspath(file)
  lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
           if os.path.abspath(frame.filename) == target]
  return lines[-1] if lines else None


def check_override(config: Any, path: str, name: str = "config") -> None:
  """ConfigError unless `path` ("train.num_steps") names a key of `config`: what a
  `--<name>.<path>=value` override may set (config_flags raises a bare AttributeError / KeyError
  from inside the flag parser); a removed key's error says what runs now."""
  from umoe_jax.config.removed import REMOVED_KEYS
  if path in REMOVED_KEYS and not _has_key(config, path):
    raise ConfigError(f"--{name}.{path} was removed: {REMOVED_KEYS[path]}; drop the flag")
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


def _has_key(config: Any, path: str) -> bool:
  node = config
  for part in path.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False
    node = node[part]
  return True


def check_override_value(config: Any, key: str, value: str, name: str = "config",
                         file: str = "") -> None:
  """ConfigError when `--<name>.<key>=<value>` does not parse as the type of `key` (an int, a
  float, a bool, or one of them or None): config_flags' message is Python's ("invalid literal for
  int() with base 10: '1.5'"); this one names the key, the type, and the value the config has.
  A key that is a section (`--config.model=3`) is named as one. Other types: config_flags' own."""
  from ml_collections.config_flags import config_path as field_paths
  try:
    field_type = field_paths.get_type(key, config)
  except Exception:  # pylint: disable=broad-except  (an unknown key: check_override names it)
    return
  parser = _value_parser(field_type)
  if parser is None:
    return
  try:
    parser.parse(value)
  except ValueError:
    if _is_section(field_type):
      raise ConfigError(f"--{name}.{key}={value}: {key} is a section, not a value: set its keys "
                        f"(--{name}.{key}.KEY=value)") from None
    current = _value_at(config, key)
    where = f" in {file}" if file else ""
    raise ConfigError(f"--{name}.{key}={value}: {key} takes {_with_article(parser.flag_type())} "
                      f"(it is {current!r}{where}), not {value!r}") from None


def _value_parser(field_type: Any) -> Any:
  """The flag parser config_flags uses for a field of `field_type`, where its message is Python's
  (int, float, bool and their optional() types) or says little (a section: "`3` is not a dict");
  None for the others."""
  try:  # config_flags' private type registry: another ml_collections may lack it (then its message)
    from ml_collections.config_flags.config_flags import _FIELD_TYPE_TO_PARSER
  except ImportError:
    return None
  from umoe_jax.config.fields import OPTIONAL_TYPES
  if _is_section(field_type):
    return _FIELD_TYPE_TO_PARSER.get(ml_collections.ConfigDict)
  scalar_types = (int, float, bool, *OPTIONAL_TYPES.values())
  return _FIELD_TYPE_TO_PARSER.get(field_type) if field_type in scalar_types else None


def _is_section(field_type: Any) -> bool:
  return isinstance(field_type, type) and issubclass(field_type, ml_collections.ConfigDict)


def _value_at(config: Any, key: str) -> Any:
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def _with_article(type_name: str) -> str:
  return f"{'an' if type_name[0].lower() in 'aeiou' else 'a'} {type_name}"


def check_argv(argv: Sequence[str], name: str = "config") -> None:
  """ConfigError when argv's `--<name>` file does not load (`load`), a `--<name>.<key>=value`
  override names no key of it (`check_override`) or has a value of another type
  (`check_override_value`); nothing without a `--<name>`."""
  path = config_path(argv, name)
  if path is None:
    return
  config = load(path)
  for arg in argv:
    for prefix in (f"--{name}.", f"-{name}.", f"--no{name}.", f"-no{name}."):
      if arg.startswith(prefix):
        key, has_value, value = arg[len(prefix):].partition("=")
        check_override(config, key, name)
        if has_value:
          check_override_value(config, key, value, name, split_config_arg(path)[0])
