"""Eight-device checks of mpjax, run in a subprocess by tests/test_multidevice.py.

The parent sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and
``JAX_PLATFORMS=cpu`` before this interpreter starts (the flag only takes effect
if it is set before JAX initialises its backend). The script prints one JSON
dict of results as the last line of stdout; the test module asserts on it.
Values are recorded raw (booleans, floats, lists) so that the assertions, and
their failure messages, live in the test module.
"""

import json
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax

N_DEVICES = 8
BATCH = 64
PER_DEVICE = BATCH // N_DEVICES
BAD_DEVICE = 3
BAD_ROW = BAD_DEVICE * PER_DEVICE + 2  # row 26 lives in rows 24..31, i.e. shard 3


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))


MODEL = MLP()


def loss_fn(params, batch):
  pred = MODEL.apply(params, batch["x"]).astype(jnp.float32)
  return jnp.mean((pred - batch["y"].astype(jnp.float32)) ** 2)


def to_numpy(tree):
  """A host copy of every leaf (donation deletes the device buffers)."""
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


def trees_bit_identical(a, b):
  """Whether two trees of arrays have the same structure, dtypes, shapes and bits."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  if ta != tb or len(la) != len(lb):
    return False
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
      return False
  return True


def leaves_as_lists(tree):
  return [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(tree)]


def per_device_trees_agree(stacked_tree, reference=None):
  """Whether each device's slice of a stacked tree is bitwise device 0's (or ``reference``)."""
  for i, stack in enumerate(jax.tree.leaves(stacked_tree)):
    stack = np.asarray(stack)
    ref = stack[0] if reference is None else np.asarray(jax.tree.leaves(reference)[i])
    if any(
      stack[d].dtype != ref.dtype or stack[d].tobytes() != ref.tobytes() for d in range(N_DEVICES)
    ):
      return False
  return True


def run_shard_map(mesh, replicated, fresh_state, clean_batch, bad_batch, check_vma):
  """The train step with ``axis_name="data"`` under ``jax.shard_map``."""
  r = {}
  sm_train_step = mpjax.make_train_step(loss_fn, axis_name="data")

  def body(state, batch):
    new_state, metrics = sm_train_step(state, batch)
    per_device = {
      "grads_finite": metrics["grads_finite"][None],
      "loss_scale": new_state.loss_scale.loss_scale[None],
      "step": new_state.step[None],
      "params": jax.tree.map(lambda p: p[None], new_state.params),
      "opt_state": jax.tree.map(lambda p: p[None], new_state.opt_state),
    }
    return new_state, metrics, per_device

  sm_step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=(P(), P(), P("data")),
      check_vma=check_vma,
    ),
    donate_argnums=0,
  )

  # Each device's own verdict on its local gradients, before the devices agree: on the
  # poisoned batch only the device holding the inf row sees a non-finite gradient.
  def local_finite(state, batch):
    scale = state.loss_scale
    loss = mpjax.autocast(loss_fn, state.policy)
    grads = jax.grad(lambda p: scale.scale(loss(p, batch)))(state.params)
    return mpjax.all_finite(scale.unscale(grads))[None]

  sm_local = jax.jit(
    jax.shard_map(
      local_finite, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"), check_vma=False
    )
  )
  local = sm_local(
    jax.device_put(fresh_state(mpjax.DynamicLossScale(2.0**10)), replicated), bad_batch
  )
  r["bad_local_grads_finite"] = [bool(v) for v in np.asarray(local)]

  # A clean step at 2**10, to compare with the plain-jit reference.
  new_state, m, pd = sm_step(
    jax.device_put(fresh_state(mpjax.DynamicLossScale(2.0**10)), replicated), clean_batch
  )
  r["clean_grads_finite"] = bool(m["grads_finite"])
  r["clean_per_device_grads_finite"] = [bool(v) for v in np.asarray(pd["grads_finite"])]
  r["clean_step"] = int(new_state.step)
  r["clean_loss"] = float(m["loss"])
  r["clean_grad_norm"] = float(m["grad_norm"])
  r["clean_params"] = leaves_as_lists(new_state.params)
  r["clean_opt_state"] = leaves_as_lists(new_state.opt_state)
  r["clean_per_device_state_agrees"] = per_device_trees_agree((pd["params"], pd["opt_state"]))

  # The poisoned batch, from a fresh state with an explicit 2**10 scale.
  state0 = jax.device_put(fresh_state(mpjax.DynamicLossScale(2.0**10)), replicated)
  before = {"params": to_numpy(state0.params), "opt_state": to_numpy(state0.opt_state)}
  r["loss_scale_before"] = float(state0.loss_scale.loss_scale)
  new_state, m, pd = sm_step(state0, bad_batch)
  r["bad_grads_finite"] = bool(m["grads_finite"])
  r["bad_per_device_grads_finite"] = [bool(v) for v in np.asarray(pd["grads_finite"])]
  r["bad_per_device_loss_scale"] = [float(v) for v in np.asarray(pd["loss_scale"])]
  r["bad_per_device_step"] = [int(v) for v in np.asarray(pd["step"])]
  r["bad_per_device_params_identical"] = per_device_trees_agree(pd["params"], before["params"])
  r["bad_per_device_opt_state_identical"] = per_device_trees_agree(
    pd["opt_state"], before["opt_state"]
  )
  r["bad_params_identical"] = trees_bit_identical(new_state.params, before["params"])
  r["bad_opt_state_identical"] = trees_bit_identical(new_state.opt_state, before["opt_state"])
  r["bad_step"] = int(new_state.step)
  r["bad_skipped"] = int(new_state.skipped_steps)
  r["bad_loss_scale"] = float(new_state.loss_scale.loss_scale)
  return r


class FP8_MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16)(nn.relu(nn.Dense(32)(nn.relu(nn.Dense(32)(x)))))


def run_fp8(mesh, replicated, x, y, data_sharded):
  """One mixed_fp8 step (every Dense in FP8) under plain jit and under shard_map."""
  model = FP8_MLP()
  policy = mpjax.Policy(
    jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(keep_bf16=(), amax_history_len=4)
  )

  def fp8_loss(params, batch):
    pred = model.apply(params, batch["x"]).astype(jnp.float32)
    return jnp.mean((pred[:, :1] - batch["y"]) ** 2)

  def fresh():
    params = model.init(jax.random.key(1), x[:1])
    return mpjax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy=policy
    )

  batch = jax.device_put({"x": x, "y": y}, data_sharded)
  plain = mpjax.make_train_step(fp8_loss)
  state = mpjax.init_fp8_state(plain, jax.device_put(fresh(), replicated), batch)
  state = state.replace(fp8=jax.device_put(state.fp8, replicated))
  ref, _ = jax.jit(plain)(state, batch)
  sm_step = mpjax.make_train_step(fp8_loss, axis_name="data")
  sm = jax.jit(
    jax.shard_map(
      lambda s, b: sm_step(s, b)[0], mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )
  )(state, batch)
  return {
    "local_x_amax": [
      float(np.abs(x[i * PER_DEVICE : (i + 1) * PER_DEVICE]).max()) for i in range(N_DEVICES)
    ],
    "global_x_amax": float(np.abs(x).max()),
    "jit_history_row0": leaves_as_lists(ref.fp8.amax_history[0]),
    "shard_map_history_row0": leaves_as_lists(sm.fp8.amax_history[0]),
    "shard_map_scale": leaves_as_lists(sm.fp8.scale),
  }


def run_pmap_step(fresh_state, x, y, x_bad):
  """The train step with ``axis_name="data"`` under ``jax.pmap`` (state stacked per device)."""
  r = {}

  def stack(tree):
    return jax.tree.map(lambda leaf: jnp.stack([np.asarray(leaf)] * N_DEVICES), tree)

  def split(a):
    return a.reshape(N_DEVICES, PER_DEVICE, *a.shape[1:])

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pstep = jax.pmap(mpjax.make_train_step(loss_fn, axis_name="data"), axis_name="data")
    new_state, m = pstep(
      stack(fresh_state(mpjax.DynamicLossScale(2.0**10))), {"x": split(x), "y": split(y)}
    )
    r["clean_per_device_grads_finite"] = [bool(v) for v in np.asarray(m["grads_finite"])]
    r["clean_per_device_step"] = [int(v) for v in np.asarray(new_state.step)]
    r["clean_loss"] = float(m["loss"][0])
    r["clean_grad_norm"] = float(m["grad_norm"][0])
    r["clean_per_device_state_agrees"] = per_device_trees_agree(
      (new_state.params, new_state.opt_state)
    )
    first = jax.tree.map(lambda a: a[0], new_state)
    r["clean_params"] = leaves_as_lists(first.params)
    r["clean_opt_state"] = leaves_as_lists(first.opt_state)

    state0 = stack(fresh_state(mpjax.DynamicLossScale(2.0**10)))
    before = to_numpy(state0.params)
    new_state, m = pstep(state0, {"x": split(x_bad), "y": split(y)})
    r["bad_per_device_grads_finite"] = [bool(v) for v in np.asarray(m["grads_finite"])]
    r["bad_per_device_loss_scale"] = [float(v) for v in np.asarray(new_state.loss_scale.loss_scale)]
    r["bad_per_device_step"] = [int(v) for v in np.asarray(new_state.step)]
    r["bad_params_identical"] = trees_bit_identical(new_state.params, before)
  r["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
  return r


def main():
  assert jax.device_count() == N_DEVICES, jax.devices()
  results = {"device_count": jax.device_count()}

  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, 4)).astype(np.float32)
  y = rng.normal(size=(BATCH, 1)).astype(np.float32)
  x_bad = x.copy()
  x_bad[BAD_ROW, 1] = np.inf
  init_params = to_numpy(MODEL.init(jax.random.key(0), x[:1]))

  def fresh_state(loss_scale=None):
    return mpjax.TrainState.create(
      apply_fn=MODEL.apply,
      params=jax.tree.map(jnp.asarray, init_params),
      tx=optax.adam(1e-2),
      policy="mixed_fp16",
      loss_scale=loss_scale,
    )

  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  replicated = NamedSharding(mesh, P())
  data_sharded = NamedSharding(mesh, P("data"))
  clean_batch = jax.device_put({"x": x, "y": y}, data_sharded)
  bad_batch = jax.device_put({"x": x_bad, "y": y}, data_sharded)

  # ---- a. plain jit with NamedSharding data parallelism (no axis_name) -------
  a = {}
  a["bad_shard_row_starts"] = sorted(
    int(s.index[0].start or 0)
    for s in bad_batch["x"].addressable_shards
    if not np.isfinite(np.asarray(s.data)).all()
  )
  a["bad_shard_device_ids"] = sorted(
    s.device.id
    for s in bad_batch["x"].addressable_shards
    if not np.isfinite(np.asarray(s.data)).all()
  )
  a["n_batch_shards"] = len(bad_batch["x"].addressable_shards)

  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  state0 = jax.device_put(fresh_state(), replicated)
  a["initial_loss_scale"] = float(state0.loss_scale.loss_scale)
  a["loss_scale_type"] = type(state0.loss_scale).__name__

  state1, m1 = step(state0, clean_batch)
  a["clean_grads_finite"] = bool(m1["grads_finite"])
  a["clean_loss"] = float(m1["loss"])
  a["clean_grad_norm"] = float(m1["grad_norm"])
  a["clean_step"] = int(state1.step)
  a["clean_skipped"] = int(state1.skipped_steps)
  a["clean_loss_scale"] = float(state1.loss_scale.loss_scale)
  a["clean_counter"] = int(state1.loss_scale.counter)
  a["clean_params_changed"] = not trees_bit_identical(state1.params, init_params)
  a["params_sharding_replicated"] = all(
    leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state1.params)
  )

  before = {
    "params": to_numpy(state1.params),
    "opt_state": to_numpy(state1.opt_state),
    "step": int(state1.step),
    "skipped": int(state1.skipped_steps),
    "loss_scale": float(state1.loss_scale.loss_scale),
  }
  state2, m2 = step(state1, bad_batch)
  a["donated_input_deleted"] = bool(jax.tree.leaves(state1.params)[0].is_deleted())
  a["bad_grads_finite"] = bool(m2["grads_finite"])
  a["bad_metric_loss_scale"] = float(m2["loss_scale"])
  a["bad_params_identical"] = trees_bit_identical(state2.params, before["params"])
  a["bad_opt_state_identical"] = trees_bit_identical(state2.opt_state, before["opt_state"])
  a["step_before"] = before["step"]
  a["bad_step"] = int(state2.step)
  a["bad_skipped"] = int(state2.skipped_steps)
  a["loss_scale_before"] = before["loss_scale"]
  a["bad_loss_scale"] = float(state2.loss_scale.loss_scale)
  a["bad_counter"] = int(state2.loss_scale.counter)
  a["bad_overflow_counter"] = int(state2.loss_scale.overflow_counter)
  scale_shards = state2.loss_scale.loss_scale.addressable_shards
  a["bad_loss_scale_shard_values"] = [float(np.asarray(s.data)) for s in scale_shards]
  a["bad_loss_scale_shard_devices"] = sorted(s.device.id for s in scale_shards)
  a["bad_params_shard_identical"] = all(
    np.asarray(s.data).tobytes() == np.asarray(leaf_before).tobytes()
    for leaf, leaf_before in zip(
      jax.tree.leaves(state2.params), jax.tree.leaves(before["params"]), strict=True
    )
    for s in leaf.addressable_shards
  )
  # A clean step after the skip trains again, from the kept params, at the halved scale.
  state3, m3 = step(state2, clean_batch)
  a["recover_grads_finite"] = bool(m3["grads_finite"])
  a["recover_metric_loss_scale"] = float(m3["loss_scale"])
  a["recover_step"] = int(state3.step)
  a["recover_skipped"] = int(state3.skipped_steps)
  results["jit"] = a

  # A clean step at 2**10 (finite on every device, whatever the parallelism)
  # under plain jit: the reference the shard_map and pmap steps must match.
  ref_state, ref_m = step(
    jax.device_put(fresh_state(mpjax.DynamicLossScale(2.0**10)), replicated), clean_batch
  )
  results["jit_ref"] = {
    "grads_finite": bool(ref_m["grads_finite"]),
    "step": int(ref_state.step),
    "loss": float(ref_m["loss"]),
    "grad_norm": float(ref_m["grad_norm"]),
    "params": leaves_as_lists(ref_state.params),
    "opt_state": leaves_as_lists(ref_state.opt_state),
    "initial_params": leaves_as_lists(init_params),
  }

  # ---- b. shard_map with axis_name="data" -------------------------------------
  for check_vma in (True, False):
    results[f"shard_map_check_vma_{check_vma}"] = run_shard_map(
      mesh, replicated, fresh_state, clean_batch, bad_batch, check_vma
    )

  # ---- b'. pmap of the train step with axis_name="data" -----------------------
  results["pmap_step"] = run_pmap_step(fresh_state, x, y, x_bad)

  # ---- c. all_finite inside shard_map -----------------------------------------
  c = {}

  def finite_body(tree):
    return (
      mpjax.all_finite(tree, axis_name="data")[None],
      mpjax.all_finite(tree)[None],
    )

  finite_fn = jax.jit(
    jax.shard_map(finite_body, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))
  )
  v_clean = np.arange(N_DEVICES * 4, dtype=np.float32)
  labels = np.arange(N_DEVICES * 4, dtype=np.int32)
  for name, bad_value in (("clean", None), ("inf", np.inf), ("nan", np.nan)):
    v = v_clean.copy()
    if bad_value is not None:
      v[BAD_DEVICE * 4 + 1] = bad_value
    tree = jax.device_put({"v": v, "labels": labels}, data_sharded)
    shared, local = finite_fn(tree)
    c[f"{name}_with_axis"] = [bool(t) for t in np.asarray(shared)]
    c[f"{name}_local"] = [bool(t) for t in np.asarray(local)]
  results["all_finite"] = c

  # ---- d. pmap of DynamicLossScale.adjust -------------------------------------
  d = {}
  ls = mpjax.DynamicLossScale(
    2.0**10, counter=1, period=2, factor=2, min_loss_scale=512.0, max_loss_scale=2.0**20
  )
  stacked = jax.tree.map(lambda leaf: jnp.stack([leaf] * N_DEVICES), ls)
  flags = np.array([True, False, True, True, False, False, True, False])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    adjust = jax.pmap(lambda s, f: s.adjust(f))
    out = adjust(stacked, jnp.asarray(flags))
    out_twice = adjust(out, jnp.asarray(flags))
  d["pmap_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
  d["flags"] = [bool(f) for f in flags]
  d["type"] = type(out).__name__
  d["loss_scale"] = [float(v) for v in np.asarray(out.loss_scale)]
  d["counter"] = [int(v) for v in np.asarray(out.counter)]
  d["overflow_counter"] = [int(v) for v in np.asarray(out.overflow_counter)]
  d["dtypes"] = [str(out.loss_scale.dtype), str(out.counter.dtype), str(out.overflow_counter.dtype)]
  d["static"] = {
    "period": out.period,
    "factor": out.factor,
    "min_loss_scale": out.min_loss_scale,
    "max_loss_scale": out.max_loss_scale,
    "hysteresis": out.hysteresis,
  }
  d["twice_loss_scale"] = [float(v) for v in np.asarray(out_twice.loss_scale)]
  d["twice_counter"] = [int(v) for v in np.asarray(out_twice.counter)]
  d["twice_overflow_counter"] = [int(v) for v in np.asarray(out_twice.overflow_counter)]
  results["pmap"] = d

  # ---- e. FP8 delayed scaling under shard_map: the amaxes of all devices -----
  results["fp8"] = run_fp8(mesh, replicated, x, y, data_sharded)

  print(json.dumps(results))


if __name__ == "__main__":
  sys.exit(main())
