"""GPU programs compiled on the CPU for H100 (and other targets), read and held to targets."""

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import mpjax
import mpjax.gpu
from mpjax import cli
from mpjax import experiment as ex
from mpjax.audit import parse_compiled_gemms

try:
  importlib.metadata.version(mpjax.gpu.PLUGIN)
except importlib.metadata.PackageNotFoundError:
  pytest.skip(
    'needs XLA\'s CUDA compiler plugin: pip install -e ".[gpu-aot]"', allow_module_level=True
  )


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
    out[name] = mpjax.kernel_report(step, state, batch, target="h100")
  return out


@pytest.mark.parametrize("target", sorted(mpjax.TARGETS))
def test_every_target_compiles_a_bf16_gemm_to_cublaslt(target):
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
  for backend, kind in (("cublaslt", "cublas_lt"), ("triton", "triton_gemm")):
    hlo = mpjax.compile_for(jnp.dot, x, w, target=target, gemm_backend=backend).as_text()
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
  gemms = parse_compiled_gemms(mpjax.compile_for(step, state, batch, target="h100").as_text())
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
    RuntimeError, match=f"pip install --no-deps jax-cuda12-pjrt=={jaxlib.__version__}"
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


@pytest.mark.parametrize("gemm_backend", ["cublaslt", "triton"])
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
  kinds = {r.call_kind for r in report.rows}
  fp8 = mpjax.get_policy(config.policy).fp8 is not None
  if gemm_backend == "triton":
    assert kinds <= {"triton_gemm", "cudnn"}
  else:
    assert kinds <= {"cublas_lt", "cudnn"} | ({"cublas_lt_f8"} if fp8 else set())
  if fp8 and gemm_backend == "cublaslt":  # every GEMM the recipe puts in FP8 is an FP8 call
    fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
    assert fp8_rows and {r.call_kind for r in fp8_rows} == {"cublas_lt_f8"}
    assert "FP8 cuBLASLt calls" in report.to_markdown()
  if mpjax.get_policy(config.policy).is_mixed and not (fp8 and gemm_backend == "triton"):
    assert report.fast_path_share == 1.0, [(r.path, [f.code for f in r.flags]) for r in report.rows]


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


def test_doctor_for_h100_prints_the_audit_and_the_kernel_report():
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "mpjax.cli",
      "doctor",
      "digits_mlp",
      "--target",
      "h100",
      "--compare",
      "fp32,mixed_bf16",
    ],
    cwd=pathlib.Path(__file__).parent.parent,
    env={k: v for k, v in os.environ.items() if k != mpjax.POLICY_ENV_VAR},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "on h100 (compiled here, no GPU needed)" in out and "__cublas$lt$matmul" in out
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
  assert "**mlp on h100**" in result.stdout and "| plain fp32 | " in result.stdout
  record = json.loads(out.read_text())
  results = record["results"]["mlp"]
  assert {"plain fp32", "mpjax mixed_bf16 autocast", "flax dtype=bf16", "jmp cast"} <= set(results)
  assert results["plain fp32"]["kernels"] > 0 and results["plain fp32"]["gemm_flops"] > 0


@pytest.fixture(scope="module")
def fp8_lm():
  step, state, batch = _lm_step("mixed_fp8")
  return step, mpjax.init_fp8_state(step, state, batch), batch


def test_every_fp8_gemm_of_an_lm_step_is_an_fp8_cublaslt_call_on_h100(fp8_lm):
  step, state, batch = fp8_lm
  # 2 blocks x (qkv, out, up, down) + the head; the first (qkv of block 0) and
  # the last (the head) stay bf16 by default.
  assert state.fp8.gemms == 7
  report = mpjax.audit(step, state, batch, target="h100")
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
  kernels = mpjax.kernel_report(step, state, batch, target="h100")
  assert kernels.calls["cublas_lt_f8"] == 3 * state.fp8.gemms
  assert {k.peak_dtype for k in kernels.kernels if k.call == "cublas_lt_f8"} <= {
    "float8_e4m3fn",
    "float8_e5m2",
  }


def test_fp8_gemms_on_a_gpu_without_fp8_tensor_cores_are_flagged(fp8_lm):
  step, state, batch = fp8_lm
  report = mpjax.audit(step, state, batch, target="a100")
  fp8_rows = [r for r in report.rows if "f8" in r.dtypes]
  assert fp8_rows and {r.call for r in fp8_rows} == {"__cublas$lt$matmul"}  # premise: no f8 call
  assert all("fp8-not-f8-call" in [f.code for f in r.flags] for r in fp8_rows)
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
