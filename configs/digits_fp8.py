"""The digits MLP with its hidden layer's GEMMs in FP8 (mpjax.get_policy("mixed_fp8")).

With two hidden layers and the default recipe (first and last GEMMs in bf16),
the 256x256 middle layer runs in FP8: E4M3 forward, E5M2 gradients, delayed
scaling.

    mpjax compare digits_fp8 --policies mixed_bf16,mixed_fp8
"""

import ml_collections

from configs import digits_mlp


def get_config() -> ml_collections.ConfigDict:
  config = digits_mlp.get_config()
  config.policy = "mixed_fp8"  # f32 params, bf16 compute, the hidden layer's GEMMs in FP8
  return config
