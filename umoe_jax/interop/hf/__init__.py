"""The PyTorch modeling code that `--format=hf` exports beside the weights (transformers'
trust_remote_code): configuration_umoe (UMoEConfig), modeling_umoe (UMoEForCausalLM), umoe_attention,
umoe_routers, umoe_layers. The files import each other relatively and nothing of umoe_jax, so the
exported directory runs without this project installed."""
