"""Which backend mpjax lowers for: where the computation is placed, not the machine's default."""

import importlib.metadata

import jax
import jax.numpy as jnp
import optax
import pytest

import mpjax
from mpjax.audit import parse_compiled_gemms

CPU = jax.devices("cpu")[0]
FP8 = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(keep_bf16=()))


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"]).astype(jnp.float32) ** 2)


def _state(policy="mixed_fp16"):
  params = {"w": jax.random.normal(jax.random.key(0), (16, 8))}
  return mpjax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), policy=policy)


BATCH = {"x": jax.random.normal(jax.random.key(1), (4, 16))}


@pytest.fixture
def gpu_host(monkeypatch):
  """JAX's default backend is a GPU, as on a GPU machine; the CPU is still there."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _f8_dots(stablehlo: str) -> list[str]:
  return [line for line in stablehlo.splitlines() if "dot_general" in line and "xf8E" in line]


def test_a_step_on_arguments_committed_to_the_cpu_skips_with_the_cpu_conditional(gpu_host):
  # XLA:CPU skips a non-finite step with a conditional; XLA:GPU selects leaf by leaf.
  state, batch = jax.device_put((_state(), BATCH), CPU)
  step = jax.jit(mpjax.make_train_step(loss_fn))
  hlo = step.lower(state, batch).compile().as_text()
  assert "conditional(" in hlo
  new_state, metrics = step(state, batch)
  assert bool(metrics["grads_finite"]) and int(new_state.step) == 1


def test_fp8_under_the_cpu_default_device_gets_the_cpu_gemm(gpu_host):
  # XLA:CPU has no FP8 GEMM: mpjax widens the FP8 operands to bf16 there.
  forward = jax.jit(mpjax.autocast(lambda w, x: x @ w, FP8))
  w, x = _state().params["w"], BATCH["x"]
  with jax.default_device(CPU):
    lowered = forward.lower(w, x).as_text()  # XLA:CPU would widen an FP8 dot by itself
    assert forward(w, x).shape == (4, 8)  # and it runs
  assert not _f8_dots(lowered) and "dot_general" in lowered


def test_a_step_compiled_for_h100_here_gets_the_gpu_program():
  try:
    importlib.metadata.version("jax-cuda12-pjrt")
  except importlib.metadata.PackageNotFoundError:
    try:
      importlib.metadata.version("jax-cuda13-pjrt")
    except importlib.metadata.PackageNotFoundError:
      pytest.skip("needs XLA's CUDA compiler plugin (jax-cuda12-pjrt or -cuda13-pjrt)")
  step = jax.jit(mpjax.make_train_step(loss_fn, skip_nonfinite=True))
  hlo = mpjax.compile_for(step, _state(FP8), BATCH, target="h100").as_text()
  assert "conditional(" not in hlo  # the update selected leaf by leaf, not skipped by a branch
  gemms = parse_compiled_gemms(hlo)  # and the forward GEMM stays FP8 (a CPU widens it to bf16)
  assert ("float8_e4m3fn", "float8_e4m3fn") in {(g.lhs_dtype, g.rhs_dtype) for g in gemms}
