"""mpjax as a drop-in for jmp: jmp's own tests under ``import mpjax as jmp``, and jmp itself.

``tests/jmp_upstream/`` holds jmp 0.0.4's ``loss_scale_test.py`` and ``policy_test.py`` with the
import pointed at mpjax (its README says where they come from). Each of their 97 cases is one
test here; the few that fail are mpjax's deliberate differences, each named in ``DELIBERATE``
with its reason and the failure expected, and reported as xfailed. A deliberate case that
passes, or fails another way, fails here, and so does a case missing from the 97.
"""

import importlib.util
import itertools
import pathlib
import unittest
import warnings

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from jmp._src import policy as jmp_policy

import mpjax

UPSTREAM = pathlib.Path(__file__).parent / "jmp_upstream"
UPSTREAM_CASES = 97
MIN_PASSING = 93

# Upstream case -> (why mpjax differs on purpose, text its failure must contain). Also in
# docs/train_step.md, "Where mpjax differs from jmp".
DELIBERATE = {
  "loss_scale_test::test_static_empty_trees_StaticLossScale": (
    "StaticLossScale(0) is refused (a zero scale turns every gradient into inf or NaN), and a "
    "StaticLossScale's scale is a leaf, so a traced scale works",
    "StaticLossScale(0) must be positive and finite",
  ),
  "loss_scale_test::test_dynamic_loss_scale_explicit_min_loss_scale2": (
    "min_loss_scale=0 is refused: the scale could reach zero, and every gradient inf or NaN",
    "min_loss_scale=0.0 must be positive and finite",
  ),
  "loss_scale_test::test_dynamic_loss_scale_tree": (
    "a DynamicLossScale has a third leaf, overflow_counter, for hysteresis",
    "Lists differ",
  ),
  "loss_scale_test::test_select_tree_rejects_non_scalar": (
    "select_tree raises a ValueError for a non-scalar predicate where jmp asserts "
    "(an assert vanishes under python -O)",
    "ValueError: select_tree: pred must be a scalar bool",
  ),
}


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"jmp_upstream_{name}", UPSTREAM / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _cases() -> dict[str, unittest.TestCase]:
  cases = {}
  for name in ("loss_scale_test", "policy_test"):
    suite = unittest.defaultTestLoader.loadTestsFromModule(_load(name))
    for case in itertools.chain.from_iterable(suite):
      cases[f"{name}::{case._testMethodName}"] = case
  return cases


CASES = _cases()


def _run(case: unittest.TestCase) -> unittest.TestResult:
  result = unittest.TestResult()
  with warnings.catch_warnings():
    # As jmp's tests run (unittest's "default"), not under pytest's "error"; upstream's own
    # `np.float32(10) / factor**100` overflows on purpose.
    warnings.simplefilter("default")
    warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)
    case.run(result)
  return result


@pytest.mark.parametrize("name", sorted(CASES))
def test_jmp_upstream_case(name):
  result = _run(CASES[name])
  if result.skipped:  # jmp's own: bf16 on a GPU, fp16 on a TPU
    pytest.skip(result.skipped[0][1])
  failures = [text for _, text in result.failures + result.errors]
  if name not in DELIBERATE:
    assert not failures, failures[0]
    return
  reason, expected = DELIBERATE[name]
  assert failures, f"{name} passes now: take it out of DELIBERATE and the docs ({reason})"
  assert expected in failures[0], f"{name} fails, but not as deliberate:\n{failures[0]}"
  pytest.xfail(reason)


def test_jmp_upstream_is_whole():
  assert len(CASES) == UPSTREAM_CASES
  assert set(DELIBERATE) <= set(CASES)
  assert UPSTREAM_CASES - len(DELIBERATE) >= MIN_PASSING


# --- against jmp itself -------------------------------------------------------------------------

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def test_str_is_jmps_and_get_policy_reads_it_back():
  for dtypes in itertools.product(_DTYPES, repeat=3):
    policy = mpjax.Policy(*dtypes)
    assert str(policy) == str(jmp.Policy(*dtypes))
    assert mpjax.get_policy(str(policy)) == policy
  assert str(mpjax.get_policy("mixed_bf16")) == "p=full,c=bf16,o=full"
  # What jmp has no key for is shown, not dropped: an FP8 policy is not mixed_bf16.
  fp8 = str(mpjax.get_policy("mixed_fp8"))
  assert fp8.startswith("p=full,c=bf16,o=full,fp8=Fp8Recipe(scaling='delayed'")
  assert repr(mpjax.get_policy("mixed_fp8")).startswith(
    "Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32, fp8=Fp8Recipe("
  )
  # Printing never raises, whatever floating dtype a policy holds (jmp's str raises).
  f8 = mpjax.Policy(jnp.float32, jnp.float8_e4m3fn, jnp.float32)
  assert str(f8) == "p=full,c=float8_e4m3fn,o=full"


def test_dtype_to_names_is_jmps_and_the_names_get_policy_reads():
  for key, names in jmp_policy.dtype_to_names.items():
    assert mpjax.dtype_to_names[key][: len(names)] == names
  for spelling in (np.float16, jnp.float16, np.dtype("float16"), "float16"):
    assert mpjax.dtype_to_names[spelling] == ("f16", "float16", "fp16")
  assert jnp.int8 not in mpjax.dtype_to_names and None not in mpjax.dtype_to_names
  for dtype, names in mpjax.dtype_to_names.items():
    for name in names:
      assert mpjax.get_policy(f"c={name}").compute_dtype == dtype
      assert mpjax.Policy(name, name, name).param_dtype == dtype


def test_unreadable_dtype_says_unknown_dtype_as_jmp_and_more():
  for spec in ("compute_float16", "c=f8"):
    with pytest.raises(ValueError, match="Unknown dtype") as info:
      mpjax.get_policy(spec)
    with pytest.raises(ValueError, match="Unknown dtype"):
      jmp.get_policy(spec)
    assert "Accepted forms" in str(info.value) and "Nearest preset" in str(info.value)
  with pytest.raises(ValueError, match="Unknown key 'weights'"):
    mpjax.get_policy("weights=f32")
  with pytest.raises(ValueError, match="compute_dtype='f17': Unknown dtype; .* 'bf16'"):
    mpjax.Policy("f32", "f17", "f32")
  # 'f16' is float16, as get_policy reads it, not numpy's 16-byte float128.
  assert mpjax.Policy("f16", "f16", "f16") == mpjax.get_policy("f16")
  with pytest.raises(ValueError, match="float128, which JAX does not compute in"):
    mpjax.Policy(np.float32, np.longdouble, np.float32)


@pytest.mark.parametrize("value", [1024, jnp.int32(1024), np.int64(1024), jnp.asarray(1024)])
def test_int_loss_scale_warns_as_jmp_and_is_f32(value):
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale") as jmp_warning:
    jmp.DynamicLossScale(value)
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale, got int") as w:
    ls = mpjax.DynamicLossScale(value, period=1)
  assert str(w[0].message).startswith(str(jmp_warning[0].message))
  assert w[0].filename == __file__  # points at the caller
  chex.assert_type(ls.loss_scale, jnp.float32)
  ls = jax.jit(lambda s: s.adjust(False).adjust(True).adjust(False))(ls)
  chex.assert_type(ls.loss_scale, jnp.float32)
  assert float(ls.loss_scale) == 512.0


def test_int_min_loss_scale_warns_as_jmp_and_survives_jit():
  floor = jnp.asarray(4, jnp.int32)
  with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
    jmp.DynamicLossScale(jnp.float32(8), min_loss_scale=floor)
  with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale, got int32"):
    ls = mpjax.DynamicLossScale(8.0, min_loss_scale=floor)
  assert ls.min_loss_scale == 4.0 and isinstance(ls.min_loss_scale, float)
  ls = jax.jit(lambda s: s.adjust(False).adjust(False))(ls)  # a static field: hashed
  assert float(ls.loss_scale) == 4.0 and ls.min_loss_scale == 4.0
  # A float floor given as an array (jmp's form) is taken without a warning.
  assert mpjax.DynamicLossScale(8.0, min_loss_scale=jnp.asarray(0.5)).min_loss_scale == 0.5
