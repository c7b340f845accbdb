"""The default character-level LM in fp16 compute, with dynamic loss scaling."""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.policy = "mixed_fp16"  # f32 params, fp16 compute
  config.loss_scale = "dynamic"  # starts at 2**15, halves on overflow, doubles every 2000 steps
  return config
