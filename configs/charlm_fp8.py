"""The default character-level LM with its layers' GEMMs in FP8 (mpjax.get_policy("mixed_fp8")).

E4M3 operands forward, E5M2 gradients backward, delayed scaling (amax histories
of 1024 steps in the train state); the first GEMM and the output head stay
bf16, and so does everything that is not a layer's GEMM. XLA:CPU emulates FP8:
on a CPU this trains correctly but slower than mixed_bf16; the speed is for
H100-class GPUs (see `mpjax doctor charlm_fp8 --target h100`).

    mpjax compare charlm_fp8 --policies mixed_bf16,mixed_fp8
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.policy = "mixed_fp8"  # f32 params, bf16 compute, layers' GEMMs in FP8
  return config
