"""Interoperability with other implementations: `official` imports checkpoints of the official
PyTorch UMoE code (github.com/ysngki/UMoE); `python -m umoe_jax.interop.official --help`. Its pieces:
`official_config` (config.json), `checkpoint_files` (reading tensors), `official_weights` (mapping).
`python -m umoe_jax.interop export` goes the other way (`export`: `official_export`, `hf_export` with
the PyTorch code of `hf/`; docs/interop.md)."""
