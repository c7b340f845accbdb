"""bf16 params and optimizer state: stochastic rounding, Kahan summation, the bf16_sr preset."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax

BF16, F32 = jnp.bfloat16, jnp.float32
NEAREST_BF16 = mpjax.Policy(BF16, BF16, F32, opt_state_dtype=BF16, rounding="nearest")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(32)(x))
    return nn.Dense(4)(x)


MODEL = MLP()


def _batch(n=32, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (n, 8)), "y": jax.random.randint(ky, (n,), 0, 4)}


def loss_fn(params, batch):
  logits = MODEL.apply(params, batch["x"]).astype(F32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


ADAMW = optax.adamw(1e-2)  # one object: every state built with it shares a compiled step
STEP = jax.jit(mpjax.make_train_step(loss_fn))
CHECKED_STEP = jax.jit(mpjax.make_train_step(loss_fn, skip_nonfinite=True))


def _state(policy="bf16_sr", tx=ADAMW, **kwargs):
  params = MODEL.init(jax.random.key(1), jnp.ones((1, 8)))
  return mpjax.TrainState.create(
    apply_fn=MODEL.apply, params=params, tx=tx, policy=policy, **kwargs
  )


def _host(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize(
  "kwargs,fix",
  [
    (dict(rounding="up"), "rounding='stochastic'"),
    (dict(rounding="kahan"), "param_dtype=jnp.bfloat16"),
    (dict(rounding="stochastic"), "set param_dtype or opt_state_dtype to jnp.bfloat16"),
    (dict(opt_state_dtype=jnp.float16), "opt_state_dtype=jnp.bfloat16"),
    (dict(opt_state_dtype=jnp.int32), "not a floating dtype"),
  ],
)
def test_bad_rounding_options_are_refused_with_the_fix(kwargs, fix):
  with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(".", r"\.")):
    mpjax.Policy(F32, BF16, F32, **kwargs)


def test_bf16_sr_preset_and_f32_masters_with_bf16_moments():
  policy = mpjax.get_policy("bf16_sr")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (BF16, BF16, F32)
  assert (policy.opt_state_dtype, policy.rounding) == (BF16, "stochastic")
  assert "rounding='stochastic'" in repr(policy)
  assert str(policy) != str(mpjax.get_policy("p=bf16,c=bf16,o=f32"))
  # Any preset's params with bf16 moments: f32 masters, stochastically rounded moments.
  mixed = mpjax.Policy(F32, BF16, F32, opt_state_dtype=BF16, rounding="stochastic")
  state, _ = STEP(_state(mixed), _batch())
  chex.assert_type(jax.tree.leaves(state.params), F32)
  adam = state.opt_state.inner[0]
  chex.assert_type(jax.tree.leaves((adam.mu, adam.nu)), BF16)
  chex.assert_type(adam.count, jnp.int32)


def test_bf16_sr_train_state_is_half_of_mixed_bf16s():
  sizes = {}
  for policy in ("mixed_bf16", "bf16_sr", "bf16_kahan"):
    state = _state(policy)
    sizes[policy] = mpjax.state_bytes(state.params, state.opt_state)
  scalars = 16  # the key's uint32[2], the update count, half of Adam's count
  assert sizes["bf16_sr"] <= sizes["mixed_bf16"] / 2 + scalars, sizes
  assert sizes["bf16_kahan"] <= sizes["mixed_bf16"] * 2 / 3 + scalars, sizes


def test_stochastic_round_is_unbiased_exact_on_bf16_values_and_keeps_specials():
  bits = jax.random.bits(jax.random.key(0), (200_000,), jnp.uint32)
  sr = jax.jit(mpjax.stochastic_round)
  x = jnp.full(bits.shape, 1.0 + 3 * 2.0**-10)  # 3/8 of bf16's spacing above 1
  y = sr(x, bits)
  chex.assert_type(y, BF16)
  assert set(np.unique(np.asarray(y, np.float32))) == {1.0, 1.0 + 2.0**-7}
  assert abs(float(jnp.mean(y.astype(F32))) - float(x[0])) < 5e-5  # nearest: 1.0, off 2.3e-3
  specials = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 1.5, -3.0, 3e38, -1e-40])
  all_ones = jnp.full(specials.shape, 0xFFFFFFFF, jnp.uint32)
  for b in (all_ones, jnp.zeros_like(all_ones)):
    out = np.asarray(sr(specials, b), np.float32)
    np.testing.assert_array_equal(out[:2], [np.inf, -np.inf])
    assert np.isnan(out[2])
    np.testing.assert_array_equal(out[3:7], [0.0, -0.0, 1.5, -3.0])
    assert np.signbit(out[4]) and np.isfinite(out[7]) and out[8] <= 0


def _below_spacing_run(policy, steps=64, n=4096):
  """Adam on w = 1 with a constant gradient: each update lr = 2**-11, a sixteenth of
  bf16's spacing at 1, far below half of it."""
  params = {"w": jnp.ones((n,), F32)}
  state = mpjax.TrainState.create(
    apply_fn=None, params=params, tx=optax.adam(2.0**-11), policy=policy
  )
  step = jax.jit(
    mpjax.make_train_step(lambda p, b: jnp.sum(p["w"].astype(F32) * b)), donate_argnums=0
  )
  for _ in range(steps):
    state, _ = step(state, jnp.ones((n,), F32))
  return float(jnp.mean(1.0 - state.params["w"].astype(F32)))


def test_updates_below_bf16_spacing_stall_to_nearest_and_are_kept_by_sr_and_kahan():
  moved = {p: _below_spacing_run(p) for p in ("fp32", NEAREST_BF16, "bf16_sr", "bf16_kahan")}
  f32 = moved["fp32"]
  assert abs(f32 - 64 * 2.0**-11) < 1e-4  # f32 masters move 2**-5
  assert moved[NEAREST_BF16] == 0.0  # round to nearest loses every update
  sr_error, kahan_error = abs(moved["bf16_sr"] - f32), abs(moved["bf16_kahan"] - f32)
  assert sr_error < 0.02 * f32, moved  # within 2% of f32 over 64 steps (sd of mean ~1%)
  assert kahan_error < 0.002 * f32 and kahan_error < sr_error, moved


def _run(state, batches, step):
  metrics = []
  for batch in batches:
    state, m = step(state, batch)
    metrics.append(m["loss"])
  return state, metrics


def test_runs_are_bit_identical_resume_continues_exactly_and_the_key_decides():
  step = STEP
  batches = [_batch(seed=i) for i in range(6)]
  a, _ = _run(_state(), batches, step)
  b, _ = _run(_state(), batches, step)
  chex.assert_trees_all_equal(_host(a.params), _host(b.params))
  chex.assert_trees_all_equal(_host(a.opt_state), _host(b.opt_state))
  # Interrupted after 3 steps, saved to host memory, resumed: the same bits.
  half, _ = _run(_state(), batches[:3], step)
  resumed = jax.tree.map(jnp.asarray, jax.device_get(half))
  resumed, _ = _run(resumed, batches[3:], step)
  chex.assert_trees_all_equal(_host(resumed.params), _host(a.params))
  chex.assert_trees_all_equal(_host(resumed.opt_state), _host(a.opt_state))
  # Another key rounds otherwise.
  c, _ = _run(_state(rounding_key=jax.random.key(7)), batches, step)
  assert any(
    not np.array_equal(x, y)
    for x, y in zip(jax.tree.leaves(_host(a.params)), jax.tree.leaves(_host(c.params)), strict=True)
  )


def test_a_skipped_step_changes_nothing_key_and_count_included():
  step = CHECKED_STEP
  state, _ = _run(_state(), [_batch(seed=0)], step)
  before = _host((state.params, state.opt_state, state.step))
  poisoned = dict(_batch(seed=1), x=_batch(seed=1)["x"].at[2, 3].set(jnp.nan))
  skipped, metrics = step(state, poisoned)
  assert not bool(metrics["grads_finite"])
  chex.assert_trees_all_equal(_host((skipped.params, skipped.opt_state, skipped.step)), before)
  assert int(skipped.opt_state.count) == 1
  # The next step rounds as if the bad batch had never come.
  after_skip, _ = step(skipped, _batch(seed=2))
  direct, _ = step(state, _batch(seed=2))
  chex.assert_trees_all_equal(_host(after_skip.params), _host(direct.params))


@pytest.mark.parametrize(
  "tx",
  [
    ADAMW,
    optax.sgd(0.1, momentum=0.9),
    optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(1e-2)),
  ],
  ids=["adamw", "sgd_momentum", "clip_injected_adam"],
)
@pytest.mark.parametrize("policy", ["bf16_sr", "bf16_kahan"])
def test_any_optax_optimizer_trains_with_bf16_state_under_jit(tx, policy):
  state = _state(policy, tx)
  batch = _batch()
  first = None
  for _ in range(20):
    state, metrics = STEP(state, batch)
    first = metrics["loss"] if first is None else first
  assert float(metrics["loss"]) < 0.8 * float(first)
  chex.assert_type(jax.tree.leaves(state.params), BF16)
  for leaf in jax.tree.leaves(state.opt_state.inner):
    if jnp.ndim(leaf) > 0:  # per-parameter state in bf16
      chex.assert_type(leaf, BF16)
    elif jnp.issubdtype(leaf.dtype, jnp.floating):  # injected hyperparameters stay f32
      chex.assert_type(leaf, F32)
  assert (state.opt_state.compensation is None) == (policy == "bf16_sr")
  assert int(state.opt_state.count) == 20
