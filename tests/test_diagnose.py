"""mpjax.diagnose: finding the op that overflows fp16, suggesting rules, gradient health.

Each planted fault is checked end to end: the fault really overflows fp16 where f32 is finite,
``find_nonfinite`` (given the loss and the train step's loss scale) names the planted module and
pass, and training under mixed_fp16 with the rules it gives (or with ``suggest_rules``) skips no
step and ends where an f32 run ends.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import traverse_util

import mpjax
from mpjax.autocast import module_of as autocast_module_of
from mpjax.diagnose import module_of

LOSS_SCALE = 2.0**15  # DynamicLossScale's initial scale under mixed_fp16
FP16_MAX = 65504.0
BATCH, WIDTH, CLASSES = 8, 16, 4
STEPS = 40


# --- Models with planted faults ------------------------------------------------------------------


class Amplify(nn.Module):
  """A projection times a large constant: its fp16 output overflows, its f32 output does not."""

  gain: float = 3.0e4

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH, name="proj")(x) * self.gain
    self.sow("intermediates", "amplified", h)
    return h


class LoudThenNormed(nn.Module):
  """Fault (a): `loud` overflows fp16 in the forward pass; the LayerNorm after it brings it back."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(Amplify(name="loud")(x))
    return nn.Dense(CLASSES, name="logits")(h)


class SoftClip(nn.Module):
  """``cap * tanh(x / cap)``: forward values stay near x, the cotangent is multiplied by cap."""

  cap: float = 50.0

  @nn.compact
  def __call__(self, x):
    return self.cap * jnp.tanh(x / self.cap)


class ClippedHidden(nn.Module):
  """Fault (b): the scaled cotangent times `squash`'s cap overflows fp16 in the backward pass."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH, name="hidden")(x)
    self.sow("intermediates", "hidden_act", h)
    h = SoftClip(name="squash")(h)
    return nn.Dense(CLASSES, name="logits")(h)


class RawAttention(nn.Module):
  """Single-head attention without the 1/sqrt(d) scale, on un-normalised inputs."""

  @nn.compact
  def __call__(self, x):
    q = nn.Dense(WIDTH, name="query")(x)
    k = nn.Dense(WIDTH, name="key")(x)
    v = nn.Dense(WIDTH, name="value")(x)
    scores = jnp.einsum("bqd,bkd->bqk", q, k)
    self.sow("intermediates", "scores", scores)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)


class LargeScores(nn.Module):
  """Fault (c): attention scores of `mixer` leave fp16's range before the softmax."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(RawAttention(name="mixer")(x)).mean(axis=1)
    return nn.Dense(CLASSES, name="logits")(h)


class Healthy(nn.Module):
  """No fault: activations of order 1-10, nothing near fp16's limits."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH, name="first")(x)
    self.sow("intermediates", "first_act", h)
    h = nn.gelu(h)
    h = nn.gelu(nn.Dense(WIDTH, name="second")(h))
    return nn.Dense(CLASSES, name="logits")(h)


class TwoLoud(nn.Module):
  """Two independent forward faults, `loud_a` then `loud_b`."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm_a")(Amplify(name="loud_a")(x))
    h = nn.LayerNorm(name="norm_b")(Amplify(name="loud_b")(h))
    return nn.Dense(CLASSES, name="logits")(h)


class CappedLogits(nn.Module):
  """A soft cap on the logits (as Gemma 2 caps its final logits): a backward-only fault."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(WIDTH, name="hidden")(x))
    return SoftClip(name="logit_cap")(nn.Dense(CLASSES, name="logits")(h))


# --- Helpers -------------------------------------------------------------------------------------


def _batches(shape, xscale=1.0, n=4, seed=0):
  """A fixed dataset: ``n`` batches labelled by a random linear teacher."""
  kx, kt = jax.random.split(jax.random.key(seed))
  x = xscale * jax.random.normal(kx, (n, BATCH, *shape))
  teacher = jax.random.normal(kt, (shape[-1], CLASSES))
  feats = x if x.ndim == 3 else x.mean(axis=2)
  y = jnp.argmax(feats @ teacher, axis=-1)
  return [{"x": x[i], "y": y[i]} for i in range(n)]


def _init(model, x):
  return jax.jit(model.init)(jax.random.key(1), x)


def _loss(model):
  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


def _scaled_grad(loss_fn):
  """The f32 program: value and gradient of the loss times the loss scale."""
  return jax.value_and_grad(lambda p, b: loss_fn(p, b) * LOSS_SCALE)


def _train_grad(loss_fn, policy="mixed_fp16", rules=None):
  """What make_train_step differentiates: the autocast loss times the loss scale."""
  run = mpjax.autocast(loss_fn, policy, rules=rules)
  return jax.value_and_grad(lambda p, b: run(p, b) * LOSS_SCALE)


def _find(loss_fn, params, batch, rules=None):
  """find_nonfinite on the train step's gradient at the default fp16 loss scale."""
  return mpjax.find_nonfinite(
    loss_fn, params, batch, policy="mixed_fp16", rules=rules, loss_scale=LOSS_SCALE
  )


def _suggest(loss_fn, params, batch, **kwargs):
  """suggest_rules on the train step's gradient at the default fp16 loss scale."""
  return mpjax.suggest_rules(
    loss_fn, params, batch, policy="mixed_fp16", loss_scale=LOSS_SCALE, **kwargs
  )


def _finite(tree):
  return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))


def _sown(model, params, x, name):
  """The f32 values the model sowed under ``name``, in any submodule."""
  _, state = jax.jit(lambda p, x: model.apply(p, x, mutable=["intermediates"]))(params, x)
  flat = traverse_util.flatten_dict(state["intermediates"])
  found = [np.ravel(v) for k, vs in flat.items() if k[-1] == name for v in vs]
  assert found, name
  return np.concatenate(found)


def _assert_premise(loss_fn, params, batch):
  """f32 loss and gradients are finite; the train step's scaled gradient under mixed_fp16 is not."""
  assert _finite(jax.jit(_scaled_grad(loss_fn))(params, batch))
  assert _finite(jax.jit(_train_grad(loss_fn, "fp32"))(params, batch))
  assert not _finite(jax.jit(_train_grad(loss_fn))(params, batch))


def _train(model, params, batches, policy, rules=None):
  """Jitted adam training; (final f32 loss over the data, skipped steps, metrics all finite)."""
  loss_fn = _loss(model)
  state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.adam(1e-2), policy=policy
  )
  step = jax.jit(mpjax.make_train_step(loss_fn, autocast_rules=rules), donate_argnums=0)
  finite = True
  for i in range(STEPS):
    state, metrics = step(state, batches[i % len(batches)])
    finite &= bool(jnp.isfinite(metrics["loss"]))
    finite &= bool(metrics.get("grads_finite", True))
  evaluate = jax.jit(loss_fn)
  final = float(np.mean([evaluate(state.params, b) for b in batches]))
  return final, int(state.skipped_steps), finite


def _assert_report(report, planted, phase):
  assert isinstance(report, mpjax.NonFiniteReport)
  assert planted in report.module.split("/"), report
  assert planted in report.path
  assert report.phase == phase
  assert report.dtype == "float16"
  assert report.dtype_max == FP16_MAX
  assert report.shadow_max > FP16_MAX
  assert math.isfinite(report.shadow_max)
  assert report.policy == "mixed_fp16"
  # Exactly the module and what is inside it, in f32.
  assert report.module
  assert report.rule == {f"*{report.module}": "fp32", f"*{report.module}/*": "fp32"}
  text = str(report)
  assert report.module in text
  assert next(iter(report.rule)) in text
  assert phase in text
  assert report.primitive in text


def _assert_rules_fix_training(model, params, batches, rules_list):
  """Without rules training skips or goes non-finite; with each rules dict it matches f32."""
  f32_loss, f32_skipped, f32_finite = _train(model, params, batches, "fp32")
  initial = float(np.mean([jax.jit(_loss(model))(params, b) for b in batches]))
  assert f32_finite and f32_skipped == 0
  assert f32_loss < 0.7 * initial  # it learned: the comparison below means something
  _, skipped, finite = _train(model, params, batches, "mixed_fp16")
  assert skipped > 0 or not finite  # premise: without the rule fp16 training is hurt
  for rules in {tuple(sorted(r.items())): dict(r) for r in rules_list}.values():  # distinct
    loss, skipped, finite = _train(model, params, batches, "mixed_fp16", rules)
    assert finite, rules
    assert skipped == 0, rules
    assert abs(loss - f32_loss) / f32_loss < 1e-2, (rules, loss, f32_loss)


# --- 1. Planted faults ---------------------------------------------------------------------------


def test_forward_overflow_is_found_and_its_rule_fixes_training():
  model, batches = LoudThenNormed(), _batches((WIDTH,))
  batch = batches[0]
  params = _init(model, batch["x"])
  loss_fn = _loss(model)
  # Premise: `loud` overflows fp16 in the forward pass only because of its range.
  amplified = np.abs(_sown(model, params, batch["x"], "amplified")).max()
  assert amplified > FP16_MAX
  assert not np.isfinite(jax.jit(mpjax.autocast(loss_fn, "mixed_fp16"))(params, batch))
  _assert_premise(loss_fn, params, batch)

  report = _find(loss_fn, params, batch)
  _assert_report(report, "loud", "forward")
  assert report.module == "LoudThenNormed/loud"
  assert report.primitive == "mul"  # the product with the gain, not the projection before it
  assert report.shadow_max == pytest.approx(amplified, rel=1e-2)  # the product, in f32
  # The forward pass alone (no loss_scale: fn runs as given) reports the same operation.
  forward = mpjax.find_nonfinite(loss_fn, params, batch)
  assert (forward.module, forward.primitive, forward.phase) == (
    "LoudThenNormed/loud",
    "mul",
    "forward",
  )
  # With its rule nothing overflows any more.
  assert _find(loss_fn, params, batch, rules=report.rule) is None

  suggested = _suggest(loss_fn, params, batch)
  assert suggested == dict(report.rule)
  _assert_rules_fix_training(model, params, batches, [report.rule, suggested])


def test_backward_only_overflow_is_found_in_the_backward_pass():
  model, batches = ClippedHidden(), _batches((WIDTH,))
  batch = batches[0]
  params = _init(model, batch["x"])
  loss_fn = _loss(model)
  # Premise: every forward value fits fp16 (the forward pass alone is clean) ...
  hidden = _sown(model, params, batch["x"], "hidden_act")
  assert 1.0 < np.abs(hidden).max() < SoftClip.cap
  assert np.isfinite(jax.jit(mpjax.autocast(loss_fn, "mixed_fp16"))(params, batch))
  assert mpjax.find_nonfinite(loss_fn, params, batch) is None
  # ... but the train step's scaled gradient does not.
  _assert_premise(loss_fn, params, batch)

  report = _find(loss_fn, params, batch)
  _assert_report(report, "squash", "backward")
  assert report.path.startswith("transpose(")
  assert report.module == "ClippedHidden/squash"
  assert _find(loss_fn, params, batch, rules=report.rule) is None

  suggested = _suggest(loss_fn, params, batch)
  assert suggested == dict(report.rule)
  _assert_rules_fix_training(model, params, batches, [report.rule, suggested])


def test_attention_scores_beyond_fp16_are_found_before_the_softmax():
  model, batches = LargeScores(), _batches((6, WIDTH), xscale=100.0)
  batch = batches[0]
  params = _init(model, batch["x"])
  loss_fn = _loss(model)
  # Premise: the f32 scores exceed fp16's range; the f32 softmax of them is fine.
  scores = _sown(model, params, batch["x"], "scores")
  assert np.isfinite(scores).all() and np.abs(scores).max() > FP16_MAX
  _assert_premise(loss_fn, params, batch)

  report = _find(loss_fn, params, batch)
  _assert_report(report, "mixer", "forward")
  assert report.module.startswith("LargeScores/mixer")
  # The scores' einsum (not the one after the softmax, "bqk,bkd->bqd"): its GEMM accumulates in
  # f32, which holds the scores; the cast of that result to fp16 is what overflows.
  assert report.module == "LargeScores/mixer/bqd,bkd->bqk", report.path
  assert report.primitive == "convert_element_type"
  assert report.shadow_max == pytest.approx(np.abs(scores).max(), rel=1e-3)
  assert _find(loss_fn, params, batch, rules=report.rule) is None

  suggested = _suggest(loss_fn, params, batch)
  assert suggested == dict(report.rule)  # the overflow needs a rule, and that one suffices
  _assert_rules_fix_training(model, params, batches, [report.rule, suggested])


def test_every_fault_of_a_model_gets_a_rule():
  model, batches = TwoLoud(), _batches((WIDTH,))
  batch = batches[0]
  params = _init(model, batch["x"])
  loss_fn = _loss(model)
  _assert_premise(loss_fn, params, batch)
  first = _find(loss_fn, params, batch)
  _assert_report(first, "loud_a", "forward")
  # The rules given take effect in the replayed gradient program, whose paths carry JAX's
  # wrappers ("jvp(TwoLoud)/loud_a"): with `loud_a` in f32 the next overflow is in `loud_b`.
  second = _find(loss_fn, params, batch, rules=first.rule)
  _assert_report(second, "loud_b", "forward")
  assert second.path.startswith("jvp(")
  both = {**first.rule, **second.rule}
  assert _find(loss_fn, params, batch, rules=both) is None
  # Premise: training needs both rules: with `loud_a`'s alone it skips steps, with both none.
  assert _train(model, params, batches, "mixed_fp16", first.rule)[1] > 0
  assert _train(model, params, batches, "mixed_fp16", both)[1:] == (0, True)

  suggested = _suggest(loss_fn, params, batch)
  assert suggested == both
  assert list(suggested) == [*first.rule, *second.rule]  # in the order the faults come
  _, skipped, finite = _train(model, params, batches, "mixed_fp16", suggested)
  assert (skipped, finite) == (0, True), (suggested, skipped)
  # Without loss_scale, rules also match inside a program given as jax.value_and_grad.
  vg = _scaled_grad(loss_fn)
  _assert_report(mpjax.find_nonfinite(vg, params, batch), "loud_a", "forward")
  _assert_report(mpjax.find_nonfinite(vg, params, batch, rules=first.rule), "loud_b", "forward")
  assert mpjax.find_nonfinite(vg, params, batch, rules=suggested) is None


class Stages(nn.Module):
  """`stage1` overflows; its sibling `stage10` (a name `stage1` is a prefix of) does not."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(Amplify(name="stage1")(x))
    h = nn.relu(nn.Dense(WIDTH, name="stage10")(h))
    return nn.Dense(CLASSES, name="logits")(h)


def test_a_report_rule_covers_only_its_module():
  model, batches = Stages(), _batches((WIDTH,))
  batch = batches[0]
  params = _init(model, batch["x"])
  loss_fn = _loss(model)
  report = _find(loss_fn, params, batch)
  _assert_report(report, "stage1", "forward")
  assert report.rule == {"*Stages/stage1": "fp32", "*Stages/stage1/*": "fp32"}

  def dtypes(fn, rules):
    by_module = mpjax.autocast_report(
      fn, params, batch, policy="mixed_fp16", rules=rules, print_report=False
    ).by_module
    return {path: set(counts) for path, counts in by_module.items()}

  plain, ruled = dtypes(loss_fn, None), dtypes(loss_fn, report.rule)
  # Premise: without rules `stage1` (and its projection inside) and `stage10` compute in fp16.
  for path in ("Stages/stage1", "Stages/stage1/proj", "Stages/stage10"):
    assert "float16" in plain[path], path
  # The rule moves `stage1` and what is inside it to f32, not its sibling `stage10`.
  assert "float16" not in ruled["Stages/stage1"]
  assert "float16" not in ruled["Stages/stage1/proj"]
  assert "float16" in ruled["Stages/stage10"]
  # The same in a gradient program, where the paths carry JAX's transformation wrappers.
  vg = jax.value_and_grad(loss_fn)
  plain, ruled = dtypes(vg, None), dtypes(vg, report.rule)
  for wrapper in ("jvp(Stages)", "transpose(jvp(Stages))"):
    assert "float16" in plain[f"{wrapper}/stage1/proj"], wrapper
    assert "float16" in plain[f"{wrapper}/stage10"], wrapper
    assert "float16" not in ruled[f"{wrapper}/stage1/proj"], wrapper
    assert "float16" in ruled[f"{wrapper}/stage10"], wrapper
  assert "float16" not in ruled["jvp(Stages)/stage1"]


def test_backward_overflow_behind_an_f32_loss_is_found():
  model, batches = CappedLogits(), _batches((WIDTH,))
  batch = batches[0]
  params = _init(model, batch["x"])
  loss_fn = _loss(model)
  # Premise: the forward pass is clean, the train step's scaled gradient is not (the f32 loss's
  # cotangent reaches `logit_cap` as fp16, and cotangent * cap overflows there), and training
  # without a rule skips steps.
  assert mpjax.find_nonfinite(loss_fn, params, batch) is None
  _assert_premise(loss_fn, params, batch)
  _, skipped, _ = _train(model, params, batches, "mixed_fp16")
  assert skipped > 0

  report = _find(loss_fn, params, batch)
  _assert_report(report, "logit_cap", "backward")
  assert report.path.startswith("transpose(")
  assert report.module == "CappedLogits/logit_cap"
  assert _find(loss_fn, params, batch, rules=report.rule) is None

  suggested = _suggest(loss_fn, params, batch)
  assert suggested == dict(report.rule)
  _assert_rules_fix_training(model, params, batches, [report.rule])


# --- 2. A clean model ----------------------------------------------------------------------------


def _healthy():
  model, batches = Healthy(), _batches((WIDTH,), xscale=3.0)
  params = _init(model, batches[0]["x"])
  return model, params, batches[0]


def test_a_clean_model_has_no_report_and_needs_no_rules():
  model, params, batch = _healthy()
  loss_fn = _loss(model)
  vg = _scaled_grad(loss_fn)
  # Premise: values are far from tiny (activations > 1, scaled gradients in the thousands) and
  # all finite under fp16 autocast, in the train step's program and in the f32 one autocast.
  assert np.abs(_sown(model, params, batch["x"], "first_act")).max() > 1.0
  _, grads = jax.jit(vg)(params, batch)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e3
  assert _finite(jax.jit(_train_grad(loss_fn))(params, batch))
  assert _finite(jax.jit(mpjax.autocast(vg, "mixed_fp16"))(params, batch))

  assert _find(loss_fn, params, batch) is None
  assert mpjax.find_nonfinite(vg, params, batch) is None
  assert mpjax.find_nonfinite(loss_fn, params, batch) is None
  assert _suggest(loss_fn, params, batch) == {}


# --- 3. suggest_rules: determinism and tolerance -------------------------------------------------


def _relative_error(low, ref):
  return max(
    float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
    / float(np.linalg.norm(np.asarray(b, np.float64)))
    for a, b in zip(jax.tree.leaves(low), jax.tree.leaves(ref), strict=True)
  )


def test_suggest_rules_is_deterministic_and_respects_tolerance():
  model, params, batch = _healthy()
  loss_fn = _loss(model)
  reference = jax.jit(_scaled_grad(loss_fn))(params, batch)

  def error_with(rules):
    """The train step's loss and gradients with ``rules``, against f32."""
    return _relative_error(jax.jit(_train_grad(loss_fn, rules=rules))(params, batch), reference)

  # Premise: the model's fp16 error (loss and gradients against f32) is small but not zero.
  error = error_with(None)
  assert 1e-5 < error < 1e-2, error

  assert _suggest(loss_fn, params, batch, tolerance=1e-1) == {}
  tolerance = error / 100
  tight = _suggest(loss_fn, params, batch, tolerance=tolerance)
  assert tight, "a tolerance below the fp16 error needs rules"
  assert all(k.startswith("*Healthy") and v == "fp32" for k, v in tight.items()), tight
  # Two rules per module: the module, and what is inside it.
  modules = [key[1:] for key in list(tight)[::2]]
  assert list(tight) == [key for m in modules for key in (f"*{m}", f"*{m}/*")], tight
  assert _suggest(loss_fn, params, batch, tolerance=tolerance) == tight
  assert list(_suggest(loss_fn, params, batch, tolerance=tolerance)) == list(tight)
  # The rules it gives meet the tolerance.
  assert error_with(tight) <= tolerance
  # Greedy: each module was needed when it was added (the rules before it miss the tolerance),
  # and max_rules=n stops after n modules, with no rules at all for n=0.
  for n in range(len(modules)):
    before = dict(list(tight.items())[: 2 * n])
    assert error_with(before or None) > tolerance, before
    assert _suggest(loss_fn, params, batch, tolerance=tolerance, max_rules=n) == before

  for bad in (0.0, -1e-3, float("nan")):
    with pytest.raises(ValueError, match="tolerance"):
      _suggest(loss_fn, params, batch, tolerance=bad)


# --- 4. grad_health ------------------------------------------------------------------------------


def _reference_health(leaves, dtype, loss_scale=1.0):
  """numpy: the figures of one module's leaves, pooled, as documented (shares of all entries):
  underflow and overflow are what a cast of the (f32) scaled values to ``dtype`` does."""
  g = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves]) * np.float32(loss_scale)
  with np.errstate(over="ignore", invalid="ignore"):
    cast = g.astype(dtype).astype(np.float64)
  normal = float(ml_dtypes.finfo(dtype).smallest_normal)
  g = g.astype(np.float64)
  a, finite = np.abs(g), np.isfinite(g)
  nonzero = finite & (a > 0)
  return {
    "zero": np.mean(a == 0),
    "underflow": np.mean(nonzero & (cast == 0)),
    "subnormal": np.mean(nonzero & (a < normal)),
    "overflow": np.mean(finite & np.isinf(cast)),
    "max": a[finite].max(),
    "nonfinite": np.sum(~finite),
  }


def _assert_health(got, want):
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_allclose(np.asarray(got[key], np.float64), want[key], rtol=1e-6, err_msg=key)


# One module "params/proj" (kernel and bias), one "params/head"; a non-float leaf is ignored.
KERNEL = np.array(
  [
    [0.0, 0.0, 1e-8, 2e-8, 1e-6],  # zeros; round to 0 in fp16 (underflow); subnormal
    [3e-5, 1e-2, 1.0, 7e4, -2e5],  # subnormal; normal; normal; overflow; overflow
  ],
  np.float32,
)
BIAS = np.array([np.inf, np.nan, -3.0, 5e-5], np.float32)
HEAD = np.array([1e-9, 0.5, -0.25, 0.0], np.float32)


def _grads():
  return {
    "params": {"proj": {"kernel": KERNEL, "bias": BIAS}, "head": {"kernel": HEAD}},
    "count": np.int32(3),
  }


def test_grad_health_matches_a_numpy_reference():
  # Premise: the hand-built values sit where they are meant to for fp16.
  info = ml_dtypes.finfo(np.float16)
  assert 2e-8 < float(info.smallest_subnormal) / 2 < 1e-6 < float(info.smallest_normal)
  assert 3e-5 < float(info.smallest_normal) < 1e-2 and 7e4 > float(info.max)
  with np.errstate(over="ignore"):
    cast = np.concatenate([KERNEL.ravel(), BIAS]).astype(np.float16)
  assert (cast[2:4] == 0).all() and (cast[4:6] != 0).all() and np.isinf(cast[8:10]).all()

  health = jax.jit(mpjax.grad_health)(_grads())
  assert set(health) == {"params/proj", "params/head"}  # kernel and bias pooled; int ignored
  proj = _reference_health([KERNEL, BIAS], np.float16)
  _assert_health(health["params/proj"], proj)
  _assert_health(health["params/head"], _reference_health([HEAD], np.float16))
  # The figures spelled out for params/proj (14 entries).
  assert float(health["params/proj"]["zero"]) == pytest.approx(2 / 14)
  assert float(health["params/proj"]["underflow"]) == pytest.approx(2 / 14)
  assert float(health["params/proj"]["subnormal"]) == pytest.approx(5 / 14)  # 1e-8 .. 5e-5
  assert float(health["params/proj"]["overflow"]) == pytest.approx(2 / 14)
  assert float(health["params/proj"]["max"]) == pytest.approx(2e5)
  assert int(health["params/proj"]["nonfinite"]) == 2
  # Eager and jitted agree.
  eager = mpjax.grad_health(_grads())
  for module in health:
    _assert_health(eager[module], {k: np.asarray(v) for k, v in health[module].items()})


def test_grad_health_measures_the_scaled_gradient():
  tiny = {"params": {"layer": {"kernel": np.array([1e-8, 1e-8, 0.5, 2.0], np.float32)}}}
  at_one = mpjax.grad_health(tiny)["params/layer"]
  assert float(at_one["underflow"]) == 0.5 and float(at_one["overflow"]) == 0.0
  scale = jnp.float32(LOSS_SCALE)
  scaled = jax.jit(lambda g, s: mpjax.grad_health(g, loss_scale=s))(tiny, scale)["params/layer"]
  # 1e-8 * 2**15 is a normal fp16 value; 2.0 * 2**15 is beyond fp16's range.
  assert float(scaled["underflow"]) == 0.0 and float(scaled["subnormal"]) == 0.0
  assert float(scaled["overflow"]) == 0.25
  assert float(scaled["max"]) == pytest.approx(2.0 * LOSS_SCALE)
  _assert_health(
    scaled, _reference_health([tiny["params"]["layer"]["kernel"]], np.float16, LOSS_SCALE)
  )


def test_grad_health_thresholds_follow_the_dtype():
  grads = _grads()
  bf16 = jax.jit(lambda g: mpjax.grad_health(g, dtype=jnp.bfloat16))(grads)
  fp16 = mpjax.grad_health(grads, dtype=jnp.float16)
  _assert_health(bf16["params/proj"], _reference_health([KERNEL, BIAS], ml_dtypes.bfloat16))
  # bf16 has f32's range: nothing underflows, is subnormal or overflows here, unlike fp16.
  for key in ("underflow", "subnormal", "overflow"):
    assert float(bf16["params/proj"][key]) == 0.0
    assert float(fp16["params/proj"][key]) > 0.0
  assert float(bf16["params/proj"]["zero"]) == float(fp16["params/proj"]["zero"])
  assert int(bf16["params/proj"]["nonfinite"]) == 2


def test_grad_health_counts_what_a_cast_to_fp16_does_at_the_edges():
  # 2**-25 (half the smallest subnormal) rounds to 0 in fp16 (ties to even); 65510 rounds to
  # 65504 and 65519 to 65504 too (fp16 only overflows from 65520 on).
  edge = np.array([2.0**-25, 65510.0, 65519.0, 65520.0], np.float32)
  with np.errstate(over="ignore"):
    cast = edge.astype(np.float16)
  assert cast[0] == 0 and np.isfinite(cast[1:3]).all() and np.isinf(cast[3])  # premise
  assert np.mean((cast == 0) & (edge != 0)) == 0.25 and np.mean(np.isinf(cast)) == 0.25
  health = mpjax.grad_health({"params": {"edge": {"kernel": edge}}})["params/edge"]
  assert float(health["underflow"]) == 0.25  # 2**-25, and only it
  assert float(health["overflow"]) == 0.25  # 65520, not 65510 or 65519
  assert float(health["max"]) == 65520.0
  _assert_health(health, _reference_health([edge], np.float16))
  # The same edges reached through the loss scale (exact: powers of two), jitted.
  scaled = jax.jit(lambda g, s: mpjax.grad_health(g, loss_scale=s))(
    {"params": {"edge": {"kernel": edge / np.float32(LOSS_SCALE)}}}, jnp.float32(LOSS_SCALE)
  )["params/edge"]
  _assert_health(scaled, {k: np.asarray(v) for k, v in health.items()})


# --- 5. module_of --------------------------------------------------------------------------------


def test_module_of_strips_transformation_wrappers():
  assert module_of is autocast_module_of  # the one autocast matches rules with
  assert module_of("transpose(jvp(MLP))/Dense_1") == "MLP/Dense_1"
  assert module_of("jvp(Encoder)/block_0/ffn") == "Encoder/block_0/ffn"
  assert module_of("Encoder/block_0") == "Encoder/block_0"
  assert module_of("transpose(jvp())") == ""
  assert module_of("") == ""


def test_an_overflow_outside_any_module_gets_a_rule_that_fixes_it():
  """A GEMM at the top level: its f32 result overflows when cast to fp16; the rule names the
  GEMM's primitive (a cast cannot be moved to f32 by a rule)."""
  w, x = jnp.full((4, 4), 30.0), jnp.full((2, 4), 1.0)

  def loss(w, x):
    return jnp.mean((x @ (w * 1000.0)) * 1e-3)

  report = mpjax.find_nonfinite(loss, w, x, loss_scale=LOSS_SCALE)
  assert report is not None and report.module == "" and report.primitive == "convert_element_type"
  assert report.rule == {"dot_general": "fp32"}
  assert "in no module" in str(report)
  assert mpjax.find_nonfinite(loss, w, x, loss_scale=LOSS_SCALE, rules=report.rule) is None
  assert mpjax.suggest_rules(loss, w, x, loss_scale=LOSS_SCALE) == report.rule


# --- 6. Loops, branches and what cannot be checked -----------------------------------------------


def _stack(kind, gain):
  """A loss whose loop (or branch) body multiplies by ``gain`` each step: with 100, the values
  go 10 -> 1e3 -> 1e5, out of fp16's range at the body's second step (index 1)."""

  def block(h, w):
    with jax.named_scope("block"):
      return (h @ w) * gain

  def loss(ws, x):
    if kind == "scan":
      h = jax.lax.scan(lambda h, w: (block(h, w), None), x, ws)[0]
    elif kind == "while":  # a trip count read from the data: a while loop, not a scan
      n = jnp.int32(ws.shape[0]) + (x[0, 0] < 0).astype(jnp.int32)
      h = jax.lax.while_loop(
        lambda c: c[0] < n, lambda c: (c[0] + 1, block(c[1], ws[c[0]])), (jnp.int32(0), x)
      )[1]
    else:
      h = jax.lax.cond(x[0, 0] > 0, lambda h: block(block(h, ws[0]), ws[1]), lambda h: h, x)
    return jnp.mean(h * 1e-6)

  return loss


@pytest.mark.parametrize(
  "kind, loss_scale, iteration",
  [("scan", LOSS_SCALE, (1,)), ("while", None, (1,)), ("cond", LOSS_SCALE, ())],
)
def test_an_overflow_inside_a_loop_or_branch_body_is_found_in_the_body(kind, loss_scale, iteration):
  ws, x = jnp.stack([jnp.eye(4)] * 3), jnp.full((2, 4), 10.0)
  loss = _stack(kind, 100.0)
  # Premise: the compiled fp16 program overflows, f32 does not.
  assert not np.isfinite(jax.jit(mpjax.autocast(loss, "mixed_fp16"))(ws, x))
  assert np.isfinite(jax.jit(loss)(ws, x))

  report = mpjax.find_nonfinite(loss, ws, x, loss_scale=loss_scale)
  assert isinstance(report, mpjax.NonFiniteReport), report
  assert (report.module, report.primitive, report.phase) == ("block", "mul", "forward")
  assert report.iteration == iteration
  assert report.shadow_max == pytest.approx(1e5, rel=1e-3)
  assert ("loop iteration" in str(report)) == bool(iteration)
  assert all(f"loop iteration {i}" in str(report) for i in iteration)
  # Its rule fixes it, and then every operation, the body's included, is checked: None.
  assert mpjax.find_nonfinite(loss, ws, x, loss_scale=loss_scale, rules=report.rule) is None
  # A clean body (10 -> 100 -> 1000) gives None too.
  assert mpjax.find_nonfinite(_stack(kind, 10.0), ws, x, loss_scale=loss_scale) is None


def test_a_backward_overflow_inside_a_scan_is_found_in_its_layer():
  """The cotangent times a soft cap overflows in the backward pass of the last scanned layer,
  the first the backward pass reaches."""
  ws, x = jnp.stack([jnp.eye(4) * 0.5] * 3), jnp.full((2, 4), 1.0)

  def loss(ws, x):
    def layer(h, w):
      with jax.named_scope("layer"):
        return 50.0 * jnp.tanh((h @ w) / 50.0), None

    return jnp.mean(jax.lax.scan(layer, x, ws)[0])

  assert mpjax.find_nonfinite(loss, ws, x) is None  # the forward pass is clean
  report = mpjax.find_nonfinite(loss, ws, x, loss_scale=LOSS_SCALE)
  assert isinstance(report, mpjax.NonFiniteReport), report
  assert (report.module, report.phase, report.iteration) == ("layer", "backward", (2,))
  assert mpjax.find_nonfinite(loss, ws, x, loss_scale=LOSS_SCALE, rules=report.rule) is None


def _host_fp16(x):
  """A host function declared to return float16: f32 cannot compute it; 1e5 overflows."""

  def times_1e5(a):
    with np.errstate(over="ignore"):
      return (np.asarray(a) * 1e5).astype(np.float16)

  return jax.pure_callback(times_1e5, jax.ShapeDtypeStruct(x.shape, jnp.float16), x)


def _sharded(x):
  """A clean function whose body runs in a shard_map, which the replay does not enter."""
  mesh = jax.make_mesh((1,), ("data",))
  spec = jax.sharding.PartitionSpec()
  return jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=spec, out_specs=spec)(x)


def _long_loop(x):
  """A clean while loop of 40 iterations (beyond the replay limit of 100 operations below)."""
  return jax.lax.fori_loop(0, 40 + (x[0] < 0).astype(jnp.int32), lambda i, h: h * 1.01, x)


@pytest.mark.parametrize(
  "fn, primitive, nonfinite, reason",
  [
    (_host_fp16, "pure_callback", True, "stays float16"),
    (_sharded, "shard_map", False, "body was not replayed"),
    (_long_loop, "while", False, "ran compiled"),
  ],
)
def test_what_cannot_be_checked_is_named_not_taken_for_none(fn, primitive, nonfinite, reason):
  x = jnp.ones(4)
  assert np.isfinite(jax.jit(fn)(x)).all() != nonfinite  # premise
  report = mpjax.find_nonfinite(fn, x, max_replayed=100)
  assert isinstance(report, mpjax.UncheckedReport), report
  assert [(u.primitive, u.nonfinite) for u in report.unchecked] == [(primitive, nonfinite)]
  assert reason in report.unchecked[0].reason
  text = str(report)
  assert "Could not check" in text and f"`{primitive}`" in text and reason in text
  assert "f32 too is unknown" in text


def test_a_stopped_run_says_what_it_could_not_check(tmp_path):
  """The message of a run the guard stops: not "diverges in f32 too" when it could not check."""
  from types import SimpleNamespace

  from mpjax.experiment.loop import _diverged_message

  x = jnp.ones(4)
  exp = SimpleNamespace(
    policy=mpjax.get_policy("mixed_fp16"),
    rules=None,
    config=SimpleNamespace(name="host_demo"),
    diagnosis=lambda state, batch: {
      "fn": _host_fp16,
      "args": (x,),
      "policy": "mixed_fp16",
      "loss_scale": None,
    },
  )
  message = _diverged_message(exp, None, None, 7, "the loss is not finite", tmp_path)
  assert "Could not check" in message and "`pure_callback`" in message, message
  assert "diverges in f32 too;" not in message
  assert "mpjax diagnose host_demo --step 7" in message


def _loop_of(x, n):
  """A while loop of ``n`` iterations, three operations each: ``lt`` (the condition), ``add``
  (the counter) and ``mul``, and nothing else in the program."""
  return jax.lax.fori_loop(0, n, lambda i, h: h * 1.01, x)


@pytest.mark.parametrize("max_replayed, iteration, replayed", [(30, 10, 31), (32, 11, 34)])
def test_a_loop_runs_compiled_once_max_replayed_operations_were_replayed(
  max_replayed, iteration, replayed
):
  """Each operation counts once: after iteration i's condition, 3 i + 1 operations were replayed;
  once that reaches max_replayed, the rest runs compiled, as find_nonfinite's docstring says."""
  x, n = jnp.ones(4), jnp.int32(40)
  ops = jax.make_jaxpr(mpjax.autocast(_loop_of, "mixed_fp16"))(x, n).eqns[0].params["jaxpr"].eqns
  loop = ops[0].params  # premise: the program is the loop alone, of three operations
  assert len(ops) == 1 and len(loop["cond_jaxpr"].eqns) + len(loop["body_jaxpr"].eqns) == 3
  report = mpjax.find_nonfinite(_loop_of, x, n, max_replayed=max_replayed)
  assert isinstance(report, mpjax.UncheckedReport), report
  [unchecked] = report.unchecked
  assert unchecked.primitive == "while"
  assert f"from iteration {iteration} on ran compiled" in unchecked.reason, unchecked.reason
  assert f"after {replayed} operations replayed" in unchecked.reason, unchecked.reason
  # 40 iterations and the last condition: 121 operations, all checked at a limit of 120 already.
  assert mpjax.find_nonfinite(_loop_of, x, n, max_replayed=3 * 40) is None


def test_a_zero_length_scan_has_nothing_to_check():
  def fn(x):
    return jax.lax.scan(lambda c, y: (c * 2.0, y), x, jnp.zeros((0, 4)))[0] + 1.0

  assert mpjax.find_nonfinite(fn, jnp.ones(4)) is None


def test_a_shard_map_that_is_the_first_overflow_is_named_once():
  """Not once as not replayed and again as not finite: one entry, with both reasons."""

  def fn(x):
    mesh = jax.make_mesh((1,), ("data",))
    spec = jax.sharding.PartitionSpec()
    return jax.shard_map(lambda a: a @ a, mesh=mesh, in_specs=spec, out_specs=spec)(x)

  x = jnp.full((4, 4), 300.0)  # 4 * 300**2 overflows fp16
  assert not np.isfinite(jax.jit(mpjax.autocast(fn, "mixed_fp16"))(x)).any()  # premise
  report = mpjax.find_nonfinite(fn, x)
  assert isinstance(report, mpjax.UncheckedReport), report
  [unchecked] = report.unchecked
  assert (unchecked.primitive, unchecked.nonfinite) == ("shard_map", True)
  assert "body was not replayed" in unchecked.reason and "f32 cannot compute" in str(unchecked)
