"""`python -m umoe_jax.eval <command> [flags]` (see `umoe_jax.eval.cli`)."""
import sys

from umoe_jax import stdout_errors
from umoe_jax.eval.cli import main

if __name__ == "__main__":
  stdout_errors.run_and_exit(main, sys.argv[1:])
