"""`python -m umoe_jax.eval <command> [flags]` (see `umoe_jax.eval.cli`)."""
import sys

from umoe_jax.eval.cli import main

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
