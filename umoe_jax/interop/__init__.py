"""Interoperability with other implementations: `official` imports checkpoints of the official
PyTorch UMoE code (github.com/ysngki/UMoE); `python -m umoe_jax.interop.official --help`. Its pieces:
`official_config` (config.json), `checkpoint_files` (reading tensors), `official_weights` (mapping)."""
