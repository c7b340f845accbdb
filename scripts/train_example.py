"""Trains a small Flax MLP with mpjax and prints loss, loss scale and skipped steps.

    python scripts/train_example.py                       # configs/example.py as it is
    python scripts/train_example.py --policy mixed_fp16 --steps 500
    MPJAX_POLICY=fp32 python scripts/train_example.py     # switch precision without code changes

Every value of ``configs/example.py`` can be overridden with ``--KEY VALUE``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

import mpjax

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "example.py"


class MLP(nn.Module):
  hidden_dim: int
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(self.hidden_dim)(x))
    x = nn.gelu(nn.Dense(self.hidden_dim)(x))
    return nn.Dense(self.num_classes)(x)


def load_config(argv: list[str] | None) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location("example_config", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for key, value in config.items():
    parser.add_argument(f"--{key}", type=type(value), default=value, help=f"default: {value}")
  config.update(vars(parser.parse_args(argv)))
  return config


def make_data(config: ml_collections.ConfigDict):
  """A fixed teacher task: labels are the argmax of a random linear map of the inputs."""
  k_teacher, k_train, k_test = jax.random.split(jax.random.key(config.seed), 3)
  teacher = jax.random.normal(k_teacher, (config.input_dim, config.num_classes))

  def split(key, n):
    x = jax.random.normal(key, (n, config.input_dim))
    return {"x": x, "y": jnp.argmax(x @ teacher, axis=-1)}

  return split(k_train, config.train_examples), split(k_test, config.test_examples)


def main(argv: list[str] | None = None) -> dict[str, float]:
  config = load_config(argv)
  train, test = make_data(config)
  model = MLP(config.hidden_dim, config.num_classes)
  params = model.init(jax.random.key(config.seed + 1), train["x"][:1])
  loss_scale = {
    "default": None,
    "dynamic": mpjax.DynamicLossScale(),
    "none": mpjax.NoOpLossScale(),
  }[config.loss_scale]
  state = mpjax.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.adam(config.learning_rate),
    policy=config.policy,
    loss_scale=loss_scale,
  )

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return config.loss_multiplier * loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])

  step = jax.jit(
    mpjax.make_train_step(loss_fn, max_grad_norm=config.max_grad_norm or None),
    donate_argnums=0,
  )
  print(f"policy {state.policy}, loss scale {type(state.loss_scale).__name__}")
  batches_per_epoch = config.train_examples // config.batch_size
  start = time.perf_counter()
  for i in range(config.steps):
    lo = (i % batches_per_epoch) * config.batch_size
    batch = jax.tree.map(lambda a, lo=lo: a[lo : lo + config.batch_size], train)
    state, metrics = step(state, batch)
    if (i + 1) % config.log_every == 0 or i + 1 == config.steps:
      print(
        f"step {i + 1:5d}  loss {float(metrics['loss']) / config.loss_multiplier:.4f}  "
        f"acc {float(metrics['aux']):.3f}  loss_scale {float(metrics['loss_scale']):.0f}  "
        f"skipped {int(state.skipped_steps)}",
        flush=True,
      )
  seconds = time.perf_counter() - start
  logits = model.apply(state.params, test["x"])
  summary = {
    "test_accuracy": float(jnp.mean(jnp.argmax(logits, -1) == test["y"])),
    "steps_per_second": config.steps / seconds,
    "skipped_steps": int(state.skipped_steps),
    "final_loss_scale": float(state.loss_scale.loss_scale),
  }
  print("summary  " + "  ".join(f"{k} {v:.4g}" for k, v in summary.items()))
  return summary


if __name__ == "__main__":
  main()
