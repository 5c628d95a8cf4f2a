"""transformers wrapper of an exported umoe-jax model (trust_remote_code):

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    model.generate(input_ids, max_new_tokens=32, do_sample=False)

The network is `umoe_decoder.Decoder` (under `model.`); decoding keeps its own cache (`UMoECache`),
or none when a router mixes over earlier tokens (then `generate` runs the whole sequence each step).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_umoe import UMoEConfig
from .umoe_decoder import Decoder, UMoECache


class UMoEPreTrainedModel(PreTrainedModel):
  config_class = UMoEConfig
  base_model_prefix = "model"
  _no_split_modules = ["DecoderBlock"]

  def _init_weights(self, module):
    for p in module.parameters(recurse=False):   # only what a checkpoint lacks: N(0, init_std)
      nn.init.normal_(p, std=self.config.umoe.get("init_std", 0.02))


class UMoEForCausalLM(UMoEPreTrainedModel, GenerationMixin):

  def __init__(self, config: UMoEConfig):
    super().__init__(config)
    self.model = Decoder(config.umoe)
    self.post_init()

  @classmethod
  def _supports_default_dynamic_cache(cls) -> bool:
    return False   # its own cache (`UMoECache`): the layers cache different tensors per kind

  def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
              cache: Optional[UMoECache] = None, past_key_values: Optional[UMoECache] = None,
              use_cache: Optional[bool] = None, labels: Optional[torch.LongTensor] = None, **kwargs):
    cache = cache if cache is not None else past_key_values
    if not self.model.decodes:
      cache = None
    elif use_cache and cache is None:
      cache = UMoECache(len(self.model.layers))
    logits = self.model(input_ids, attention_mask, cache)
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                             ignore_index=-100)
    # transformers 5 names the returned cache `cache`, 4 `past_key_values`
    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(loss=loss, logits=logits, **{name: cache})

  def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not self.model.decodes:
      cache = None
    elif cache is not None and cache.get_seq_length():
      input_ids = input_ids[:, cache.get_seq_length():]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache,
            "use_cache": self.model.decodes and kwargs.get("use_cache", True) is not False}
