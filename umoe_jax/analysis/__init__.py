"""What the experts do: routing statistics, the probe and reports (drawn by umoe_jax.plot). The
trainer's routing probe, `umoe_jax.train.routing_probe`, builds on them; nothing here imports the
trainer.

  routing.py     the statistics (pure numpy): fluctuation, Jaccard, entropy, load, consistency,
                 attention / FFN overlap of a shared pool
  probe.py       the probe tokens and every router's picks from a forward pass
  checkpoints.py which checkpoints, their model configs (same shapes; reading: umoe_jax/load.py)
  report.py      the report dict (JSON) and its text tables
  cli.py         `analyze` (the whole analysis) and the command python -m umoe_jax.analysis routing
                 --checkpoints=A,B,... (see there)
"""
