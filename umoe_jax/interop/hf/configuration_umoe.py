"""The transformers config of an exported umoe-jax model: its `model` section, as JSON, plus the
standard fields transformers and its tools read."""
from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig


class UMoEConfig(PretrainedConfig):
  """`umoe`: umoe-jax's model section (a dict) with the resolved routers of the routed sub-layers
  under "attention_router" / "ffn_router"."""

  model_type = "umoe_jax"

  def __init__(self, umoe: Optional[dict] = None, bos_token_id: Optional[int] = None,
               eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None, **kwargs):
    umoe = dict(umoe or {})
    self.umoe = umoe
    self.vocab_size = umoe.get("vocab_size", 0)
    self.hidden_size = umoe.get("d_model", 0)
    self.num_hidden_layers = umoe.get("n_layers", 0)
    self.max_position_embeddings = umoe.get("max_seq_len", 0)
    kwargs.setdefault("tie_word_embeddings", False)
    super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                     **kwargs)
