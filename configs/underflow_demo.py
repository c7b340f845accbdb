"""fp16 gradients that underflow unless the loss is scaled (mpjax.data.load_underflow_task).

mpjax train underflow_demo --config.loss_scale=none     # fp16 unscaled: stays at chance
mpjax train underflow_demo                              # dynamic loss scaling: learns
mpjax train underflow_demo --config.policy=fp32         # the reference
"""

import ml_collections

from configs import digits_mlp


def get_config() -> ml_collections.ConfigDict:
  config = digits_mlp.get_config()
  config.policy = "mixed_fp16"  # fp16 compute: gradients below 6e-8 round to zero
  config.loss_scale = "default"  # dynamic for fp16 (the fix); "none" shows the failure
  config.steps = 400  # training steps
  config.learning_rate = 1e-2  # peak AdamW learning rate
  config.batch_size = 64  # examples per step
  config.data = ml_collections.ConfigDict()
  config.data.name = "underflow"  # a teacher task whose loss is defined times 2**-21
  config.model = ml_collections.ConfigDict()
  config.model.name = "mlp"  # mpjax.models.MLP: dense -> GELU layers, then a dense head
  config.model.features = (64,)  # one hidden layer
  return config
