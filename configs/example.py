"""Example experiment: an MLP classifier on a synthetic teacher task (scripts/train_example.py)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.policy = (
    "mixed_bf16"  # precision policy, anything mpjax.get_policy reads; MPJAX_POLICY overrides
  )
  config.loss_scale = "default"  # "default" (dynamic for fp16, none otherwise), "dynamic", "none"
  config.steps = 300  # training steps
  config.batch_size = 128  # examples per step
  config.learning_rate = 3e-3  # Adam learning rate
  config.max_grad_norm = 1.0  # clip gradients to this global norm; 0 turns clipping off
  config.input_dim = 64  # features per example
  config.hidden_dim = 256  # width of the two hidden layers
  config.num_classes = 10  # classes of the teacher task
  config.train_examples = 8192  # size of the fixed synthetic training set
  config.test_examples = 2048  # size of the held-out set
  config.loss_multiplier = 1.0  # multiplies the loss; 1e-6 makes fp16 gradients underflow unscaled
  config.log_every = 50  # steps between progress lines
  config.seed = 0  # seed of data and initialisation
  return config
