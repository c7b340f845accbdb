import dataclasses
import logging

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpjax
from mpjax import policy as policy_module

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


@pytest.mark.parametrize(
  "spec, expected",
  [
    ("fp32", (F32, F32, F32)),
    ("mixed_bf16", (F32, BF16, F32)),
    ("mixed_fp16", (F32, F16, F32)),
    ("pure_bf16", (BF16, BF16, BF16)),
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16", (F32, BF16, BF16)),  # jmp: output follows compute
    ("c=f16", (F32, F16, F16)),
    ("p=f16,c=f16", (F16, F16, F16)),
    (" P = F32 , C = BF16 , O = F32 ", (F32, BF16, F32)),
    ("half", (F16, F16, F16)),  # jmp's half on a CPU/GPU
    ("full", (F32, F32, F32)),
    ("bf16", (BF16, BF16, BF16)),
  ],
)
def test_get_policy_grammar(spec, expected):
  policy = mpjax.get_policy(spec)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == tuple(
    np.dtype(d) for d in expected
  )


def test_get_policy_accepts_jmp_and_mpjax_policies():
  policy = mpjax.get_policy(jmp.get_policy("p=f32,c=bf16,o=f32"))
  assert policy == mpjax.get_policy("mixed_bf16")
  assert mpjax.get_policy(policy) is policy


def test_policy_is_hashable_static_and_prints_readably():
  a = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  b = mpjax.Policy(np.float32, "bfloat16", np.dtype("float32"))
  assert a == b and hash(a) == hash(b)
  assert repr(a) == "Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)"
  assert str(mpjax.get_policy("mixed_fp16")) == "p=full,c=f16,o=full"  # jmp's form
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.compute_dtype = jnp.float16
  assert a.with_output_dtype(jnp.bfloat16).output_dtype == jnp.bfloat16


def test_policy_rejects_non_floating_dtype():
  with pytest.raises(ValueError, match="not a floating dtype"):
    mpjax.Policy(jnp.float32, jnp.int8, jnp.float32)


def test_casts_only_half_and_single_float_leaves():
  policy = mpjax.get_policy("mixed_bf16")
  tree = {
    "w": jnp.ones((2,), jnp.float32),
    "h": jnp.ones((2,), jnp.float16),
    "np": np.ones((2,), np.float32),
    "label": jnp.arange(3),
    "mask": jnp.array([True, False]),
    "key": jax.random.key(0),
    "raw_key": jax.random.PRNGKey(0),
    "f64": np.ones((2,), np.float64),
    "scalar": 1.5,
  }

  @jax.jit
  def cast(tree):
    return policy.cast_to_compute(tree), policy.cast_to_param(tree), policy.cast_to_output(tree)

  compute, param, output = cast(tree)
  for name in ("w", "h", "np"):
    chex.assert_type(compute[name], jnp.bfloat16)
    chex.assert_type(param[name], jnp.float32)
    chex.assert_type(output[name], jnp.float32)
  assert compute["label"].dtype == jnp.int32
  assert compute["mask"].dtype == jnp.bool_
  assert jax.dtypes.issubdtype(compute["key"].dtype, jax.dtypes.prng_key)
  assert compute["raw_key"].dtype == jnp.uint32
  # With x64 off a numpy float64 leaf is f32 to JAX, and cast as f32 is, in or out of jit.
  assert policy.cast_to_compute(tree)["f64"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "typo, nearest", [("mixed_bf61", "mixed_bf16"), ("fp_32", "fp32"), ("mixd_fp16", "mixed_fp16")]
)
def test_unreadable_spec_names_forms_and_nearest_preset(typo, nearest):
  with pytest.raises(ValueError) as info:
    mpjax.get_policy(typo)
  message = str(info.value)
  assert f"Nearest preset: {nearest!r}" in message
  assert "p=f32,c=bf16" in message and "jmp.Policy" in message


def test_unreadable_spec_kinds():
  with pytest.raises(ValueError, match="Unknown dtype 'f8'"):
    mpjax.get_policy("p=f32,c=f8")
  with pytest.raises(ValueError, match="'params='"):
    mpjax.get_policy("weights=f32")
  with pytest.raises(ValueError, match="not a policy spec"):
    mpjax.get_policy(3)


def test_auto_on_cpu_follows_bf16_dot_instructions(monkeypatch):
  monkeypatch.setattr(policy_module, "cpu_has_native_bf16_dot", lambda: True)
  assert mpjax.get_policy("auto") == mpjax.get_policy("mixed_bf16")
  monkeypatch.setattr(policy_module, "cpu_has_native_bf16_dot", lambda: False)
  assert mpjax.get_policy("auto") == mpjax.get_policy("fp32")


@pytest.mark.parametrize(
  "capability, expected",
  [("9.0", "mixed_bf16"), ("8.0", "mixed_bf16"), ("7.0", "mixed_fp16"), ("6.1", "fp32")],
)
def test_auto_on_gpu_follows_compute_capability(monkeypatch, capability, expected):
  class FakeGpu:
    platform = "gpu"
    compute_capability = capability

  monkeypatch.setattr(policy_module.jax, "devices", lambda: [FakeGpu()])
  assert mpjax.get_policy("auto") == mpjax.get_policy(expected)


def test_env_var_overrides_every_spec_and_logs_once(monkeypatch, caplog):
  policy_module._log_override_once.cache_clear()
  monkeypatch.setenv("MPJAX_POLICY", "mixed_fp16")
  with caplog.at_level(logging.WARNING, logger="mpjax"):
    assert mpjax.get_policy("fp32") == mpjax.get_policy("mixed_fp16")
    assert mpjax.get_policy(mpjax.get_policy("pure_bf16")).compute_dtype == jnp.float16
  records = [r for r in caplog.records if "MPJAX_POLICY" in r.getMessage()]
  assert len(records) == 1
  assert "c=f16" in records[0].getMessage() and "preset 'mixed_fp16'" in records[0].getMessage()


def test_env_var_with_typo_names_the_variable(monkeypatch):
  monkeypatch.setenv("MPJAX_POLICY", "mixed_bf61")
  with pytest.raises(ValueError, match="Environment variable MPJAX_POLICY.*Nearest preset"):
    mpjax.get_policy("fp32")


# --- jmp drop-in ---------------------------------------------------------------------------------


def test_jmp_half_helpers():
  assert mpjax.half_dtype() == jnp.float16  # jmp's half: bf16 on TPU, fp16 elsewhere (CPU here)
  tree = {"w": jnp.ones(2), "b": jnp.ones(2, jnp.bfloat16), "i": jnp.arange(2)}
  half = mpjax.cast_to_half(tree)
  assert (half["w"].dtype, half["b"].dtype, half["i"].dtype) == (jnp.float16,) * 2 + (jnp.int32,)
  full = mpjax.cast_to_full(half)
  assert (full["w"].dtype, full["b"].dtype, full["i"].dtype) == (jnp.float32,) * 2 + (jnp.int32,)


def test_a_numpy_float64_batch_is_cast_like_f32_unless_x64_is_on():
  batch = {"x": np.random.default_rng(0).standard_normal((4, 3)), "y": np.arange(4)}
  assert batch["x"].dtype == np.float64  # the premise: numpy's default
  policy = mpjax.get_policy("mixed_bf16")
  cast = policy.cast_to_compute(batch)
  assert cast["x"].dtype == jnp.bfloat16 and cast["y"].dtype == batch["y"].dtype
  jax.config.update("jax_enable_x64", True)
  try:
    assert policy.cast_to_compute(batch)["x"].dtype == np.float64  # x64 on: float64 is asked for
  finally:
    jax.config.update("jax_enable_x64", False)


def test_str_of_an_fp8_policy_is_refused_with_the_fix():
  with pytest.raises(ValueError, match="'fp8=' key .* does not read back; use the 'mixed_fp8'"):
    mpjax.get_policy(str(mpjax.get_policy("mixed_fp8")))


def test_unknown_key_and_accepted_forms_name_the_storage_keys():
  with pytest.raises(ValueError) as info:
    mpjax.get_policy("p=f32,moments=bf16")
  message = str(info.value)
  assert (
    "not 'params=', 'compute=', 'output=', 'opt=', 'opt_state_dtype=', 'rounding=', 'reduce=' "
    "or 'gather='" in message
  )
  assert "opt=bf16,rounding=stochastic" in message and "reduce=f32" in message


@pytest.mark.parametrize(
  "spec, reduce, gather",
  [
    ("p=f32,c=bf16,o=f32,reduce=f32", jnp.float32, None),
    ("p=f32,c=bf16,reduce_dtype=bf16,gather=bf16", jnp.bfloat16, jnp.bfloat16),
    ("p=f32,c=f16,gather_dtype=f32", None, jnp.float32),
  ],
)
def test_reduce_and_gather_dtypes_read_from_jmps_grammar_and_print_back(spec, reduce, gather):
  policy = mpjax.get_policy(spec)
  assert policy.reduce_dtype == (None if reduce is None else np.dtype(reduce))
  assert policy.gather_dtype == (None if gather is None else np.dtype(gather))
  assert mpjax.get_policy(str(policy)) == policy and hash(mpjax.get_policy(str(policy)))
  assert mpjax.get_policy("mixed_bf16").reduce_dtype is None  # the presets leave them to XLA


def test_a_reduce_or_gather_dtype_other_than_f32_or_the_compute_dtype_is_refused():
  with pytest.raises(ValueError, match=r"reduce_dtype=float16: .* use reduce_dtype=jnp.float32"):
    mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, reduce_dtype=jnp.float16)
  with pytest.raises(ValueError, match="gather_dtype=bfloat16"):
    mpjax.get_policy("p=f32,c=f16,gather=bf16")


def test_a_float64_opt_state_dtype_is_refused_for_its_own_reason():
  with pytest.raises(ValueError, match="opt_state_dtype=float64") as info:
    mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, opt_state_dtype=jnp.float64)
  assert "fp16" not in str(info.value) and "computes in float32" in str(info.value)
