"""Is a DeepSeek-V3-style blockwise FP8 GEMM worth building for H100? A roofline estimate.

DeepSeek-V3's recipe scales activations per 1x128 tile and weights per 128x128 block. Hopper's
FP8 Tensor Cores take one scale per operand, so in XLA such a GEMM is a sum over K blocks of
128: one f8 x f8 dot per K block, each partial product scaled in f32 and added (what DeepGEMM
does in registers, inside one kernel). This script compiles that form and a bf16 GEMM of the
same sizes for H100 here (no GPU needed) and prints the estimated time of each: the forward
GEMM of GPT-2 small's MLP (8192 tokens, 768 -> 3072) and its transpose (3072 -> 768).

    python scripts/hopper_blockwise_estimate.py [--json results/gpu/hopper_blockwise_h100.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from bench import compile_record  # scripts/ is on the path when this script runs

import mpjax
from mpjax.kernels import report_from_hlo

E4M3 = jnp.float8_e4m3fn
TILE = 128


def bf16_gemm(x: jax.Array, w: jax.Array) -> jax.Array:
  """mixed_bf16's GEMM: bf16 operands, f32 accumulation, a bf16 result."""
  return jnp.dot(
    x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16
  )


def _quantize(x: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  scale = jnp.maximum(amax, 1e-12) / 448.0
  return (x / scale).astype(E4M3), scale


def blockwise_gemm(x: jax.Array, w: jax.Array) -> jax.Array:
  """DeepSeek-V3's blockwise FP8 GEMM: x per 1x128 tile, w per 128x128 block, one f8 dot per K
  block accumulated in f32 across blocks."""
  t, k = x.shape
  n = w.shape[1]
  kb, nb = k // TILE, n // TILE
  xt = x.reshape(t, kb, TILE)
  xq, sx = _quantize(xt, jnp.max(jnp.abs(xt), axis=-1, keepdims=True))  # (t, kb, 128), (t, kb, 1)
  wt = w.reshape(kb, TILE, nb, TILE)
  wq, sw = _quantize(wt, jnp.max(jnp.abs(wt), axis=(1, 3), keepdims=True))  # (kb, 1, nb, 1)
  # One f8 x f8 dot per K block: (kb, t, 128) x (kb, 128, n) -> (kb, t, n), f32.
  partial = jax.lax.dot_general(
    xq.transpose(1, 0, 2),
    wq.reshape(kb, TILE, n),
    (((2,), (1,)), ((0,), (0,))),
    preferred_element_type=jnp.float32,
  )
  scales = sx.transpose(1, 0, 2) * jnp.repeat(sw.reshape(kb, 1, nb), TILE, axis=-1)
  return jnp.sum(partial * scales, axis=0).astype(jnp.bfloat16)


def estimate(target: str = "h100") -> dict[str, dict[str, float]]:
  """Estimated ms of each form for GPT-2 small's two MLP GEMMs, compiled for ``target``."""
  out = {}
  for name, (k, n) in {"mlp up 768->3072": (768, 3072), "mlp down 3072->768": (3072, 768)}.items():
    x = jax.ShapeDtypeStruct((8192, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    row = {}
    for form, fn in (("bf16", bf16_gemm), ("blockwise fp8", blockwise_gemm)):
      report = report_from_hlo(mpjax.compile_for(fn, x, w, target=target).as_text(), target)
      row[f"{form} ms"] = 1e3 * report.estimated_seconds
      row[f"{form} gemm ms"] = 1e3 * report.estimated_gemm_seconds
      row[f"{form} fp8 gemms"] = report.fp8_gemms
    row["blockwise / bf16"] = row["blockwise fp8 ms"] / row["bf16 ms"]
    out[name] = row
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100")
  parser.add_argument("--json", help="write the figures, the command and the versions here")
  args = parser.parse_args(argv)
  figures = estimate(args.target)
  for name, row in figures.items():
    print(
      f"{name} on {args.target}: bf16 {row['bf16 ms']:.4f} ms, blockwise FP8 "
      f"{row['blockwise fp8 ms']:.4f} ms ({row['blockwise / bf16']:.2f}x; its GEMM kernels "
      f"{row['blockwise fp8 gemm ms']:.4f} ms, {row['blockwise fp8 fp8 gemms']} FP8 GEMMs)"
    )
  if args.json:
    command = " ".join(["python scripts/hopper_blockwise_estimate.py", *sys.argv[1:]])
    with open(args.json, "w") as f:
      json.dump(
        {"command": command, **compile_record(args.target, "default"), "results": figures},
        f,
        indent=2,
      )


if __name__ == "__main__":
  main()
