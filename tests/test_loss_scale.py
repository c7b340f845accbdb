import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax


def _run(ls, flags):
  """Applies ``adjust`` for each flag inside one jitted scan, as a training loop would."""

  @jax.jit
  def run(ls, flags):
    def body(ls, finite):
      ls = ls.adjust(finite)
      return ls, ls.loss_scale

    return jax.lax.scan(body, ls, flags)

  return run(ls, jnp.asarray(flags))


def test_scale_is_f32_whatever_it_was_given():
  for value in (jnp.float16(1024), np.float64(1024), 1024, jnp.bfloat16(1024)):
    chex.assert_type(mpjax.StaticLossScale(value).loss_scale, jnp.float32)
    if isinstance(value, int):  # warns as jmp does: tests/test_jmp_upstream.py
      continue
    chex.assert_type(mpjax.DynamicLossScale(value).loss_scale, jnp.float32)
  chex.assert_type(mpjax.NoOpLossScale().loss_scale, jnp.float32)
  ls = mpjax.DynamicLossScale(jnp.float16(1024)).adjust(False)  # jmp#47
  chex.assert_type(ls.loss_scale, jnp.float32)
  assert float(ls.loss_scale) == 512.0


@pytest.mark.parametrize("ls", [mpjax.StaticLossScale(2.0**10), mpjax.DynamicLossScale(2.0**10)])
def test_scale_unscale_round_trip_in_f32(ls):
  tree = {
    "g": jnp.full((3,), 0.5, jnp.float16),
    "b": jnp.full((2,), 3.0, jnp.bfloat16),
    "n": jnp.arange(3),
  }
  scaled = jax.jit(ls.scale)(tree)
  chex.assert_type(scaled["g"], jnp.float32)
  np.testing.assert_array_equal(scaled["g"], 0.5 * float(ls.loss_scale))
  unscaled = jax.jit(ls.unscale)(scaled)
  chex.assert_type([unscaled["g"], unscaled["b"]], jnp.float32)
  np.testing.assert_array_equal(unscaled["g"], 0.5)
  np.testing.assert_array_equal(unscaled["b"], 3.0)
  assert unscaled["n"].dtype == jnp.int32


def test_static_and_noop_never_move():
  for ls in (mpjax.StaticLossScale(8.0), mpjax.NoOpLossScale()):
    final, scales = _run(ls, [False, True, False])
    np.testing.assert_array_equal(scales, float(ls.loss_scale))


def test_growth_after_period_finite_steps():
  final, scales = _run(mpjax.DynamicLossScale(4.0, period=3), [True] * 7)
  np.testing.assert_array_equal(scales, [4, 4, 8, 8, 8, 16, 16])
  assert int(final.counter) == 1


def test_overflow_resets_the_count_and_divides():
  final, scales = _run(
    mpjax.DynamicLossScale(64.0, period=3), [True, True, False, True, True, True]
  )
  np.testing.assert_array_equal(scales, [64, 64, 32, 32, 32, 64])


def test_growth_caps_at_max_and_never_reaches_inf():
  final, scales = _run(
    mpjax.DynamicLossScale(2.0**14, period=1, max_loss_scale=2.0**16), [True] * 5
  )
  np.testing.assert_array_equal(scales, [2**15, 2**16, 2**16, 2**16, 2**16])
  f32_max = float(np.finfo(np.float32).max)
  final, scales = _run(
    mpjax.DynamicLossScale(2.0**120, period=1, max_loss_scale=f32_max), [True] * 20
  )
  assert np.all(np.isfinite(scales)) and float(scales[-1]) == f32_max


def test_hysteresis_waits_for_consecutive_overflows():
  ls = mpjax.DynamicLossScale(64.0, period=100, hysteresis=2)
  final, scales = _run(ls, [False, True, False, False, False, True, False])
  # One overflow waits; a finite step resets the run; the second consecutive one
  # halves, and so does each further one of the run.
  np.testing.assert_array_equal(scales, [64, 64, 64, 32, 16, 16, 16])


def test_min_loss_scale_holds_after_many_jitted_overflows():
  ls = mpjax.DynamicLossScale(2.0**15, min_loss_scale=4.0)
  final, scales = _run(ls, [False] * 50)
  assert float(scales.min()) == 4.0 and float(final.loss_scale) == 4.0
  assert final.min_loss_scale == 4.0
  # And across separate jitted calls, where jmp's flatten used to drop the floor.
  step = jax.jit(lambda ls: ls.adjust(jnp.array(False)))
  for _ in range(20):
    ls = step(ls)
  assert float(ls.loss_scale) == 4.0 and ls.min_loss_scale == 4.0


def test_adjust_under_vmap():
  ls = mpjax.DynamicLossScale(16.0, period=1)
  batched = jax.tree.map(lambda x: jnp.stack([x] * 3), ls)
  out = jax.vmap(lambda ls, f: ls.adjust(f))(batched, jnp.array([True, False, True]))
  np.testing.assert_array_equal(out.loss_scale, [32, 8, 32])
  assert out.period == 1


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"factor": 1}, "factor=1 must be > 1"),
    ({"factor": 0.5}, "factor"),
    ({"period": 0}, "period=0 must be an integer >= 1"),
    ({"period": 2.5}, "period"),
    ({"hysteresis": 0}, "hysteresis"),
    ({"min_loss_scale": 8.0, "max_loss_scale": 4.0, "loss_scale": 4.0}, "min_loss_scale=8.0 >"),
    ({"min_loss_scale": 0.0}, "positive"),
    ({"max_loss_scale": float("inf")}, "finite"),
    ({"loss_scale": 2.0**30}, "outside"),
  ],
)
def test_bad_dynamic_hyperparameters_fail_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mpjax.DynamicLossScale(**kwargs)


def test_bad_static_scale():
  with pytest.raises(ValueError, match="positive and finite"):
    mpjax.StaticLossScale(0.0)


def test_all_finite():
  tree = {"a": jnp.ones(3, jnp.float16), "i": jnp.arange(3), "k": jax.random.key(0)}
  assert bool(jax.jit(mpjax.all_finite)(tree))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    poisoned = dict(tree, b=jnp.array([1.0, bad], jnp.bfloat16))
    assert not bool(jax.jit(mpjax.all_finite)(poisoned))
  assert bool(mpjax.all_finite({}))


def test_select_tree():
  on_true, on_false = {"w": jnp.ones(2), "n": jnp.array(1)}, {"w": jnp.zeros(2), "n": jnp.array(2)}
  out = jax.jit(mpjax.select_tree)(jnp.array(True), on_true, on_false)
  chex.assert_trees_all_equal(out, on_true)
  out = jax.jit(mpjax.select_tree)(jnp.array(False), on_true, on_false)
  chex.assert_trees_all_equal(out, on_false)
  with pytest.raises(ValueError, match="differ in structure"):
    mpjax.select_tree(jnp.array(True), on_true, {"w": jnp.zeros(2)})
  with pytest.raises(ValueError, match="scalar bool"):
    mpjax.select_tree(jnp.array([True, False]), on_true, on_false)


# --- jmp drop-in: jmp's own test cases, in our words --------------------------------------------


def test_dynamic_loss_scale_takes_jmp_positional_arguments_and_a_whole_float_period():
  ls = mpjax.DynamicLossScale(jnp.float32(2.0**10), jnp.int32(3), 100.0, 4.0, 2.0)
  assert (ls.period, ls.factor, ls.min_loss_scale) == (100, 4.0, 2.0)
  assert isinstance(ls.period, int) and int(ls.counter) == 3
  chex.assert_type(ls.loss_scale, jnp.float32)
  # The floor survives jit (jmp loses it): shrinking from 4.0 stops at 2.0.
  small = mpjax.DynamicLossScale(4.0, 0, 10, 4.0, 2.0)
  shrunk = jax.jit(lambda s: s.adjust(False))(small)
  assert float(shrunk.loss_scale) == 2.0 and shrunk.min_loss_scale == 2.0
  with pytest.raises(ValueError, match="period=100.5 must be an integer"):
    mpjax.DynamicLossScale(2.0, 0, 100.5)


def test_no_op_loss_scale_returns_the_tree_itself():
  tree = {"g": jnp.ones(3, jnp.bfloat16), "n": jnp.arange(2)}
  ls = mpjax.NoOpLossScale()
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree
