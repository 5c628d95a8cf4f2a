"""`python -m umoe_jax.analysis routing --checkpoints=...` (see `umoe_jax.analysis.cli`)."""
from absl import app

from umoe_jax import flag_errors, stdout_errors
from umoe_jax.analysis import cli
from umoe_jax.analysis.cli import define_flags, main

__doc__ = cli.__doc__  # what --help prints above the flags

if __name__ == "__main__":
  define_flags()
  stdout_errors.run_and_exit(app.run, main, flags_parser=flag_errors.parser(exit_code=1))
