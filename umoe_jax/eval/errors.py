"""`EvalError`: bad input to an evaluation (task, data file, checkpoint, tokenizer, flags).

Raised with a message that names the bad value or file (and line); the CLI (`umoe_jax.eval.cli`)
prints it as one line and exits non-zero. A ValueError, so library callers can catch it as one.
"""


class EvalError(ValueError):
  """An evaluation input is wrong; the message says which and why."""
