"""Step time, saved activations and compile time of mixed precision against fp32 and the peers.

Runs, in one process and interleaved after warm-up, one Adam training step
(f32 master params, state donated) of two unchanged f32 Flax models:

- ``mlp``: an MLP 1024-4096-4096-1024, batch 256;
- ``transformer``: a 4-layer causal transformer LM (d_model 512, 8 heads, MLP
  2048, seq 256, batch 4, vocabulary 512).

Variants, each against ``plain fp32`` (``jax.value_and_grad`` + optax):

- ``mpjax fp32``: :func:`mpjax.make_train_step` with the fp32 policy (its
  bookkeeping: loss scaling, finite check, skip, grad norm);
- ``mpjax mixed_bf16 autocast``: the default for mixed policies;
- ``mpjax mixed_bf16 cast``: the same with ``autocast=False`` (params and batch
  cast to bf16 up front, jmp-style policy casting);
- ``mpjax mixed_fp16 autocast``: fp16 with dynamic loss scaling;
- ``flax dtype=bf16``: the peer a Flax user reaches for, every module built
  with ``dtype=jnp.bfloat16``, in a plain step;
- ``jmp cast``: jmp's recipe by hand: ``jmp.get_policy("params=float32,
  compute=bfloat16,output=float32")``, params and inputs cast to bf16, a plain
  step.

Per variant: the median step time and its ratio to ``plain fp32``; the
activations saved for the backward pass (residuals that are not arguments,
``jax.ad_checkpoint``) and their ratio to fp32; tracing plus compiling time and
its ratio to fp32. Prints a markdown table; ``--json`` writes the figures.

    python scripts/bench.py [--models mlp,transformer] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from jax._src.ad_checkpoint import saved_residuals

import mpjax


class MLP(nn.Module):
  features: tuple[int, ...]
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.features):
      x = nn.Dense(width, dtype=self.dtype)(x)
      if i < len(self.features) - 1:
        x = nn.relu(x)
    return x


class Block(nn.Module):
  d_model: int
  heads: int
  mlp: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    b, s, _ = x.shape
    h = nn.LayerNorm(dtype=self.dtype)(x)
    qkv = nn.Dense(3 * self.d_model, dtype=self.dtype)(h).reshape(b, s, 3, self.heads, -1)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    mask = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32)).astype(v.dtype)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, self.d_model)
    x = x + nn.Dense(self.d_model, dtype=self.dtype)(attn)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(self.mlp, dtype=self.dtype)(h)
    return x + nn.Dense(self.d_model, dtype=self.dtype)(nn.gelu(h))


class TransformerLM(nn.Module):
  vocab: int = 512
  d_model: int = 512
  heads: int = 8
  mlp: int = 2048
  layers: int = 4
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d_model))
    for _ in range(self.layers):
      x = Block(self.d_model, self.heads, self.mlp, self.dtype)(x)
    return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def _workload(name: str, small: bool) -> tuple[Callable[[Any], nn.Module], Any, Callable]:
  """(model factory by dtype, batch, loss(logits, batch)) for one workload."""
  key = jax.random.key(0)
  if name == "mlp":
    sizes = (16, 32, 32, 8) if small else (1024, 4096, 4096, 1024)
    batch_size = 4 if small else 256
    batch = {
      "x": jax.random.normal(key, (batch_size, sizes[0])),
      "y": jax.random.normal(jax.random.key(1), (batch_size, sizes[-1])),
    }
    return (
      lambda dtype: MLP(sizes[1:], dtype),
      batch,
      lambda out, batch: jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2),
    )
  dims = (
    dict(vocab=64, d_model=32, heads=4, mlp=64, layers=2)
    if small
    else dict(vocab=512, d_model=512, heads=8, mlp=2048, layers=4)
  )
  seq, batch_size = (16, 2) if small else (256, 4)
  tokens = jax.random.randint(key, (batch_size, seq + 1), 0, dims["vocab"])
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  return (
    lambda dtype: TransformerLM(**dims, dtype=dtype),
    batch,
    lambda out, batch: optax.softmax_cross_entropy_with_integer_labels(
      out.astype(jnp.float32), batch["y"]
    ).mean(),
  )


def _variants(name: str, small: bool) -> dict[str, tuple[Callable, Callable, Callable]]:
  """name -> (step, init_state, loss_of_params for residuals)."""
  make_model, batch, loss = _workload(name, small)
  tx = optax.adam(1e-4)
  f32_model = make_model(None)
  params = f32_model.init(jax.random.key(2), batch["x"])

  def plain(model, cast: Callable[[Any], Any] = lambda t: t):
    def loss_of(params, batch):
      return loss(model.apply(cast(params), cast(batch["x"])), batch)

    def step(carry, batch):
      params, opt_state = carry
      value, grads = jax.value_and_grad(loss_of)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    def init():
      own = jax.tree.map(jnp.copy, params)  # the step donates it
      return own, tx.init(own)

    return jax.jit(step, donate_argnums=0), init, loss_of

  def with_mpjax(policy: str, autocast: bool = True):
    def loss_of(params, batch):
      return loss(f32_model.apply(params, batch["x"]), batch)

    step = mpjax.make_train_step(loss_of, autocast=autocast)

    def init():
      return mpjax.TrainState.create(apply_fn=f32_model.apply, params=params, tx=tx, policy=policy)

    p = mpjax.get_policy(policy)
    run = (
      mpjax.autocast(loss_of, p)
      if autocast
      else lambda params, batch: loss_of(p.cast_to_compute(params), p.cast_to_compute(batch))
    )
    return jax.jit(step, donate_argnums=0), init, run

  jmp_policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
  return (
    {
      "plain fp32": plain(f32_model),
      "mpjax fp32": with_mpjax("fp32"),
      "mpjax mixed_bf16 autocast": with_mpjax("mixed_bf16"),
      "mpjax mixed_bf16 cast": with_mpjax("mixed_bf16", autocast=False),
      "mpjax mixed_fp16 autocast": with_mpjax("mixed_fp16"),
      "flax dtype=bf16": plain(make_model(jnp.bfloat16)),
      "jmp cast": plain(f32_model, jmp_policy.cast_to_compute),
    },
    batch,
    params,
  )


def _residual_bytes(loss_of: Callable, params: Any, batch: Any) -> int:
  """Bytes of the activations saved for the backward pass (not the arguments)."""
  total = 0
  for aval, where in saved_residuals(loss_of, params, batch):
    if "from the argument" not in where:
      total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
  return total


def bench(name: str, rounds: int, small: bool = False) -> dict[str, dict[str, float]]:
  variants, batch, params = _variants(name, small)
  results: dict[str, dict[str, float]] = {}
  states = {}
  for label, (step, init, loss_of) in variants.items():
    state = init()
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    for _ in range(3):  # warm up
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    states[label] = (compiled, state)
    results[label] = {
      "compile_s": compile_s,
      "residual_mib": _residual_bytes(loss_of, params, batch) / 2**20,
    }
  times: dict[str, list[float]] = {label: [] for label in variants}
  for _ in range(rounds):
    for label in variants:
      compiled, state = states[label]
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready((state, metrics))
      times[label].append(time.perf_counter() - start)
      states[label] = (compiled, state)
  base = results["plain fp32"]
  base_time = statistics.median(times["plain fp32"])
  for label, r in results.items():
    r["step_ms"] = statistics.median(times[label]) * 1e3
    r["step_ratio"] = r["step_ms"] / (base_time * 1e3)
    r["residual_ratio"] = r["residual_mib"] / base["residual_mib"]
    r["compile_ratio"] = r["compile_s"] / base["compile_s"]
  return results


def _table(name: str, results: dict[str, dict[str, float]]) -> str:
  lines = [
    f"**{name}**",
    "",
    "| variant | step ms | vs fp32 | saved activations MiB | vs fp32 | compile s | vs fp32 |",
    "|---|---|---|---|---|---|---|",
  ]
  for label, r in results.items():
    lines.append(
      f"| {label} | {r['step_ms']:.1f} | {r['step_ratio']:.3f}x | {r['residual_mib']:.1f} | "
      f"{r['residual_ratio']:.3f}x | {r['compile_s']:.2f} | {r['compile_ratio']:.2f}x |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="mlp,transformer", help="comma-separated workloads")
  parser.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds")
  parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test)")
  parser.add_argument("--json", help="write the figures to this JSON file")
  args = parser.parse_args(argv)
  all_results = {}
  for name in args.models.split(","):
    all_results[name] = bench(name, args.rounds, args.small)
    print(_table(name, all_results[name]), end="\n\n", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(all_results, f, indent=2)
  return all_results


if __name__ == "__main__":
  main()
