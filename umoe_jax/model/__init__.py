"""Model code: attention variants, routers, experts, blocks and the LM."""
from umoe_jax.model.lm import CausalLM, abstract_model, build_model  # noqa: F401
