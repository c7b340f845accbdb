"""Round trips of the loss-scale states and of TrainState: orbax, pickle, jit, flatten.

Every evolving value of a state must survive (bitwise, with its dtype), and so
must every hyperparameter, which lives in the static fields (the treedef), not
in the checkpoint: orbax restores the leaves into the abstract target's
structure, so the target must be built from a state with the same
hyperparameters.
"""

import dataclasses
import pickle

import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import mpjax

DYNAMIC_HYPERPARAMETERS = dict(
  period=7, factor=4, min_loss_scale=4.0, max_loss_scale=2.0**20, hysteresis=3
)


def _dynamic(*flags):
  ls = mpjax.DynamicLossScale(2.0**12, **DYNAMIC_HYPERPARAMETERS)
  for flag in flags:
    ls = ls.adjust(flag)
  return ls


# name -> (state, expected leaves: (loss_scale,) or (loss_scale, counter, overflow_counter)).
LOSS_SCALES = {
  "noop": (mpjax.NoOpLossScale(), None),
  "static": (mpjax.StaticLossScale(512.0), (512.0,)),
  # Three finite steps of a period of 7: counter 3, no growth yet.
  "dynamic_counting": (_dynamic(True, True, True), (2.0**12, 3, 0)),
  # Two non-finite steps, within hysteresis 3: scale kept, overflow_counter 2.
  "dynamic_overflowing": (_dynamic(True, False, False), (2.0**12, 0, 2)),
  # The third non-finite step shrinks by factor 4.
  "dynamic_shrunk": (_dynamic(False, False, False), (2.0**10, 0, 3)),
}


@pytest.fixture(params=sorted(LOSS_SCALES))
def loss_scale_case(request):
  ls, expected = LOSS_SCALES[request.param]
  return ls, expected


def _static_fields(obj):
  return {
    f.name: getattr(obj, f.name)
    for f in dataclasses.fields(obj)
    if not f.metadata.get("pytree_node", True)
  }


def assert_loss_scales_equal(restored, original):
  assert type(restored) is type(original)
  assert _static_fields(restored) == _static_fields(original)
  # strict: same dtypes and shapes too; the treedef carries the static fields.
  chex.assert_trees_all_equal(restored, original, strict=True)
  assert jax.tree.structure(restored) == jax.tree.structure(original)
  if isinstance(original, mpjax.StaticLossScale):
    assert restored.loss_scale.dtype == jnp.float32
  if isinstance(original, mpjax.DynamicLossScale):
    assert restored.loss_scale.dtype == jnp.float32
    assert restored.counter.dtype == jnp.int32
    assert restored.overflow_counter.dtype == jnp.int32


def test_cases_hold_what_they_claim(loss_scale_case):
  ls, expected = loss_scale_case
  if expected is None:
    assert jax.tree.leaves(ls) == []
  elif len(expected) == 1:
    assert float(ls.loss_scale) == expected[0]
  else:
    got = (float(ls.loss_scale), int(ls.counter), int(ls.overflow_counter))
    assert got == expected
    assert _static_fields(ls) == DYNAMIC_HYPERPARAMETERS


# ---- orbax ------------------------------------------------------------------------


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _orbax_round_trip(kind, tree, path, into=None):
  """Saves ``tree`` and restores it into the structure of ``into`` (default: ``tree``)."""
  into = tree if into is None else into
  if kind == "standard":
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, tree)
      ckptr.wait_until_finished()
      return ckptr.restore(path, _abstract(into))
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(path, tree)
    target = _abstract(into)
    return ckptr.restore(
      path,
      args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
      ),
    )


@pytest.mark.parametrize("kind", ["standard", "pytree"])
def test_orbax_round_trip_loss_scale(loss_scale_case, kind, tmp_path):
  ls, _ = loss_scale_case
  restored = _orbax_round_trip(kind, ls, tmp_path / "ckpt")
  assert_loss_scales_equal(restored, ls)


def test_orbax_restored_dynamic_loss_scale_keeps_evolving_the_same(tmp_path):
  ls = _dynamic(True, False, False)
  restored = _orbax_round_trip("standard", ls, tmp_path / "ckpt")
  for flags in [(False,), (True,) * 7, (False, False, False) * 3]:
    a, b = ls, restored
    for flag in flags:
      a, b = a.adjust(flag), b.adjust(flag)
    assert_loss_scales_equal(b, a)
  # 9 more non-finite steps from 4096, factor 4: floored at min_loss_scale=4.
  assert float(b.loss_scale) == 4.0


# ---- a TrainState after real steps --------------------------------------------------


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))


MODEL = MLP()


def _loss_fn(params, batch):
  pred = MODEL.apply(params, batch["x"]).astype(jnp.float32)
  return jnp.mean((pred - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def batches():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 4)).astype(np.float32)
  y = rng.normal(size=(16, 1)).astype(np.float32)
  x_bad = x.copy()
  x_bad[5, 2] = np.inf
  return {"clean": {"x": x, "y": y}, "bad": {"x": x_bad, "y": y}}


@pytest.fixture(scope="module")
def step_fn():
  # No donation: the original and the restored state both take the next step.
  return jax.jit(mpjax.make_train_step(_loss_fn))


@pytest.fixture
def trained_state(batches, step_fn):
  params = MODEL.init(jax.random.key(0), batches["clean"]["x"][:1])
  state = mpjax.TrainState.create(
    apply_fn=MODEL.apply,
    params=params,
    tx=optax.adam(1e-2),
    policy="mixed_fp16",
    loss_scale=mpjax.DynamicLossScale(2.0**10, period=5, min_loss_scale=2.0),
  )
  state, m1 = step_fn(state, batches["clean"])
  state, m2 = step_fn(state, batches["bad"])
  state, m3 = step_fn(state, batches["clean"])
  assert [bool(m["grads_finite"]) for m in (m1, m2, m3)] == [True, False, True]
  # Every counter is away from its initial value, so a dropped field shows.
  assert int(state.step) == 2
  assert int(state.skipped_steps) == 1
  assert float(state.loss_scale.loss_scale) == 2.0**9
  assert int(state.loss_scale.counter) == 1
  assert int(state.opt_state[0].count) == 2
  return state


def _train_state_static_fields(state):
  return (state.apply_fn, state.tx, state.policy)


@pytest.mark.parametrize("kind", ["standard", "pytree"])
def test_orbax_round_trip_train_state(trained_state, kind, tmp_path):
  # Restored into a fresh state (as a resumed run does), whose every counter differs.
  fresh = mpjax.TrainState.create(
    apply_fn=trained_state.apply_fn,
    params=jax.tree.map(jnp.zeros_like, trained_state.params),
    tx=trained_state.tx,
    policy="mixed_fp16",
    loss_scale=mpjax.DynamicLossScale(2.0**10, period=5, min_loss_scale=2.0),
  )
  assert int(fresh.step) != int(trained_state.step)  # the premise: a no-op restore would show
  assert float(fresh.loss_scale.loss_scale) != float(trained_state.loss_scale.loss_scale)
  restored = _orbax_round_trip(kind, trained_state, tmp_path / "ckpt", into=fresh)
  assert type(restored) is mpjax.TrainState
  assert _train_state_static_fields(restored) == _train_state_static_fields(trained_state)
  assert restored.policy == mpjax.get_policy("mixed_fp16")
  chex.assert_trees_all_equal(restored.step, trained_state.step, strict=True)
  chex.assert_trees_all_equal(restored.skipped_steps, trained_state.skipped_steps, strict=True)
  chex.assert_trees_all_equal(restored.params, trained_state.params, strict=True)
  chex.assert_trees_all_equal(restored.opt_state, trained_state.opt_state, strict=True)
  assert_loss_scales_equal(restored.loss_scale, trained_state.loss_scale)
  chex.assert_trees_all_equal(restored, trained_state, strict=True)
  assert restored.step.dtype == restored.skipped_steps.dtype == jnp.int32
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(restored.params))


@pytest.mark.parametrize("batch_kind", ["clean", "bad"])
def test_restored_train_state_steps_like_the_original(
  trained_state, batches, step_fn, batch_kind, tmp_path
):
  restored = _orbax_round_trip("standard", trained_state, tmp_path / "ckpt")
  expected_state, expected_metrics = step_fn(trained_state, batches[batch_kind])
  got_state, got_metrics = step_fn(restored, batches[batch_kind])
  assert bool(got_metrics["grads_finite"]) == (batch_kind == "clean")
  chex.assert_trees_all_equal(got_metrics, expected_metrics, strict=True)
  chex.assert_trees_all_equal(got_state, expected_state, strict=True)
  # The step really moved something, so equality is not the trivial kind.
  if batch_kind == "clean":
    assert int(got_state.step) == int(restored.step) + 1
    assert int(got_state.loss_scale.counter) == 2
  else:
    assert int(got_state.skipped_steps) == 2
    assert float(got_state.loss_scale.loss_scale) == 2.0**8
  assert jax.tree.structure(got_state) == jax.tree.structure(expected_state)


def test_flax_serialization_round_trip_train_state(trained_state):
  data = flax.serialization.to_bytes(trained_state)
  restored = flax.serialization.from_bytes(trained_state.replace(), data)
  chex.assert_trees_all_equal(restored, trained_state, strict=True)
  assert_loss_scales_equal(restored.loss_scale, trained_state.loss_scale)


# ---- pickle, jit, flatten/unflatten, flax serialization -----------------------------


def test_pickle_round_trip_loss_scale(loss_scale_case):
  ls, _ = loss_scale_case
  restored = pickle.loads(pickle.dumps(ls))
  assert_loss_scales_equal(restored, ls)


def test_jit_round_trip_loss_scale(loss_scale_case):
  ls, _ = loss_scale_case
  assert_loss_scales_equal(jax.jit(lambda s: s)(ls), ls)


def test_flatten_unflatten_loss_scale(loss_scale_case):
  ls, _ = loss_scale_case
  leaves, treedef = jax.tree.flatten(ls)
  assert_loss_scales_equal(jax.tree.unflatten(treedef, leaves), ls)
  # New leaves through the same treedef keep the hyperparameters.
  moved = jax.tree.unflatten(treedef, [leaf + 1 for leaf in leaves])
  assert _static_fields(moved) == _static_fields(ls)
  for new, old in zip(jax.tree.leaves(moved), leaves, strict=True):
    assert new.dtype == old.dtype
    np.testing.assert_array_equal(new, old + 1)


def test_flax_serialization_round_trip_loss_scale(loss_scale_case):
  ls, _ = loss_scale_case
  target = jax.tree.map(jnp.zeros_like, ls)
  restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(ls))
  assert_loss_scales_equal(restored, ls)


def test_min_loss_scale_survives_jit():
  # jmp's hand-written flatten dropped min_loss_scale under jit, so a jitted
  # backoff fell through the floor. 8 / 4 = 2 must stop at 4.
  ls = mpjax.DynamicLossScale(8.0, factor=4, min_loss_scale=4.0, max_loss_scale=64.0)
  out = jax.jit(lambda s: s.adjust(False))(ls)
  assert float(out.loss_scale) == 4.0
  assert out.min_loss_scale == 4.0
  assert out.max_loss_scale == 64.0
  # And the ceiling: 32 * 4 = 128 must stop at 64.
  grow = mpjax.DynamicLossScale(32.0, period=1, factor=4, min_loss_scale=4.0, max_loss_scale=64.0)
  assert float(jax.jit(lambda s: s.adjust(True))(grow).loss_scale) == 64.0


def test_jit_round_trip_inside_a_train_state_keeps_loss_scale_fields():
  ls = _dynamic(True, False)
  state = mpjax.TrainState.create(
    apply_fn=MODEL.apply,
    params=MODEL.init(jax.random.key(0), jnp.ones((1, 4))),
    tx=optax.adam(1e-3),
    policy="mixed_fp16",
    loss_scale=ls,
  )
  out = jax.jit(lambda s: s)(state)
  assert_loss_scales_equal(out.loss_scale, ls)
  chex.assert_trees_all_equal(out, state, strict=True)
