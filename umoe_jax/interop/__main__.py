"""`python -m umoe_jax.interop <command>`: `export` (`umoe_jax.interop.export`). Importing an official
checkpoint is `python -m umoe_jax.interop.official`."""
from __future__ import annotations

import sys

_COMMANDS = ("export",)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in _COMMANDS:
    got = f"unknown command {argv[0]!r}" if argv and not argv[0].startswith("-") else "no command"
    print(f"error: {got}; usage: python -m umoe_jax.interop export --checkpoint=DIR --out=DIR "
          "--format=official|hf (import: python -m umoe_jax.interop.official)", file=sys.stderr)
    return 2
  from umoe_jax.interop import export
  return export.main(argv[1:])


if __name__ == "__main__":
  from umoe_jax import stdout_errors
  stdout_errors.run_and_exit(main)
