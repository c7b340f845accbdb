"""GPU programs compiled on the CPU for H100 (and other targets), read and held to targets."""

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import mpjax
import mpjax.gpu
import mpjax.kernels
from mpjax import cli
from mpjax import experiment as ex
from mpjax.audit import audit_jaxpr, parse_compiled_gemms

pytestmark = pytest.mark.usefixtures("gpu_compiler")  # compiles for GPU targets

# From jaxlib 0.12, XLA compiles a cuDNN block-scaled GEMM without a GPU only through cuDNN's
# deviceless mode, which needs cuDNN >= 9.15 and the CUDA driver's library (libcuda.so.1),
# absent from a machine without a GPU driver (mpjax.compile_for says so).
NO_DEVICELESS_CUDNN = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


class Block(nn.Module):
  d: int
  heads: int

  @nn.compact
  def __call__(self, x):
    b, s, _ = x.shape
    qkv = nn.Dense(3 * self.d)(nn.LayerNorm()(x)).reshape(b, s, 3, self.heads, -1)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v).reshape(b, s, self.d)
    x = x + nn.Dense(self.d)(att)
    return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))


class LM(nn.Module):
  d: int = 256
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(256, self.d)(tokens)
    for _ in range(self.layers):
      x = Block(self.d, self.d // 64)(x)
    return nn.Dense(256)(nn.LayerNorm()(x))


def _lm_step(
  policy, *, skip_nonfinite=None, peer=False, max_grad_norm=1.0, d=256, layers=2, seq=128
):
  """(donating jitted AdamW step, with clipping by default; abstract state, abstract batch)."""
  model = LM(d, layers)
  batch = {"x": jax.ShapeDtypeStruct((8, seq), jnp.int32)}
  batch["y"] = batch["x"]
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((8, seq), jnp.int32)))
  cast = jax.tree.map if peer else None

  def loss_fn(p, b):
    if cast:  # the Flax dtype=bfloat16 / jmp peer: a bf16 copy of every weight, bf16 throughout
      p = cast(lambda w: w.astype(jnp.bfloat16), p)
    logits = model.apply(p, b["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  kw = dict(autocast=False, cast_params=False) if peer else {}
  step = mpjax.make_train_step(
    loss_fn, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, **kw
  )
  state = jax.eval_shape(
    lambda p: mpjax.TrainState.create(
      apply_fn=model.apply, params=p, tx=optax.adamw(1e-3), policy=policy
    ),
    params,
  )
  return jax.jit(step, donate_argnums=0), state, batch


@pytest.fixture(scope="module")
def reports():
  variants = {
    "fp32": ("fp32", {}),
    "mixed_bf16": ("mixed_bf16", {}),
    "mixed_bf16 checked": ("mixed_bf16", {"skip_nonfinite": True}),
    "mixed_fp16": ("mixed_fp16", {}),  # dynamic loss scale: checked
    "mixed_fp16 unchecked": ("mixed_fp16", {"skip_nonfinite": False}),
    "peer": ("fp32", {"peer": True}),
    # Without clipping, only the finite check reads the gradients a second time.
    "mixed_bf16 no clip": ("mixed_bf16", {"max_grad_norm": None}),
    "mixed_bf16 no clip checked": ("mixed_bf16", {"max_grad_norm": None, "skip_nonfinite": True}),
  }
  out = {}
  issue_lm = dict(d=512, layers=4, seq=256)  # the LM the GPU targets were set on
  for name, (policy, kw) in variants.items():
    if name == "mixed_fp16 unchecked":
      step, state, batch = _lm_step(policy, skip_nonfinite=False, **issue_lm)
      state = state.replace(loss_scale=mpjax.StaticLossScale(1.0))
    else:
      step, state, batch = _lm_step(policy, **kw, **issue_lm)
    # The targets below were set on the cuBLASLt mode, where the deviceless program has the
    # GEMM kernels a GPU runs; XLA's default mode gets placeholder Triton tiles here.
    out[name] = mpjax.kernel_report(step, state, batch, target="h100", gemm_backend="cublaslt")
  return out


@pytest.mark.parametrize("target", sorted(mpjax.TARGETS))
def test_every_target_compiles_a_bf16_gemm_in_both_gemm_modes(target):
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
  # XLA's default mode (also by its first name, "triton") makes a Triton GEMM fusion,
  # the cuBLASLt mode a cuBLASLt call.
  modes = ((None, "triton_gemm"), ("triton", "triton_gemm"), ("cublaslt", "cublas_lt"))
  for backend, kind in modes:
    mode = {} if backend is None else {"gemm_backend": backend}
    hlo = mpjax.compile_for(jnp.dot, x, w, target=target, **mode).as_text()
    assert [g.kind for g in parse_compiled_gemms(hlo)] == [kind]
  assert mpjax.get_target(target).peak_tflops(jnp.bfloat16) > mpjax.get_target(target).peak_tflops(
    jnp.float32
  )


def test_mixed_bf16_step_moves_fewer_bytes_in_about_as_many_kernels_as_fp32(reports):
  fp32, bf16, peer = reports["fp32"], reports["mixed_bf16"], reports["peer"]
  assert bf16.count <= 1.05 * fp32.count, (bf16.count, fp32.count)
  assert bf16.bytes_moved <= 0.6 * fp32.bytes_moved, bf16.bytes_moved / fp32.bytes_moved
  # No more than the Flax dtype=bfloat16 peer, though softmax runs in f32 (its
  # gradient is y * (dy - sum(y * dy)), so no row sum is kept for the backward).
  assert bf16.bytes_moved <= peer.bytes_moved, bf16.bytes_moved / peer.bytes_moved
  assert bf16.estimated_seconds < 0.75 * fp32.estimated_seconds
  assert bf16.count < peer.count  # the peer converts every weight twice
  assert bf16.temp_bytes < fp32.temp_bytes
  # Every GEMM kernel is a cuBLASLt call with half operands: on Tensor Cores.
  gemms = [k for k in bf16.kernels if k.kind == "gemm"]
  assert len(gemms) == len([k for k in fp32.kernels if k.kind == "gemm"]) > 0
  assert {k.peak_dtype for k in gemms} == {"bfloat16"}
  assert bf16.flops == fp32.flops


@pytest.mark.parametrize(
  "checked, unchecked",
  [
    ("mixed_bf16 checked", "mixed_bf16"),
    ("mixed_fp16", "mixed_fp16 unchecked"),
    ("mixed_bf16 no clip checked", "mixed_bf16 no clip"),
  ],
)
def test_a_checked_step_costs_no_conditional_and_no_copy_of_the_state(reports, checked, unchecked):
  checked, unchecked = reports[checked], reports[unchecked]
  assert checked.count <= 1.1 * unchecked.count, (checked.count, unchecked.count)
  assert checked.by_kind["conditional"] == 0
  assert checked.copy_bytes <= unchecked.copy_bytes  # no copy of params or optimizer state
  assert checked.bytes_moved <= 1.05 * unchecked.bytes_moved


@pytest.mark.parametrize("policy, written", [("mixed_bf16", {"bfloat16"}), ("mixed_fp16", None)])
def test_bf16_weight_gradient_gemms_write_bf16_and_fp16_ones_f32(policy, written):
  step, state, batch = _lm_step(policy)
  compiled = mpjax.compile_for(step, state, batch, target="h100", gemm_backend="cublaslt")
  gemms = parse_compiled_gemms(compiled.as_text())
  assert {g.kind for g in gemms} == {"cublas_lt"}
  # fp16 writes its weight gradients (a [d_in, d_out] result of a GEMM over the
  # batch) in f32, for range; bf16 has f32's range and writes everything in bf16.
  written = written or {"float16", "float32"}
  assert {g.out_dtype for g in gemms} == written


def test_a_kernel_moves_the_bytes_of_every_operand_and_result():
  # Eight f32 arrays summed in one fusion: XLA prints its sixth operand as
  # "/*index=5*/%p5", which the byte count once dropped.
  arrays = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 8
  report = mpjax.kernel_report(lambda *xs: sum(xs[1:], xs[0]), *arrays, target="h100")
  assert report.count == 1
  assert report.bytes_moved == 9 * 1024 * 1024 * 4  # 8 read, 1 written


def test_split_k_partial_sums_are_counted_and_said_and_a_users_sum_is_not_one():
  a = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
  report = mpjax.kernel_report(lambda a, b: a @ b, a, b, target="h100")
  gemm, add = report.kernels
  # The premise: the untuned Triton GEMM splits K, writing an f32 partial sum per slice that a
  # second kernel reads and adds; unsplit, the GEMM would write 256 x 1024 bf16 (0.5 MB).
  partials = gemm.bytes - (256 * 4096 + 4096 * 1024) * 2
  assert gemm.kind == "gemm" and add.kind == "fusion" and partials > 256 * 1024 * 4
  assert partials % (256 * 1024 * 4) == 0
  assert gemm.split_k_partial_bytes == partials
  assert (report.split_k_gemms, report.split_k_bytes) == (1, 2 * partials)
  assert report.to_dict()["split_k_bytes"] == 2 * partials
  assert f"default 1 ({2 * partials / 1e6:.1f} MB)" in mpjax.kernels.kernel_table(
    {"default": report}
  )
  # cuBLASLt splits inside its one call, and a reduction the user wrote is not a split-K sum.
  lt = mpjax.kernel_report(
    lambda a, b: jnp.sum(a @ b, axis=0), a, b, target="h100", gemm_backend="cublaslt"
  )
  assert [k.kind for k in lt.kernels] == ["gemm", "fusion"]
  assert (lt.split_k_gemms, lt.split_k_bytes) == (0, 0)
  assert "split K" not in mpjax.kernels.kernel_table({"cublaslt": lt})


def test_unknown_target_and_backend_are_refused_with_the_choices():
  with pytest.raises(ValueError, match="h100"):
    mpjax.get_target("h1000")
  with pytest.raises(ValueError, match="cublaslt"):
    mpjax.compile_for(jnp.sin, jnp.ones(3), target="h100", gemm_backend="cudnn")


def test_a_missing_or_mismatched_compiler_plugin_names_the_fix(monkeypatch):
  import jaxlib

  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "version", missing)
  with pytest.raises(
    RuntimeError, match=f"pip install --no-deps jax-cuda13-pjrt=={jaxlib.__version__}"
  ):
    mpjax.gpu._check_compiler()
  monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
  with pytest.raises(RuntimeError, match="0.0.1 does not match jaxlib"):
    mpjax.gpu._check_compiler()

  def cuda13_only(name):  # as jax[cuda13] installs it, on a CUDA 13 machine
    if name != "jax-cuda13-pjrt":
      raise importlib.metadata.PackageNotFoundError(name)
    return jaxlib.__version__

  monkeypatch.setattr(importlib.metadata, "version", cuda13_only)
  mpjax.gpu._check_compiler()  # it compiles as well

  def old_cuda13(name):
    if name != "jax-cuda13-pjrt":
      raise importlib.metadata.PackageNotFoundError(name)
    return "0.0.1"

  monkeypatch.setattr(importlib.metadata, "version", old_cuda13)
  with pytest.raises(
    RuntimeError,
    match=rf"jax-cuda13-pjrt 0\.0\.1 does not match .*pip install --no-deps "
    rf"jax-cuda13-pjrt=={re.escape(jaxlib.__version__)} ",
  ):
    mpjax.gpu._check_compiler()
  # A jaxlib past the last jax-cuda12-pjrt (0.12.0.1): the fix names only the cuda13 plugin.
  monkeypatch.setattr(jaxlib, "__version__", "0.12.1")
  with pytest.raises(RuntimeError) as e:
    mpjax.gpu._check_compiler()
  assert "jax-cuda13-pjrt==0.12.1" in str(e.value) and "cuda12-pjrt==" not in str(e.value)
  monkeypatch.setattr(jaxlib, "__version__", "0.10.2")
  with pytest.raises(RuntimeError, match=r"or jax-cuda12-pjrt==0\.10\.2"):
    mpjax.gpu._check_compiler()


def test_importing_mpjax_with_the_compiler_plugin_logs_no_traceback():
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  }
  code = "import mpjax, jax; print(jax.default_backend())"
  quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert quiet.returncode == 0 and quiet.stdout.strip() == "cpu"
  assert "Traceback" not in quiet.stderr and "plugin configuration error" not in quiet.stderr
  # The premise: without mpjax's import first, JAX itself logs the traceback here.
  noisy = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True
  )
  assert "Jax plugin configuration error" in noisy.stderr


CONFIGS = sorted(p.stem for p in (pathlib.Path(__file__).parent.parent / "configs").glob("*.py"))


@pytest.mark.parametrize("gemm_backend", ["default", "cublaslt"])
@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_audits_on_h100_with_every_gemm_matched(
  name, gemm_backend, monkeypatch
):
  monkeypatch.delenv(mpjax.POLICY_ENV_VAR, raising=False)
  config = ex.load_config(name)
  report = cli.doctor_report(config, "h100", gemm_backend)
  assert report.platform == "gpu" and len(report.rows) >= 5
  not_found = [(r.path, r.shape) for r in report.rows if r.call in (None, "(not found)")]
  assert not not_found, (report.compiled_note, not_found)
  assert not report.compiled_only, report.compiled_only  # nothing compiled that is not audited
  assert mpjax.gpu.describe_gemm_backend(gemm_backend) in report.compiled_note
  kinds = {r.call_kind for r in report.rows}
  fp8 = mpjax.get_policy(config.policy).fp8 is not None
  if gemm_backend == "default":
    assert kinds <= {"triton_gemm", "cudnn"}
  else:
    assert kinds <= {"cublas_lt", "cudnn"} | ({"cublas_lt_f8"} if fp8 else set())
  fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
  assert bool(fp8_rows) == fp8
  if fp8 and gemm_backend == "cublaslt":  # every GEMM the recipe puts in FP8 is an FP8 call
    assert {r.call_kind for r in fp8_rows} == {"cublas_lt_f8"}
    assert "FP8 cuBLASLt calls" in report.to_markdown()
  # Whatever the mode: a GEMM planned in FP8 either multiplies FP8 compiled, on the fast
  # path, or is flagged as having lost its FP8.
  for r in fp8_rows:
    lost = not r.compiled_dtypes.startswith("f8")
    assert ("fp8-lost" in [f.code for f in r.flags]) == lost and r.fast == (not lost), r
  if mpjax.get_policy(config.policy).is_mixed:
    wide = [r for r in report.rows if r not in fp8_rows]
    said = [r for r in wide if r.accumulation != "unknown"]
    assert all(r.fast for r in said), [(r.path, [f.code for f in r.flags]) for r in said]
    dots = [r for r in report.rows if r.op != "conv_general_dilated"]
    assert {r.accumulation for r in dots} == {"f32"}
    # Where the program does not say it (a cuDNN convolution writing bf16: cuDNN's choice),
    # the audit says "unknown" and does not count the GEMM on the fast path.
    unknown = [r for r in wide if r.accumulation == "unknown"]
    assert report.accumulation_unknown == tuple(unknown) and not any(r.fast for r in unknown)


def test_audit_lists_no_gemm_that_the_program_does_not_compute():
  """A convolution's gradient w.r.t. the input image is computed by its VJP and thrown away."""
  conv = nn.Conv(8, (3, 3))
  x = jnp.ones((4, 8, 8, 1))
  params = conv.init(jax.random.key(0), x)

  def loss(p, x):
    return jnp.sum(conv.apply(p, x) ** 2)

  report = mpjax.audit(jax.grad(mpjax.autocast(loss, "mixed_bf16")), params, x)
  assert len(report.rows) == 2  # forward, and the kernel's gradient; not the image's
  jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, "mixed_bf16")))(params, x)
  assert str(jaxpr).count("conv_general_dilated[") == 3  # the premise: the VJP computes three


def _doctor(*args: str) -> subprocess.CompletedProcess:
  """``mpjax doctor ARGS`` as a user runs it: a fresh process from the repository root."""
  return subprocess.run(
    [sys.executable, "-m", "mpjax.cli", "doctor", *args],
    cwd=pathlib.Path(__file__).parent.parent,
    env={k: v for k, v in os.environ.items() if k != mpjax.POLICY_ENV_VAR},
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_doctor_for_h100_prints_the_audit_and_the_kernel_report():
  result = _doctor("digits_mlp", "--target", "h100", "--compare", "fp32,mixed_bf16")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  # XLA's default mode unless told otherwise, and every part of the output says so.
  mode = "XLA's default mode (Triton GEMMs on)"
  assert f"on h100 (compiled here, no GPU needed, in {mode})" in out
  assert f"Compiled for NVIDIA H100 SXM 80GB without a GPU, in {mode}." in out
  assert "`__triton" in out and "__cublas$lt$matmul" not in out
  assert out.count(mode) >= 3  # the heading, the audit's note and the kernel table's note
  assert "| compiled dtypes | accumulation |" in out and "| bf16 x bf16 -> f32 | f32 |" in out
  assert "Fast path: 100.0% of" in out
  assert "**Kernels per train step on h100**" in out
  assert "| fp32 | " in out and "| mixed_bf16 | " in out and "roofline estimate" in out
  bad = subprocess.run(
    [sys.executable, "-m", "mpjax.cli", "doctor", "digits_mlp", "--target", "h1000"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert bad.returncode == 2 and "use one of ['a100', 'b200', 'h100', 'h200', 'l4']" in bad.stderr


def test_doctor_in_the_cublaslt_mode_says_so():
  report = cli.doctor_report(ex.load_config("digits_mlp"), "h100", "cublaslt")
  assert {r.call for r in report.rows} == {"__cublas$lt$matmul"}
  assert "in cuBLASLt mode (Triton GEMMs off" in report.compiled_note


def test_bench_target_prints_kernel_tables_with_ratios(tmp_path):
  out = tmp_path / "bench.json"
  result = subprocess.run(
    [
      sys.executable,
      "scripts/bench.py",
      "--target",
      "h100",
      "--small",
      "--models",
      "mlp",
      "--json",
      str(out),
    ],
    cwd=pathlib.Path(__file__).parent.parent,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr
  mode = "XLA's default mode (Triton GEMMs on)"
  assert f"**mlp on h100, {mode}**" in result.stdout and "| plain fp32 | " in result.stdout
  record = json.loads(out.read_text())
  results = record["results"]["mlp"]
  assert {"plain fp32", "mpjax mixed_bf16 autocast", "flax dtype=bf16", "jmp cast"} <= set(results)
  assert results["plain fp32"]["kernels"] > 0 and results["plain fp32"]["gemm_flops"] > 0
  # The FP8 head variant: the recipe's default keeps the last layer bf16, this one does not.
  fp8, head = results["mpjax mixed_fp8 autocast"], results["mpjax mixed_fp8 autocast, FP8 head"]
  assert 0 < fp8["fp8_gemms"] < head["fp8_gemms"]
  assert "With the output head in FP8 too (keep_bf16=('first',))" in result.stdout
  # The FP8 step's bound: the bf16 step less what its GEMM kernels save, said from the figures.
  bf16 = results["mpjax mixed_bf16 autocast"]
  saved = bf16["estimated_gemm_ms"] - fp8["estimated_gemm_ms"]
  bound = (bf16["estimated_ms"] - saved) / bf16["estimated_ms"]
  assert 0 < fp8["estimated_gemm_ms"] < fp8["estimated_ms"]
  assert f"the step would be {bound:.3f}x" in result.stdout
  # The record says how it compiled: the mode, the XLA options and flags, the versions.
  assert record["command"].startswith("python scripts/bench.py --target h100 --small")
  assert (record["gemm_backend"], record["gemm_mode"]) == ("default", mode)
  assert record["xla_options"] == {"xla_gpu_enable_triton_gemm": True}
  assert record["jax"] == jax.__version__ and record["jaxlib"] and record["compiler_plugins"]
  assert "XLA_FLAGS" in record
  assert {r["gemm_backend"] for r in results.values()} == {"default"}
  assert results["plain fp32"]["calls"] == {"triton_gemm": results["plain fp32"]["by_kind"]["gemm"]}


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")  # jax >= 0.12
def test_bench_target_with_fused_attention_counts_its_kernels_and_flops(tmp_path):
  # GPT-2 with jax's Pallas flash attention (here its small shape: 2 layers): the attention's
  # GEMMs are in custom kernels, which the bench names and whose FLOPs it counts from the shapes.
  out = tmp_path / "bench.json"
  argv = ["--target", "h100", "--small", "--models", "gpt2_fused", "--json", str(out)]
  result = subprocess.run(
    [sys.executable, "scripts/bench.py", *argv],
    cwd=pathlib.Path(__file__).parent.parent,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr
  results = json.loads(out.read_text())["results"]["gpt2_fused"]
  layers, dense_per_layer = 2, 4  # each Dense: 3 GEMMs (forward, both gradients); and the head
  for label, r in results.items():
    assert r["custom_kernels"] >= 2 * layers, label  # a forward and a backward kernel per layer
    assert sum(r["calls"].values()) == 3 * (dense_per_layer * layers + 1), (label, r["calls"])
  assert 0 < results["mpjax mixed_fp8 autocast"]["fp8_gemms"]
  # Per layer 9 GEMMs (2 forward, 7 backward) of 2 * batch * heads * seq^2 * head_dim FLOPs,
  # half of each computed (causal); batch 2, 2 heads, seq 16, head_dim 16.
  flops = layers * 9 * (2 * 2 * 2 * 16 * 16 * 16) / 2
  assert "The fused attention (bf16 in every variant): " in result.stdout
  assert f"their GEMMs, {flops:.4g} FLOP counted from the shapes" in result.stdout


@pytest.fixture(scope="module")
def fp8_lm():
  step, state, batch = _lm_step("mixed_fp8")
  return step, mpjax.init_fp8_state(step, state, batch), batch


def test_every_fp8_gemm_of_an_lm_step_is_an_fp8_cublaslt_call_on_h100(fp8_lm):
  step, state, batch = fp8_lm
  # 2 blocks x (qkv, out, up, down) + the head; the first (qkv of block 0) and
  # the last (the head) stay bf16 by default.
  assert state.fp8.gemms == 7
  report = mpjax.audit(step, state, batch, target="h100", gemm_backend="cublaslt")
  fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
  # Forward and both backward GEMMs of each: E4M3 x E4M3 forward, E5M2 gradients.
  assert len(fp8_rows) == 3 * state.fp8.gemms
  assert {r.call for r in fp8_rows} == {"__cublas$lt$matmul$f8"}
  assert sum("e5m2" in r.dtypes for r in fp8_rows) == 2 * state.fp8.gemms
  others = [r for r in report.rows if r not in fp8_rows]
  assert {r.call for r in others} == {"__cublas$lt$matmul"} and others
  # The attention GEMMs (two computed operands) and the kept layers are bf16.
  assert {r.dtypes.split(" ->")[0] for r in others} == {"bf16 x bf16"}
  assert report.fast_path_share == 1.0 and not report.flagged
  kernels = mpjax.kernel_report(step, state, batch, target="h100", gemm_backend="cublaslt")
  assert kernels.calls["cublas_lt_f8"] == kernels.fp8_gemms == 3 * state.fp8.gemms
  assert {k.peak_dtype for k in kernels.kernels if k.call == "cublas_lt_f8"} <= {
    "float8_e4m3fn",
    "float8_e5m2",
  }


@pytest.mark.parametrize(
  "gemm_backend", ["default", pytest.param("cublaslt", marks=pytest.mark.slow)]
)
def test_fp8_gemms_on_a_gpu_without_fp8_tensor_cores_are_flagged(fp8_lm, gemm_backend):
  step, state, batch = fp8_lm
  report = mpjax.audit(step, state, batch, target="a100", gemm_backend=gemm_backend)
  fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
  # The premise: no compiled GEMM multiplies FP8 on an A100.
  assert fp8_rows and not any(r.compiled_dtypes.startswith("f8") for r in fp8_rows)
  assert all("fp8-lost" in [f.code for f in r.flags] for r in fp8_rows)
  assert report.fast_path_share < 1.0


def test_fp8_gemm_dims_not_a_multiple_of_16_are_flagged():
  model = nn.Sequential([nn.Dense(200), nn.relu, nn.Dense(200), nn.relu, nn.Dense(16)])
  x = jnp.ones((64, 64))
  params = model.init(jax.random.key(0), x)
  state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy="mixed_fp8"
  )
  step = mpjax.make_train_step(lambda p, b: jnp.mean(model.apply(p, b) ** 2))
  report = mpjax.audit(step, state, x, target="h100")
  fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
  assert len(fp8_rows) == 3  # the middle Dense: 200 = 8 x 25, aligned for bf16, not for FP8
  for row in fp8_rows:
    assert row.alignment == 16 and row.misaligned
    (flag,) = [f for f in row.flags if f.code == "misaligned"]
    assert "multiples of 16" in flag.reason
  assert all(not r.misaligned for r in report.rows if r not in fp8_rows)


def _mlp_step(policy, depth):
  """(jitted Adam step of an MLP of ``depth`` Dense layers, 256 wide; state; batch): abstract."""
  layers = [nn.Dense(256)]
  for _ in range(depth - 1):
    layers += [nn.relu, nn.Dense(256)]
  model = nn.Sequential(layers)
  batch = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), batch)
  step = jax.jit(mpjax.make_train_step(lambda p, b: jnp.mean(model.apply(p, b) ** 2)))
  state = jax.eval_shape(
    lambda p: mpjax.TrainState.create(
      apply_fn=model.apply, params=p, tx=optax.adam(1e-3), policy=policy
    ),
    params,
  )
  return step, state, batch


@pytest.mark.parametrize(
  "workload, gemms, fp8_gemms",
  [
    # depth Dense layers: a forward and two gradient GEMMs each, but the first layer, whose
    # input has no gradient; the recipe keeps the first and the last layer bf16.
    ("mlp, 3 layers", 8, 3),
    ("mlp, 5 layers", 14, 9),
    # 17 Dense layers (4 a block and the head) and 24 attention GEMMs (2 forward, 4 backward
    # a block), which multiply two computed operands and stay bf16.
    ("lm, 4 layers", 75, 45),
  ],
)
def test_the_fp8_share_of_a_mixed_fp8_step_compiled_for_h100_in_the_default_mode(
  workload, gemms, fp8_gemms
):
  # mixed_fp8 with its default recipe, compiled for H100 in XLA's default mode (Triton GEMM
  # fusions): every GEMM the recipe puts in FP8 multiplies f8 x f8, and the audit says the same.
  if workload.startswith("mlp"):
    step, state, batch = _mlp_step("mixed_fp8", depth=int(workload.split()[1]))
  else:
    step, state, batch = _lm_step("mixed_fp8", d=128, layers=4, seq=64)
  state = mpjax.init_fp8_state(step, state, batch)
  assert state.fp8.gemms == fp8_gemms // 3
  report = mpjax.audit(step, state, batch, target="h100", gemm_backend="default")
  assert len(report.rows) == gemms and not report.compiled_only  # each matched to its kernel
  f8 = [r for r in report.rows if re.match(r"f8_e\w+ x f8_e", r.compiled_dtypes)]
  assert len(f8) == fp8_gemms and {r.call_kind for r in f8} == {"triton_gemm"}
  if workload != "mlp, 3 layers":  # the deeper MLP and the LM: 64% and 60%
    assert len(f8) >= 0.6 * len(report.rows)
  assert not report.flagged and report.fast_path_share == 1.0
  assert "multiply FP8 x FP8" in str(report)


@pytest.mark.parametrize(
  "workload, gemms, planned",
  [("mlp, 5 layers", 14, 9), pytest.param("lm, 4 layers", 75, 45, marks=pytest.mark.slow)],
)
def test_every_gemm_mixed_mxfp8_plans_is_a_cudnn_block_scaled_call_on_b200_and_emulated_on_h100(
  workload, gemms, planned
):
  # The GEMMs mixed_fp8 puts in FP8 (forward and both gradients), block-scaled: compiled for a
  # B200 in XLA's default mode each is one __cudnn$blockScaledDot of E4M3 operands with E8M0
  # scales per 32; compiled for an H100, which has no block-scaled Tensor Cores, each is a bf16
  # GEMM, flagged.
  if workload.startswith("mlp"):
    step, state, batch = _mlp_step("mixed_mxfp8", depth=5)
  else:
    step, state, batch = _lm_step("mixed_mxfp8", d=128, layers=4, seq=64)
  h100 = mpjax.audit(step, state, batch, target="h100", gemm_backend="default")
  emulated = [r for r in h100.rows if "block-scaled-emulated" in _codes(r)]
  # What XLA makes of them differs by version (jax 0.10.2: bf16 cuBLASLt calls; 0.12.1: dots in
  # loop fusions, flagged not-tensor-core too), never an FP8 or block-scaled call.
  assert len(emulated) == planned and "cudnn_block_scaled" not in {r.call_kind for r in emulated}
  assert not any(r.compiled_dtypes.startswith("f8") for r in emulated)
  assert len(h100.flagged) == planned
  assert cli.block_scaling_line(h100, "h100", "mixed_mxfp8").startswith(
    f"Block scaling on h100: EMULATED. {planned} of {planned}"
  )
  assert cli.block_scaling_line(h100, "h100", "mixed_bf16") == ""
  if NO_DEVICELESS_CUDNN:
    # jaxlib >= 0.12 compiles cuDNN calls without a GPU only with cuDNN >= 9.15 and the CUDA
    # driver's library on the machine: compile_for says so, naming what compiles instead.
    with pytest.raises(RuntimeError, match=r"deviceless mode, which needs cuDNN >= 9\.15"):
      mpjax.audit(step, state, batch, target="b200", gemm_backend="default")
    return
  b200 = mpjax.audit(step, state, batch, target="b200", gemm_backend="default")
  assert len(b200.rows) == gemms and not b200.compiled_only
  blocked = [r for r in b200.rows if r.block_scales]
  assert len(blocked) == planned and {r.block_scales for r in blocked} == {"f8_e8m0fnu per 32"}
  assert {r.call for r in blocked} == {"__cudnn$blockScaledDot"}
  assert {r.compiled_dtypes for r in blocked} == {"f8_e4m3fn x f8_e4m3fn -> bf16"}
  assert not b200.flagged and b200.fast_path_share == 1.0
  assert f"{planned} block-scaled GEMMs" in str(b200) and f"{planned} are cuDNN" in str(b200)
  b200_kernels = mpjax.kernel_report(step, state, batch, target="b200")
  assert b200_kernels.calls["cudnn_block_scaled"] == planned
  assert b200_kernels.fp8_gemms == planned
  assert cli.block_scaling_line(b200, "b200", "mixed_mxfp8").startswith(
    f"Block scaling on b200: native. {planned} of {planned}"
  )
  # Premise: mixed_bf16 has no block-scaled GEMM on the B200.
  step, state, batch = (
    _mlp_step("mixed_bf16", depth=5)
    if workload.startswith("mlp")
    else _lm_step("mixed_bf16", d=128, layers=4, seq=64)
  )
  assert not [r for r in mpjax.audit(step, state, batch, target="b200").rows if r.block_scales]


def test_block_scaled_dot_under_jax_grad_is_three_cudnn_calls_on_b200():
  # A user's own layer (no autocast, no train step): jax.grad of block_scaled_dot compiled for
  # a B200 here runs its forward GEMM and both gradient GEMMs as cuDNN block-scaled calls. The
  # backward pass must read where it is compiled for from its residuals: its cotangent, made by
  # jax.grad, carries no placement.
  def loss(x, w):
    y = mpjax.block_scaled_dot(x, w, (((1,), (0,)), ((), ())), mpjax.MXFP8, jnp.bfloat16)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  if NO_DEVICELESS_CUDNN:  # the B200 compile: see test_every_gemm_mixed_mxfp8_plans_...
    with pytest.raises(RuntimeError, match=r"deviceless mode, which needs cuDNN >= 9\.15"):
      mpjax.kernel_report(grad, x, w, target="b200")
    return
  report = mpjax.kernel_report(grad, x, w, target="b200")
  assert report.calls == {"cudnn_block_scaled": 3} and report.fp8_gemms == 3
  # Premise: on an H100 the same GEMMs are bf16 ones.
  h100 = mpjax.kernel_report(grad, x, w, target="h100")
  assert "cudnn_block_scaled" not in h100.calls and h100.fp8_gemms == 0


@pytest.mark.slow
def test_doctor_says_a_block_scaled_policy_is_emulated_on_h100():
  policies = ("--config.policy=mixed_mxfp8", "--compare", "mixed_bf16,mixed_mxfp8")
  result = _doctor("default", "--target", "h100", *policies)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "Block scaling on h100: EMULATED. 21 of 21 block-scaled GEMMs" in out
  assert out.count("block-scaled-emulated") >= 21  # each GEMM's flag in the table
  assert "| mixed_mxfp8 | " in out and "| mixed_bf16 | " in out


@pytest.mark.parametrize("gradients", ["mxfp8", "nvfp4"])
def test_nvfp4_runs_its_forward_gemms_in_fp4_and_its_gradients_as_its_recipe_says_on_b200(
  gradients,
):
  # mixed_nvfp4: gradient GEMMs in MXFP8; NVIDIA's whole recipe (NVFP4_FP4_GRADIENTS): in FP4.
  recipe = mpjax.NVFP4 if gradients == "mxfp8" else mpjax.NVFP4_FP4_GRADIENTS
  policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=recipe)
  fp4 = ("f8_e4m3fn per 16", "f4_e2m1fn x f4_e2m1fn -> f32")
  mx = ("f8_e8m0fnu per 32", "f8_e4m3fn x f8_e4m3fn -> bf16")
  want = sorted([fp4] * 3 + [mx if gradients == "mxfp8" else fp4] * 6)
  step, state, batch = _mlp_step(policy, depth=5)
  h100 = mpjax.audit(step, state, batch, target="h100", gemm_backend="default")
  scales = sorted(r.block_scales for r in h100.rows if "block-scaled-emulated" in _codes(r))
  assert scales == [scale for scale, _ in want]
  if NO_DEVICELESS_CUDNN:  # the B200 compile: see test_every_gemm_mixed_mxfp8_plans_...
    return
  report = mpjax.audit(step, state, batch, target="b200", gemm_backend="default")
  blocked = [r for r in report.rows if r.block_scales]
  assert {r.call for r in blocked} == {"__cudnn$blockScaledDot"} and not report.flagged
  assert sorted((r.block_scales, r.compiled_dtypes) for r in blocked) == want
  kernels = mpjax.kernel_report(step, state, batch, target="b200")
  fp4_kernels = [k for k in kernels.kernels if str(k.peak_dtype).startswith("float4")]
  assert len(fp4_kernels) == want.count(fp4)  # at B200's FP4 peak, twice its FP8 one
  k = fp4_kernels[0]
  assert kernels.kernel_seconds(k) <= max(
    k.flops / 9000e12, k.bytes / (mpjax.get_target("b200").memory_tbps * 1e12)
  )
  # No GEMM kernel but the model's: the Hadamard transform is elementwise, fused by XLA.
  assert kernels.by_kind["gemm"] == len(report.rows)


# --------------------------------------------------------------------------- FP8, as compiled

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _qdq(x, dtype, scale):
  """Quantize -> dequantize, as FP8 recipes wrote it: ``convert(clip(x / s)) * s`` in bf16."""
  big = float(jnp.finfo(dtype).max)
  q = jnp.clip(x.astype(jnp.float32) / scale, -big, big).astype(dtype)
  return q.astype(jnp.bfloat16) * jnp.asarray(scale, jnp.bfloat16)


def _codes(row):
  return [f.code for f in row.flags]


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_a_qdq_gemm_in_the_default_mode_loses_its_fp8_and_is_flagged(out_dtype):
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)

  def f(x, w):
    return jnp.dot(_qdq(x, E4M3, 2.0), _qdq(w, E4M3, 0.5), preferred_element_type=out_dtype)

  # The premise: compiled for an H100 in XLA's default mode, no GEMM multiplies FP8.
  hlo = mpjax.compile_for(f, x, w, target="h100").as_text()
  gemms = parse_compiled_gemms(hlo)
  assert gemms and "$f8" not in hlo
  assert not [g for g in gemms if "float8" in g.lhs_dtype + g.rhs_dtype], gemms
  report = mpjax.audit(f, x, w, target="h100")
  (row,) = report.rows
  assert row.dtypes.startswith("f8_e4m3fn x f8_e4m3fn")  # planned FP8
  assert row.call_kind == "triton_gemm" and row.compiled_dtypes.startswith("bf16 x bf16")
  assert _codes(row) == ["fp8-lost"] and not row.fast and report.fast_path_share == 0.0
  assert "multiplies bf16 x bf16: the FP8 was lost" in row.flags[0].reason
  assert "XLA's default mode (Triton GEMMs on)" in report.compiled_note
  assert "0 multiply FP8 x FP8" in str(report) and "1 lost their FP8" in str(report)
  # With Triton GEMMs off the same program is one FP8 cuBLASLt call, on the fast path.
  lt = mpjax.audit(f, x, w, target="h100", gemm_backend="cublaslt")
  assert lt.rows[0].call == "__cublas$lt$matmul$f8" and not lt.flagged
  assert lt.fast_path_share == 1.0
  # The estimate costs what is multiplied: bf16 here, FP8 there.
  assert _gemm_peak_dtypes(f, x, w, gemm_backend="default") == ["bfloat16"]
  assert _gemm_peak_dtypes(f, x, w, gemm_backend="cublaslt") == ["float8_e4m3fn"]


def _gemm_peak_dtypes(f, *args, gemm_backend, target="h100"):
  report = mpjax.kernel_report(f, *args, target=target, gemm_backend=gemm_backend)
  return [k.peak_dtype for k in report.kernels if k.kind == "gemm"]


@pytest.mark.parametrize("lhs, rhs", [(E4M3, E4M3), (E5M2, E4M3)])
def test_a_direct_fp8_dot_in_the_default_mode_stays_fp8_on_the_fast_path(lhs, rhs):
  x, w = jax.ShapeDtypeStruct((256, 512), lhs), jax.ShapeDtypeStruct((512, 1024), rhs)

  def f(x, w):
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)

  report = mpjax.audit(f, x, w, target="h100")
  (row,) = report.rows
  # An f8 x f8 dot inside a Triton GEMM fusion: FP8 on the fast path, no flag.
  assert row.call_kind == "triton_gemm"
  assert row.compiled_dtypes.split(" ->")[0] == row.dtypes.split(" ->")[0]
  assert not row.flags and row.fast and report.fast_path_share == 1.0
  assert row.accumulation == "f32"
  assert "1 multiply FP8 x FP8 (0 FP8 cuBLASLt calls" in str(report)
  kernels = mpjax.kernel_report(f, x, w, target="h100")
  assert kernels.fp8_gemms == 1 and kernels.to_dict()["fp8_gemms"] == 1
  assert _gemm_peak_dtypes(f, x, w, gemm_backend="default") == [np.dtype(lhs).name]
  lt = mpjax.audit(f, x, w, target="h100", gemm_backend="cublaslt")
  assert lt.rows[0].call_kind == "cublas_lt_f8" and lt.fast_path_share == 1.0


def test_the_estimate_costs_an_fp8_gemm_at_the_fp8_peak_and_a_bf16_one_at_the_bf16_peak():
  from mpjax.kernels import Kernel, KernelReport

  def seconds(target, *dtypes):
    kernels = tuple(Kernel(f"g{i}", "gemm", 0, 1e15, d) for i, d in enumerate(dtypes))
    return KernelReport(mpjax.get_target(target), kernels, 0, 0, "default").estimated_seconds

  assert seconds("h100", "float8_e4m3fn") == pytest.approx(1e3 / 1978.9)
  assert seconds("h100", "float8_e5m2") == pytest.approx(1e3 / 1978.9)
  assert seconds("h100", "bfloat16") == pytest.approx(1e3 / 989.4)
  assert seconds("h100", "float32") == pytest.approx(1e3 / 494.7)
  assert seconds("a100", "float8_e4m3fn") == pytest.approx(1e3 / 312.0)  # no FP8: bf16's rate
  # A GEMM of an f8 and a bf16 operand multiplies bf16: the wider operand sets the rate.
  hlo = """ENTRY %main (p0: f8e4m3fn[256,512], p1: bf16[512,1024]) -> f32[256,1024] {
  %p0 = f8e4m3fn[256,512]{1,0} parameter(0)
  %p1 = bf16[512,1024]{1,0} parameter(1)
  ROOT %dot.1 = f32[256,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
  (kernel,) = mpjax.kernels.report_from_hlo(hlo, "h100").kernels
  assert kernel.peak_dtype == "bfloat16"


def test_the_estimate_splits_into_gemm_kernels_and_the_rest():
  from mpjax.kernels import Kernel, KernelReport

  h100 = mpjax.get_target("h100")
  gemm = Kernel("g", "gemm", 1e6, 1e15, "bfloat16", call="triton_gemm")  # compute-bound: 1.01 ms
  big = Kernel("f", "fusion", 3.35e9, 0.0, None)  # memory-bound: 1 ms at 3.35 TB/s
  report = KernelReport(h100, (gemm, big), 0, 0, "default")
  assert report.kernel_seconds(gemm) == pytest.approx(1e3 / 989.4)
  assert report.kernel_seconds(big) == pytest.approx(1e-3)
  assert report.estimated_gemm_seconds == pytest.approx(1e3 / 989.4)
  assert report.estimated_seconds == pytest.approx(1e3 / 989.4 + 1e-3)
  assert report.to_dict()["estimated_gemm_ms"] == pytest.approx(1e6 / 989.4)


def test_a_custom_kernel_that_is_no_gemm_is_counted_and_said_to_have_unknown_flops():
  # A Pallas kernel as jax 0.10.2 compiles it for H100 (its Triton IR left out), after a GEMM.
  hlo = """HloModule m
ENTRY %main (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %k.1 = bf16[64,64]{1,0} custom-call(%dot.1), custom_call_target="__gpu$xla.gpu.triton"
}"""
  report = mpjax.kernels.report_from_hlo(hlo, "h100")
  gemm, kernel = report.kernels
  assert (gemm.kind, kernel.kind) == ("gemm", "custom") and kernel.call is None
  assert report.custom_kernels == report.to_dict()["custom_kernels"] == 1
  assert kernel.bytes == 2 * 64 * 64 * 2 and kernel.flops == 0.0  # its FLOPs are not readable
  assert report.kernel_seconds(kernel) == pytest.approx(kernel.bytes / 3.35e12)
  assert "Custom-call kernels that are no GEMM" in mpjax.kernels.kernel_table({"x": report})
  body, dot = hlo.splitlines()[:-3], hlo.splitlines()[-3].strip()
  plain = mpjax.kernels.report_from_hlo("\n".join([*body, f"  ROOT {dot}", "}"]), "h100")
  assert [k.kind for k in plain.kernels] == ["gemm"]
  assert "Custom-call kernels" not in mpjax.kernels.kernel_table({"x": plain})


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")  # jax >= 0.12
def test_a_pallas_kernel_compiles_for_the_gpu_and_its_kernels_are_counted():
  # A Pallas (Triton) kernel with GEMMs of its own, forward and backward, as a model holds one:
  # from jax 0.11 Pallas lowers only where it can read the GPU (compile_for gives it the target's).
  import pallas_matmul

  x, w = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 64), jnp.float32)
  grad = jax.grad(pallas_matmul.loss, argnums=(0, 1))
  report = mpjax.kernel_report(grad, x, w, target="h100")
  names = {k.name for k in report.kernels if k.kind == "custom"}
  assert report.custom_kernels == len(names) == 3, names  # forward, and two backward kernels
  # XLA's own GEMMs are the projection's (forward, and its two gradients), the kernels' are not.
  assert report.by_kind["gemm"] == 3
  assert "Custom-call kernels that are no GEMM" in mpjax.kernels.kernel_table({"pallas": report})
  # The audit lists no GEMM of a kernel's own program, and says which kernels it did not read.
  audited = mpjax.audit(grad, x, w, target="h100")
  assert len(audited.rows) == 3 and len(audited.custom_kernels) == report.custom_kernels
  assert "Not audited: " in audited.to_markdown()


def test_cudnn_attention_which_needs_a_gpu_to_trace_gets_an_error_that_names_what_compiles():
  # jax traces cuDNN's fused attention only with a GPU; inside a mixed-precision train step, as
  # `mpjax doctor --target` compiles it, the error says so and what compiles instead.
  def loss_fn(params, batch):
    q = (batch["x"] @ params["w"]).reshape(2, 128, 4, 64)
    out = jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).mean()

  state = mpjax.TrainState.create(
    apply_fn=None, params={"w": jnp.ones((64, 256))}, tx=optax.sgd(0.1), policy="mixed_bf16"
  )
  batch = {"x": jnp.ones((256, 64))}
  step = jax.jit(mpjax.make_train_step(loss_fn))
  with pytest.raises(RuntimeError, match="cuDNN is not detected") as raised:
    jax.eval_shape(step, state, batch)  # the premise: without a GPU jax cannot trace it at all
  assert "compile_for" not in str(raised.value)
  with pytest.raises(RuntimeError, match=r"calls cuDNN's fused attention .* implementation='xla'"):
    mpjax.kernel_report(step, state, batch, target="h100")


# The H200 run that showed FP8 lost (results/gpu/gpu_check_h200.json, jax 0.11.2): gpu_check's
# char LM (d_model 512, 8 heads, 4 layers, MLP 2048, seq 256, vocabulary 256, batch 16), its
# mixed_fp8 step then quantize -> dequantize -> dot in FP8 for every layer GEMM but the first
# (block 0's qkv) and the last (the head), forward and both backward GEMMs. Here the same
# model at a quarter of every size (seq / d_model, MLP / d_model and vocabulary / d_model kept,
# so each GEMM's share of the FLOPs is the same), without its optimizer.
H200_RUN = pathlib.Path(__file__).parent.parent / "results" / "gpu" / "gpu_check_h200.json"
H200_LM = dict(d=128, heads=2, layers=4, mlp=512, seq=64, vocab=64, batch=4)


@jax.custom_vjp
def _qdq_dense(x, w):
  return jnp.einsum("bsd,dn->bsn", _qdq(x, E4M3, 0.5), _qdq(w, E4M3, 0.25))


def _qdq_dense_fwd(x, w):
  return _qdq_dense(x, w), (x, w)


def _qdq_dense_bwd(residuals, g):
  x, w = residuals
  qx, qw, qg = _qdq(x, E4M3, 0.5), _qdq(w, E4M3, 0.25), _qdq(g, E5M2, 2.0)
  return jnp.einsum("bsn,dn->bsd", qg, qw), jnp.einsum("bsd,bsn->dn", qx, qg)


_qdq_dense.defvjp(_qdq_dense_fwd, _qdq_dense_bwd)


def _bf16_dense(x, w):
  return jnp.einsum("bsd,dn->bsn", x, w)


def _qdq_lm_grad():
  """``jax.grad`` of the Q/DQ char LM's loss, and abstract params and tokens."""
  d, heads = H200_LM["d"], H200_LM["heads"]

  def norm(x):
    x = x.astype(jnp.float32)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return ((x - mean) * lax.rsqrt(var + 1e-5)).astype(jnp.bfloat16)

  def loss(params, tokens):
    x = params["embed"][tokens]
    b, s, _ = x.shape
    for i, p in enumerate(params["blocks"]):
      qkv = (_bf16_dense if i == 0 else _qdq_dense)(norm(x), p["qkv"])
      qkv = qkv.reshape(b, s, 3, heads, d // heads)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / 8.0
      scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
      probs = jax.nn.softmax(scores).astype(jnp.bfloat16)
      x = x + _qdq_dense(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d), p["out"])
      x = x + _qdq_dense(jax.nn.gelu(_qdq_dense(norm(x), p["up"])), p["down"])
    logits = _bf16_dense(norm(x), params["head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  def bf16(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  block = {"qkv": bf16(d, 3 * d), "out": bf16(d, d), "up": bf16(d, H200_LM["mlp"])}
  block["down"] = bf16(H200_LM["mlp"], d)
  params = {
    "embed": bf16(H200_LM["vocab"], d),
    "blocks": [block] * H200_LM["layers"],
    "head": bf16(d, H200_LM["vocab"]),
  }
  tokens = jax.ShapeDtypeStruct((H200_LM["batch"], H200_LM["seq"]), jnp.int32)
  return jax.grad(loss), params, tokens


def test_the_h200_run_that_lost_fp8_is_reproduced_without_a_gpu():
  # In the default set (two compiles of a small LM, ~12 s): CI runs it on both jax versions.
  from mpjax.audit import audit_jaxpr

  # What the H200 recorded: its mixed_fp8 step had no FP8 cuBLASLt call (75 GEMMs: 20
  # cuBLASLt, 55 Triton fusions), 14.3% of its GEMM FLOPs on the audit's fast path; what
  # mpjax predicted, compiled without a GPU in the cuBLASLt mode: 45 FP8 cuBLASLt calls.
  record = json.loads(H200_RUN.read_text())
  assert record["device"] == "NVIDIA H200"
  ran = record["variants"]["mixed_fp8 (delayed scaling)"]
  assert ran["calls"] == "cublas_lt 20, triton_gemm 55" and "f8" not in ran["calls"]
  assert ran["fast_path_share"] == pytest.approx(1 / 7)
  predicted = record["prediction"]["mixed_fp8 (delayed scaling)"]["predicted"]
  assert predicted["calls"] == {"cublas_lt": 30, "cublas_lt_f8": 45}

  grad, params, tokens = _qdq_lm_grad()
  jaxpr = jax.make_jaxpr(grad)(params, tokens)
  for mode, share in (("default", ran["fast_path_share"]), ("cublaslt", 1.0)):
    hlo = mpjax.compile_for(grad, params, tokens, target="h200", gemm_backend=mode).as_text()
    report = audit_jaxpr(jaxpr, platform="gpu", hlo_text=hlo)
    fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
    assert len(report.rows) == 75 and len(fp8_rows) == 45 and not report.compiled_only
    assert report.fast_path_share == pytest.approx(share)
    gemms = parse_compiled_gemms(hlo)
    f8_gemms = [g for g in gemms if "float8" in g.lhs_dtype]
    if mode == "default":  # as the H200 ran it: no FP8 GEMM, every planned one flagged
      assert "$f8" not in hlo and not f8_gemms and {g.kind for g in gemms} == {"triton_gemm"}
      assert all(_codes(r) == ["fp8-lost"] for r in fp8_rows)
      assert not [r for r in report.rows if r not in fp8_rows and r.flags]
    else:  # as mpjax predicted it
      assert len(f8_gemms) == 45 and {g.kind for g in f8_gemms} == {"cublas_lt_f8"}
      assert not report.flagged


# ----------------------------------------------------------------- accumulation, conv FLOPs


def _gpu_check():
  import importlib.util

  path = pathlib.Path(__file__).parent.parent / "scripts" / "gpu_check.py"
  spec = importlib.util.spec_from_file_location("gpu_check", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its Flax modules are dataclasses
  spec.loader.exec_module(module)
  return module


def _half_dot(x, w):
  return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=x.dtype)


@pytest.mark.parametrize(
  "gemm_backend, kind", [("default", "triton_gemm"), ("cublaslt", "cublas_lt")]
)
def test_a_bf16_gemm_compiled_for_h100_reads_f32_accumulation_in_every_instrument(
  gemm_backend, kind
):
  x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
  hlo = mpjax.compile_for(_half_dot, x, w, target="h100", gemm_backend=gemm_backend).as_text()
  (gemm,) = parse_compiled_gemms(hlo)  # (sizes that XLA does not split over K deviceless)
  # bf16 x bf16 -> bf16: the result is bf16, the accumulation (read from the call) is f32.
  assert (gemm.kind, gemm.out_dtype, gemm.accumulation) == (kind, "bfloat16", "f32")
  kernels = mpjax.kernel_report(_half_dot, x, w, target="h100", gemm_backend=gemm_backend)
  assert [(k.call, k.accumulation) for k in kernels.kernels if k.call] == [(kind, "f32")]
  assert kernels.to_dict()["accumulation"] == {"f32": 1}
  report = mpjax.audit(_half_dot, x, w, target="h100", gemm_backend=gemm_backend)
  assert report.rows[0].accumulation == "f32" and report.fast_path_share == 1.0
  check = _gpu_check().accumulation_check(hlo)
  assert check == {
    "f32_accumulation": "yes",
    "gemms": 1,
    "by_dtype": {"f32": 1},
    "not_f32": [],
    "unknown": [],
  }


def test_a_gemm_whose_program_says_f16_or_nothing_is_not_counted_as_f32_accumulation():
  x = jax.ShapeDtypeStruct((256, 512), jnp.float16)
  w = jax.ShapeDtypeStruct((512, 1024), jnp.float16)
  jaxpr = jax.make_jaxpr(_half_dot)(x, w)
  gpu_check = _gpu_check()
  # The cuBLASLt call as compiled for H100, hand-edited to an f16-accumulating algorithm.
  lt = mpjax.compile_for(_half_dot, x, w, target="h100", gemm_backend="cublaslt").as_text()
  assert lt.count('"algorithm":"ALG_UNSET"') == 1  # the premise: the call's own algorithm
  edited = lt.replace('"algorithm":"ALG_UNSET"', '"algorithm":"ALG_DOT_F16_F16_F16"')
  assert [g.accumulation for g in parse_compiled_gemms(edited)] == ["f16"]
  kernels = mpjax.kernels.report_from_hlo(edited, "h100", gemm_backend="cublaslt")
  assert kernels.to_dict()["accumulation"] == {"f16": 1}
  assert gpu_check.accumulation_check(edited)["f32_accumulation"] == "NO"
  (row,) = audit_jaxpr(jaxpr, platform="gpu", hlo_text=edited).rows
  assert _codes(row) == ["low-precision-accumulation"] and not row.fast
  # A bf16 convolution compiled for H100: a cuDNN call writing bf16, whose accumulation is
  # cuDNN's choice, not in the program.
  conv, conv_args, _ = _convs((32, 64))
  hlo = mpjax.compile_for(conv, *conv_args, target="h100").as_text()
  (gemm,) = parse_compiled_gemms(hlo)
  assert (gemm.kind, gemm.out_dtype, gemm.accumulation) == ("cudnn", "bfloat16", "unknown")
  assert gpu_check.accumulation_check(hlo)["f32_accumulation"] == "unknown"
  kernels = mpjax.kernels.report_from_hlo(hlo, "h100")
  assert kernels.to_dict()["accumulation"] == {"unknown": 1}
  report = audit_jaxpr(jax.make_jaxpr(conv)(*conv_args), platform="gpu", hlo_text=hlo)
  (row,) = report.rows
  assert row.accumulation == "unknown" and not row.flags and not row.fast
  assert report.fast_path_share == 0.0 and report.accumulation_unknown == (row,)
  assert report.to_dict()["accumulation_unknown"] == 1
  text = str(report)
  assert "Accumulation: not known for 1 half-precision GEMMs" in text
  assert "does not count them as accumulating in f32" in text


def _convs(channels, *, grad=False):
  """3x3 'SAME' NHWC convolutions through ``channels`` (bf16), and their hand-counted FLOPs."""
  n, h, w = 8, 32, 32
  x = jax.ShapeDtypeStruct((n, h, w, channels[0]), jnp.bfloat16)
  kernels = [
    jax.ShapeDtypeStruct((3, 3, c_in, c_out), jnp.bfloat16)
    for c_in, c_out in zip(channels, channels[1:], strict=False)
  ]

  def f(x, *ks):
    for k in ks:
      x = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return x.astype(jnp.float32).sum() if grad else x

  # Each: 2 x output elements x (3 x 3 taps x input channels).
  forward = [
    2 * n * h * w * c_out * (3 * 3 * c_in)
    for c_in, c_out in zip(channels, channels[1:], strict=False)
  ]
  return f, (x, *kernels), forward


@pytest.mark.parametrize("channels", [(32, 64, 128), (64, 64)])
def test_the_kernel_report_counts_convolution_flops_whatever_the_filter_layout(channels):
  f, args, forward = _convs(channels)
  report = mpjax.kernel_report(f, *args, target="h100")
  convs = [k for k in report.kernels if k.kind == "conv"]
  assert len(convs) == len(channels) - 1 and {k.call for k in convs} == {"cudnn"}
  assert [k.flops for k in convs] == forward
  # 32 -> 64 -> 128: 2 * 8 * 32 * 32 * (64 * 9 * 32 + 128 * 9 * 64) = 1.51 GFLOP.
  assert report.flops == sum(forward)
  # The gradients w.r.t. the image and every filter: each convolution's cuDNN backward-input
  # and backward-filter calls (forward labels, other operands) cost its forward FLOPs each;
  # of the forward convolutions only those whose output a gradient needs are computed.
  g, args, forward = _convs(channels, grad=True)
  grads = mpjax.kernel_report(jax.grad(g, argnums=tuple(range(len(args)))), *args, target="h100")
  assert grads.by_kind["conv"] == 3 * len(forward) - 1
  assert grads.flops == 2 * sum(forward) + sum(forward[:-1])


def _conv_f32_result(x, k):
  """A bf16 3x3 'SAME' convolution accumulated into an f32 result (preferred_element_type)."""
  dims = ("NHWC", "HWIO", "NHWC")
  return lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=dims, preferred_element_type=jnp.float32
  )


@pytest.mark.parametrize("gemm_backend", ["default", "cublaslt"])
def test_a_bf16_conv_compiled_as_f32_for_h100_is_flagged_and_a_bf16_dense_gemm_is_not(
  gemm_backend,
):
  # digits_cnn's first convolution (8 -> 32 channels), and a bf16 x bf16 -> f32 dense GEMM.
  x = jax.ShapeDtypeStruct((64, 8, 8, 8), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((3, 3, 8, 32), jnp.bfloat16)
  a = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)

  def f(x, k, a, w):
    return _conv_f32_result(x, k), lax.dot(a, w, preferred_element_type=jnp.float32)

  report = mpjax.audit(f, x, k, a, w, target="h100", gemm_backend=gemm_backend)
  conv, dense = report.rows
  # Planned bf16 x bf16 -> f32; XLA:GPU hands cuDNN f32 operands (the premise).
  assert conv.dtypes == "bf16 x bf16 -> f32" and conv.compiled_dtypes == "f32 x f32 -> f32"
  assert conv.call == "__cudnn$convForward" and _codes(conv) == ["half-lost"] and not conv.fast
  reason = conv.flags[0].reason
  assert reason.startswith("planned in bf16, compiled as f32 x f32 (__cudnn$convForward)")
  assert "let the convolution write bf16" in reason
  assert dense.compiled_dtypes.startswith("bf16 x bf16") and not dense.flags and dense.fast
  assert report.half_lost == (conv,) and report.to_dict()["half_lost"] == 1
  assert report.fast_path_share == pytest.approx(dense.flops / (conv.flops + dense.flops))
  text = str(report)
  assert "Half precision lost: 1 GEMMs planned with f16/bf16 operands" in text
  assert "1 flagged, 1 compiled wider than planned" in text


def test_autocast_bf16_convolutions_compile_bf16_for_h100_forward_and_backward():
  conv = nn.Sequential([nn.Conv(32, (3, 3)), nn.relu, nn.Conv(64, (3, 3))])
  x = jax.ShapeDtypeStruct((64, 8, 8, 8), jnp.float32)
  params = jax.eval_shape(conv.init, jax.random.key(0), x)

  def loss(p, x):
    return jnp.mean(conv.apply(p, x).astype(jnp.float32) ** 2)

  grad = jax.grad(mpjax.autocast(loss, "mixed_bf16"), argnums=(0, 1))
  report = mpjax.audit(grad, params, x, target="h100")
  convs = [r for r in report.rows if r.op == "conv_general_dilated"]
  # Forward 2, the kernels' gradients 2, the image's gradients 2 (x is differentiated too),
  # each a cuDNN call multiplying bf16 x bf16 as planned (it was f32 x f32).
  assert len(convs) == 6 and not report.compiled_only
  assert {(r.call_kind, r.compiled_dtypes) for r in convs} == {("cudnn", "bf16 x bf16 -> bf16")}
  assert not report.half_lost and not report.flagged
  # The gradients keep their operands' dtypes: f32 for the f32 kernels and image.
  shapes = jax.eval_shape(grad, params, x)
  assert {a.dtype for a in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.float32)}
