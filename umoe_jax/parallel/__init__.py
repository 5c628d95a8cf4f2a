"""Parallelism: device mesh, logical-axis shardings, multi-process start-up, expert parallelism.

  mesh.make_mesh(config.mesh)                        -> Mesh("data", "fsdp", "tensor", "expert")
  sharding.state_shardings(abstract, mesh, rules)    -> NamedSharding per leaf (params, opt state)
  sharding.use_mesh(mesh, rules)                     the context the model traces under
  distributed.initialize_from_env()                  jax.distributed from env / SLURM / TPU pod
  expert_parallel                                    shard_map + token exchange (all-gather / all-to-all)
"""
