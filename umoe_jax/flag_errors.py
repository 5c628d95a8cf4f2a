"""A flag the command line cannot parse, as one `error:` line, for the commands run by absl.app.run.

absl.app.run reports an unknown flag, a value of the wrong type (`--tokens=abc`) or a config
override of the wrong type (`--config.model.n_layers=abc`) as "FATAL Flags parsing error: ..." plus
a "Pass --helpshort ..." line; the commands report every other bad input as one `error:` line, and
this makes flags the same:

    app.run(main, flags_parser=flag_errors.parser(exit_code=2))

absl's --help, --helpshort, --helpfull and --helpxml print the help and exit with status 1;
`parse_flags` (used by `parser` and train.py's own parser, which adds a hint line and --debug)
exits 0 after the help, as argparse and the commands' own `--help` do.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

from absl import flags


def parser(exit_code: int = 1) -> Callable[[Sequence[str]], list[str]]:
  """An absl.app.run `flags_parser`: absl's own parsing (argv -> the arguments left over), with a
  flags.Error printed as "error: <message>" and the process exiting with `exit_code`."""

  def parse(argv: Sequence[str]) -> list[str]:
    try:
      return parse_flags(argv)
    except flags.Error as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      raise SystemExit(exit_code) from None

  return parse


def parse_flags(argv: Sequence[str]) -> list[str]:
  """flags.FLAGS(argv) (the arguments left over), with absl's help flags exiting 0, not 1: they
  are the only flags that exit while parsing (--only_check_flags exits 0 already)."""
  try:
    return flags.FLAGS(list(argv))
  except SystemExit:
    raise SystemExit(0) from None
