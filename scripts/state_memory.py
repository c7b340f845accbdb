"""The train state's bytes per parameter and the H100 step's bytes and kernels, per policy.

For the benchmark's two workloads (scripts/bench.py: the MLP 1024-4096-4096-1024
at batch 256 and the 4-layer d512 transformer LM at seq 256, batch 4), with
AdamW, each policy's train step (:func:`mpjax.make_train_step`, state donated)
is compiled for the GPU target on this machine (no GPU needed) in both GEMM
modes, and its kernel report read: kernels launched and bytes moved, as ratios
to the ``fp32`` policy's step in the same mode. And the train state's bytes per
parameter (params plus optimizer state) per policy. Writes the figures, the
command, the jax versions and the XLA flags as JSON.

The two modes bound what a real GPU runs. XLA's default mode (Triton GEMMs on)
is the one users run, but compiled without a GPU nothing autotunes: every GEMM
is a Triton fusion with placeholder tiles, some of them split-K, which write
f32 partial sums that another kernel reads back. The cuBLASLt mode (Triton
GEMMs off) has no such partials: each GEMM reads its operands and writes its
output once. The table gives the bytes of those partials
(:attr:`mpjax.KernelReport.split_k_bytes`). A real GPU's autotuner picks, per
GEMM, a tuned Triton tile or the cuBLASLt call.

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
from mpjax.gpu import gemm_mode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import MLP, TransformerLM, compile_record  # noqa: E402  (scripts/ is not a package)

POLICIES = ("fp32", "mixed_bf16", "pure_bf16", "bf16_sr", "bf16_kahan")
GEMM_BACKENDS = ("default", "cublaslt")


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
  name: str,
  target: str,
  small: bool,
  policies: tuple[str, ...] = POLICIES,
  gemm_backends: tuple[str, ...] = GEMM_BACKENDS,
) -> dict[str, dict[str, Any]]:
  """Per policy: state bytes per parameter, and per GEMM mode the step's kernels and bytes."""
  model, batch, loss_of = workload(name, small)
  params = jax.eval_shape(model.init, jax.random.key(2), batch["x"])
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  tx = optax.adamw(1e-4)
  step = jax.jit(mpjax.make_train_step(loss_of), donate_argnums=0)
  out: dict[str, dict[str, Any]] = {}
  for policy in policies:
    state = jax.eval_shape(
      lambda p, policy=policy: mpjax.TrainState.create(
        apply_fn=model.apply, params=p, tx=tx, policy=policy
      ),
      params,
    )
    out[policy] = {
      "state_bytes_per_param": mpjax.state_bytes(state.params, state.opt_state) / n_params
    }
    for backend in gemm_backends:
      report = mpjax.kernel_report(step, state, batch, target=target, gemm_backend=backend)
      out[policy][backend] = {
        "kernels": report.count,
        "bytes_moved": report.bytes_moved,
        "split_k_bytes": report.split_k_bytes,
        "estimated_ms": report.estimated_seconds * 1e3,
      }
  base = out["fp32"]
  for r in out.values():
    for backend in gemm_backends:
      r[backend]["kernels_ratio"] = r[backend]["kernels"] / base[backend]["kernels"]
      r[backend]["bytes_ratio"] = r[backend]["bytes_moved"] / base[backend]["bytes_moved"]
    if "mixed_bf16" in out:
      r["state_ratio_to_mixed_bf16"] = (
        r["state_bytes_per_param"] / out["mixed_bf16"]["state_bytes_per_param"]
      )
  out["params"] = {"count": n_params}
  return out


def table(name: str, results: dict[str, dict[str, Any]], gemm_backends: tuple[str, ...]) -> str:
  head = " | ".join(
    f"kernels ({b}) | x fp32 | bytes moved, MB ({b}) | x fp32 | of them split-K partials, MB"
    for b in gemm_backends
  )
  rows = [
    f"**{name}** ({results['params']['count']:,} params, AdamW)",
    "",
    f"| policy | state bytes/param | {head} |",
    "|---|---:" + "|---:|---:|---:|---:|---:" * len(gemm_backends) + "|",
  ]
  for policy in (p for p in results if p != "params"):
    r = results[policy]
    cells = " | ".join(
      f"{r[b]['kernels']} | {r[b]['kernels_ratio']:.2f} | {r[b]['bytes_moved'] / 1e6:.1f} | "
      f"{r[b]['bytes_ratio']:.3f} | {r[b]['split_k_bytes'] / 1e6:.1f}"
      for b in gemm_backends
    )
    rows.append(f"| {policy} | {r['state_bytes_per_param']:.2f} | {cells} |")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100", help="a GPU target (mpjax.TARGETS)")
  parser.add_argument("--models", default="mlp,transformer")
  parser.add_argument(
    "--policies", default=",".join(POLICIES), help="comma-separated; must include fp32 (the base)"
  )
  parser.add_argument(
    "--gemm_backends",
    default=",".join(GEMM_BACKENDS),
    help="comma-separated GEMM modes to compile in: default (XLA's, Triton GEMMs on), cublaslt",
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
  try:
    backends = tuple(gemm_mode(b.strip()) for b in args.gemm_backends.split(","))
  except ValueError as e:
    parser.error(f"--gemm_backends {args.gemm_backends}: {e}")
  per_mode = ("gemm_backend", "gemm_mode", "xla_options")
  modes = {b: compile_record(args.target, b) for b in backends}
  record: dict[str, Any] = {
    "command": " ".join(["python", "scripts/state_memory.py", *(argv or sys.argv[1:])]),
    **{k: v for k, v in modes[backends[0]].items() if k not in per_mode},  # versions, flags
    "gemm_modes": {b: {k: m[k] for k in per_mode[1:]} for b, m in modes.items()},
    "results": {},
  }
  for name in args.models.split(","):
    record["results"][name] = results = measure(name, args.target, args.small, policies, backends)
    print(table(name, results, backends) + "\n")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(record, f, indent=2, sort_keys=True)
  return record


if __name__ == "__main__":
  main()
