import chex
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax


class MLP(nn.Module):
  """A Flax MLP with no dtype of its own: the step's casts decide its precision."""

  features: tuple[int, ...] = (32, 32, 4)

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.features):
      x = nn.Dense(width)(x)
      if i < len(self.features) - 1:
        x = nn.gelu(x)
    return x


MODEL = MLP()


def _batch(n=64, d=8, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (n, d)), "y": jax.random.randint(ky, (n,), 0, 4)}


def _params(d=8):
  return MODEL.init(jax.random.key(1), jnp.ones((1, d)))


def loss_fn(params, batch):
  logits = MODEL.apply(params, batch["x"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _state(policy, tx=None, **kwargs):
  return mpjax.TrainState.create(
    apply_fn=MODEL.apply, params=_params(), tx=tx or optax.sgd(0.5), policy=policy, **kwargs
  )


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def test_bf16_step_matches_f32_reference_and_keeps_f32_masters():
  batch = _batch()
  step = jax.jit(mpjax.make_train_step(loss_fn))
  ref_state, ref_metrics = step(_state("fp32"), batch)
  state, metrics = step(_state("mixed_bf16"), batch)
  chex.assert_type(jax.tree.leaves(state.params), jnp.float32)
  chex.assert_type(jax.tree.leaves(state.opt_state), jnp.float32)
  chex.assert_type(metrics["loss"], jnp.float32)
  # The update (new - old) agrees with the f32 update within bf16 tolerance.
  old = _params()
  ref_update = jax.tree.map(jnp.subtract, ref_state.params, old)
  update = jax.tree.map(jnp.subtract, state.params, old)
  for u, r in zip(jax.tree.leaves(update), jax.tree.leaves(ref_update), strict=True):
    assert float(jnp.linalg.norm(u - r) / jnp.linalg.norm(r)) < 3e-2
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-2)
  assert not np.array_equal(metrics["loss"], ref_metrics["loss"])  # it did run in bf16


# autocast=True under fp32, as mpjax.autocast does, runs the loss function itself: no remat
# (on a CPU) and no retrace that would change what XLA makes of it (e.g. its softmax).
@pytest.mark.parametrize("autocast", [None, True])
def test_fp32_policy_matches_a_plain_optax_step(autocast):
  batch, params, tx = _batch(), _params(), optax.adam(1e-2)

  @jax.jit
  def plain(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  p, o, loss = plain(params, tx.init(params))
  step = mpjax.make_train_step(loss_fn, autocast=autocast)
  jaxpr = jax.make_jaxpr(step)(_state("fp32", tx), batch).jaxpr
  assert not {"remat2", "checkpoint"} & _primitives(jaxpr)
  state, metrics = jax.jit(step)(_state("fp32", tx), batch)
  chex.assert_trees_all_close(state.params, p, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(state.opt_state, o, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)


def test_policy_casting_module_without_dtype_computes_in_the_compute_dtype():
  seen = []

  def recording_loss(params, batch):
    logits = MODEL.apply(params, batch["x"])
    seen.append((logits.dtype, batch["x"].dtype, batch["y"].dtype))
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["y"]
    ).mean()

  step = mpjax.make_train_step(recording_loss, autocast=False)
  jax.jit(step)(_state("mixed_bf16"), _batch())
  assert seen[-1] == (jnp.bfloat16, jnp.bfloat16, jnp.int32)  # labels untouched
  step = mpjax.make_train_step(recording_loss, cast_batch=False, autocast=False)
  jax.jit(step)(_state("mixed_bf16"), _batch())
  assert seen[-1][1] == jnp.float32


def test_cast_params_false_hands_the_f32_masters_to_a_model_that_takes_the_policy():
  seen = []
  model = nn.Dense(4, **mpjax.linen_kwargs("mixed_bf16"))

  def loss_fn(params, batch):
    seen.append(jax.tree.leaves(params)[0].dtype)
    logits = model.apply(params, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  params = model.init(jax.random.key(1), jnp.ones((1, 8)))
  state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.sgd(0.5), policy="mixed_bf16"
  )
  step = mpjax.make_train_step(loss_fn, cast_params=False)  # not autocast either
  jaxpr = jax.make_jaxpr(step)(state, _batch())
  assert seen[-1] == jnp.float32
  # the model casts each weight where it uses it: every GEMM bf16 x bf16, forward and backward
  assert _gemm_operand_dtypes(jaxpr.jaxpr) and set(_gemm_operand_dtypes(jaxpr.jaxpr)) == {
    ("bfloat16", "bfloat16")
  }
  autocast_jaxpr = jax.make_jaxpr(mpjax.make_train_step(loss_fn))(state, _batch())
  # autocast rematerialises (remat2); the cast_params=False step is not autocast
  assert "remat2" in _primitives(autocast_jaxpr.jaxpr) and "remat2" not in _primitives(jaxpr.jaxpr)
  with pytest.raises(ValueError, match="cast_params=False is for models that take the policy"):
    mpjax.make_train_step(loss_fn, cast_params=False, autocast=True)


def _primitives(jaxpr):
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def _gemm_operand_dtypes(jaxpr):
  dtypes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      dtypes.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      dtypes += _gemm_operand_dtypes(sub)
  return dtypes


@pytest.mark.parametrize("policy,half", [("mixed_bf16", "bfloat16"), ("mixed_fp16", "float16")])
def test_mixed_policies_autocast_by_default(policy, half):
  seen = []

  def recording_loss(params, batch):
    seen.append(jax.tree.leaves(params)[0].dtype)  # traced as written: f32
    return loss_fn(params, batch)

  step = mpjax.make_train_step(recording_loss)
  jaxpr = jax.make_jaxpr(step)(_state(policy), _batch()).jaxpr
  assert seen == [jnp.float32]
  gemms = _gemm_operand_dtypes(jaxpr)
  assert len(gemms) == 9  # 3 layers x (forward + 2 gradient GEMMs)
  assert all(g == (half, half) for g in gemms), gemms
  state, metrics = jax.jit(step)(_state(policy), _batch())
  assert bool(jnp.isfinite(metrics["loss"])) and int(state.step) == 1


def test_autocast_rules_are_checked_when_the_step_is_made():
  with pytest.raises(ValueError, match="not an op class"):
    mpjax.make_train_step(loss_fn, autocast_rules={"exp": "fp23"})


def test_policy_change_recompiles_with_new_dtypes():
  seen = []

  def recording_loss(params, batch):
    seen.append(jax.tree.leaves(params)[0].dtype)
    return loss_fn(params, batch)

  step = jax.jit(mpjax.make_train_step(recording_loss, autocast=False), donate_argnums=0)
  batch = _batch()
  for policy in ("mixed_bf16", "fp32", "mixed_fp16"):
    state, _ = step(_state(policy), batch)
  assert seen == [jnp.bfloat16, jnp.float32, jnp.float16]
  hlo_bf16 = step.lower(_state("mixed_bf16"), batch).as_text()
  hlo_f32 = step.lower(_state("fp32"), batch).as_text()
  assert "bf16" in hlo_bf16 and "bf16" not in hlo_f32


@pytest.mark.parametrize("program", ["cpu", "gpu"])
def test_inf_in_one_batch_skips_the_step_bit_identically(program, monkeypatch):
  if program == "gpu":  # the step XLA:GPU gets (fused norm, selected update), run here
    monkeypatch.setattr("mpjax.train_step.by_platform", lambda *args, cpu, other: other(*args))
  batch = _batch()
  state = _state("mixed_fp16", optax.adam(1e-2))
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  for _ in range(2):
    state, metrics = step(state, batch)
  assert bool(metrics["grads_finite"])
  before = _host((state.params, state.opt_state, state.step))
  scale_before = float(state.loss_scale.loss_scale)
  poisoned = dict(batch, x=batch["x"].at[5, 3].set(jnp.inf))
  state, metrics = step(state, poisoned)
  assert not bool(metrics["grads_finite"])
  chex.assert_trees_all_equal(_host((state.params, state.opt_state, state.step)), before)
  assert float(state.loss_scale.loss_scale) == scale_before / 2
  assert int(state.skipped_steps) == 1 and int(state.step) == 2
  state, metrics = step(state, batch)  # and training goes on
  assert bool(metrics["grads_finite"]) and int(state.step) == 3


@pytest.mark.parametrize(
  "policy,loss_scale,skip_nonfinite,checked",
  [
    ("fp32", None, None, False),
    ("mixed_bf16", None, None, False),
    ("mixed_fp16", None, None, True),
    ("mixed_fp16", mpjax.NoOpLossScale(), None, True),  # fp16's range, even unscaled
    ("fp32", mpjax.StaticLossScale(2.0**8), None, True),
    ("fp32", None, True, True),
    ("mixed_fp16", mpjax.StaticLossScale(2.0**8), False, False),
  ],
)
def test_the_step_checks_gradients_where_the_loss_is_scaled_or_fp16_unless_told(
  policy, loss_scale, skip_nonfinite, checked
):
  step = mpjax.make_train_step(loss_fn, skip_nonfinite=skip_nonfinite)
  state = _state(policy, loss_scale=loss_scale)
  # An unchecked step is a plain optax step: no conditional, no norm of the gradients.
  primitives = {e.primitive.name for e in jax.make_jaxpr(step)(state, _batch()).jaxpr.eqns}
  assert ("cond" in primitives) == checked
  step = jax.jit(step)
  state, metrics = step(state, _batch())
  keys = {"loss", "loss_scale"} | ({"grad_norm", "grads_finite"} if checked else set())
  assert set(metrics) == keys
  poisoned = _batch()
  poisoned["x"] = poisoned["x"].at[5, 3].set(jnp.inf)
  new_state, _ = step(state, poisoned)
  if checked:
    chex.assert_trees_all_equal(new_state.params, state.params)
    assert int(new_state.skipped_steps) == 1 and int(new_state.step) == 1
  else:  # trained on, as plain optax would
    assert not all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(new_state.params))
    assert int(new_state.skipped_steps) == 0 and int(new_state.step) == 2


def test_fp16_underflow_needs_loss_scaling():
  """Gradients of ~1e-7 underflow fp16 unless the loss is scaled."""
  batch = _batch()

  def tiny_loss(params, batch):
    return 1e-7 * loss_fn(params, batch)

  def train(loss_scale, policy="mixed_fp16"):
    state = _state(policy, optax.adam(1e-2), loss_scale=loss_scale)
    step = jax.jit(mpjax.make_train_step(tiny_loss), donate_argnums=0)
    start = jax.tree.map(np.array, state.params)
    for _ in range(30):
      state, metrics = step(state, batch)
    return start, state, float(loss_fn(state.params, batch))

  initial = float(loss_fn(_params(), batch))
  start, state, final = train(mpjax.NoOpLossScale())
  chex.assert_trees_all_equal(_host(state.params), start)  # every gradient was zero
  assert final == pytest.approx(initial, rel=1e-6)
  _, state, final = train(mpjax.DynamicLossScale())
  _, _, reference = train(None, policy="fp32")
  assert final < 0.9 * initial
  assert final == pytest.approx(reference, rel=0.02)  # learns as fp32 does
  assert int(state.skipped_steps) == 0


def test_aux_and_clipping():
  def loss_with_aux(params, batch):
    return loss_fn(params, batch), {"n": batch["y"].shape[0]}

  state, metrics = jax.jit(mpjax.make_train_step(loss_with_aux, max_grad_norm=1e-3))(
    _state("fp32"), _batch()
  )
  assert int(metrics["aux"]["n"]) == 64
  update_norm = optax.tree.norm(jax.tree.map(jnp.subtract, state.params, _params()))
  assert float(metrics["grad_norm"]) > 1e-2
  np.testing.assert_allclose(update_norm, 0.5 * 1e-3, rtol=1e-3)  # sgd(0.5) x clipped norm


@pytest.mark.parametrize("leaves", [0, 3, 150])  # 150: three fused groups of at most 64
def test_the_gpu_gradient_norm_is_the_global_norm_and_sees_every_non_finite_leaf(leaves):
  from mpjax.train_step import _fused_norm

  keys = jax.random.split(jax.random.key(0), max(leaves, 1))
  # Sizes around the norm's 1024-wide rows: one short of, equal to and past a row.
  grads = {f"g{i}": jax.random.normal(keys[i], (1023 + i % 3, 1 + i % 2)) for i in range(leaves)}
  gpu_norm = jax.jit(_fused_norm)
  want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads.values()))
  np.testing.assert_allclose(gpu_norm(grads), want, rtol=1e-5)
  np.testing.assert_allclose(gpu_norm(grads), optax.tree.norm(grads), rtol=1e-5)
  if leaves:  # a non-finite value in the last group's last leaf reaches the norm
    last = f"g{leaves - 1}"
    for bad in (jnp.inf, jnp.nan):
      poisoned = {**grads, last: grads[last].at[-1, -1].set(bad)}
      assert not np.isfinite(gpu_norm(poisoned))


def test_step_runs_eagerly_and_keeps_callers_params_under_donation():
  params = _params()
  state = mpjax.TrainState.create(
    apply_fn=MODEL.apply, params=params, tx=optax.sgd(0.1), policy="fp32"
  )
  step = mpjax.make_train_step(loss_fn)
  eager_state, _ = step(state, _batch())
  jitted_state, _ = jax.jit(step, donate_argnums=0)(state, _batch())
  chex.assert_trees_all_close(eager_state.params, jitted_state.params, rtol=1e-5, atol=1e-7)
  jax.tree.map(np.asarray, params)  # the caller's arrays were not donated away


def test_default_loss_scale_follows_the_policy():
  assert isinstance(_state("mixed_fp16").loss_scale, mpjax.DynamicLossScale)
  assert float(_state("mixed_fp16").loss_scale.loss_scale) == 2.0**15
  assert isinstance(_state("mixed_bf16").loss_scale, mpjax.NoOpLossScale)
  assert isinstance(_state("fp32").loss_scale, mpjax.NoOpLossScale)
  state = _state("mixed_bf16", loss_scale=mpjax.StaticLossScale(8.0))
  assert float(state.loss_scale.loss_scale) == 8.0


def test_pure_bf16_keeps_bf16_params_and_state_dtypes():
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  state = _state("pure_bf16", optax.adam(1e-3))
  for _ in range(2):
    state, _ = step(state, _batch())
  chex.assert_type(jax.tree.leaves(state.params), jnp.bfloat16)


def test_env_var_switches_the_state_policy(monkeypatch):
  monkeypatch.setenv("MPJAX_POLICY", "mixed_fp16")
  state = _state("fp32")
  assert state.policy.compute_dtype == jnp.float16
  assert isinstance(state.loss_scale, mpjax.DynamicLossScale)


def test_non_scalar_loss_is_named():
  def per_example(params, batch):
    return MODEL.apply(params, batch["x"]).sum(-1)

  with pytest.raises(ValueError, match=r"shape \(64,\).*jnp.mean"):
    jax.jit(mpjax.make_train_step(per_example))(_state("fp32"), _batch())
  with pytest.raises(ValueError, match="3 items"):
    jax.jit(mpjax.make_train_step(lambda p, b: (1.0, 2.0, 3.0)))(_state("fp32"), _batch())


@pytest.mark.parametrize("policy", ["fp32", "mixed_bf16", "bf16_sr"])
def test_gradient_accumulation_with_optax_multisteps_updates_every_kth_step(policy):
  # optax.MultiSteps is an object with init and update, not a GradientTransformation; Flax's
  # TrainState takes it, and so does mpjax's.
  tx = optax.MultiSteps(optax.sgd(0.5), every_k_schedule=2)
  assert not isinstance(tx, optax.GradientTransformation)  # the premise
  state = _state(policy, tx=tx)
  step = jax.jit(mpjax.make_train_step(loss_fn))
  one, _ = step(state, _batch(seed=0))
  chex.assert_trees_all_equal(one.params, state.params)  # the first micro-batch only accumulates
  two, _ = step(one, _batch(seed=1))
  # The update is SGD on the mean of the two micro-batches' f32 gradients.
  grads = [jax.grad(loss_fn)(_params(), _batch(seed=s)) for s in (0, 1)]
  expected = jax.tree.map(lambda p, a, b: p - 0.5 * (a + b) / 2, _params(), *grads)
  tol = {"fp32": 1e-6, "mixed_bf16": 5e-3, "bf16_sr": 5e-3}[policy]
  as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), two.params)
  chex.assert_trees_all_close(as_f32, expected, atol=tol, rtol=tol)
  assert not jnp.allclose(jax.tree.leaves(as_f32)[0], jax.tree.leaves(_params())[0])


def test_bad_construction_input_is_named():
  with pytest.raises(ValueError, match="no floating-point leaf"):
    mpjax.TrainState.create(apply_fn=MODEL.apply, params={"step": jnp.arange(3)}, tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match="Nearest preset: 'mixed_bf16'"):
    _state("mixed_bf61")
  with pytest.raises(TypeError, match="tx must be an optax optimizer.*got str"):
    _state("fp32", tx="adam")
  with pytest.raises(TypeError, match="loss_scale must be"):
    _state("fp32", loss_scale=2.0**15)
  with pytest.raises(ValueError, match="max_grad_norm"):
    mpjax.make_train_step(loss_fn, max_grad_norm=0.0)
  with pytest.raises(TypeError, match="loss_fn must be a function"):
    mpjax.make_train_step("loss")
  with pytest.raises(TypeError, match="mpjax.TrainState"):
    mpjax.make_train_step(loss_fn)({"params": _params()}, _batch())
  with pytest.raises(TypeError, match="skip_nonfinite='yes' must be True, False or None"):
    mpjax.make_train_step(loss_fn, skip_nonfinite="yes")
  with pytest.raises(ValueError, match="skip_nonfinite=False with a DynamicLossScale"):
    mpjax.make_train_step(loss_fn, skip_nonfinite=False)(_state("mixed_fp16"), _batch())


class _BatchNormNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.Dense(4)(nn.relu(x))


@pytest.mark.parametrize("policy", ["mixed_bf16", "fp32"])
def test_model_state_batchnorm_statistics_update_in_f32_and_match_the_f32_reference(policy):
  net = _BatchNormNet()
  batch = _batch()
  variables = net.init(jax.random.key(0), batch["x"], train=False)

  def bn_loss(params, model_state, batch):
    logits, updates = net.apply(
      {**params, **model_state}, batch["x"], train=True, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    return jnp.mean(loss), updates

  state = mpjax.TrainState.create(
    apply_fn=net.apply,
    params={"params": variables["params"]},
    model_state={"batch_stats": variables["batch_stats"]},
    tx=optax.sgd(0.1),
    policy=policy,
  )
  step = jax.jit(mpjax.make_train_step(bn_loss, with_model_state=True, skip_nonfinite=True))
  new_state, _ = step(state, batch)
  # Reference: the same update of the running mean, computed in f32 by hand.
  h = batch["x"] @ variables["params"]["Dense_0"]["kernel"] + variables["params"]["Dense_0"]["bias"]
  expected_mean = 0.5 * variables["batch_stats"]["BatchNorm_0"]["mean"] + 0.5 * h.mean(0)
  got_mean = new_state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
  chex.assert_type(got_mean, jnp.float32)
  chex.assert_trees_all_close(got_mean, expected_mean, rtol=2e-2, atol=2e-2)
  assert int(new_state.step) == 1

  # A skipped step leaves the statistics bit-identical, like everything else.
  bad = {**batch, "x": batch["x"].at[0, 0].set(jnp.inf)}
  skipped_state, metrics = step(new_state, bad)
  assert not bool(metrics["grads_finite"])
  chex.assert_trees_all_equal(skipped_state.model_state, new_state.model_state)


def test_model_state_loss_fn_must_return_a_pair():
  state = mpjax.TrainState.create(apply_fn=MODEL.apply, params=_params(), tx=optax.sgd(0.1))
  step = mpjax.make_train_step(lambda p, s, b: loss_fn(p, b), with_model_state=True)
  with pytest.raises(ValueError, match=r"\(loss, new_model_state\)"):
    jax.jit(step)(state, _batch())


def test_a_state_created_with_its_step_compiles_the_fp8_step_once(caplog):
  batch = _batch()
  # Premise: a state created without the step makes its FP8 state in the first
  # step, and the jitted step compiles again on the second (and says so).
  step = jax.jit(mpjax.make_train_step(loss_fn))
  plain = _state("mixed_fp8")
  assert plain.fp8 is None
  with caplog.at_level("WARNING", logger="mpjax"):
    made, _ = step(plain, batch)
    step(made, batch)
  assert step._cache_size() == 2
  assert "train_step=step, example_batch=batch" in caplog.text
  caplog.clear()

  step = jax.jit(mpjax.make_train_step(loss_fn))
  with caplog.at_level("WARNING", logger="mpjax"):
    state = _state("mixed_fp8", train_step=step, example_batch=batch)
    assert step._cache_size() == 0  # traced for shapes only, nothing compiled
    assert isinstance(state.fp8, mpjax.Fp8State) and state.fp8.gemms == made.fp8.gemms == 1
    first, _ = step(state, batch)
    second, _ = step(first, batch)
  assert step._cache_size() == 1
  assert caplog.text == ""
  assert int(second.step) == 2
  # Its first step is the one the plain state takes (scales of 1, empty history).
  for a, b in zip(
    jax.tree.leaves((first.params, first.fp8)),
    jax.tree.leaves((made.params, made.fp8)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_create_given_the_step_for_a_policy_without_fp8_state_changes_nothing():
  batch = _batch()
  step = jax.jit(mpjax.make_train_step(loss_fn))
  for policy in ("mixed_bf16", "fp32"):
    state = _state(policy, train_step=step, example_batch=batch)
    assert state.fp8 is None
  current = mpjax.Policy(
    jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(scaling="current")
  )
  assert _state(current, train_step=step, example_batch=batch).fp8 is None


@pytest.mark.parametrize("given", ["train_step", "example_batch"])
def test_create_refuses_the_step_without_a_batch_and_the_other_way(given):
  kwargs = {"train_step": mpjax.make_train_step(loss_fn), "example_batch": _batch()}
  missing = next(k for k in kwargs if k != given)
  with pytest.raises(TypeError, match=f"{given} was given without {missing}.*pass both"):
    _state("mixed_fp8", **{given: kwargs[given]})
