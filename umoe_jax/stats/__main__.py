"""`python -m umoe_jax.stats`: the command line of `umoe_jax.stats.cli`."""
from umoe_jax import stats

# absl's --help prints the main module's docstring: show the package overview (usage, definitions).
__doc__ = stats.__doc__

if __name__ == "__main__":
  stats.run_cli()
