"""GPU check: mixed precision timed, FP8 GEMMs counted and a short training run, on one GPU.

The one prepared script for a lent NVIDIA GPU (an H100 or H200; sized to
finish in a few minutes there), run on that machine's own jax. In one process it:

1. records the environment: jax and jaxlib versions, Python, the device kind,
   the CUDA versions (the CUDA plugin's version queries, the backend's platform
   version, ``nvidia-smi`` through ``jax.print_environment_info``, and the
   installed ``jax-cuda*`` / ``nvidia-*`` packages: what exists of these),
   ``XLA_FLAGS`` as found (the script sets no flag) and the default matmul
   precision;
2. times one Adam train step of three models, built by ``scripts/bench.py``
   (imported, not copied): ``lm``, a 4-layer causal transformer LM (d_model 512,
   8 heads, MLP 2048, vocabulary 512, seq 256, batch 16), ``gpt2``, GPT-2
   small's shape (12 layers, d_model 768, 12 heads, vocabulary 50304, seq 1024,
   batch 8) with its attention scores in memory, and ``gpt2_fused``, the same
   with jax's Pallas flash attention (causal, bf16 in every variant; interpreted
   where the backend is not a GPU). Variants: fp32 at the default matmul
   precision (TF32 on Ampere and later), ``mixed_bf16`` (mpjax autocast),
   ``mixed_fp8`` (delayed scaling) compiled twice from one trace, in XLA's
   default mode and with the compile option
   ``xla_gpu_enable_triton_gemm=False``, ``mixed_fp8`` with the output head in
   FP8 too (``Fp8Recipe(keep_bf16=("first",))``, default mode), the Flax
   ``dtype=bfloat16`` peer and jmp's bf16 compute. Each variant is compiled
   once; steps run with the state donated, warmed up, then the median of
   interleaved rounds. Per variant: step ms, ratio to fp32, MFU (the step's GEMM
   FLOPs from :func:`mpjax.audit.audit_jaxpr` of the fp32 step, plus, for
   ``gpt2_fused``, the fused attention's, which the audit does not read, from
   its shapes (``bench.fused_attention_flops``: the half the causal kernels
   compute), over the step time, over the device's dense bf16 peak from
   :func:`mpjax.get_target`), compile seconds and options, the audit's fast-path
   share and GEMM calls, and the accumulation of every compiled GEMM as the
   program says it (:func:`accumulation_check`: the cuBLAS(Lt) call's algorithm
   and result type, the Triton fusion dot's; ``unknown`` where it does not say,
   e.g. a cuDNN convolution or a ``dot`` XLA:CPU emits), never inferred from the
   fast-path share; and the kernel report of the program this GPU's autotuner
   made (:func:`program_report`: kernels, GEMM calls, split-K GEMMs, bytes
   moved, the roofline estimate and its ratio to the measured step), to set
   beside the deviceless prediction of ``scripts/bench.py --target``;
3. for ``mixed_fp8``, whether every FP8 GEMM that mpjax planned (audit rows with
   an FP8 operand) ran in FP8: the compiled program's GEMMs
   (:func:`mpjax.audit.parse_compiled_gemms` of ``compiled.as_text()``) with
   both operands FP8, be it an ``__cublas$lt$matmul$f8`` call or a Triton GEMM
   fusion whose dot takes f8e4m3fn/f8e5m2 operands;
4. trains the default experiment (``mpjax train``'s config: a char LM on
   Python's own source, ``mixed_bf16``) for 200 steps and compares its loss,
   logged every 20 steps, with a CPU run of the same config and seed
   (``results/gpu/charlm_cpu_reference.json``): max |loss - loss_cpu| / loss_cpu
   over the logged steps, and the final and test losses. The corpus is this
   Python's standard library, which differs between Python versions, so
   ``--corpus FILE`` trains on a text file instead (written from this Python's
   standard library where it is missing): make the reference with it here,
   carry the file to the GPU machine, and both runs train on one token stream.

Prints one markdown table (and the training line); ``--json`` writes every
figure, and is rewritten after each part, so a run cut short keeps what it had.

What it does NOT check: numerics of the models it times (random tokens, one
batch); step time of anything but these three models at these sizes; the fused
attention's FLOPs as its kernels ran them (counted from the shapes), or how
jax's Pallas kernel compares with cuDNN's fused attention; the deviceless
prediction itself (``python scripts/bench.py --target h200``, run apart: this
script records the real program to compare it with); Triton-off for variants
other than ``mixed_fp8``; which FP8 GEMM was lost when counts differ (it
compares counts: planned against compiled); fp16, fp32 at ``highest``
precision, Keras; multi-GPU. Without ``--corpus`` the char LM trains on this
Python's standard library, so under another Python version than the
reference's the two loss curves need not agree closely (``corpus_match`` says
whether the token streams were the same). On a CPU the Triton option does not
apply and is not passed, no FP8 GEMM exists (XLA:CPU widens FP8 operands), MFU
needs ``--peak-tflops``, and ``--small`` compiles without LLVM optimization
(``SMALL_CPU_OPTIONS``).

    python scripts/gpu_check.py [--rounds 20] [--models lm,gpt2_fused,gpt2] [--no-train] [--json F]
    python scripts/gpu_check.py --small    # tiny sizes: a smoke test on a CPU
    python scripts/gpu_check.py --write-reference results/gpu/charlm_cpu_reference.json \
      --corpus .gpu/charlm_corpus.txt.gz   # here; then on the GPU, with .gpu carried:
    python scripts/gpu_check.py --corpus .gpu/charlm_corpus.txt.gz --json "$OUT/gpu_check.json"
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jaxlib
import numpy as np

import mpjax
import mpjax.experiment as experiment
from mpjax import data
from mpjax.audit import AuditReport, audit_jaxpr, parse_compiled_gemms
from mpjax.kernels import report_from_hlo

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "results" / "gpu" / "charlm_cpu_reference.json"


def _load_bench() -> Any:
  """scripts/bench.py as a module (its Flax modules need it in ``sys.modules``)."""
  spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


bench = _load_bench()

# model: (bench workload, batch size; small batch size)
MODELS = {"lm": ("transformer", 16, 4), "gpt2": ("gpt2", 8, 2), "gpt2_fused": ("gpt2_fused", 8, 2)}
TRITON_OFF = {"xla_gpu_enable_triton_gemm": False}
FP32 = "fp32 (default precision: TF32)"
VARIANTS = {  # label: (bench variant, compile options)
  FP32: ("plain fp32", {}),
  "mixed_bf16 (mpjax autocast)": ("mpjax mixed_bf16 autocast", {}),
  "mixed_fp8 (XLA default)": ("mpjax mixed_fp8 autocast", {}),
  "mixed_fp8 (Triton GEMMs off)": ("mpjax mixed_fp8 autocast", TRITON_OFF),
  "mixed_fp8, FP8 head (XLA default)": (bench.FP8_HEAD_LABEL, {}),
  "flax dtype=bf16": ("flax dtype=bf16", {}),
  "jmp (bf16 compute)": ("jmp cast", {}),
}
TRAIN = ["steps=200", "checkpoint_every=0"]  # the default config otherwise
SMALL_TRAIN = TRAIN[1:] + [
  "steps=20",
  "log_every=5",
  "warmup_steps=5",
  "batch_size=8",
  "data.seq_len=32",
  "data.max_chars=60000",
  "model.d_model=32",
  "model.n_layers=1",
  "model.d_ff=64",
]
# --small on a CPU: every variant compiled without LLVM optimization (half the compile
# time); its step times mean nothing there anyway.
SMALL_CPU_OPTIONS = {"xla_backend_optimization_level": 0}
_TARGET_OF_DEVICE = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200"))


# --------------------------------------------------------------------------- environment


_CUDA_QUERIES = (  # key: the CUDA plugin's query (jax._src.lib.cuda_versions)
  ("cuda_runtime", "cuda_runtime_get_version"),
  ("cuda_runtime_build", "cuda_runtime_build_version"),
  ("cuda_driver", "cuda_driver_get_version"),
  ("cudnn", "cudnn_get_version"),
  ("cublas", "cublas_get_version"),
)


def _cuda_versions(info: str) -> dict[str, Any]:
  """What this jax says of CUDA: plugin queries, platform version, nvidia-smi, the wheels."""
  try:
    from jax._src.lib import cuda_versions  # private: the plugin's own version queries
  except ImportError:
    cuda_versions = None
  out: dict[str, Any] = {}
  for key, name in _CUDA_QUERIES:
    query = getattr(cuda_versions, name, None)
    try:
      out[key] = query() if query is not None else None
    except Exception as e:  # noqa: BLE001 (a query may fail where the driver is odd)
      out[key] = f"unavailable: {type(e).__name__}: {e}"
  runtime = out.get("cuda_runtime")
  if isinstance(runtime, int):  # 12080 -> "12.8"
    out["cuda_runtime_version"] = f"{runtime // 1000}.{runtime % 1000 // 10}"
  client = getattr(jax.devices()[0], "client", None)  # "cuda 12080" on a GPU
  out["platform_version"] = str(getattr(client, "platform_version", None))
  for key, pattern in (
    ("nvidia_smi_cuda", r"CUDA Version:\s*([\d.]+)"),
    ("nvidia_smi_driver", r"Driver Version:\s*([\d.]+)"),
  ):
    found = re.search(pattern, info)
    out[key] = found.group(1) if found else None
  out["packages"] = {
    d.metadata["Name"]: d.version
    for d in importlib.metadata.distributions()
    if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "nvidia-"))
  }
  return out


def _git_commit() -> str | None:
  """The repository's commit (``-dirty`` with local changes), or None where git cannot tell."""
  try:
    done = subprocess.run(
      ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
      capture_output=True,
      text=True,
      timeout=20,
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout.strip() or None


def environment() -> dict[str, Any]:
  """Versions, device, CUDA, XLA_FLAGS and the matmul precision this run had."""
  device = jax.devices()[0]
  info = jax.print_environment_info(return_string=True) or ""  # runs nvidia-smi on a GPU
  try:
    cuda = _cuda_versions(info)
  except Exception as e:  # noqa: BLE001 (a missing version must not cost the run)
    cuda = {"error": f"{type(e).__name__}: {e}"}
  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "mpjax": mpjax.__version__,
    "git": _git_commit(),
    "python": sys.version.split()[0],
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "compute_capability": getattr(device, "compute_capability", None),
    "cuda": cuda,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "default_matmul_precision": getattr(jax.config, "jax_default_matmul_precision", None),
    "environment_info": info,
  }


def _peak(device_kind: str, override: float | None) -> dict[str, Any]:
  """The dense bf16 peak MFU is taken against, and where it came from."""
  if override:
    return {"tflops": override, "source": "--peak-tflops"}
  target = next((t for key, t in _TARGET_OF_DEVICE if key in device_kind), None)
  if target is None:
    return {"tflops": None, "source": f"no mpjax target for {device_kind!r}: MFU not computed"}
  bf16 = mpjax.get_target(target).bf16_tflops
  return {"tflops": bf16, "source": f"mpjax.get_target({target!r}).bf16_tflops"}


def program_report(hlo: str, memory: Any, device_kind: str, gemm_backend: str) -> dict[str, Any]:
  """The kernel report of a program compiled on this GPU, as JSON-ready figures.

  The program the GPU's autotuner made (tuned Triton tiles or cuBLASLt calls,
  split-K where it chose it), read as :func:`mpjax.kernels.report_from_hlo`
  reads a deviceless one: kernels, GEMM calls, split-K GEMMs and their
  partial sums' bytes, bytes moved and the roofline estimate at the rates of
  the mpjax target this device is. ``{"note": ...}`` where it cannot be read.
  """
  target = next((t for key, t in _TARGET_OF_DEVICE if key in device_kind), None)
  if target is None:
    return {"note": f"not read: no mpjax target for {device_kind!r}"}
  try:
    return report_from_hlo(hlo, target, memory, gemm_backend).to_dict()
  except Exception as e:  # noqa: BLE001 (an HLO construct the reader does not know)
    return {"note": f"not read: {type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- timing


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


def _fresh_state(step: Callable, init: Callable, batch: Any) -> Any:
  """A new state (the step donates it); an FP8 one with the state its first step would make."""
  state = init()
  return mpjax.init_fp8_state(step, state, batch) if isinstance(state, mpjax.TrainState) else state


def _is_f8(dtype: str) -> bool:
  return dtype.startswith("float8")


def fp8_count(report: AuditReport, hlo: str) -> dict[str, Any]:
  """FP8 GEMMs mpjax planned (the audit) against compiled GEMMs with both operands FP8 (HLO)."""
  planned = sum(_is_f8(r.lhs_dtype) or _is_f8(r.rhs_dtype) for r in report.rows)
  compiled = parse_compiled_gemms(hlo)
  f8 = [g for g in compiled if _is_f8(g.lhs_dtype) and _is_f8(g.rhs_dtype)]
  audit_view = {  # the audit's own FP8 figures, where this mpjax has them
    name: getattr(report, name)
    for name in dir(type(report))
    if "fp8" in name and not name.startswith("_") and isinstance(getattr(report, name), int | float)
  }
  audit_view["flags"] = dict(
    Counter(f.code for r in report.rows for f in r.flags if "f8" in f.code or "fp8" in f.code)
  )
  return {
    "planned": planned,
    "compiled_f8": len(f8),
    "compiled_f8_by_kind": dict(Counter(g.kind for g in f8)),
    "compiled_gemms": len(compiled),
    "lost": max(planned - len(f8), 0),
    "all_planned_in_fp8": planned > 0 and len(f8) >= planned,
    "audit": audit_view,
  }


def accumulation_check(hlo_text: str) -> dict[str, Any]:
  """Each compiled floating-point GEMM's accumulation, read from the program, and a verdict.

  ``f32_accumulation`` is ``"yes"`` where the compiled program says f32 (or f64)
  for every GEMM, ``"NO"`` where it says a narrower dtype for any, else
  ``"unknown"`` (some GEMM's accumulation is not in the program, or it has no
  GEMM). A half result does not count as f32 accumulation, nor does the
  audit's fast-path share.
  """
  gemms = [
    g
    for g in parse_compiled_gemms(hlo_text)
    if all(jax.numpy.issubdtype(d, jax.numpy.floating) for d in (g.lhs_dtype, g.rhs_dtype))
  ]
  narrow = [g.name for g in gemms if g.accumulation not in ("f32", "f64", "unknown")]
  unknown = [g.name for g in gemms if g.accumulation == "unknown"]
  verdict = "NO" if narrow else "unknown" if unknown or not gemms else "yes"
  return {
    "f32_accumulation": verdict,
    "gemms": len(gemms),
    "by_dtype": dict(Counter(g.accumulation for g in gemms)),
    "not_f32": narrow,
    "unknown": unknown,
  }


# --------------------------------------------------------------------------- one model


def _batch(name: str, small: bool) -> Any:
  """bench.py's workload batch, at this script's batch size (random tokens)."""
  workload, batch_size, small_batch_size = MODELS[name]
  sizes = bench._workload(workload, small)[3]
  shape = (small_batch_size if small else batch_size, sizes["seq"] + 1)
  tokens = jax.random.randint(jax.random.key(0), shape, 0, sizes["vocab"])
  return {"x": tokens[:, :-1], "y": tokens[:, 1:]}, dict(sizes, batch=shape[0])


def _compile_one(
  traced: Any, lowered: Any, source: str, options: dict, base: dict
) -> tuple[dict, Any]:
  """(figures, executable) of one variant: compiled with ``base`` and, on a GPU, ``options``."""
  on_gpu = jax.default_backend() == "gpu"
  applied = {**base, **(options if on_gpu else {})}
  start = time.perf_counter()
  compiled = lowered.compile(applied or None)
  seconds = time.perf_counter() - start
  hlo = compiled.as_text()
  report = audit_jaxpr(
    traced.jaxpr, platform=jax.default_backend(), hlo_text=hlo if on_gpu else None
  )
  figures = {
    "source": f"scripts/bench.py {source!r}",
    "compile_options": applied,
    "compile_s": seconds,
    "gemm_flops": report.total_flops,
    "fast_path_share": report.fast_path_share,
    "calls": dict(Counter(r.call_kind or "unknown" for r in report.rows)),
    "custom_kernels": len(report.custom_kernels),  # e.g. Pallas: their GEMMs not audited
    "accumulation": accumulation_check(hlo),
  }
  if on_gpu:
    off = options.get("xla_gpu_enable_triton_gemm") is False
    figures["program"] = program_report(
      hlo,
      compiled.memory_analysis(),
      jax.devices()[0].device_kind,
      "cublaslt" if off else "default",
    )
  else:
    figures["program"] = {"note": f"not read: a {jax.default_backend()} program, not a GPU's"}
  if options and not on_gpu:
    figures["compile_note"] = (
      f"{options} not passed: it applies to XLA:GPU only (backend {jax.default_backend()})"
    )
  if "fp8" in source:
    figures["fp8"] = fp8_count(report, hlo)
  return figures, compiled


def _kernels_interpreted() -> bool:
  """Whether a Pallas GPU kernel (gpt2_fused's attention) runs interpreted: off a GPU."""
  return jax.default_backend() != "gpu"


def _compile_variants(name: str, small: bool) -> tuple[dict[str, dict], dict[str, tuple], dict]:
  """Each variant traced once (the FP8 pair shares one trace) and compiled once; audited.

  ``compile_s`` is tracing, lowering and compiling, but for a variant that reuses
  another's trace (``trace_reused``), where it is compiling only. A variant that
  fails to compile is recorded with its error and left out of the timing.
  """
  built, _ = bench._variants(
    MODELS[name][0], small, keras=False, fp8=True, interpret=_kernels_interpreted()
  )
  batch, sizes = _batch(name, small)
  base = SMALL_CPU_OPTIONS if small and jax.default_backend() == "cpu" else {}
  figures, runs, traces = {}, {}, {}
  for label, (source, options) in VARIANTS.items():
    step, init, _, _ = built[source]
    state = _fresh_state(step, init, batch)
    reused, start = source in traces, time.perf_counter()
    if not reused:
      traced = step.trace(state, batch)
      traces[source] = (traced, traced.lower())
    trace_s = time.perf_counter() - start
    try:
      figures[label], compiled = _compile_one(*traces[source], source, options, base)
    except Exception as e:  # noqa: BLE001 (e.g. a compile option this XLA does not know)
      figures[label] = {"compile_options": options, "error": f"{type(e).__name__}: {e}"}
      continue
    figures[label].update(compile_s=figures[label]["compile_s"] + trace_s, trace_reused=reused)
    print(f"  {name} {label}: compiled in {figures[label]['compile_s']:.1f} s", flush=True)

    def call(carry, compiled=compiled):
      return compiled(carry, batch)[0]

    runs[label] = (call, state)
  return figures, runs, sizes


def measure_model(name: str, small: bool, rounds: int, peak_tflops: float | None) -> dict:
  """One model's variants: compiled, audited, timed side by side; ratios and MFU."""
  start = time.perf_counter()
  figures, runs, sizes = _compile_variants(name, small)
  step_ms = _median_ms(runs, rounds)
  del runs  # the states: free the device memory before the next model
  # The audit reads no GEMM inside a custom kernel: the fused attention's are counted from
  # its shapes (bench.fused_attention_flops), in every variant alike.
  fused = sizes.get("attention") == "fused"
  attention_flops = bench.fused_attention_flops(sizes, sizes["batch"]) if fused else 0.0
  model_flops = figures[FP32]["gemm_flops"] + attention_flops
  for label, f in figures.items():
    if label not in step_ms:  # did not compile
      continue
    f["step_ms"] = step_ms[label]
    f["step_ratio"] = step_ms[label] / step_ms[FP32]
    tflops = model_flops / (step_ms[label] * 1e-3) / 1e12
    f["model_tflops"] = tflops
    f["mfu"] = tflops / peak_tflops if peak_tflops else None
    if "estimated_ms" in f["program"]:
      f["program"]["estimate_over_measured"] = f["program"]["estimated_ms"] / step_ms[label]
  return {
    "sizes": sizes,
    "model_flops": model_flops,
    "fused_attention_flops": attention_flops,
    "fused_attention_interpreted": fused and _kernels_interpreted(),
    "fused_attention_kernel": bench.fused_attention_kernel() if fused else None,
    "seconds": time.perf_counter() - start,
    "variants": figures,
  }


# --------------------------------------------------------------------------- training


def corpus_file(path: str, max_chars: int) -> pathlib.Path:
  """The char LM's text file; where it is missing, written from this Python's standard library."""
  file = pathlib.Path(path)
  if not file.exists():
    text, _ = data.stdlib_text(max_chars)
    file.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open if file.suffix == ".gz" else open)(file, "wt", encoding="utf-8") as f:
      f.write(text)
    print(f"wrote {file}: {len(text)} characters of Python {sys.version.split()[0]}'s library")
  return file


def train_charlm(small: bool, corpus: str | None = None) -> dict[str, Any]:
  """The default experiment (mixed_bf16) for 200 steps (``--small``: a tiny one): its losses.

  ``corpus``: a text file to train on (:func:`corpus_file`) instead of this
  Python's standard library.
  """
  overrides = SMALL_TRAIN if small else TRAIN
  config = experiment.load_config(None, overrides)
  if corpus is not None:  # not a key of the shipped config: set here, not as an override
    config.data.text_file = str(corpus_file(corpus, config.data.max_chars))
  tokens = np.asarray(experiment.Experiment(config).dataset.train["tokens"])
  run_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
  start = time.perf_counter()
  try:
    summary = experiment.train(config, run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  finally:
    shutil.rmtree(run_dir, ignore_errors=True)
  return {
    "config": config.name,
    "overrides": overrides,
    "policy": summary["policy"],
    "seed": config.seed,
    "steps": summary["steps"],
    "losses": {str(r["step"]): r["loss"] for r in rows if "loss" in r},
    "final_loss": summary["loss"],
    "test_loss": summary["test_loss"],
    "skipped_steps": summary["skipped_steps"],
    "steps_per_second": summary["steps_per_second"],
    "seconds": time.perf_counter() - start,
    "corpus": {
      "python": sys.version.split()[0],
      "text_file": pathlib.Path(corpus).name if corpus else None,
      "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()[:16],
    },
  }


def compare_losses(run: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
  """max |loss - loss_cpu| / loss_cpu over the steps both logged, and the final losses."""
  if reference is None:
    return {"compared": False, "note": "no CPU reference found"}
  if reference["overrides"] != run["overrides"] or reference["seed"] != run["seed"]:
    note = f"the reference is for {reference['overrides']} (seed {reference['seed']})"
    return {"compared": False, "note": note}
  steps = sorted(set(run["losses"]) & set(reference["losses"]), key=int)
  if not steps:
    return {"compared": False, "note": "no logged step in common with the reference"}
  diffs = [abs(run["losses"][s] - reference["losses"][s]) / reference["losses"][s] for s in steps]
  return {
    "compared": True,
    "steps": [int(s) for s in steps],
    "loss_cpu": {s: reference["losses"][s] for s in steps},
    "max_rel_diff": max(diffs),
    "max_rel_diff_step": int(steps[diffs.index(max(diffs))]),
    "final_loss": run["final_loss"],
    "final_loss_cpu": reference["final_loss"],
    "test_loss": run["test_loss"],
    "test_loss_cpu": reference["test_loss"],
    "corpus_match": run["corpus"]["sha256"] == reference["corpus"]["sha256"],
    "reference_jax": reference["jax"],
    "reference_date": reference["date"],
  }


def reference_record(run: dict[str, Any], argv: list[str]) -> dict[str, Any]:
  """A training run (from :func:`train_charlm`) as a CPU reference: with command, versions, date."""
  return {
    "what": "CPU reference of the char LM training that scripts/gpu_check.py compares against",
    "command": shlex.join(["python", "scripts/gpu_check.py", *argv]),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "git": _git_commit(),
    "device": experiment.device_description(),
    **run,
  }


# --------------------------------------------------------------------------- report


def markdown(figures: dict[str, Any]) -> str:
  """One table of every model and variant, then the training comparison."""
  lines = [
    "| model | variant | step ms | vs fp32 | MFU | FP8 GEMMs in FP8 / planned | fast path "
    "| f32 accumulation (compiled) | kernels / split-K GEMMs / estimate over step | compile s |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for model, m in figures["models"].items():
    for label, v in m.get("variants", {}).items():
      if "error" in v:
        lines.append(f"| {model} | {label} | failed: {v['error'][:80]} | | | | | | | |")
        continue
      mfu = f"{100 * v['mfu']:.1f}%" if v.get("mfu") is not None else "-"
      fp8 = v.get("fp8")
      f8 = f"{fp8['compiled_f8']} / {fp8['planned']}" if fp8 else "-"
      acc = v.get("accumulation")
      said = (
        f"{acc['f32_accumulation']} ({acc['by_dtype'].get('f32', 0)} of {acc['gemms']} f32)"
        if acc
        else "-"
      )
      p = v["program"]
      program = (
        f"{p['kernels']} / {p['split_k_gemms']} / {p['estimate_over_measured']:.2f}"
        if "kernels" in p
        else "-"
      )
      lines.append(
        f"| {model} | {label} | {v['step_ms']:.2f} | {v['step_ratio']:.3f}x | {mfu} | {f8} "
        f"| {100 * v['fast_path_share']:.0f}% | {said} | {program} | {v['compile_s']:.1f} |"
      )
  env = figures["environment"]
  cuda = env["cuda"].get("cuda_runtime_version") or env["cuda"].get("nvidia_smi_cuda")
  lines += [
    "",
    f"{env['device_kind']}, jax {env['jax']}, jaxlib {env['jaxlib']}, CUDA {cuda or '-'}, "
    f"XLA_FLAGS={env['xla_flags']!r}; MFU against {figures['peak']['source']}.",
  ]
  if figures.get("errors"):
    lines.append(f"failed (tracebacks in the JSON): {', '.join(figures['errors'])}.")
  t = figures.get("training", {}).get("comparison")
  if t and t.get("compared"):
    lines.append(
      f"char LM ({figures['training']['steps']} steps, {figures['training']['policy']}): final "
      f"loss {t['final_loss']:.4f} here, {t['final_loss_cpu']:.4f} on CPU; max |dloss|/loss "
      f"{100 * t['max_rel_diff']:.2f}% (step {t['max_rel_diff_step']}); corpus the same: "
      f"{t['corpus_match']}."
    )
  elif t:
    lines.append(f"char LM: not compared with the CPU: {t['note']}.")
  return "\n".join(lines)


def _measure(args: argparse.Namespace, name: str, figures: dict[str, Any]) -> None:
  peak = figures["peak"]["tflops"]
  figures["models"][name] = measure_model(name, args.small, args.rounds, peak)


def _save(figures: dict[str, Any], path: str | None) -> None:
  if path:
    figures["markdown"] = markdown(figures)
    pathlib.Path(path).write_text(json.dumps(figures, indent=2, default=str) + "\n")


def _guarded(part: str, figures: dict, fn: Callable[[], Any]) -> Any:
  """Runs one part; a failure is recorded (and printed) and the run goes on to the next."""
  try:
    return fn()
  except Exception:  # noqa: BLE001 (one run on a lent GPU: keep the other parts)
    figures.setdefault("errors", {})[part] = traceback.format_exc(limit=8)
    print(f"{part} failed:\n{figures['errors'][part]}", file=sys.stderr, flush=True)
    return None


def _train(args: argparse.Namespace, figures: dict[str, Any]) -> None:
  run = train_charlm(args.small, args.corpus)
  path = pathlib.Path(args.reference)
  reference = json.loads(path.read_text()) if path.is_file() else None
  comparison = compare_losses(run, reference)
  figures["training"] = {**run, "reference": str(path), "comparison": comparison}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20, help="timed interleaved rounds")
  parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke test)")
  parser.add_argument(
    "--models", default="lm,gpt2_fused,gpt2", help="comma-separated: lm, gpt2_fused, gpt2"
  )
  parser.add_argument("--no-train", action="store_true", help="skip the char LM training")
  parser.add_argument("--reference", default=str(REFERENCE), help="the CPU reference JSON")
  parser.add_argument("--peak-tflops", type=float, help="bf16 peak for MFU (default: the GPU's)")
  parser.add_argument("--write-reference", metavar="PATH", help="only train here and save")
  parser.add_argument(
    "--corpus", metavar="FILE", help="train the char LM on this text file (written if missing)"
  )
  parser.add_argument("--json", help="write the figures to this JSON file (after each part)")
  args = parser.parse_args(argv)
  if args.write_reference:  # only the training, here (a CPU), saved as the reference
    record = reference_record(train_charlm(args.small, args.corpus), argv)
    pathlib.Path(args.write_reference).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.write_reference}: final loss {record['final_loss']:.4f}")
    return record
  env = environment()
  print(f"{env['device_kind']} ({env['backend']}), jax {env['jax']}, jaxlib {env['jaxlib']}")
  figures = {"environment": env, "small": args.small, "rounds": args.rounds, "models": {}}
  figures["peak"] = _peak(env["device_kind"], args.peak_tflops)
  figures["variants_compiled"] = {label: opts for label, (_, opts) in VARIANTS.items()}
  parts = [
    (name, lambda name=name: _measure(args, name, figures)) for name in args.models.split(",")
  ]
  # After the first model, the training; the GPT-2s, the slowest parts, come last, the fused
  # one first (the step the FP8 aim is read on): a run cut short keeps what it had.
  if not args.no_train:
    parts.insert(1, ("training", lambda: _train(args, figures)))
  for part, run in parts:
    start = time.perf_counter()
    _guarded(part, figures, run)
    print(f"{part}: {time.perf_counter() - start:.0f} s", flush=True)
    _save(figures, args.json)
  figures["markdown"] = markdown(figures)
  print(figures["markdown"], flush=True)
  _save(figures, args.json)
  return figures


if __name__ == "__main__":
  main()
