import functools
import math
from collections import Counter

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.extend import core as jcore

import mpjax
from mpjax.audit import parse_compiled_gemms
from mpjax.jax_compat import saved_residuals

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
GEMMS = ("dot_general", "ragged_dot_general", "conv_general_dilated")


# --- Models -------------------------------------------------------------------------------------


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(4, name="head")(x)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)  # BatchNorm cancels a bias
    x = nn.BatchNorm(use_running_average=False)(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, (2, 2), (2, 2))
    return nn.Dense(4)(x.reshape(x.shape[0], -1))


class Block(nn.Module):
  """A pre-LayerNorm causal transformer block: einsum attention, -1e9 mask, GELU MLP."""

  heads: int = 4

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    h = nn.LayerNorm()(x)
    qkv = nn.Dense(3 * d, use_bias=False)(h).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    x = x + nn.Dense(d)(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))
    h = nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x)))
    return x + nn.Dense(d)(h)


class LM(nn.Module):
  vocab: int = 16

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, 32)(tokens)
    x = Block()(x)
    return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


def _init(model, key, x):
  return jax.jit(model.init)(key, x)  # one compiled init: op-by-op is slow


@functools.cache
def _mlp_case():
  x = jax.random.normal(jax.random.key(0), (2, 16))
  model = MLP()
  params = _init(model, jax.random.key(1), x)["params"]
  return model, params, x, lambda apply, params, x: apply({"params": params}, x)


@functools.cache
def _cnn_case():
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  model = CNN()
  variables = _init(model, jax.random.key(1), x)

  def forward(apply, params, x):
    variables_in = {"params": params, "batch_stats": variables["batch_stats"]}
    return apply(variables_in, x, mutable=["batch_stats"])[0]

  return model, variables["params"], x, forward


@functools.cache
def _block_case():
  x = jax.random.normal(jax.random.key(0), (2, 8, 32))
  model = Block()
  params = _init(model, jax.random.key(1), x)["params"]
  return model, params, x, lambda apply, params, x: apply({"params": params}, x)


def _loss(forward, apply):
  return lambda params, x: jnp.sum(forward(apply, params, x) ** 2)


CASES = {"mlp": _mlp_case, "cnn": _cnn_case, "block": _block_case}


# --- Helpers ------------------------------------------------------------------------------------


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' params."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for inner in jcore.jaxprs_in_params(eqn.params):
      yield from _eqns(inner)


def _in_dtypes(eqn):
  return tuple(np.dtype(v.aval.dtype) for v in eqn.invars)


def _gemms(jaxpr):
  """(operand dtypes, accumulation dtype) of every GEMM and convolution, nested ones included."""
  found = []
  for eqn in _eqns(jaxpr):
    if eqn.primitive.name in GEMMS:
      acc = eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype
      found.append((_in_dtypes(eqn)[:2], np.dtype(acc)))  # a ragged dot's group sizes: int
  return found


def _live(jaxpr, name):
  """Every ``name`` equation whose result is used, nested ones included.

  (JAX's JVP of ``reduce_max`` counts ties with a ``reduce_sum`` in the operand's dtype, and
  never uses the count: dead code, never run.)
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  used = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jcore.Literal)}
  used |= {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name and any(v in used for v in eqn.outvars):
      found.append(eqn)
    for inner in jcore.jaxprs_in_params(eqn.params):
      found += _live(inner, name)
  return found


def _ops(jaxpr, name):
  """The operand dtypes of every live ``name`` equation."""
  return [_in_dtypes(eqn) for eqn in _live(jaxpr, name)]


def _not_f32(jaxpr, name):
  """Each live ``name`` equation with a non-f32 operand, described."""
  return [
    f"{eqn.primitive.name} {[v.aval.str_short() for v in eqn.invars]} at "
    f"{eqn.source_info.name_stack}"
    for eqn in _live(jaxpr, name)
    if _in_dtypes(eqn) != (F32,) * len(eqn.invars)
  ]


def _assert_gemms_lowered(jaxpr, compute=BF16, count=None):
  gemms = _gemms(jaxpr)
  assert gemms, "no GEMM in the jaxpr"
  assert set(gemms) == {((compute, compute), F32)}, gemms
  if count is not None:
    assert len(gemms) == count, gemms


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def _rel(got, want):
  """||got - want|| / ||want|| (the absolute error where ``want`` is all zeros)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.linalg.norm(got - want) / (np.linalg.norm(want) or 1.0))


def _assert_close(got, want, tol=3e-2):
  """Each leaf of ``got`` within relative norm error ``tol`` of ``want``'s."""
  errors = jax.tree_util.tree_leaves_with_path(jax.tree.map(_rel, got, want))
  bad = {jax.tree_util.keystr(path): e for path, e in errors if not e < tol}
  assert not bad, bad


# --- 1, 2: the three models ---------------------------------------------------------------------


def _grad_jaxpr(case, remat=None):
  """The jaxpr of the gradient, w.r.t. params and input, of the case's bf16 autocast loss."""
  model, params, x, forward = CASES[case]()
  loss = _loss(forward, mpjax.autocast(model.apply, "mixed_bf16", remat=remat))
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_gemm_forward_and_backward_is_bf16_with_f32_accumulation(case):
  model, params, x, forward = CASES[case]()
  jaxpr = _grad_jaxpr(case)
  n_forward = len(_gemms(jax.make_jaxpr(functools.partial(forward, model.apply))(params, x)))
  # The forward and both backward GEMMs of each: none dropped, none left in f32.
  _assert_gemms_lowered(jaxpr, count=3 * n_forward)
  assert {np.dtype(a.dtype) for a in jaxpr.out_avals} == {F32}  # gradients of f32 values


# remat=False is the GPU lowering, where softmax is traced as JAX's custom-JVP one.
@pytest.mark.parametrize("remat", [None, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_exp_and_reduce_sum_forward_and_backward_takes_f32(case, remat):
  jaxpr = _grad_jaxpr(case, remat)
  assert _live(jaxpr, "reduce_sum")
  assert _live(jaxpr, "exp") or case != "block"  # the block's softmax has one
  assert _not_f32(jaxpr, "exp") == []
  assert _not_f32(jaxpr, "reduce_sum") == []


@pytest.mark.parametrize("remat", [None, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_gradients_match_f32_within_bf16_tolerance(case, remat):
  model, params, x, forward = CASES[case]()
  apply = mpjax.autocast(model.apply, "mixed_bf16", remat=remat)

  @jax.jit
  def run(params, x):
    return forward(apply, params, x), jax.grad(_loss(forward, apply))(params, x)

  @jax.jit
  def reference(params, x):
    return forward(model.apply, params, x), jax.grad(_loss(forward, model.apply))(params, x)

  (out, grads), (ref_out, ref_grads) = run(params, x), reference(params, x)
  chex.assert_type(out, jnp.float32)
  chex.assert_type(jax.tree.leaves(grads), jnp.float32)
  assert _rel(out, ref_out) < 3e-2
  assert not np.array_equal(out, ref_out)  # it did run in bf16
  _assert_close(grads, ref_grads)


def test_bias_gradient_over_many_examples_is_summed_in_f32():
  # d/db sum(x @ w + b) = the number of rows: 16384 ones summed in bf16 stop at 8192.
  model = nn.Dense(4)
  x = jax.random.normal(jax.random.key(0), (16384, 8))
  params = _init(model, jax.random.key(1), x[:1])["params"]

  def loss(apply):
    return lambda params, x: jnp.sum(apply({"params": params}, x))

  grads = jax.jit(jax.grad(loss(mpjax.autocast(model.apply, "mixed_bf16"))))(params, x)
  chex.assert_type(grads["bias"], jnp.float32)
  np.testing.assert_allclose(grads["bias"], np.full(4, 16384.0), rtol=1e-2)


def test_cnn_batch_stats_update_in_f32():
  model, params, x, _ = _cnn_case()
  stats = _init(model, jax.random.key(1), x)["batch_stats"]
  apply = jax.jit(
    functools.partial(mpjax.autocast(model.apply, "mixed_bf16"), mutable=["batch_stats"])
  )
  _, updates = apply({"params": params, "batch_stats": stats}, x)
  _, ref = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
  chex.assert_type(jax.tree.leaves(updates), jnp.float32)
  _assert_close(updates, ref)


def test_fp32_policy_returns_the_function_itself():
  fn = MLP().apply
  assert mpjax.autocast(fn, "fp32") is fn
  assert mpjax.autocast(fn, mpjax.get_policy("fp32")) is fn


def _saved(loss, *args):
  """What the backward pass of ``loss`` keeps, arguments excluded: [(aval, bytes)]."""
  return [
    (aval, math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
    for aval, where in saved_residuals(loss, *args)
    if "from the argument" not in where
  ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_pass_keeps_at_most_half_the_f32_activations(case):
  model, params, x, forward = CASES[case]()
  f32 = sum(b for _, b in _saved(_loss(forward, model.apply), params, x))
  cast_loss = _loss(forward, mpjax.autocast(model.apply))
  saved = _saved(cast_loss, params, x)
  assert sum(b for _, b in saved) <= 0.5 * f32
  # Activations are kept in bf16; the f32 ones left are reduction results and
  # the test loss's own (out ** 2, outside autocast), none larger than the output.
  out_size = math.prod(jax.eval_shape(functools.partial(forward, model.apply), params, x).shape)
  big_f32 = [a for a, _ in saved if a.dtype == F32 and math.prod(a.shape) > out_size]
  assert not big_f32, big_f32
  # The saving comes from remat; without it the same gradient keeps more.
  eager_loss = _loss(forward, mpjax.autocast(model.apply, remat=False))
  assert sum(b for _, b in _saved(eager_loss, params, x)) > sum(b for _, b in saved)
  grads = jax.jit(jax.grad(cast_loss))(params, x)
  # The same gradient up to bf16 rounding (without remat, softmax's is JAX's custom-JVP one).
  _assert_close(grads, jax.jit(jax.grad(eager_loss))(params, x), tol=1e-2)


def test_a_callback_runs_once_per_gradient_step():
  calls = []

  def fn(w, x):
    jax.debug.callback(lambda: calls.append(1))
    return jnp.tanh(x @ w)

  loss = lambda w, x: jnp.sum(mpjax.autocast(fn)(w, x))  # noqa: E731
  jax.block_until_ready(jax.jit(jax.grad(loss))(_normal(0, (16, 8)), _normal(1, (4, 16))))
  jax.effects_barrier()
  assert len(calls) == 1  # not again in a recomputation for the backward pass


def test_autocast_traces_once_per_argument_shapes_and_static_values():
  traces = []

  def fn(params, x, activate=True):
    traces.append(x.shape)
    h = x @ params["w"]
    return jax.nn.relu(h) if activate else h

  cast = mpjax.autocast(fn)
  params = {"w": _normal(0, (16, 8))}
  x1, x2 = _normal(1, (4, 16)), _normal(2, (4, 16))
  assert _rel(cast(params, x1), jax.nn.relu(x1 @ params["w"])) < 3e-2
  assert _rel(cast(params, x2), jax.nn.relu(x2 @ params["w"])) < 3e-2  # new values, one trace
  jax.jit(jax.grad(lambda p, x: jnp.sum(cast(p, x))))(params, x1)
  jax.jit(lambda p, x: cast(p, x))(params, x2)
  assert traces == [(4, 16)]
  assert cast(params, _normal(3, (5, 16))).shape == (5, 8)
  assert traces == [(4, 16), (5, 16)]
  assert float(jnp.min(cast(params, x1, activate=False))) < 0  # a static value is part of the key
  assert len(traces) == 3
  cast(params, x1, activate=False)
  assert len(traces) == 3


# --- 3: fp16 ------------------------------------------------------------------------------------


def test_fp16_block_with_large_activations_and_a_minus_1e9_mask_stays_finite():
  # A Dense in front makes the block's input (and so its LayerNorms' inputs and the residual
  # stream) an fp16 activation of magnitude ~300: x * x overflows fp16 unless the LayerNorm
  # statistics run in f32. (With them in fp16, rsqrt(inf) = 0 keeps the output finite, but the
  # gradients are wrong: hence the comparison with f32 too.)
  model = nn.Sequential([nn.Dense(32), Block()])
  x = _normal(0, (2, 8, 32), 300.0)
  params = _init(model, jax.random.key(1), x)
  apply = mpjax.autocast(model.apply, "mixed_fp16")

  def loss(apply):
    return lambda params, x: jnp.mean(apply(params, x) ** 2)

  out, grads = jax.jit(lambda p, x: (apply(p, x), jax.grad(loss(apply))(p, x)))(params, x)
  assert bool(jnp.all(jnp.isfinite(out)))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  chex.assert_type(jax.tree.leaves(grads), jnp.float32)
  # The fp16 rewrite, not an f32 fallback: its GEMMs are fp16 x fp16 -> f32.
  _assert_gemms_lowered(jax.make_jaxpr(apply)(params, x), compute=F16)
  ref_out, ref_grads = jax.jit(lambda p, x: (model.apply(p, x), jax.grad(loss(model.apply))(p, x)))(
    params, x
  )
  assert _rel(out, ref_out) < 3e-2
  _assert_close(grads, ref_grads)


def _lm_batches(steps, batch=16, length=9, vocab=16):
  """``steps`` batches of a next-token task: each token is the last + 1 or + 2 (mod vocab), at
  random, so the best loss on fresh data is log 2."""
  k1, k2 = jax.random.split(jax.random.key(0))
  start = jax.random.randint(k1, (steps, batch, 1), 0, vocab)
  jumps = jax.random.randint(k2, (steps, batch, length - 1), 1, 3)
  tokens = jnp.concatenate([start, start + jnp.cumsum(jumps, axis=-1)], axis=-1) % vocab
  return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}


def test_fp16_autocast_training_matches_f32_training():
  model, steps = LM(), 80
  batches = _lm_batches(steps)
  params = _init(model, jax.random.key(0), batches["inputs"][0])
  tx = optax.adam(1e-2)

  def make_loss(apply):
    def loss_fn(params, batch):
      logits = apply(params, batch["inputs"]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn

  def train(loss_fn, state):
    step = mpjax.make_train_step(loss_fn)
    state, metrics = jax.jit(lambda s, b: lax.scan(step, s, b))(state, batches)
    # The last 10 steps' mean: each step sees a fresh batch.
    return state, float(jnp.mean(metrics["loss"][-10:])), step

  # The state keeps fp32 master params (the step casts nothing before loss_fn) with dynamic loss
  # scaling on; autocast inside the loss does the fp16 compute.
  state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=tx, policy="fp32", loss_scale=mpjax.DynamicLossScale()
  )
  state, loss, step = train(make_loss(mpjax.autocast(model.apply, "mixed_fp16")), state)
  batch = jax.tree.map(lambda b: b[0], batches)
  _assert_gemms_lowered(jax.make_jaxpr(step)(state, batch), compute=F16)
  ref_state = mpjax.TrainState.create(apply_fn=model.apply, params=params, tx=tx, policy="fp32")
  ref_state, ref_loss, _ = train(make_loss(model.apply), ref_state)
  chex.assert_type(jax.tree.leaves(state.params), jnp.float32)
  assert int(state.step) + int(state.skipped_steps) == steps
  assert ref_loss < 1.0  # it learned: from log 16 = 2.77 towards log 2 = 0.69
  assert abs(loss - ref_loss) / ref_loss < 0.02, (loss, ref_loss)


# --- 4: composition -----------------------------------------------------------------------------


def _check_matches_f32(cast_fn, ref_fn, *args):
  """``cast_fn`` matches ``ref_fn`` in value and in gradient w.r.t. the first argument.

  Returns the gradient's jaxpr, whose GEMMs are all bf16 x bf16 -> f32.
  """

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a) ** 2)

  out, grads = jax.jit(lambda *a: (cast_fn(*a), jax.grad(loss(cast_fn))(*a)))(*args)
  ref_out, ref_grads = jax.jit(lambda *a: (ref_fn(*a), jax.grad(loss(ref_fn))(*a)))(*args)
  chex.assert_type(jax.tree.leaves(grads), jnp.float32)
  assert _rel(out, ref_out) < 3e-2
  _assert_close(grads, ref_grads)
  jaxpr = jax.make_jaxpr(jax.grad(loss(cast_fn)))(*args)
  _assert_gemms_lowered(jaxpr)
  return jaxpr


def _primitives(jaxpr):
  return {eqn.primitive.name for eqn in _eqns(jaxpr)}


def _layer(p, h):
  return jax.nn.relu(h @ p["w"] + p["b"])


def _stacked_params(layers=3, d=32):
  return {"w": _normal(0, (layers, d, d), d**-0.5), "b": _normal(1, (layers, d), 0.1)}


def test_autocast_enters_a_scan_over_stacked_layer_params():
  def fn(params, x):
    return lax.scan(lambda h, p: (_layer(p, h), None), x, params)[0]

  jaxpr = _check_matches_f32(mpjax.autocast(fn), fn, _stacked_params(), _normal(2, (8, 32)))
  assert "scan" in _primitives(jaxpr)  # still a loop, GEMMs lowered inside it
  # Forward, and both backward GEMMs, once each in the loop bodies.
  assert len(_gemms(jaxpr)) == 3


def _experts(params, x):
  """A mixture-of-experts layer: each token to one of 8 experts, one ragged (grouped) GEMM."""
  expert = jnp.argmax(x @ params["router"], axis=-1)
  order = jnp.argsort(expert)
  group_sizes = jnp.bincount(expert, length=params["w"].shape[0]).astype(jnp.int32)
  h = lax.ragged_dot(x[order], params["w"], group_sizes)
  return jnp.tanh(h)[jnp.argsort(order)]


def test_autocast_lowers_a_ragged_dot_forward_and_backward():
  params = {"router": _normal(0, (32, 8)), "w": _normal(1, (8, 32, 48), 0.2)}
  x = _normal(2, (64, 32))
  jaxpr = _check_matches_f32(mpjax.autocast(_experts, "mixed_bf16"), _experts, params, x)
  # Forward, and the two GEMMs of its gradient (the weight's in ragged-contracting mode).
  ragged = [e for e in _eqns(jaxpr) if e.primitive.name == "ragged_dot_general"]
  assert len(ragged) == 3
  modes = {e.params["ragged_dot_dimension_numbers"].rhs_group_dimensions for e in ragged}
  assert modes == {(0,), ()}
  report = mpjax.autocast_report(_experts, params, x, print_report=False)
  assert report.lowered_flops == report.gemm_flops == 2 * 64 * 32 * 8 + 2 * 64 * 32 * 48
  rows = mpjax.audit(jax.grad(lambda p, x: jnp.sum(mpjax.autocast(_experts)(p, x))), params, x)
  ragged_rows = [r for r in rows.rows if r.op == "ragged_dot_general"]
  # Each grouped GEMM does 64 x 32 x 48 multiply-adds, whatever its mode; the gradient w.r.t.
  # x, which this grad does not ask for, is not computed and not listed.
  assert [r.flops for r in ragged_rows] == [2 * 64 * 32 * 48] * 2
  assert ragged_rows[0].dims == {"batch": 1, "M": 64, "N": 48, "K": 32}
  assert rows.fast_path_share == 1.0


def test_autocast_composes_with_vmap_both_ways():
  params = {"w": _normal(0, (16, 32), 0.25), "b": _normal(1, (32,), 0.1)}
  x = _normal(2, (6, 16))

  def per_example(params, x):
    assert x.shape == (16,)
    return _layer(params, x)

  ref = jax.vmap(per_example, in_axes=(None, 0))
  _check_matches_f32(jax.vmap(mpjax.autocast(per_example), in_axes=(None, 0)), ref, params, x)
  _check_matches_f32(mpjax.autocast(ref), ref, params, x)


def test_autocast_enters_remat_in_flax_and_jax_checkpoint():
  class Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.remat(nn.Dense)(32)(x)
      return nn.Dense(4)(jax.checkpoint(jnp.tanh)(x))

  model = Remat()
  x = _normal(0, (4, 16))
  params = _init(model, jax.random.key(1), x)
  jaxpr = _check_matches_f32(mpjax.autocast(model.apply), model.apply, params, x)
  remats = [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name in ("checkpoint", "remat2")]
  # The model's two (no policy), inside autocast's own around the whole function, whose
  # recomputation in the backward pass holds them again.
  remats = [eqn for eqn in remats if eqn.params["policy"] is None]
  assert len(remats) >= 2
  assert any(_gemms(eqn.params["jaxpr"]) for eqn in remats)  # the Dense's, lowered (above)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_autocast_enters_both_branches_of_a_cond(sign):
  params = {"w": _normal(0, (16, 8), 0.25), "v": _normal(1, (16, 8), 0.25)}

  def fn(params, x):
    return lax.cond(
      jnp.sum(x) > 0,
      lambda x: x @ params["w"],
      lambda x: jnp.tanh(x @ params["v"]),
      x,
    )

  x = sign * jnp.abs(_normal(2, (4, 16)))
  jaxpr = _check_matches_f32(mpjax.autocast(fn), fn, params, x)
  assert "cond" in _primitives(jaxpr)


def test_autocast_enters_a_while_loop():
  w = _normal(0, (16, 16), 0.25)

  def fn(w, x):
    def body(carry):
      i, h = carry
      return i + 1, jnp.tanh(h @ w) + x

    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

  x = _normal(1, (4, 16))
  cast = mpjax.autocast(fn)
  out = jax.jit(cast)(w, x)
  chex.assert_type(out, jnp.float32)
  assert _rel(out, fn(w, x)) < 3e-2
  jaxpr = jax.make_jaxpr(cast)(w, x)
  assert "while" in _primitives(jaxpr)
  _assert_gemms_lowered(jaxpr, count=1)


def test_autocast_runs_relu_custom_jvp_and_its_rule():
  params = {"w": _normal(0, (16, 32), 0.25), "v": _normal(1, (32, 4), 0.25)}

  def fn(params, x):
    return jax.nn.relu(x @ params["w"]) @ params["v"]

  x = _normal(2, (4, 16))
  cast = mpjax.autocast(fn)
  assert "custom_jvp_call" in _primitives(jax.make_jaxpr(cast)(params, x))
  _check_matches_f32(cast, fn, params, x)


def test_user_custom_vjp_backward_still_runs():
  @jax.custom_vjp
  def doubles_gradient(x):
    return x

  doubles_gradient.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))
  params = {"w": _normal(0, (16, 32), 0.25), "v": _normal(1, (32, 4), 0.25)}
  x = _normal(2, (4, 16))

  def fn(params, x, identity=doubles_gradient):
    return jnp.tanh(identity(x @ params["w"])) @ params["v"]

  def loss(fn):
    return lambda params, x: jnp.sum(fn(params, x) ** 2)

  cast = mpjax.autocast(fn)
  out, grads = jax.jit(jax.value_and_grad(loss(cast)))(params, x)
  ref_fn = functools.partial(fn, identity=lambda x: x)
  ref_out, ref_grads = jax.jit(jax.value_and_grad(loss(ref_fn)))(params, x)
  assert _rel(out, ref_out) < 3e-2
  assert _rel(grads["w"], 2 * ref_grads["w"]) < 3e-2  # the user's bwd ran
  assert _rel(grads["v"], ref_grads["v"]) < 3e-2
  chex.assert_type(jax.tree.leaves(grads), jnp.float32)
  _assert_gemms_lowered(jax.make_jaxpr(jax.grad(loss(cast)))(params, x))


def test_autocast_runs_an_nnx_module_through_split_and_merge():
  class NNXMLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(16, 32, rngs=rngs)
      self.norm = nnx.LayerNorm(32, rngs=rngs)
      self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.norm(self.hidden(x))))

  graphdef, state = nnx.split(NNXMLP(nnx.Rngs(0)))

  def fn(state, x):
    return nnx.merge(graphdef, state)(x)

  _check_matches_f32(mpjax.autocast(fn), fn, state, _normal(1, (4, 16)))


def test_what_an_nnx_module_sets_on_itself_is_carried_out_as_nnx_transforms_carry_it():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(16, 32, rngs=rngs)
      self.norm = nnx.BatchNorm(32, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.out(self.drop(nnx.relu(self.norm(self.linear(x)))))

  def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)

  def train(wrap):
    model = Net(nnx.Rngs(0))
    initial = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat, nnx.RngCount))

    @nnx.jit
    def step(model, x):
      return nnx.value_and_grad(wrap(loss_fn))(model, x)

    losses = [float(step(model, _normal(i, (8, 16)) + 3.0)[0]) for i in range(2)]
    return initial, *nnx.state(model, nnx.BatchStat, nnx.RngCount), losses

  (initial_stats, initial_counts), stats, counts, losses = train(lambda f: f)
  _, cast_stats, cast_counts, cast_losses = train(mpjax.autocast)
  # The premise: a step moves the running statistics and the dropout stream's count.
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), initial_stats, stats)
  assert all(jax.tree.leaves(moved)) and jax.tree.leaves(initial_counts) != jax.tree.leaves(counts)
  chex.assert_trees_all_equal(cast_counts, counts)  # the same dropout masks, step after step
  chex.assert_trees_all_close(cast_stats, stats, rtol=3e-2, atol=3e-3)
  chex.assert_type(jax.tree.leaves(cast_stats), jnp.float32)
  np.testing.assert_allclose(cast_losses, losses, rtol=3e-2)


# --- 5: explicit choices ------------------------------------------------------------------------

DIMS = (((1,), (0,)), ((), ()))


def test_a_highest_precision_dot_stays_f32():
  a, b = _normal(0, (8, 16)), _normal(1, (16, 4))

  def fn(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)

  cast = mpjax.autocast(fn)
  np.testing.assert_allclose(jax.jit(cast)(a, b), fn(a, b), rtol=1e-6, atol=1e-6)
  gemms = _gemms(jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(cast(a, b) ** 2), (0, 1)))(a, b))
  assert len(gemms) == 3
  assert set(gemms) == {((F32, F32), F32)}


def test_a_user_written_mixed_dot_general_stays_as_written():
  a, b = _normal(0, (8, 16)), _normal(1, (16, 4))

  def fn(a, b):
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return lax.dot_general(a, b, DIMS, preferred_element_type=jnp.float32)

  jaxpr = jax.make_jaxpr(mpjax.autocast(fn))(a, b)
  (dot,) = [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "dot_general"]
  assert not [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "custom_vjp_call"]  # as written
  assert _in_dtypes(dot) == (BF16, BF16)
  assert np.dtype(dot.outvars[0].aval.dtype) == F32
  np.testing.assert_array_equal(jax.jit(mpjax.autocast(fn))(a, b), jax.jit(fn)(a, b))


def test_an_explicit_astype_float16_stays_float16_under_bf16():
  x = jnp.full((4,), 1 + 2**-9)  # exact in fp16, rounds to 1 in bf16

  def fn(x):
    return x.astype(jnp.float16) * 2

  cast = mpjax.autocast(fn, "mixed_bf16")
  assert _ops(jax.make_jaxpr(cast)(x), "mul") == [(F16, F16)]
  out = jax.jit(cast)(x)
  chex.assert_type(out, jnp.float32)  # the policy's output dtype
  np.testing.assert_array_equal(out, np.full(4, 2 + 2**-8))


# --- 6: rules -----------------------------------------------------------------------------------


def test_a_keep_rule_runs_exp_in_its_traced_dtype():
  x = _normal(0, (8,)).astype(jnp.bfloat16)
  default = jax.make_jaxpr(mpjax.autocast(jnp.exp))(x)
  kept = jax.make_jaxpr(mpjax.autocast(jnp.exp, rules={"exp": "keep"}))(x)
  assert _ops(default, "exp") == [(F32,)]
  assert _ops(kept, "exp") == [(BF16,)]


def test_a_module_rule_keeps_the_head_in_f32():
  model, params, x, forward = _mlp_case()
  cast = mpjax.autocast(model.apply, rules={"*head*": "fp32"})
  lowered, f32 = ((BF16, BF16), F32), ((F32, F32), F32)
  jaxpr = jax.make_jaxpr(functools.partial(forward, cast))(params, x)
  assert Counter(_gemms(jaxpr)) == {lowered: 2, f32: 1}
  f32_dots = [
    eqn
    for eqn in _eqns(jaxpr)
    if eqn.primitive.name == "dot_general" and _in_dtypes(eqn) == (F32, F32)
  ]
  assert [d.invars[1].aval.shape for d in f32_dots] == [params["head"]["kernel"].shape]
  loss = _loss(forward, cast)
  gemms = _gemms(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
  assert Counter(gemms) == {lowered: 6, f32: 3}  # forward and backward
  out, grads = jax.jit(lambda p, x: (forward(cast, p, x), jax.grad(loss)(p, x)))(params, x)
  ref = forward(model.apply, params, x)
  assert _rel(out, ref) < 3e-2
  _assert_close(grads, jax.grad(_loss(forward, model.apply))(params, x))


def test_gemm_only_level_changes_only_the_gemms():
  w, x, y = _normal(0, (16, 8), 0.25), _normal(1, (4, 16)), _normal(2, (8,)).astype(jnp.bfloat16)

  def fn(w, x, y):
    return jnp.tanh(x @ w), jnp.exp(y)

  gemm_only = jax.make_jaxpr(mpjax.autocast(fn, level="gemm_only"))(w, x, y)
  _assert_gemms_lowered(gemm_only, count=1)
  assert _ops(gemm_only, "tanh") == [(F32,)]  # the GEMM's result came back f32
  assert _ops(gemm_only, "exp") == [(BF16,)]  # as traced
  full = jax.make_jaxpr(mpjax.autocast(fn))(w, x, y)
  assert _ops(full, "tanh") == [(BF16,)]
  assert _ops(full, "exp") == [(F32,)]
  out = jax.jit(mpjax.autocast(fn, level="gemm_only"))(w, x, y)
  chex.assert_type(out, jnp.float32)
  assert _rel(out[0], fn(w, x, y)[0]) < 3e-2


def test_a_minus_1e9_constant_saturates_to_the_fp16_maximum():
  w, x = _normal(0, (16, 4)), _normal(1, (4, 16))
  mask = jnp.tril(jnp.ones((4, 4), bool))

  def fn(w, x):
    return jnp.where(mask, x @ w, -1e9)

  out = jax.jit(mpjax.autocast(fn, "mixed_fp16"))(w, x)
  assert bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_array_equal(out[~mask], np.full(6, -65504.0))
  assert _rel(jnp.where(mask, out, 0), jnp.where(mask, fn(w, x), 0)) < 3e-2


# --- Name stacks --------------------------------------------------------------------------------


class _ScanLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.relu(nn.Dense(16, name="inner")(x)), None


@jax.custom_jvp
def _matmul(x, w):
  return x @ w


_matmul.defjvp(lambda p, t: (_matmul(*p), t[0] @ p[1] + p[0] @ t[1]))


class Scoped(nn.Module):
  """Named GEMMs in Flax's scan and remat, a jit, a cond and a custom_jvp with GEMMs in its rule."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="first")(x)
    scan = nn.scan(_ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    x, _ = scan(name="stack")(x, None)
    x = nn.remat(nn.Dense)(16, name="rem")(x)
    w1, w2, w3 = (self.param(f"w{i}", nn.initializers.lecun_normal(), (16, 16)) for i in range(3))
    with jax.named_scope("jitted"):
      x = jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w1)
    with jax.named_scope("branch"):
      x = lax.cond(jnp.sum(x) > 0, lambda a: a @ w2, lambda a: a @ w2.T, x)
    with jax.named_scope("custom"):
      x = _matmul(x, w3)
    return nn.Dense(4, name="head")(x)


SCOPES = {"first", "inner", "rem", "jitted", "branch", "custom", "head"}


def _gemm_paths(jaxpr, prefix=""):
  """The name stack of every GEMM from the top (as mpjax.audit reads it), nested ones included."""
  paths = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    path = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
    if eqn.primitive.name in GEMMS:
      paths.append(path)
    for inner in jcore.jaxprs_in_params(eqn.params):
      paths += _gemm_paths(inner, path)
  return paths


def _scope_of(path):
  """The one module or named scope of ``SCOPES`` that ``path`` names."""
  (scope,) = SCOPES.intersection(path.split("/"))
  return scope


def _by_pass(paths):
  """The scopes of forward GEMMs, and of the backward (transposed) ones."""
  forward = {_scope_of(p) for p in paths if not p.startswith("transpose(")}
  backward = {_scope_of(p) for p in paths if p.startswith("transpose(jvp(")}
  return forward, backward


@functools.cache
def _scoped_case():
  x = _normal(0, (2, 16))
  model = Scoped()
  params = _init(model, jax.random.key(1), x)["params"]
  return model, params, x, lambda apply, params, x: apply({"params": params}, x)


def test_every_gemm_keeps_its_module_path_forward_and_backward():
  model, params, x, forward = _scoped_case()
  cast = mpjax.autocast(model.apply)
  plain_fwd = _gemm_paths(jax.make_jaxpr(functools.partial(forward, model.apply))(params, x))
  cast_fwd = _gemm_paths(jax.make_jaxpr(functools.partial(forward, cast))(params, x))
  assert sorted(cast_fwd) == sorted(plain_fwd)
  assert {_scope_of(p) for p in cast_fwd} == SCOPES
  plain_loss, cast_loss = _loss(forward, model.apply), _loss(forward, cast)
  plain = _gemm_paths(jax.make_jaxpr(jax.grad(plain_loss))(params, x))
  paths = _gemm_paths(jax.make_jaxpr(jax.grad(cast_loss))(params, x))
  assert _by_pass(paths) == _by_pass(plain) == (SCOPES, SCOPES), paths
  assert all(p.startswith(("jvp(Scoped)/", "transpose(jvp(")) for p in paths), paths
  # The custom_jvp rule's GEMMs (which take tangents) are transposed under jax.grad.
  _assert_close(jax.grad(cast_loss)(params, x), jax.grad(plain_loss)(params, x))


def test_a_module_rule_still_matches_a_flax_module_under_grad():
  model, params, x, forward = _mlp_case()
  loss = _loss(forward, mpjax.autocast(model.apply, rules={"*head*": "fp32"}))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
  dtypes = {}
  for eqn, path in zip(
    (e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"), _gemm_paths(jaxpr), strict=True
  ):
    dtypes.setdefault(path.split("/")[-1], set()).add(_in_dtypes(eqn))
  assert dtypes == {"Dense_0": {(BF16, BF16)}, "Dense_1": {(BF16, BF16)}, "head": {(F32, F32)}}


def test_audit_rows_of_an_autocast_function_name_their_modules():
  model, params, x, forward = _scoped_case()
  cast = mpjax.autocast(model.apply)
  rows = mpjax.audit(functools.partial(forward, cast), params, x).rows
  plain = mpjax.audit(functools.partial(forward, model.apply), params, x).rows
  assert sorted(r.path for r in rows) == sorted(r.path for r in plain)
  loss = _loss(forward, cast)
  paths = [r.path for r in mpjax.audit(jax.grad(loss), params, x).rows]
  assert _by_pass(paths) == (SCOPES, SCOPES), paths
  assert "jvp(Scoped)/head" in paths


# --- 7: bad input -------------------------------------------------------------------------------


def _never_called(*args):
  raise AssertionError("autocast must check its arguments before calling fn")


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"rules": {"exp": "fp23"}}, r"'fp23' is not an op class.*Did you mean 'fp32'"),
    ({"rules": {"expp": "fp32"}}, r"'expp' is neither a primitive.*Did you mean 'exp'"),
    ({"rules": {"*head*": "bf61"}}, r"'\*head\*': 'bf61' names no policy"),
    ({"policy": "mixed_bf61"}, r"precision policy 'mixed_bf61'.*Nearest preset: 'mixed_bf16'"),
    ({"level": "fulll"}, r"level='fulll' is not one of 'full', 'gemm_only'"),
  ],
  ids=["unknown_class", "unknown_primitive", "unknown_module_policy", "policy_typo", "level"],
)
def test_bad_arguments_raise_when_autocast_is_called(kwargs, match):
  policy = kwargs.pop("policy", "mixed_bf16")
  with pytest.raises(ValueError, match=match):
    mpjax.autocast(_never_called, policy, **kwargs)
  with pytest.raises(ValueError, match=match):
    mpjax.autocast_report(_never_called, jnp.ones(2), policy=policy, **kwargs)


def _doubled_by_a_kernel(x):
  """``2 * x`` by a Pallas kernel (interpreted on the CPU): a primitive autocast does not know,
  holding a program typed for the dtypes it was traced with."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return pl.pallas_call(kernel, out_shape=out, interpret=True)(x)


def _kernel_after_a_gemm(x, w):
  return _doubled_by_a_kernel(jnp.tanh(x @ w)), _doubled_by_a_kernel((x @ w).astype(jnp.bfloat16))


def test_a_primitive_autocast_does_not_know_runs_as_traced_and_a_rule_can_say_so(caplog):
  x = jax.random.normal(jax.random.key(0), (8, 16))
  w = 0.25 * jax.random.normal(jax.random.key(1), (16, 8))
  assert "pallas_call" not in mpjax.OP_CLASSES  # the premise: autocast does not know it
  expected = _kernel_after_a_gemm(x, w)
  with caplog.at_level("WARNING", logger="mpjax"):
    warned = jax.jit(mpjax.autocast(_kernel_after_a_gemm, "mixed_bf16"))(x, w)
  assert "'pallas_call' is not classified" in caplog.text
  assert "rules={'pallas_call': 'keep'}" in caplog.text  # the advice it gives is one that works
  caplog.clear()
  with caplog.at_level("WARNING", logger="mpjax"):
    keep = mpjax.autocast(_kernel_after_a_gemm, "mixed_bf16", rules={"pallas_call": "keep"})
    kept = jax.jit(keep)(x, w)
  assert "not classified" not in caplog.text
  chex.assert_type(kept, jnp.float32)  # the policy's output dtype
  chex.assert_trees_all_equal(kept, warned)
  chex.assert_trees_all_close(kept, expected, rtol=2e-2, atol=5e-2)
  assert not jnp.array_equal(kept[0], expected[0])  # and the GEMM before it did run in bf16


@pytest.mark.parametrize(
  ("rules", "match"),
  [
    ({"pallas_call": "follow"}, r"'follow' cannot run it: 'pallas_call' holds a program typed"),
    ({"pallas_cal": "keep"}, r"'pallas_cal' names no primitive of this function.*'pallas_call'"),
    ({"Dense_0": "keep"}, r"'Dense_0' names no primitive.*a wildcard or a '/', e.g. '\*Dense_0\*'"),
  ],
  ids=["program_in_another_class", "typo", "module_without_wildcard"],
)
def test_a_rule_for_a_primitive_autocast_does_not_know_is_checked_against_the_trace(rules, match):
  x, w = jnp.ones((8, 16)), jnp.ones((16, 8))
  run = mpjax.autocast(_kernel_after_a_gemm, "mixed_bf16", rules=rules)  # accepted: not traced
  with pytest.raises(ValueError, match=match):
    jax.jit(run)(x, w)


def test_a_primitive_autocast_enters_takes_no_class():
  with pytest.raises(ValueError, match=r"autocast enters 'scan'.*takes no class"):
    mpjax.autocast(_never_called, "mixed_bf16", rules={"scan": "fp32"})


# --- 8: autocast_report -------------------------------------------------------------------------


def test_report_counts_the_mlp_gemms_in_bf16(capsys):
  model, params, x, forward = _mlp_case()
  report = mpjax.autocast_report(model.apply, {"params": params}, x)
  assert isinstance(report, mpjax.AutocastReport)
  assert report.by_class["lower"] == {"bfloat16": 3}
  assert report.lowered_share == 1.0
  assert report.gemm_flops == report.lowered_flops == 2 * 2 * (16 * 32 + 32 * 32 + 32 * 4)
  assert any("Dense_0" in path for path in report.by_module)
  assert any("head" in path for path in report.by_module)
  assert "Dense_0" in capsys.readouterr().out  # the printed table
  jaxpr = jax.make_jaxpr(functools.partial(forward, mpjax.autocast(model.apply)))(params, x)
  assert report.by_class["lower"]["bfloat16"] == len(_gemms(jaxpr))


def test_report_with_an_f32_head_has_a_lowered_share_below_one():
  model, params, x, _ = _mlp_case()
  report = mpjax.autocast_report(
    model.apply, {"params": params}, x, rules={"*head*": "fp32"}, print_report=False
  )
  assert report.lowered_share < 1
  assert report.lowered_flops == 2 * 2 * (16 * 32 + 32 * 32)
  head = {path: counts for path, counts in report.by_module.items() if "head" in path}
  assert head and all("bfloat16" not in counts for counts in head.values()), head


def test_report_counts_gemms_in_a_scan_once_per_iteration_and_explicit_f32_as_f32():
  params, x = _stacked_params(layers=3), _normal(2, (8, 32))

  def scanned(params, x):
    return lax.scan(lambda h, p: (_layer(p, h), None), x, params)[0]

  report = mpjax.autocast_report(scanned, params, x, print_report=False)
  assert report.by_class["lower"] == {"bfloat16": 3}
  assert report.gemm_flops == report.lowered_flops == 3 * 2 * 8 * 32 * 32

  def highest(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST)

  report = mpjax.autocast_report(highest, x, params["w"][0], print_report=False)
  assert report.gemm_flops == 2 * 8 * 32 * 32
  assert report.lowered_flops == 0 and report.lowered_share == 0.0


def test_op_classes_name_the_documented_classes():
  assert mpjax.OP_CLASSES["dot_general"] == mpjax.OP_CLASSES["conv_general_dilated"] == "lower"
  assert mpjax.OP_CLASSES["exp"] == mpjax.OP_CLASSES["reduce_sum"] == "fp32"
  assert mpjax.OP_CLASSES["add"] == "promote"
  assert mpjax.OP_CLASSES["reshape"] == "follow"
  assert set(mpjax.OP_CLASSES.values()) == {"lower", "fp32", "promote", "follow", "keep"}


def test_reverse_mode_jacobian_works_and_forward_mode_is_refused_as_documented():
  f = mpjax.autocast(lambda w, x: jnp.tanh(x @ w).sum(-1), "mixed_bf16")
  w, x = jax.random.normal(jax.random.key(0), (8, 8)), jax.random.normal(jax.random.key(1), (4, 8))
  jac = jax.jit(jax.jacrev(f))(w, x)
  ref = jax.jacrev(lambda w, x: jnp.tanh(x @ w).sum(-1))(w, x)
  assert jac.dtype == jnp.float32
  np.testing.assert_allclose(jac, ref, rtol=0.05, atol=0.05)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jacfwd(f)(w, x)


# --- Every GEMM layout runs, forward and backward ----------------------------------------------

# Transposed and batched GEMMs as real models write them. XLA:CPU runs a bf16 x bf16 -> f32
# dot only with the left operand's contracting dim last; it folds transposes written around a
# GEMM (``w.T``, ``swapaxes``, the transpose of a gradient) into the dot and may swap its
# operands, which once made it upcast such a GEMM to f32 or fail with "UNIMPLEMENTED:
# Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32".
LAYOUTS = {
  "tied_embedding_x_wT": (lambda x, w: jnp.dot(x, w.T), (8, 16), (24, 16)),
  "tied_embedding_einsum": ("bsd,vd->bsv", (2, 8, 16), (24, 16)),
  "lhs_transposed": (lambda x, w: x.T @ w, (16, 8), (16, 24)),
  "scores_swapaxes": (lambda q, k: q @ jnp.swapaxes(k, -1, -2), (2, 4, 8, 16), (2, 4, 8, 16)),
  "weight_stored_out_in": ("bsd,fd->bsf", (2, 8, 16), (32, 16)),
  "gated_mlp_down_transposed": ("bsf,df->bsd", (2, 8, 32), (16, 32)),
  "gated_mlp_up": ("bsd,dgf->bsgf", (2, 8, 16), (16, 2, 32)),
  "multi_head_scores": ("bqhd,bkhd->bhqk", (2, 8, 4, 16), (2, 8, 4, 16)),
  "multi_head_values": ("bhqk,bkhd->bqhd", (2, 4, 8, 8), (2, 8, 4, 16)),
  "grouped_query_scores": ("bqhgd,bkhd->bhgqk", (2, 8, 2, 2, 16), (2, 8, 2, 16)),
  "grouped_query_values": ("bhgqk,bkhd->bqhgd", (2, 2, 2, 8, 8), (2, 8, 2, 16)),
  "multi_query_scores": ("bqhd,bkd->bhqk", (2, 8, 4, 16), (2, 8, 16)),
  "multi_query_values": ("bhqk,bkd->bqhd", (2, 4, 8, 8), (2, 8, 16)),
  "gemma_query_projection": ("btd,ndh->btnh", (2, 8, 16), (4, 16, 8)),
  "gemma_output_projection": ("btnh,nhd->btd", (2, 8, 4, 8), (4, 8, 16)),
  "sequence_major_batch": ("qbd,kbd->bqk", (8, 2, 16), (8, 2, 16)),
}


@pytest.mark.parametrize("options", [{}, {"remat": False}, {"level": "gemm_only"}])
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_every_gemm_layout_runs_bf16_forward_and_backward(case, options):
  form, lhs_shape, rhs_shape = LAYOUTS[case]
  gemm = form if callable(form) else functools.partial(jnp.einsum, form)

  def loss(a, b):
    return jnp.mean(jnp.sin(gemm(a, b).astype(jnp.float32)))

  a, b = (
    jax.random.normal(k, s)
    for k, s in zip(jax.random.split(jax.random.key(0)), (lhs_shape, rhs_shape), strict=True)
  )
  step = jax.jit(jax.value_and_grad(mpjax.autocast(loss, "mixed_bf16", **options), (0, 1)))
  value, grads = step(a, b)  # runs: no "Unsupported element type for DotThunk"
  ref_value, ref_grads = jax.value_and_grad(loss, (0, 1))(a, b)
  chex.assert_trees_all_close(value, ref_value, atol=0.01)
  for g, r in zip(grads, ref_grads, strict=True):
    chex.assert_type(g, jnp.float32)
    assert float(jnp.max(jnp.abs(g - r))) <= 0.05 * float(jnp.max(jnp.abs(r)))
  # On the fast kernel: every compiled GEMM, forward and both backward, bf16 x bf16 -> f32.
  compiled = parse_compiled_gemms(step.lower(a, b).compile().as_text())
  assert len(compiled) == 3
  assert {(g.lhs_dtype, g.rhs_dtype, g.out_dtype) for g in compiled} == {
    ("bfloat16", "bfloat16", "float32")
  }


class _TokensResidual(nn.Module):
  """Token and learnt position embeddings, one pre-norm residual branch: how a GPT starts."""

  @nn.compact
  def __call__(self, tokens):
    # jnp.take runs under jit: the lookup inside it must still be seen as one.
    x = nn.Embed(64, 32)(tokens) + self.param("pos", nn.initializers.normal(), (8, 32))
    return x + nn.Dense(32)(nn.LayerNorm()(x))


@pytest.mark.parametrize(
  "policy, rules, residual",
  [("mixed_bf16", None, BF16), ("mixed_fp16", None, F32), ("mixed_bf16", {"*Embed*": "fp32"}, F32)],
)
def test_an_embedding_lookup_starts_a_bf16_residual_stream_under_bf16_compute_only(
  policy, rules, residual
):
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)
  model = _TokensResidual()
  params = model.init(jax.random.key(1), tokens)
  table = params["params"]["Embed_0"]["embedding"]
  cast = mpjax.autocast(model.apply, policy, rules=rules)
  jaxpr = jax.make_jaxpr(cast)(params, tokens)
  (gather,) = _live(jaxpr, "gather")
  assert _in_dtypes(gather)[0] == F32  # the f32 table is read as it is: no bf16 copy of it
  *_, add = _live(jaxpr, "add")  # the residual add, the function's last
  assert add.outvars[0].aval.shape == (2, 8, 32)
  # The position embedding joined the looked-up rows as a bias joins a GEMM's result.
  assert np.dtype(add.outvars[0].aval.dtype) == residual
  # The rows looked up are the table's, rounded once to the residual's dtype.
  embed = nn.Embed(64, 32).apply
  rows = jax.jit(
    mpjax.autocast(lambda w, t: embed({"params": {"embedding": w}}, t), policy, rules=rules)
  )
  np.testing.assert_array_equal(
    rows(table, tokens), table[tokens].astype(residual).astype(jnp.float32)
  )


def test_a_bf16_embedding_lookup_accumulates_its_gradient_in_f32():
  # 4096 lookups of one row: a bf16 scatter-add would lose the sum (2^-9 per add).
  table = _normal(0, (16, 32))
  tokens = jnp.full((4096,), 3)
  w = _normal(1, (4096, 32)).astype(jnp.bfloat16).astype(jnp.float32)
  loss = mpjax.autocast(lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * w), "mixed_bf16")
  grad = jax.jit(jax.grad(loss))(table)
  want = np.asarray(w, np.float64).sum(0)
  assert np.abs(np.asarray(grad[3]) - want).max() < 1e-4 * np.abs(w).sum(0).max()
  assert not np.asarray(grad[:3]).any() and not np.asarray(grad[4:]).any()


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_tied_embedding_lm_trains_in_mixed_bf16(api):
  """Flax's ``Embed.attend`` (lm1b, wmt, Gemma's tied output head) under autocast, jitted."""
  vocab, d = 32, 16
  tokens = jnp.arange(16).reshape(2, 8) % vocab
  if api == "linen":

    class TiedLM(nn.Module):
      @nn.compact
      def __call__(self, t):
        embed = nn.Embed(vocab, d)
        return embed.attend(nn.gelu(nn.Dense(d)(embed(t))))

    model = TiedLM()
    params = model.init(jax.random.key(0), tokens)
    apply = model.apply
  else:

    class NNXTiedLM(nnx.Module):
      def __init__(self, rngs):
        self.embed, self.dense = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)

      def __call__(self, t):
        return self.embed.attend(nnx.gelu(self.dense(self.embed(t))))

    graphdef, params = nnx.split(NNXTiedLM(nnx.Rngs(0)))

    def apply(p, t):
      return nnx.merge(graphdef, p)(t)

  def loss_fn(p, batch):
    logits = apply(p, batch).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch).mean()

  losses = {}
  for policy in ("fp32", "mixed_bf16"):
    state = mpjax.TrainState.create(
      apply_fn=None, params=params, tx=optax.adam(3e-2), policy=policy
    )
    step = jax.jit(mpjax.make_train_step(loss_fn))
    for _ in range(30):
      state, metrics = step(state, tokens)
    losses[policy] = float(metrics["loss"])
  assert losses["fp32"] < 0.5 * math.log(vocab)  # it learns
  assert abs(losses["mixed_bf16"] - losses["fp32"]) < 0.05 * losses["fp32"] + 0.02
  report = mpjax.audit(step, state, tokens)
  assert report.fast_path_share == 1.0


def test_stack_and_unstack_are_classified_and_stack_promotes(caplog):
  """``lax.stack`` appears where Flax's BatchNorm runs under ``vmap(axis_name=...)``."""

  def fn(x, w):
    h = x @ w  # bf16 under autocast
    a, b = lax.unstack(lax.stack([h, h.astype(jnp.float32) * 2.0]))
    return a, b

  x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  with caplog.at_level("WARNING", logger="mpjax"):
    a, b = jax.jit(mpjax.autocast(fn, "mixed_bf16"))(x, w)
  assert "not classified" not in caplog.text
  chex.assert_type([a, b], jnp.float32)  # the f32 input wins: stack promotes
  chex.assert_trees_all_close(b, 2.0 * a)
