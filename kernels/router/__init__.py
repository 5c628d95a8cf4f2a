"""Router kernels: triton_topk.py, the top-k ids of each row in one Triton pass (the same ids as
`jax.lax.top_k`). Chosen through `umoe_jax.ops.topk.BACKENDS`."""
