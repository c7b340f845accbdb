"""GPU check: the fast path audited and timed on one NVIDIA GPU, in at most five minutes.

For a lent GPU (an H100 or H200); it runs on a CPU too, where the compiled-HLO
part of the audit is skipped and the numbers mean little. In one process:

1. sets the XLA flags that route GEMMs to cuBLASLt (:func:`mpjax.xla.configure_xla`)
   before JAX starts its backend, and prints the device;
2. audits the train step of a char-level decoder-only transformer LM like the
   default config's (d_model 512, 8 heads, 4 layers, MLP 2048, seq 256,
   vocabulary 256, batch 16, AdamW with clipping) under ``mixed_bf16``: every
   GEMM should be a cuBLASLt call or a Triton GEMM fusion taking bf16 operands
   and accumulating in f32;
3. times one train step (state donated, warm-up, then the median of
   interleaved rounds) for fp32 at the default matmul precision (TF32 on
   Ampere and later), fp32 under ``jax.default_matmul_precision("highest")``,
   ``mixed_bf16`` (autocast), ``mixed_fp16`` with dynamic loss scaling and
   ``mixed_fp8`` (FP8 layer GEMMs, delayed scaling: on an H100/H200 every FP8
   GEMM should be an ``__cublas$lt$matmul$f8`` call, the "calls" column);
4. measures a bf16 x bf16 -> f32 GEMM peak (8192^3) and reports each step's
   GEMM throughput (the audit's FLOPs over the step time) against it.

Prints one markdown table with ratios to fp32; ``--json`` writes the figures.

    python scripts/gpu_check.py [--rounds 20] [--triton-gemm auto|on|off] [--autotune-level N]
        [--json out.json]
    python scripts/gpu_check.py --small    # tiny sizes: a smoke test on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from mpjax.audit import AuditReport, audit_jaxpr
from mpjax.gpu import kernel_report, report_from_hlo
from mpjax.train_state import TrainState
from mpjax.train_step import init_fp8_state, make_train_step
from mpjax.xla import configure_xla, pad_to_multiple

FULL = dict(vocab=256, d_model=512, heads=8, layers=4, mlp=2048, seq=256, batch=16, peak=8192)
SMALL = dict(vocab=61, d_model=32, heads=4, layers=1, mlp=64, seq=16, batch=4, peak=256)


class Block(nn.Module):
  """A pre-norm transformer block: causal self-attention and a GELU MLP."""

  d_model: int
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, x):
    b, s, _ = x.shape
    h = nn.LayerNorm()(x)
    qkv = nn.Dense(3 * self.d_model)(h).reshape(b, s, 3, self.heads, -1)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attention = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v)
    x = x + nn.Dense(self.d_model)(attention.reshape(b, s, self.d_model))
    h = nn.Dense(self.mlp)(nn.LayerNorm()(x))
    return x + nn.Dense(self.d_model)(nn.gelu(h))


class CharLM(nn.Module):
  """A decoder-only character LM; the vocabulary is padded to a multiple of 8."""

  vocab: int
  d_model: int
  heads: int
  layers: int
  mlp: int

  @nn.compact
  def __call__(self, tokens):
    vocab = pad_to_multiple(self.vocab, 8)
    x = nn.Embed(vocab, self.d_model)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d_model))
    for _ in range(self.layers):
      x = Block(self.d_model, self.heads, self.mlp)(x)
    return nn.Dense(vocab)(nn.LayerNorm()(x))


def _step_and_state(sizes: dict[str, int], policy: str) -> tuple[Callable, Callable, Any]:
  """(jitted train step, fresh-state factory, batch) for the char LM under ``policy``."""
  model = CharLM(sizes["vocab"], sizes["d_model"], sizes["heads"], sizes["layers"], sizes["mlp"])
  tokens = jax.random.randint(
    jax.random.key(0), (sizes["batch"], sizes["seq"] + 1), 0, sizes["vocab"]
  )
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  params = model.init(jax.random.key(1), batch["x"])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  step = jax.jit(make_train_step(loss_fn, max_grad_norm=1.0), donate_argnums=0)

  def init():
    return TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adamw(3e-3), policy=policy
    )

  return step, init, batch


def _compile(step: Callable, *args: Any) -> tuple[Any, AuditReport, float]:
  """Traces and compiles once; the audit reads that program (and its HLO on a GPU)."""
  start = time.perf_counter()
  traced = step.trace(*args)
  compiled = traced.lower().compile()
  seconds = time.perf_counter() - start
  platform = jax.default_backend()
  hlo_text = compiled.as_text() if platform == "gpu" else None
  return compiled, audit_jaxpr(traced.jaxpr, platform=platform, hlo_text=hlo_text), seconds


def _median_ms(runs: dict[str, tuple[Callable, Any]], rounds: int) -> dict[str, float]:
  """Median milliseconds per call of each ``(call(carry) -> carry, carry)``, interleaved."""
  carries = {label: carry for label, (_, carry) in runs.items()}
  for label, (call, _) in runs.items():  # warm up
    for _ in range(2):
      carries[label] = call(carries[label])
    jax.block_until_ready(carries[label])
  times: dict[str, list[float]] = {label: [] for label in runs}
  for _ in range(rounds):
    for label, (call, _) in runs.items():
      start = time.perf_counter()
      carries[label] = jax.block_until_ready(call(carries[label]))
      times[label].append(time.perf_counter() - start)
  return {label: statistics.median(t) * 1e3 for label, t in times.items()}


def _gemm_peak(n: int, rounds: int) -> tuple[float, float]:
  """(milliseconds, TFLOP/s) of an n^3 bf16 x bf16 -> f32 GEMM."""
  a = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(3), (n, n), jnp.bfloat16)
  gemm = jax.jit(lambda a, b: lax.dot(a, b, preferred_element_type=jnp.float32))
  compiled = gemm.lower(a, b).compile()
  ms = _median_ms({"peak": (lambda _: compiled(a, b), None)}, rounds)["peak"]
  return ms, 2.0 * n**3 / (ms * 1e-3) / 1e12


def _calls(report: AuditReport) -> str:
  kinds = Counter(r.call_kind or ("(not found)" if r.call else "-") for r in report.rows)
  return ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))


_TARGET_OF_DEVICE = (
  ("H200", "h200"),
  ("H100", "h100"),
  ("A100", "a100"),
  ("B200", "b200"),
  ("L4", "l4"),
)


def _prediction(
  programs: dict[str, tuple], step_ms: dict[str, float], device_kind: str
) -> tuple[str, dict[str, Any]]:
  """What mpjax predicts without a GPU (mpjax.kernel_report) against what this GPU compiled.

  For the nearest shipped target, each variant's step is compiled deviceless
  (cuBLASLt GEMMs, as XLA falls back to without autotuning) and its kernels,
  GEMM calls, temp memory and roofline estimate set beside those of the
  program this device compiled (read the same way) and the measured step time.
  On a CPU only the prediction is shown.
  """
  target = next((t for key, t in _TARGET_OF_DEVICE if key in device_kind), "h100")
  on_gpu = jax.default_backend() == "gpu"
  lines = [
    f"**prediction ({target}, compiled without a GPU) against this device's program**",
    "",
    "| variant | kernels predicted | kernels here | GEMM calls predicted | GEMM calls here "
    "| temp MB predicted | temp MB here | est. ms | measured ms |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  figures = {"target": target}
  for label, (step, state, batch, compiled) in programs.items():
    if "highest" in label:  # the precision context is not part of the step: left out
      continue
    predicted = kernel_report(step, state, batch, target=target)
    real = (
      report_from_hlo(compiled.as_text(), target, compiled.memory_analysis()) if on_gpu else None
    )

    def calls(r):
      return ", ".join(f"{k} {n}" for k, n in sorted(r.calls.items())) if r else "-"

    lines.append(
      f"| {label} | {predicted.count} | {real.count if real else '-'} | {calls(predicted)} "
      f"| {calls(real)} | {predicted.temp_bytes / 1e6:.1f} "
      f"| {f'{real.temp_bytes / 1e6:.1f}' if real else '-'} "
      f"| {predicted.estimated_seconds * 1e3:.3f} | {step_ms[label]:.2f} |"
    )
    figures[label] = {"predicted": predicted.to_dict(), "here": real.to_dict() if real else None}
  return "\n".join(lines), figures


def run(sizes: dict[str, int], rounds: int) -> dict[str, Any]:
  """Audits and times the variants; returns every figure and the markdown."""
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}\n")
  variants = {  # label: (policy, matmul precision context)
    "fp32 (default precision: TF32)": ("fp32", None),
    "fp32 (precision highest)": ("fp32", "highest"),
    "mixed_bf16 (autocast)": ("mixed_bf16", None),
    "mixed_fp16 (dynamic loss scale)": ("mixed_fp16", None),
    "mixed_fp8 (delayed scaling)": ("mixed_fp8", None),
  }
  compiled_runs, reports, compile_s, programs = {}, {}, {}, {}
  for label, (policy, precision) in variants.items():
    step, init, batch = _step_and_state(sizes, policy)
    state = init_fp8_state(step, init(), batch)  # FP8: the state its first step would make
    scope = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
    with scope:  # the precision is read when the step is traced
      compiled, reports[label], compile_s[label] = _compile(step, state, batch)
      programs[label] = (step, state, batch, compiled)

    def call(state, compiled=compiled, batch=batch):
      return compiled(state, batch)[0]

    compiled_runs[label] = (call, state)

  default = reports["mixed_bf16 (autocast)"]
  print("**audit: mixed_bf16 train step**\n")
  print(default, end="\n\n")
  # On a GPU autocast's GEMMs write bf16 (cuBLASLt and Triton accumulate in f32 inside);
  # the audit's fast path checks half operands with f32 accumulation, whatever is written.
  fast = default.fast_path_share == 1.0
  verdict = (
    f"every GEMM half x half with f32 accumulation: {'yes' if fast else 'NO'}; "
    f"flagged: {len(default.flagged)} of {len(default.rows)}; "
  )
  if jax.default_backend() == "gpu":
    tensor_core = all(r.call_kind in ("cublas_lt", "triton_gemm") for r in default.rows)
    verdict += f"every GEMM on cuBLASLt or a Triton GEMM fusion: {'yes' if tensor_core else 'NO'}"
  else:
    verdict += "calls: unknown without a GPU"
  print(verdict, end="\n\n")

  step_ms = _median_ms(compiled_runs, rounds)
  peak_ms, peak_tflops = _gemm_peak(sizes["peak"], rounds)
  base = step_ms["fp32 (default precision: TF32)"]
  lines = [
    "| variant | step ms | vs fp32 | GEMM TFLOP/s | of bf16 peak | fast path | calls | compile s |",
    "|---|---|---|---|---|---|---|---|",
  ]
  figures: dict[str, Any] = {"device": device.device_kind, "backend": jax.default_backend()}
  figures["variants"] = {}
  for label, report in reports.items():
    tflops = report.total_flops / (step_ms[label] * 1e-3) / 1e12
    figures["variants"][label] = {
      "step_ms": step_ms[label],
      "step_ratio": step_ms[label] / base,
      "gemm_tflops": tflops,
      "peak_fraction": tflops / peak_tflops,
      "fast_path_share": report.fast_path_share,
      "gemm_flops": report.total_flops,
      "calls": _calls(report),
      "precisions": sorted({r.precision for r in report.rows}),
      "compile_s": compile_s[label],
    }
    lines.append(
      f"| {label} | {step_ms[label]:.2f} | {step_ms[label] / base:.3f}x | {tflops:.1f} | "
      f"{100 * tflops / peak_tflops:.1f}% | {100 * report.fast_path_share:.0f}% | "
      f"{_calls(report)} | {compile_s[label]:.1f} |"
    )
  n = sizes["peak"]
  lines.append(
    f"| bare GEMM {n}^3 bf16 x bf16 -> f32 | {peak_ms:.2f} | - | {peak_tflops:.1f} | 100% "
    "| - | - | - |"
  )
  table = "\n".join(lines)
  print(table)
  prediction, figures["prediction"] = _prediction(programs, step_ms, device.device_kind)
  print(f"\n{prediction}")
  table += f"\n\n{prediction}"
  figures.update(
    peak_ms=peak_ms,
    peak_tflops=peak_tflops,
    verdict=verdict,
    audit=default.to_dict(),
    markdown=f"{default}\n\n{verdict}\n\n{table}",
  )
  return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20, help="timed interleaved rounds")
  parser.add_argument("--small", action="store_true", help="tiny sizes (a smoke test)")
  parser.add_argument(
    "--triton-gemm",
    choices=("auto", "on", "off"),
    default="auto",
    help="Triton GEMM fusions: XLA's choice by autotuning, forced on, or off (cuBLASLt only)",
  )
  parser.add_argument(
    "--autotune-level",
    type=int,
    help="XLA's GPU autotuning level (0-4; default XLA's): lower compiles faster",
  )
  parser.add_argument(
    "--keep-xla-flags",
    action="store_true",
    help="do not set XLA flags (needed when JAX's backend already started, as in tests)",
  )
  parser.add_argument("--json", help="write the figures to this JSON file")
  args = parser.parse_args(argv)
  if not args.keep_xla_flags:  # before anything starts the backend
    triton = {"auto": None, "on": True, "off": False}[args.triton_gemm]
    extra = (
      () if args.autotune_level is None else (f"--xla_gpu_autotune_level={args.autotune_level}",)
    )
    print(f"XLA_FLAGS={configure_xla(cublaslt=True, triton_gemm=triton, extra_flags=extra)}")
  figures = run(SMALL if args.small else FULL, args.rounds)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(figures, f, indent=2)
  return figures


if __name__ == "__main__":
  main()
