"""The train state's bytes per parameter and the H100 step's bytes and kernels, per policy.

For the benchmark's two workloads (scripts/bench.py: the MLP 1024-4096-4096-1024
at batch 256 and the 4-layer d512 transformer LM at seq 256, batch 4), with
AdamW, each policy's train step (:func:`mpjax.make_train_step`, state donated)
is compiled for the GPU target on this machine (no GPU needed; XLA's default
mode) and its kernel report read: kernels launched and bytes moved, as ratios
to the ``fp32`` policy's step. And the train state's bytes per parameter
(params plus optimizer state) per policy. Writes the figures, the command, the
jax versions and the XLA flags as JSON.

    python scripts/state_memory.py [--target h100] [--json results/gpu/bf16_sr_h100.json]
    python scripts/state_memory.py --small --models mlp --policies fp32,pure_bf16,bf16_sr
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import MLP, TransformerLM, compile_record  # noqa: E402  (scripts/ is not a package)

POLICIES = ("fp32", "mixed_bf16", "pure_bf16", "bf16_sr", "bf16_kahan")


def workload(name: str, small: bool) -> tuple[Any, Any, Any]:
  """(model, batch, loss_of(params, batch)) of the benchmark's workload ``name``."""
  key = jax.random.key(0)
  if name == "mlp":
    sizes = (16, 32, 32, 8) if small else (1024, 4096, 4096, 1024)
    batch_size = 8 if small else 256
    model = MLP(sizes[1:])
    batch = {
      "x": jax.random.normal(key, (batch_size, sizes[0])),
      "y": jax.random.normal(jax.random.key(1), (batch_size, sizes[-1])),
    }

    def loss_of(params, batch):
      return jnp.mean((model.apply(params, batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)

    return model, batch, loss_of
  dims = (
    dict(vocab=64, d_model=32, heads=4, mlp=64, layers=2)
    if small
    else dict(vocab=512, d_model=512, heads=8, mlp=2048, layers=4)
  )
  seq, batch_size = (16, 2) if small else (256, 4)
  model = TransformerLM(**dims)
  tokens = jax.random.randint(key, (batch_size, seq + 1), 0, dims["vocab"])
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

  def loss_of(params, batch):
    logits = model.apply(params, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return model, batch, loss_of


def measure(
  name: str, target: str, small: bool, policies: tuple[str, ...] = POLICIES
) -> dict[str, dict[str, float]]:
  """Per policy: state bytes per parameter, and the target step's kernels and bytes moved."""
  model, batch, loss_of = workload(name, small)
  params = jax.eval_shape(model.init, jax.random.key(2), batch["x"])
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  tx = optax.adamw(1e-4)
  step = jax.jit(mpjax.make_train_step(loss_of), donate_argnums=0)
  out: dict[str, dict[str, float]] = {}
  for policy in policies:
    state = jax.eval_shape(
      lambda p, policy=policy: mpjax.TrainState.create(
        apply_fn=model.apply, params=p, tx=tx, policy=policy
      ),
      params,
    )
    report = mpjax.kernel_report(step, state, batch, target=target)
    out[policy] = {
      "state_bytes_per_param": mpjax.state_bytes(state.params, state.opt_state) / n_params,
      "kernels": report.count,
      "bytes_moved": report.bytes_moved,
      "estimated_ms": report.estimated_seconds * 1e3,
    }
  base = out["fp32"]
  for r in out.values():
    r["kernels_ratio"] = r["kernels"] / base["kernels"]
    r["bytes_ratio"] = r["bytes_moved"] / base["bytes_moved"]
    if "mixed_bf16" in out:
      r["state_ratio_to_mixed_bf16"] = (
        r["state_bytes_per_param"] / out["mixed_bf16"]["state_bytes_per_param"]
      )
  out["params"] = {"count": n_params}
  return out


def table(name: str, results: dict[str, dict[str, float]]) -> str:
  rows = [
    f"**{name}** ({results['params']['count']:,} params, AdamW)",
    "",
    "| policy | state bytes/param | kernels | x fp32 | bytes moved (MB) | x fp32 |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for policy in (p for p in results if p != "params"):
    r = results[policy]
    rows.append(
      f"| {policy} | {r['state_bytes_per_param']:.2f} | {r['kernels']} | "
      f"{r['kernels_ratio']:.2f} | {r['bytes_moved'] / 1e6:.1f} | {r['bytes_ratio']:.2f} |"
    )
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100", help="a GPU target (mpjax.TARGETS)")
  parser.add_argument("--models", default="mlp,transformer")
  parser.add_argument(
    "--policies", default=",".join(POLICIES), help="comma-separated; must include fp32 (the base)"
  )
  parser.add_argument("--small", action="store_true", help="tiny models (for the tests)")
  parser.add_argument("--json", default="", help="write the figures here")
  args = parser.parse_args(argv)
  policies = tuple(p.strip() for p in args.policies.split(","))
  if "fp32" not in policies:
    parser.error(
      f"--policies {args.policies}: must include fp32, the policy the kernel and byte ratios "
      "are taken against"
    )
  record: dict[str, Any] = {
    "command": " ".join(["python", "scripts/state_memory.py", *(argv or sys.argv[1:])]),
    **compile_record(args.target, "default"),
    "results": {},
  }
  for name in args.models.split(","):
    record["results"][name] = results = measure(name, args.target, args.small, policies)
    print(table(name, results) + "\n")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(record, f, indent=2, sort_keys=True)
  return record


if __name__ == "__main__":
  main()
