"""Measures what mpjax's train-step bookkeeping costs over a plain JAX + optax step.

Runs, in one process and interleaved after warm-up, on an MLP
(1024-4096-4096-1024, batch 256, Adam, state donated):

- ``plain fp32``: ``jax.value_and_grad`` + ``tx.update`` + ``optax.apply_updates``;
- ``mpjax fp32``: ``mpjax.make_train_step`` with the fp32 policy (loss scaling,
  finite check, skip and grad norm included);
- ``mpjax mixed_bf16`` and ``mpjax mixed_fp16`` (policy casting with dynamic
  loss scaling), for reference;
- ``flax bf16``: the peer a Flax user reaches for, ``nn.Dense(dtype=bfloat16)``
  in a plain step;
- ``flax bf16 + mixed_dot``: the same modules with
  ``dot_general=mpjax.mixed_dot_general()`` (every GEMM, forward and backward,
  bf16 x bf16 -> f32) in an mpjax step.

Prints the median step time of each and its ratio to ``plain fp32``.

    python scripts/bench_train_step.py [--rounds 15] [--sizes 1024,4096,4096,1024] [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

import mpjax


class MLP(nn.Module):
  features: tuple[int, ...]
  dtype: Any = None
  dot_general: Any = lax.dot_general

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.features):
      x = nn.Dense(width, dtype=self.dtype, dot_general=self.dot_general)(x)
      if i < len(self.features) - 1:
        x = nn.relu(x)
    return x


def main(argv: list[str] | None = None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
  parser.add_argument("--sizes", default="1024,4096,4096,1024", help="input width, then layers")
  parser.add_argument("--batch", type=int, default=256, help="batch size")
  args = parser.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",")]

  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  batch = {
    "x": jax.random.normal(kx, (args.batch, sizes[0])),
    "y": jax.random.normal(ky, (args.batch, sizes[-1])),
  }
  tx = optax.adam(1e-4)

  def make_loss(model):
    def loss_fn(params, batch):
      pred = model.apply(params, batch["x"]).astype(jnp.float32)
      return jnp.mean((pred - batch["y"]) ** 2)

    return loss_fn

  def plain(model):
    loss_fn = make_loss(model)
    params = model.init(kp, batch["x"])

    def plain_step(carry, batch):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    return jax.jit(plain_step, donate_argnums=0), lambda: (params, tx.init(params))

  def with_mpjax(model, policy):
    params = model.init(kp, batch["x"])
    step = jax.jit(mpjax.make_train_step(make_loss(model)), donate_argnums=0)
    return step, lambda: mpjax.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx, policy=policy
    )

  f32 = MLP(tuple(sizes[1:]))
  flax_bf16 = MLP(tuple(sizes[1:]), dtype=jnp.bfloat16)
  mixed = MLP(tuple(sizes[1:]), dtype=jnp.bfloat16, dot_general=mpjax.mixed_dot_general())
  variants = {
    "plain fp32": plain(f32),
    "mpjax fp32": with_mpjax(f32, "fp32"),
    "mpjax mixed_bf16": with_mpjax(f32, "mixed_bf16"),
    "mpjax mixed_fp16": with_mpjax(f32, "mixed_fp16"),
    "flax bf16": plain(flax_bf16),
    "flax bf16 + mixed_dot": with_mpjax(mixed, "fp32"),
  }

  states = {}
  for name, (step, init) in variants.items():
    state = init()
    for _ in range(3):  # compile and warm up
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    states[name] = state

  times: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(args.rounds):
    for name, (step, _) in variants.items():
      start = time.perf_counter()
      states[name], metrics = step(states[name], batch)
      jax.block_until_ready((states[name], metrics))
      times[name].append(time.perf_counter() - start)

  medians = {name: statistics.median(t) for name, t in times.items()}
  base = medians["plain fp32"]
  print(
    f"MLP {'-'.join(map(str, sizes))}, batch {args.batch}, Adam, {args.rounds} interleaved rounds"
  )
  print(f"{'variant':<24} {'median ms':>10} {'vs plain fp32':>14}")
  for name, median in medians.items():
    print(f"{name:<24} {median * 1e3:>10.1f} {median / base:>13.3f}x")
  return {name: median / base for name, median in medians.items()}


if __name__ == "__main__":
  main()
