"""`python -m umoe_jax.stats`: the command line of `umoe_jax.stats.cli`."""
from umoe_jax import stats, stdout_errors

# absl's --help prints the main module's docstring: show the package overview (usage, definitions).
__doc__ = stats.__doc__

if __name__ == "__main__":
  stdout_errors.run_and_exit(stats.run_cli)
