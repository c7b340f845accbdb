"""An MLP classifier on scikit-learn's bundled 8x8 digits (no download)."""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.steps = 400  # training steps
  config.batch_size = 64  # images per step
  config.learning_rate = 3e-3  # peak AdamW learning rate
  config.warmup_steps = 20  # linear warm-up steps
  config.log_every = 20  # steps between metric lines
  config.eval_every = 0  # evaluate at the end only
  config.checkpoint_every = 0  # checkpoint at the end only
  config.data = ml_collections.ConfigDict()
  config.data.name = "digits"  # flat (64,) pixel vectors in [0, 1]
  config.model = ml_collections.ConfigDict()
  config.model.name = "mlp"  # mpjax.models.MLP: dense -> GELU layers, then a dense head
  config.model.features = (256, 256)  # hidden widths
  return config
