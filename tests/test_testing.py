"""mpjax.testing: each assertion passes where the property holds and names the fault where not."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
import mpjax.testing as mt


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="head")(nn.gelu(nn.Dense(32, name="body")(x)))


MODEL = MLP()
X = jax.random.normal(jax.random.key(1), (16, 16))
Y = jnp.arange(16) % 8
PARAMS = MODEL.init(jax.random.key(0), X)


def loss_fn(params, batch):
  logits = MODEL.apply(params, batch["x"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


BATCH = {"x": X, "y": Y}


def test_matches_f32_passes_in_bf16_and_names_the_leaf_that_overflows_fp16():
  mt.assert_matches_f32(loss_fn, PARAMS, BATCH, policy="mixed_bf16")
  big = {"x": X * 1e5, "y": Y}  # inputs beyond fp16's range (65504): inf once cast
  assert not np.isfinite(mpjax.autocast(loss_fn, "mixed_fp16")(PARAMS, big))  # the premise
  with pytest.raises(AssertionError, match=r"output .* is off its f32 value by inf"):
    mt.assert_matches_f32(loss_fn, PARAMS, big, policy="mixed_fp16")


def test_matches_f32_compares_gradients_with_the_tolerance_of_the_compute_dtype():
  assert mt.default_tolerance("mixed_bf16") == pytest.approx(4 * 2.0**-7)
  with pytest.raises(AssertionError, match=r"gradient \['params'\]\['(body|head)'\]"):
    mt.assert_matches_f32(loss_fn, PARAMS, BATCH, policy="mixed_bf16", rtol=1e-3)


def test_fast_path_with_the_head_kept_in_f32():
  step = jax.jit(jax.grad(mpjax.autocast(loss_fn, "mixed_bf16", rules={"*head*": "fp32"})))
  mt.assert_fast_path(step, PARAMS, BATCH, f32_modules=["*head*"])
  with pytest.raises(AssertionError, match=r"head.*f32-operands"):
    mt.assert_fast_path(step, PARAMS, BATCH)
  with pytest.raises(AssertionError, match="'\\*tail\\*' matched no GEMM"):
    mt.assert_fast_path(step, PARAMS, BATCH, f32_modules=["*head*", "*tail*"])


def _state(policy="mixed_fp16"):
  return mpjax.TrainState.create(
    apply_fn=MODEL.apply, params=PARAMS, tx=optax.adam(1e-2), policy=policy
  )


def test_skip_keeps_state_on_an_inf_batch_and_refuses_a_finite_one():
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  state, _ = step(_state(), BATCH)  # a step in, so the optimizer state is not all zeros
  bad = {"x": X.at[3, 2].set(jnp.inf), "y": Y}
  mt.assert_skip_keeps_state(step, state, bad)
  with pytest.raises(AssertionError, match="finite gradients, so nothing was skipped"):
    mt.assert_skip_keeps_state(step, state, BATCH)
  unchecked = jax.jit(mpjax.make_train_step(loss_fn))
  with pytest.raises(AssertionError, match="does not check gradients"):
    mt.assert_skip_keeps_state(unchecked, _state("mixed_bf16"), bad)


def test_a_step_that_trains_on_a_bad_batch_is_caught():
  def careless(state, batch):  # applies the update whatever the gradients
    grads = jax.grad(loss_fn)(state.params, batch)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(params=params, opt_state=opt_state, skipped_steps=state.skipped_steps + 1)
    return new, {"grads_finite": jnp.array(False)}

  bad = {"x": X.at[3, 2].set(jnp.inf), "y": Y}
  with pytest.raises(AssertionError, match=r"a skipped step changed params\['params'\]"):
    mt.assert_skip_keeps_state(careless, _state(), bad)


def test_checkpoint_round_trip_of_a_trained_state():
  step = jax.jit(mpjax.make_train_step(loss_fn))
  state, _ = step(_state(), BATCH)
  mt.assert_checkpoint_round_trip(state)


@pytest.mark.parametrize("fault", ["value", "dtype"])
def test_checkpoint_round_trip_names_a_leaf_the_checkpoint_lost(fault, monkeypatch):
  """A checkpointer that brings one leaf back changed (its value, or its dtype) is caught."""
  import orbax.checkpoint as ocp

  step = jax.jit(mpjax.make_train_step(loss_fn))
  state, _ = step(_state(), BATCH)
  restore = ocp.StandardCheckpointer.restore

  def lossy(self, path, target):
    restored = restore(self, path, target)
    kernel = restored.params["params"]["body"]["kernel"]
    kernel = kernel.at[0, 0].add(1.0) if fault == "value" else kernel.astype(jnp.bfloat16)
    params = {
      "params": {
        **restored.params["params"],
        "body": {**restored.params["params"]["body"], "kernel": kernel},
      }
    }
    return restored.replace(params=params)

  mt.assert_checkpoint_round_trip(state)  # the premise: the real checkpointer loses nothing
  monkeypatch.setattr(ocp.StandardCheckpointer, "restore", lossy)
  reason = "values differ" if fault == "value" else "float32.* saved, bfloat16.* restored"
  with pytest.raises(AssertionError, match=rf"\['body'\]\['kernel'\] did not survive.*{reason}"):
    mt.assert_checkpoint_round_trip(state)


class BNMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    h = nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))
    return nn.Dense(8)(nn.relu(h))


BN_MODEL = BNMLP()
BN_VARS = BN_MODEL.init(jax.random.key(0), X)


def bn_loss_fn(params, model_state, batch):
  logits, updates = BN_MODEL.apply(
    {"params": params["params"], **model_state}, batch["x"], mutable=["batch_stats"]
  )
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
  return loss.mean(), updates


def _bn_state():
  return mpjax.TrainState.create(
    apply_fn=BN_MODEL.apply,
    params={"params": BN_VARS["params"]},
    tx=optax.adam(1e-2),
    policy="mixed_fp16",
    model_state={"batch_stats": BN_VARS["batch_stats"]},
  )


def test_skip_keeps_state_checks_the_model_state():
  step = jax.jit(mpjax.make_train_step(bn_loss_fn, with_model_state=True))
  state, _ = step(_bn_state(), BATCH)  # statistics and optimizer state away from their init
  bad = {"x": X.at[3, 2].set(jnp.inf), "y": Y}
  mt.assert_skip_keeps_state(step, state, bad)  # mpjax's step keeps the statistics

  def writes_statistics(state, batch):  # the statistics of the bad batch kept on a skip
    new, metrics = step(state, batch)
    _, stats = bn_loss_fn(state.params, state.model_state, batch)
    return new.replace(model_state=stats), metrics

  with pytest.raises(
    AssertionError, match=r"changed model_state\['batch_stats'\]\['BatchNorm_0'\]"
  ):
    mt.assert_skip_keeps_state(writes_statistics, state, bad)


def test_skip_keeps_state_checks_the_fp8_state():
  step = jax.jit(mpjax.make_train_step(loss_fn, skip_nonfinite=True))
  fp8 = mpjax.Fp8Recipe(keep_bf16=())  # both Dense layers in FP8
  state = _state(mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=fp8))
  state = mpjax.init_fp8_state(step, state, BATCH)
  bad = {"x": X.at[3, 2].set(jnp.nan), "y": Y}  # FP8 casts saturate inf, not NaN
  for _ in range(2):
    state, _ = step(state, BATCH)
  assert state.fp8 is not None and float(jnp.max(state.fp8.amax_history)) > 0  # the premise
  mt.assert_skip_keeps_state(step, state, bad)

  def pushes_amaxes(state, batch):  # the bad step's amaxes pushed into the history
    new, metrics = step(state, batch)
    fp8 = new.fp8.replace(amax_history=jnp.roll(new.fp8.amax_history, 1, axis=0))
    return new.replace(fp8=fp8), metrics

  with pytest.raises(AssertionError, match=r"a skipped step changed fp8\.amax_history"):
    mt.assert_skip_keeps_state(pushes_amaxes, state, bad)
