"""`python -m umoe_jax.analysis routing --checkpoints=...` (see `umoe_jax.analysis.cli`)."""
from absl import app

from umoe_jax.analysis.cli import define_flags, main

if __name__ == "__main__":
  define_flags()
  app.run(main)
