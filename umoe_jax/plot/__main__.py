"""python -m umoe_jax.plot RUN [RUN ...] [--out=DIR] [--title=...]: see umoe_jax/plot/runs.py."""
from umoe_jax import stdout_errors
from umoe_jax.plot import runs

if __name__ == "__main__":
  stdout_errors.run_and_exit(runs.main)
