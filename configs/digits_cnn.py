"""A small CNN with BatchNorm on scikit-learn's bundled 8x8 digits (no download)."""

import ml_collections

from configs import digits_mlp


def get_config() -> ml_collections.ConfigDict:
  config = digits_mlp.get_config()
  config.data.name = "digits_image"  # (8, 8, 1) images
  config.model = ml_collections.ConfigDict()
  config.model.name = "cnn"  # conv -> BatchNorm -> relu blocks, then a dense head
  config.model.features = (32, 64)  # channels of the conv blocks
  config.model.dense = 128  # width of the dense layer before the head
  return config
