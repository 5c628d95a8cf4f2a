"""Evaluation: held-out perplexity (`perplexity`) and zero-shot tasks by log-likelihood scoring
(`tasks`: readers of the shared eval JSONL files; `harness`: batched scoring, metrics and the CLI
`python -m umoe_jax.eval.harness`)."""
