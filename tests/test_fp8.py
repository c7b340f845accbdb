"""FP8 GEMMs: the quantize/scale primitives against numpy, fp8_dot against GEMMs of the FP8
values, the FP8 GEMMs XLA:GPU makes of a layer, and delayed scaling through the train step.

References are built with ml_dtypes (numpy's FP8 types), independently of
mpjax.fp8. Everything mpjax runs goes through jax.jit, as users call it.
"""

import importlib.metadata

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax import lax

import mpjax
import mpjax.gpu
import mpjax.testing
from mpjax import fp8
from mpjax.audit import parse_compiled_gemms

E4M3, E5M2, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16
FMAX = {E4M3: 448.0, E5M2: 57344.0}
D_IN = 16
WIDTHS = (64, 64, 64, 64)
N_DENSE = len(WIDTHS) + 1  # Dense_0 .. Dense_4; Dense_0 and Dense_4 stay bf16 by default
MIDDLE = list(range(1, N_DENSE - 1))


# --- numpy references --------------------------------------------------------------------------


def _np_quantize(x, dtype, scale):
  """``x * (1 / scale)`` in f32, the reciprocal rounded to f32 once, then saturated and cast."""
  big = FMAX[dtype]
  inverse = np.float32(1.0) / np.float32(scale)
  return np.clip(np.asarray(x, np.float32) * inverse, -big, big).astype(dtype)


def _np_quantize_by_division(x, dtype, scale):
  """The same with a true f32 division, which rounds differently on a few FP8 ties."""
  big = FMAX[dtype]
  return np.clip(np.asarray(x, np.float32) / np.float32(scale), -big, big).astype(dtype)


def _np_dequantize(q, scale, dtype):
  return (q.astype(dtype) * np.asarray(scale, np.float32).astype(dtype)).astype(dtype)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


# --- a small Flax MLP --------------------------------------------------------------------------


class MLP(nn.Module):
  widths: tuple[int, ...] = WIDTHS

  @nn.compact
  def __call__(self, x):
    for width in self.widths:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(1)(x)


MODEL = MLP()


def _batch(seed=0, n=32, gain=1.0):
  x = jax.random.normal(jax.random.key(seed), (n, D_IN)) * gain
  return {"x": x, "y": jnp.sin(2.0 * x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]}


def _params():
  """Initial params, each kernel scaled by its own factor: its amax names its layer."""
  params = MODEL.init(jax.random.key(1), jnp.ones((1, D_IN)))["params"]
  return {
    "params": {
      name: {**layer, "kernel": layer["kernel"] * (1.0 + 0.25 * int(name.split("_")[1]))}
      for name, layer in params.items()
    }
  }


def loss_fn(params, batch):
  pred = MODEL.apply(params, batch["x"]).astype(jnp.float32)
  return jnp.mean((pred - batch["y"]) ** 2)


def _policy(**recipe):
  return mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(**recipe))


def _state(policy="mixed_fp8", tx=None):
  return mpjax.TrainState.create(
    apply_fn=MODEL.apply, params=_params(), tx=tx or optax.sgd(0.05), policy=policy
  )


def _kernel_amaxes(params):
  return [float(jnp.max(jnp.abs(params["params"][f"Dense_{i}"]["kernel"]))) for i in range(N_DENSE)]


def _reference_amaxes(params, batch):
  """The f32 model's per-Dense GEMM input amax and output-cotangent amax."""
  p = params["params"]
  x = batch["x"]

  def forward(eps):
    h, ins = x, []
    for i in range(N_DENSE):
      ins.append(jnp.max(jnp.abs(h)))
      z = h @ p[f"Dense_{i}"]["kernel"] + eps[i] + p[f"Dense_{i}"]["bias"]
      h = jax.nn.relu(z) if i < N_DENSE - 1 else z
    return jnp.mean((h - batch["y"]) ** 2), ins

  eps = [jnp.zeros((x.shape[0], w)) for w in (*WIDTHS, 1)]
  grads, ins = jax.grad(forward, has_aux=True)(eps)
  return np.array(ins), np.array([jnp.max(jnp.abs(g)) for g in grads])


# --- 1. quantize / dequantize -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_quantize_dequantize_match_numpy_bit_for_bit(dtype, in_dtype):
  rng = np.random.default_rng(0)
  # Magnitudes from FP8 subnormals to far beyond the range, both signs.
  x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-4, 6, 4096)).astype(in_dtype)
  quantize = jax.jit(fp8.quantize, static_argnums=1)
  dequantize = jax.jit(fp8.dequantize, static_argnums=2)
  for scale in (1.0, 2.0**-5, 16.0, 0.37, 13.0):
    ref = _np_quantize(x, dtype, scale)
    q = np.asarray(quantize(jnp.asarray(x), jnp.dtype(dtype), jnp.float32(scale)))
    assert q.dtype == dtype
    # quantize multiplies by the f32 reciprocal of the scale: bit for bit, whatever the scale.
    np.testing.assert_array_equal(_bits(q), _bits(ref))
    # Premise: the data really reaches the clipped range and the FP8 subnormals.
    assert np.sum(np.abs(ref.astype(np.float32)) == FMAX[dtype]) > 10
    assert np.any((ref != 0) & (np.abs(ref.astype(np.float32)) < ml_dtypes.finfo(dtype).tiny))
    for out_dtype in (BF16, np.float32):
      dq = np.asarray(dequantize(jnp.asarray(q), jnp.float32(scale), jnp.dtype(out_dtype)))
      assert dq.dtype == out_dtype
      np.testing.assert_array_equal(_bits(dq), _bits(_np_dequantize(q, scale, out_dtype)))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_multiplies_by_the_f32_reciprocal_on_a_rounding_tie(dtype):
  # quantize computes x * f32(1/scale), the reciprocal taken once in f32, on every backend. On
  # a rounding tie of the format that differs from a true division: 338 / 13 is exactly 26.0
  # (an E5M2 tie between 24 and 28; round-to-nearest-even gives 24) while 338 * f32(1/13) =
  # 26.000002 rounds to 28. Likewise 0.1650390625 / 13 = 0.0126953125, an E4M3 tie
  # (0.01171875 by division, 0.013671875 by the reciprocal).
  x = np.array([338.0, -169.0, 0.1650390625, 1.0], np.float32)
  scale = np.float32(13.0)
  quotient = x / scale
  assert np.all(quotient * scale == x)  # premise: the quotients are exact ...
  lo, hi = (np.nextafter(quotient, d).astype(dtype) for d in (-np.inf, np.inf))
  assert np.sum(_bits(lo) != _bits(hi)) >= 1  # ... and one sits on a rounding tie of the format
  ref = _np_quantize(x, dtype, scale)
  by_division = _np_quantize_by_division(x, dtype, scale)
  # Premise: there, true division rounds differently from the reciprocal.
  assert np.any(_bits(ref) != _bits(by_division))
  got = jax.jit(fp8.quantize, static_argnums=1)(jnp.asarray(x), jnp.dtype(dtype), scale)
  got = np.asarray(got)
  assert got.dtype == dtype
  np.testing.assert_array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_saturates_and_keeps_nan(dtype):
  big = FMAX[dtype]
  # Premise: a plain cast does not saturate (E4M3 has no inf: 1000 -> NaN; E5M2 -> inf).
  assert np.isnan(np.float32(1000.0).astype(E4M3).astype(np.float32))
  assert np.isinf(np.float32(1e6).astype(E5M2).astype(np.float32))
  x = np.array([1.5 * big, -1.5 * big, 1e6, -1e30, np.inf, -np.inf, 3e38, 0.5], np.float32)
  assert np.all(np.abs(x[:-1]) > big)  # premise: all but the last overflow the format
  q = jax.jit(fp8.quantize, static_argnums=1)(jnp.asarray(x), jnp.dtype(dtype), jnp.float32(0.5))
  q = np.asarray(q).astype(np.float32)
  assert np.all(np.isfinite(q))
  np.testing.assert_array_equal(q, [big, -big, big, -big, big, -big, big, 1.0])
  nan = jax.jit(fp8.quantize, static_argnums=1)(
    jnp.array([np.nan, 1.0], jnp.float32), jnp.dtype(dtype), jnp.float32(1.0)
  )
  nan = np.asarray(nan).astype(np.float32)
  assert np.isnan(nan[0]) and nan[1] == 1.0


# --- 2. compute_scale ---------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_compute_scale_rule_and_fallback(margin, dtype):
  amax = np.array([0.5, 3.0, 448.0, 1e-3, 7e4, 1e30, 0.0, np.inf, np.nan, 1e-44], np.float32)
  old = np.linspace(0.25, 2.5, amax.size).astype(np.float32)
  new = np.asarray(
    jax.jit(fp8.compute_scale, static_argnums=(2, 3))(
      jnp.asarray(amax), jnp.asarray(old), jnp.dtype(dtype), margin
    )
  )
  assert new.dtype == np.float32
  ref = (amax[:6].astype(np.float64) * 2.0**margin / FMAX[dtype]).astype(np.float32)
  np.testing.assert_allclose(new[:6], ref, rtol=2e-7)
  # amax 0, inf, NaN (and one so small that the scale would underflow to 0) keep the old scale.
  assert np.float32(1e-44) * np.float32(2.0**margin / FMAX[dtype]) == 0  # premise
  np.testing.assert_array_equal(new[6:], old[6:])
  assert np.all(np.isfinite(new)) and np.all(new > 0)


# --- 3. amax history ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (5,), (6, 7), (2, 3, 5), (2, 1, 3, 4)])
@pytest.mark.parametrize("in_dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_gradient_amax_is_the_amax_of_the_whole_gradient(shape, in_dtype):
  # The gradient's amax is taken per feature first (a reduction XLA:GPU fuses with the bias
  # gradient's); the value is the whole array's largest magnitude all the same, as f32.
  rng = np.random.default_rng(sum(shape) + len(shape))
  x = (rng.standard_normal(shape) * 3.0).astype(np.float32)
  cases = [x]
  if x.size > 1:
    big = x.copy().reshape(-1)
    big[-1] = -1e4  # the largest magnitude is negative and in the last feature
    cases.append(big.reshape(shape))
    for special in (np.inf, -np.inf, np.nan):
      y = x.copy().reshape(-1)
      y[x.size // 2] = special
      cases.append(y.reshape(shape))
  ours = jax.jit(fp8.gradient_amax)
  for case in cases:
    case = case.astype(in_dtype)
    got = ours(jnp.asarray(case))
    want = np.max(np.abs(case.astype(np.float32)))
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fp8.amax)(case)))


def test_push_amax_and_history_amax_match_a_shift_register():
  length = 4
  pushes = np.array(
    [
      [1.0, 2.0, 3.0],
      [5.0, 0.5, 0.25],
      [np.inf, 4.0, np.nan],  # non-finite: recorded as 0
      [0.125, 8.0, 2.0],
      [2.0, 1.0, 6.0],
      [0.5, 0.5, 0.5],
    ],
    np.float32,
  )
  push = jax.jit(fp8.push_amax)
  read = jax.jit(fp8.history_amax, static_argnums=1)
  history = jnp.zeros((length, 3), jnp.float32)
  ref = np.zeros((length, 3), np.float32)
  for amaxes in pushes:
    history = push(history, jnp.asarray(amaxes))
    ref = np.concatenate([np.where(np.isfinite(amaxes), amaxes, 0.0)[None], ref[:-1]])
    np.testing.assert_array_equal(np.asarray(history), ref)
    np.testing.assert_array_equal(np.asarray(read(history, "max")), ref.max(axis=0))
    np.testing.assert_array_equal(np.asarray(read(history, "most_recent")), ref[0])
  # Premise: the oldest rows really were dropped (5.0 and the first row are gone) and the two
  # algorithms disagree on this history.
  assert 5.0 not in ref and np.any(ref.max(axis=0) != ref[0])
  assert np.all(np.isfinite(np.asarray(history)))


@pytest.mark.parametrize("bwd_format", ["e5m2", "e4m3"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fp8_state_delayed_scales_and_advance_match_numpy(algo, bwd_format):
  recipe = mpjax.Fp8Recipe(
    amax_history_len=3, amax_compute_algo=algo, margin=1, bwd_format=bwd_format
  )
  initial = mpjax.Fp8State.initial(recipe, gemms=4)
  assert initial.gemms == 4
  assert initial.scale.dtype == initial.amax_history.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(initial.scale), np.ones((4, 3), np.float32))
  np.testing.assert_array_equal(np.asarray(initial.amax_history), np.zeros((3, 4, 3), np.float32))

  # (history row, gemm, column). GEMM 0: no amax yet; 1: the max and the latest differ; 2: an
  # inf and a NaN in the latest row; 3: an amax so small that its scale underflows to 0.
  history = np.zeros((3, 4, 3), np.float32)
  history[:, 1] = [[2.0, 0.5, 100.0], [7.0, 0.25, 3000.0], [1.0, 4.0, 10.0]]
  history[:, 2] = [[np.inf, np.nan, 8.0], [3.0, 1.0, 2.0], [0.0, 0.0, 0.0]]
  history[:, 3] = [[1e-44, 2.0, 1e-44], [1e-44, 1.0, 1e-44], [0.0, 0.0, 0.0]]
  old = np.arange(1, 13, dtype=np.float32).reshape(4, 3) / 8.0
  state = mpjax.Fp8State(scale=jnp.asarray(old), amax_history=jnp.asarray(history))
  assert state.gemms == 4
  source = history.max(axis=0) if algo == "max" else history[0]
  assert np.any(history.max(axis=0)[1] != history[0, 1])  # premise: the algorithms differ
  fmax = np.array([448.0, 448.0, FMAX[recipe.bwd_dtype.type]])
  assert fmax[2] == (57344.0 if bwd_format == "e5m2" else 448.0)  # premise: the grad's format
  new = (source.astype(np.float64) * 2.0 / fmax).astype(np.float32)
  ok = np.isfinite(source) & (source > 0) & (new > 0)
  ref = np.where(ok, new, old)
  # Premise: both branches happen, each in every column, and the fallback cases are among them.
  assert np.all(ok.any(axis=0)) and np.all((~ok).any(axis=0))
  assert not ok[0].any() and not ok[3, 0] and not ok[3, 2] and not ok[2, 1]

  scales = np.asarray(jax.jit(fp8.delayed_scales, static_argnums=1)(state, recipe))
  assert scales.dtype == np.float32 and scales.shape == (4, 3)
  np.testing.assert_allclose(scales[ok], ref[ok], rtol=2e-7)
  np.testing.assert_array_equal(scales[~ok], old[~ok])

  amaxes = np.array([[1.0, 2.0, 3.0], [np.inf, 0.5, 0.0], [4.0, np.nan, 5.0], [6.0, 7.0, 8.0]])
  after = jax.jit(fp8.advance)(state, jnp.asarray(scales), jnp.asarray(amaxes, np.float32))
  assert isinstance(after, mpjax.Fp8State) and after.gemms == 4
  _assert_bit_identical(after.scale, jnp.asarray(scales))
  pushed = np.where(np.isfinite(amaxes), amaxes, 0.0).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(after.amax_history[0]), pushed)
  np.testing.assert_array_equal(np.asarray(after.amax_history[1:]), history[:-1])
  assert after.amax_history.shape == (3, 4, 3)


# --- 4. fp8_dot ---------------------------------------------------------------------------------

DENSE = (((1,), (0,)), ((), ()))


def _np_current(x, dtype):
  """Current scaling of ``x`` as the recipe defines it: (its FP8 values, scale = amax / max)."""
  a = np.max(np.abs(np.asarray(x, np.float32)))
  scale = np.float32(a) * np.float32(1.0 / FMAX[dtype])
  return _np_quantize(x, dtype, scale), scale


def _np_fp8_gemm(a, b, scale, dtype):
  """``(a @ b) * scale`` of FP8 values ``a``, ``b``: in f64, rounded to f32, then to ``dtype``.

  The f32 ``scale`` is the product of the operands' scales, taken in f32.
  """
  exact = a.astype(np.float64) @ b.astype(np.float64)
  return (exact * np.float64(scale)).astype(np.float32).astype(dtype)


def _bf16_ulp(x):
  """The spacing of bf16 values at ``x`` (8 significant bits)."""
  x = np.abs(np.asarray(x, np.float64))
  return 2.0 ** (np.floor(np.log2(np.maximum(x, 2.0**-126))) - 7)


def _assert_gemms_match(got, want):
  """Asserts an FP8 GEMM's (out, dx, dw) equal their references from the same FP8 values.

  out and dx are bf16: the reference bit for bit, except where the f32
  accumulation lands on the other side of a bf16 rounding (one ulp; near zero,
  2**-20 of the largest magnitude). dw is the f32 gradient of an f32 weight: the
  f32 accumulation's error only. Returns a scale for each (2**-8 or 1e-6 of the
  reference's largest magnitude).
  """
  for g, w in zip(got[:2], want[:2], strict=True):
    g, w = np.asarray(g), w.astype(np.float64)
    assert g.dtype == BF16
    diff = np.abs(g.astype(np.float64) - w)
    tol = np.maximum(_bf16_ulp(w), 2.0**-20 * np.max(np.abs(w)))
    assert np.all(diff <= tol), np.max(diff / tol)
    assert np.mean(diff == 0) > 0.97, np.mean(diff == 0)
  dw, want_dw = np.asarray(got[2]), want[2]
  assert dw.dtype == want_dw.dtype == np.float32
  np.testing.assert_allclose(dw, want_dw, rtol=0, atol=1e-6 * np.max(np.abs(want_dw)))
  return [2.0**-8 * np.max(np.abs(w.astype(np.float32))) for w in want[:2]] + [
    1e-6 * np.max(np.abs(want_dw))
  ]


def _fp8_dot_vjp(recipe, with_scales):
  @jax.jit
  def run(x, w, scales, ct):
    def f(a, b, s):
      return fp8.fp8_dot(a, b, s if with_scales else None, DENSE, recipe, jnp.bfloat16)

    out, vjp = jax.vjp(f, x, w, scales)
    dx, dw, seen = vjp(ct.astype(out.dtype))
    return out, dx, dw, seen

  return run


def test_fp8_dot_current_scaling_multiplies_the_fp8_values_and_scales_the_result():
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((32, 64)) * 3.0).astype(BF16)  # a bf16 activation
  w = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32)  # an f32 master weight
  ct = rng.standard_normal((32, 48)).astype(np.float32)  # the loss's weights on the output
  out, dx, dw, _ = _fp8_dot_vjp(mpjax.Fp8Recipe(scaling="current"), False)(
    x, w, np.ones(3, np.float32), ct
  )
  assert (out.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)

  (xq, sx), (wq, sw) = _np_current(x, E4M3), _np_current(w, E4M3)
  gq, sg = _np_current(ct.astype(BF16), E5M2)
  ref_out = _np_fp8_gemm(xq, wq, sx * sw, BF16)
  ref_dx = _np_fp8_gemm(gq, wq.T, sg * sw, BF16)
  ref_dw = _np_fp8_gemm(xq.T, gq, sx * sg, np.float32)
  tol_out, tol_dx, tol_dw = _assert_gemms_match((out, dx, dw), (ref_out, ref_dx, ref_dw))

  # Premise: FP8 happened. The plain bf16 GEMMs differ by clearly more than the tolerances.
  f32 = np.float32
  xb, wb, gb = x.astype(f32), w.astype(BF16).astype(f32), ct.astype(BF16).astype(f32)
  assert np.max(np.abs(np.asarray(out, f32) - xb @ wb)) > 4 * tol_out
  assert np.max(np.abs(np.asarray(dx, f32) - gb @ wb.T)) > 4 * tol_dx
  assert np.max(np.abs(np.asarray(dw) - xb.T @ gb)) > 1000 * tol_dw


def test_fp8_dot_delayed_scaling_uses_the_given_scales_and_returns_the_amaxes():
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((32, 64)) * 3.0).astype(BF16)
  w = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32)
  ct = rng.standard_normal((32, 48)).astype(np.float32)
  f32 = np.float32
  amax_x, amax_w = np.max(np.abs(x.astype(f32))), np.max(np.abs(w))
  amax_g = np.max(np.abs(ct.astype(BF16).astype(f32)))
  # Scales unlike current scaling's: half the amax saturates x and the gradient, 16x leaves
  # w with few levels.
  scales = np.array([0.5 * amax_x / 448.0, 16.0 * amax_w / 448.0, 0.25 * amax_g / 57344.0], f32)
  out, dx, dw, seen = _fp8_dot_vjp(mpjax.Fp8Recipe(), True)(x, w, scales, ct)
  assert (out.dtype, dx.dtype, dw.dtype, seen.dtype) == (
    jnp.bfloat16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float32,
  )
  # The cotangent of the scales is this step's amaxes: lhs, rhs, output gradient.
  np.testing.assert_array_equal(np.asarray(seen), np.array([amax_x, amax_w, amax_g], f32))

  sx, sw, sg = scales
  xq, wq = _np_quantize(x, E4M3, sx), _np_quantize(w, E4M3, sw)
  gq = _np_quantize(ct.astype(BF16), E5M2, sg)
  ref_out = _np_fp8_gemm(xq, wq, sx * sw, BF16)
  ref_dx = _np_fp8_gemm(gq, wq.T, sg * sw, BF16)
  ref_dw = _np_fp8_gemm(xq.T, gq, sx * sg, np.float32)
  tol_out, tol_dx, tol_dw = _assert_gemms_match((out, dx, dw), (ref_out, ref_dx, ref_dw))

  # Premise: the given scales matter. Current scaling's results differ by clearly more.
  (cx, csx), (cw, csw) = _np_current(x, E4M3), _np_current(w, E4M3)
  cg, csg = _np_current(ct.astype(BF16), E5M2)
  assert np.max(np.abs(np.asarray(out, f32) - _np_fp8_gemm(cx, cw, csx * csw, f32))) > 4 * tol_out
  assert np.max(np.abs(np.asarray(dx, f32) - _np_fp8_gemm(cg, cw.T, csg * csw, f32))) > 4 * tol_dx
  assert np.max(np.abs(np.asarray(dw) - _np_fp8_gemm(cx.T, cg, csx * csg, f32))) > 1000 * tol_dw


# --- 4b. the FP8 GEMMs XLA:GPU makes ------------------------------------------------------------

# An FP8 layer's three GEMMs: E4M3 x E4M3 forward, E5M2 x E4M3 for both gradients.
FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e4m3", "e5m2")]
LAYERS = {
  "dense": (lambda w, x: x @ w, (64, 48), (32, 64)),
  "batched": (lambda w, x: jnp.einsum("bij,bjk->bik", x, w), (4, 64, 48), (4, 32, 64)),
}


def _skip_without_compiler():
  try:
    importlib.metadata.version(mpjax.gpu.PLUGIN)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("needs XLA's CUDA compiler plugin (jax-cuda12-pjrt or -cuda13-pjrt)")


def _h100_gemms(fn, args, mode):
  """The dot GEMMs of ``fn`` compiled for H100 here (no GPU) in a GEMM mode."""
  _skip_without_compiler()
  if mode == "default" and "default" not in mpjax.gpu.GEMM_BACKENDS:
    mode = "triton"  # XLA's default mode, by its first name
  text = mpjax.compile_for(fn, *args, target="h100", gemm_backend=mode).as_text()
  return [g for g in parse_compiled_gemms(text) if g.op == "dot"]


def _fp8_pair(gemm):
  names = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
  return tuple(sorted(names.get(d, d) for d in (gemm.lhs_dtype, gemm.rhs_dtype)))


def _layer_step(fn, policy):
  """``value_and_grad`` of a loss of ``fn(w, x)`` under autocast, for both arguments."""
  forward = mpjax.autocast(fn, policy)

  def loss(w, x):
    return jnp.mean(forward(w, x).astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("mode", ["default", "cublaslt"])
def test_fp8_gemms_of_a_layer_stay_fp8_compiled_for_h100(mode, layer):
  # XLA's default mode (Triton GEMM fusions) and Triton GEMMs off (cuBLASLt): each of the
  # layer's three GEMMs, forward and both gradients, multiplies FP8 operands.
  fn, w_shape, x_shape = LAYERS[layer]
  args = (jax.ShapeDtypeStruct(w_shape, jnp.float32), jax.ShapeDtypeStruct(x_shape, jnp.float32))
  # mixed_fp8 with nothing kept in bf16 (a lone layer is both the first and the last).
  gemms = _h100_gemms(_layer_step(fn, _policy(keep_bf16=())), args, mode)
  assert sorted(_fp8_pair(g) for g in gemms) == FP8_PAIRS
  if mode == "default":
    assert {(g.kind, g.call[:9]) for g in gemms} == {("triton_gemm", "__triton_")}
  else:
    assert {g.call for g in gemms} == {"__cublas$lt$matmul$f8"}
    # The scale goes to cuBLASLt, which writes the bf16 result itself: no pass of its own.
    assert {g.out_dtype for g in gemms} == {"bfloat16"}
  # Premise: the same layer under mixed_bf16 is three bf16 GEMMs.
  gemms = _h100_gemms(_layer_step(fn, "mixed_bf16"), args, mode)
  assert sorted(_fp8_pair(g) for g in gemms) == [("bfloat16", "bfloat16")] * 3


class _MlpBlocks(nn.Module):
  """GPT-2 small's MLP, twice, between a first and a last bf16 Dense: LayerNorm -> Dense ->
  GELU -> Dense, with residuals."""

  d: int = 768

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.d)(x)
    for _ in range(2):
      h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
      x = x + nn.Dense(self.d)(nn.gelu(h))
    return nn.Dense(self.d)(x)


@pytest.mark.slow
def test_gradient_amax_shares_the_kernels_of_the_bias_gradient_compiled_for_h100(monkeypatch):
  # GPT-2 small's MLP shapes (8 x 1024 tokens, 768 -> 3072 -> 768), mixed_fp8 with delayed
  # scaling, compiled for H100 in XLA's default mode. The output gradient's amax, taken per
  # feature, is a reduction of the shape of the bias and LayerNorm gradients' sums, so XLA
  # computes it in their kernels; taken over the whole array (what it was), it is a reduction of
  # another shape, and XLA moved those sums to kernels of their own that read the gradient again.
  _skip_without_compiler()
  model = _MlpBlocks()
  x = jax.ShapeDtypeStruct((8, 1024, 768), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)

  def loss(p, b):
    return jnp.mean(model.apply(p, b).astype(jnp.float32) ** 2)

  def report():
    step = jax.jit(mpjax.make_train_step(loss), donate_argnums=0)
    state = jax.eval_shape(
      lambda: mpjax.TrainState.create(
        apply_fn=model.apply,
        params=jax.tree.map(jnp.zeros_like, params),
        tx=optax.adam(1e-3),
        policy="mixed_fp8",
      )
    )
    state = mpjax.init_fp8_state(step, state, x)
    assert state.fp8.gemms == 4  # the two blocks' Dense layers; the first and last stay bf16
    return mpjax.kernel_report(step, state, x, target="h100", gemm_backend="default")

  per_feature = report()
  monkeypatch.setattr(fp8, "gradient_amax", fp8.amax)  # the whole-array amax, as before
  whole = report()
  assert per_feature.fp8_gemms == whole.fp8_gemms == 12
  # Measured with jaxlib 0.10.2: 2317.7 MB against 2340.9 MB, 768.5 us against 775.5 us.
  assert per_feature.bytes_moved < 0.995 * whole.bytes_moved
  assert per_feature.estimated_seconds < 0.995 * whole.estimated_seconds


# --- 5. delayed scaling through the train step ---------------------------------------------------


def test_first_steps_fill_the_history_and_scales():
  state = _state()
  assert state.fp8 is None
  step = jax.jit(mpjax.make_train_step(loss_fn))
  batch = _batch()
  kernels = _kernel_amaxes(state.params)
  assert len(set(kernels)) == N_DENSE  # premise: each kernel's amax names its layer
  ins, cts = _reference_amaxes(state.params, batch)

  s1, _ = step(state, batch)
  assert isinstance(s1.fp8, mpjax.Fp8State)
  assert s1.fp8.gemms == len(MIDDLE) == 3
  assert s1.fp8.scale.dtype == s1.fp8.amax_history.dtype == jnp.float32
  assert s1.fp8.scale.shape == (3, 3) and s1.fp8.amax_history.shape == (1024, 3, 3)
  history = np.asarray(s1.fp8.amax_history)
  for row, i in enumerate(MIDDLE):  # row j: the j-th FP8 GEMM in program order
    amaxes = history[0, row]
    assert amaxes[1] == np.float32(kernels[i])  # the f32 master kernel, exactly
    # The bf16 input activation and the output cotangent, against the f32 model.
    np.testing.assert_allclose(amaxes[0], ins[i], rtol=0.05)
    np.testing.assert_allclose(amaxes[2], cts[i], rtol=0.1)
  assert np.all(history[1:] == 0)
  np.testing.assert_array_equal(np.asarray(s1.fp8.scale), np.ones((3, 3), np.float32))
  # Premise: the three columns are far apart (more than the tolerances), so a swap would show.
  for a, b in ((ins, kernels), (ins, cts), (kernels, cts)):
    assert all(abs(a[i] - b[i]) > 0.25 * max(a[i], b[i]) for i in MIDDLE)

  s2, _ = step(s1, batch)
  first = history[0]
  np.testing.assert_allclose(
    np.asarray(s2.fp8.scale[:, 1]), [kernels[i] / 448.0 for i in MIDDLE], rtol=1e-6
  )
  np.testing.assert_allclose(np.asarray(s2.fp8.scale), first / [448.0, 448.0, 57344.0], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(s2.fp8.amax_history[1]), first)
  moved = _kernel_amaxes(s1.params)
  assert np.asarray(s2.fp8.amax_history[0, :, 1]).tolist() == [
    float(np.float32(moved[i])) for i in MIDDLE
  ]
  assert np.all(np.asarray(s2.fp8.amax_history[2:]) == 0)
  # Premise: step 1 moved the kernels, so the new row is not the old one again.
  assert moved != kernels


def test_amax_compute_algo_max_and_most_recent():
  # The first step's activations are 8x larger. The weights stay (learning rate 0; the biases
  # stay 0), so every layer's input amax comes down 8x on the second step.
  batches = [_batch(gain=8.0), _batch(), _batch()]
  states = {}
  for algo in ("max", "most_recent"):
    state = _state(_policy(amax_compute_algo=algo, amax_history_len=4), tx=optax.sgd(0.0))
    step = jax.jit(mpjax.make_train_step(loss_fn))
    history = []
    for batch in batches:
      state, _ = step(state, batch)
      history.append(state.fp8)
    states[algo] = history
  # Steps 1 and 2 read a history of at most one row: the same for both algorithms.
  _assert_bit_identical(states["max"][:2], states["most_recent"][:2])
  before, with_max, with_recent = states["max"][1], states["max"][2], states["most_recent"][2]
  hist = np.asarray(before.amax_history)
  assert hist.shape == (4, 3, 3) and before.gemms == 3
  # Premise: every FP8 layer's input amax came down from step 1 to 2.
  assert np.all(hist[1, :, 0] > 4 * hist[0, :, 0])
  fmax = np.array([448.0, 448.0, 57344.0])
  np.testing.assert_allclose(np.asarray(with_max.scale), hist.max(axis=0) / fmax, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(with_recent.scale), hist[0] / fmax, rtol=1e-6)
  assert np.all(np.asarray(with_max.scale[:, 0]) > 4 * np.asarray(with_recent.scale[:, 0]))


def test_delayed_scale_from_history_saturates_a_jump_in_amax():
  # Learning rate 0: both runs see the same params. Step 2's inputs are 8x step 1's, so delayed
  # scaling (scale from step 1's amax) clips the FP8 layers' inputs at step 1's amax, where
  # current scaling (scale from the amax now) does not.
  batches = [_batch(), _batch(gain=8.0)]
  losses = {}
  for scaling in ("delayed", "current"):
    state = _state(_policy(scaling=scaling), tx=optax.sgd(0.0))
    step = jax.jit(mpjax.make_train_step(loss_fn))
    losses[scaling] = []
    for batch in batches:
      state, metrics = step(state, batch)
      losses[scaling].append(float(metrics["loss"]))
    if scaling == "delayed":
      hist = np.asarray(state.fp8.amax_history[:, 0])  # the first FP8 GEMM's
      assert hist[0, 0] > 4 * hist[1, 0]  # premise: the input amax jumped past its scale
      assert float(state.fp8.scale[0, 0]) == pytest.approx(hist[1, 0] / 448.0, rel=1e-6)
    else:
      assert state.fp8 is None
  delayed, current = losses["delayed"], losses["current"]
  assert delayed[0] == pytest.approx(current[0], rel=0.03)  # step 1: both about right
  assert delayed[1] < 0.9 * current[1]  # step 2: clipped activations, a smaller output


def test_gemm_whose_result_the_loss_does_not_use_keeps_its_state():
  # ``side`` only reaches aux: its backward never runs, so its amaxes' cotangent is zero: a row
  # of zeros (no information) goes into its history, and its scale stays as it was.
  k = jax.random.split(jax.random.key(0), 4)
  params = {n: jax.random.normal(kk, (D_IN, D_IN)) / 4.0 for n, kk in zip("abcd", k, strict=True)}

  def loss(p, x):
    h = jnp.tanh(x @ p["a"])
    side = h @ p["b"]
    out = jnp.tanh(h @ p["c"]) @ p["d"]
    return jnp.mean(out.astype(jnp.float32) ** 2), jnp.sum(side.astype(jnp.float32))

  state = mpjax.TrainState.create(
    apply_fn=loss, params=params, tx=optax.sgd(0.1), policy="mixed_fp8"
  )
  step = jax.jit(mpjax.make_train_step(loss))
  x = _batch()["x"]
  s1, _ = step(state, x)
  s2, _ = step(s1, x)
  side, used_row = 0, 1  # rows: "b" then "c"; "a" and "d" stay bf16
  assert s2.fp8.gemms == 2
  for s in (s1, s2):
    np.testing.assert_array_equal(np.asarray(s.fp8.scale[side]), np.ones(3, np.float32))
    assert not np.any(np.asarray(s.fp8.amax_history[:, side]))
  # Premise: the GEMM whose result is used did move on: real amaxes, a scale from them.
  used = np.asarray(s2.fp8.amax_history[:, used_row])
  assert np.all(used[:2] > 0) and not np.any(used[2:])
  assert float(used[1, 1]) == float(jnp.max(jnp.abs(params["c"])))
  assert float(s2.fp8.scale[used_row, 1]) == pytest.approx(float(used[1, 1]) / 448.0, rel=1e-6)
  # A scale the history cannot replace stays: from a state whose side GEMM had scale 0.5 and an
  # empty history, the zero row keeps it 0.5 (not reset to 1, not 0).
  fp8_state = s1.fp8.replace(
    scale=s1.fp8.scale.at[side].set(0.5), amax_history=jnp.zeros_like(s1.fp8.amax_history)
  )
  s3, _ = step(s1.replace(fp8=fp8_state), x)
  np.testing.assert_array_equal(np.asarray(s3.fp8.scale[side]), np.full(3, 0.5, np.float32))
  assert not np.any(np.asarray(s3.fp8.amax_history[:, side]))
  assert np.all(np.asarray(s3.fp8.amax_history[0, used_row]) > 0)
  # A zero row is pushed (not the history left as it was): from a history whose latest row saw
  # amaxes, those move to row 1 and the scale they give stays.
  seen = np.array([224.0, 224.0, 28672.0], np.float32)
  fp8_state = s1.fp8.replace(amax_history=jnp.zeros_like(s1.fp8.amax_history).at[0, side].set(seen))
  s4, _ = step(s1.replace(fp8=fp8_state), x)
  history = np.asarray(s4.fp8.amax_history[:, side])
  assert not np.any(history[0]) and not np.any(history[2:])
  np.testing.assert_array_equal(history[1], seen)
  np.testing.assert_allclose(np.asarray(s4.fp8.scale[side]), [0.5, 0.5, 0.5], rtol=1e-6)


# --- 6. a skipped step ---------------------------------------------------------------------------


def test_skipped_step_keeps_fp8_state_bit_identical():
  step = jax.jit(mpjax.make_train_step(loss_fn, skip_nonfinite=True))
  state, metrics = step(_state(), _batch())
  assert bool(metrics["grads_finite"]) and state.fp8.gemms == 3
  bad = _batch(seed=1)
  bad["x"] = bad["x"].at[3, 5].set(jnp.nan)
  skipped, metrics = step(state, bad)
  assert not bool(metrics["grads_finite"])  # premise
  _assert_bit_identical(skipped.fp8, state.fp8)
  _assert_bit_identical(skipped.params, state.params)
  _assert_bit_identical(skipped.opt_state, state.opt_state)
  assert int(skipped.step) == int(state.step) == 1 and int(skipped.skipped_steps) == 1
  # Premise: a good step on that batch's shapes does move the FP8 state.
  moved, _ = step(state, _batch(seed=1))
  assert (
    np.asarray(moved.fp8.amax_history).tobytes() != np.asarray(state.fp8.amax_history).tobytes()
  )


# --- 7. init_fp8_state ---------------------------------------------------------------------------


def test_init_fp8_state_matches_what_the_first_step_makes():
  state, batch = _state(), _batch()
  made, _ = jax.jit(mpjax.make_train_step(loss_fn))(state, batch)
  step = jax.jit(mpjax.make_train_step(loss_fn))
  ready = mpjax.init_fp8_state(step, state, batch)
  assert step._cache_size() == 0  # traced for shapes only, nothing compiled
  assert jax.tree.structure(ready.fp8) == jax.tree.structure(made.fp8)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(ready.fp8)] == [
    (x.shape, x.dtype) for x in jax.tree.leaves(made.fp8)
  ]
  assert isinstance(ready.fp8, mpjax.Fp8State) and ready.fp8.gemms == made.fp8.gemms == 3
  np.testing.assert_array_equal(np.asarray(ready.fp8.scale), np.ones((3, 3), np.float32))
  np.testing.assert_array_equal(
    np.asarray(ready.fp8.amax_history), np.zeros((1024, 3, 3), np.float32)
  )
  # From it, the step compiles once, and its first step is the one the empty state takes.
  s1, _ = step(ready, batch)
  s2, _ = step(s1, batch)
  assert jax.tree.structure(s1.fp8) == jax.tree.structure(ready.fp8)
  assert step._cache_size() == 1
  _assert_bit_identical((s1.params, s1.fp8), (made.params, made.fp8))
  # Premise: starting from the empty state compiles twice (a new fp8 structure).
  fresh = jax.jit(mpjax.make_train_step(loss_fn))
  fresh(fresh(state, batch)[0], batch)
  assert fresh._cache_size() == 2


def test_a_step_that_makes_the_fp8_state_says_how_to_compile_once(caplog):
  state, batch = _state(), _batch()
  with caplog.at_level("WARNING", logger="mpjax"):
    step = jax.jit(mpjax.make_train_step(loss_fn))
    step(step(state, batch)[0], batch)
  assert step._cache_size() == 2  # the premise: the state made in the step compiles it twice
  assert "mpjax.init_fp8_state(step, state, batch)" in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING", logger="mpjax"):
    step = jax.jit(mpjax.make_train_step(loss_fn))
    ready = mpjax.init_fp8_state(step, state, batch)
    step(step(ready, batch)[0], batch)
  assert step._cache_size() == 1
  assert "init_fp8_state" not in caplog.text


# --- 8. checkpoints -----------------------------------------------------------------------------


def test_checkpoint_round_trip_of_a_trained_fp8_state(tmp_path):
  step = jax.jit(mpjax.make_train_step(loss_fn))
  tx = optax.adam(1e-3)  # one optimizer: it is part of the state's (static) structure
  state = _state(tx=tx)
  for seed in range(2):
    state, _ = step(state, _batch(seed=seed))
  mpjax.testing.assert_checkpoint_round_trip(state, str(tmp_path / "helper"))

  target = mpjax.init_fp8_state(step, _state(tx=tx), _batch())
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
  # Premise: the target's FP8 state is not the trained one.
  assert target.fp8.gemms == state.fp8.gemms == 3
  assert target.fp8.amax_history.tobytes() != state.fp8.amax_history.tobytes()
  assert isinstance(restored, mpjax.TrainState) and restored.policy == state.policy
  _assert_bit_identical(restored, state)
  (a, ma), (b, mb) = step(state, _batch(seed=2)), step(restored, _batch(seed=2))
  _assert_bit_identical((a, ma), (b, mb))


# --- 9. which GEMMs run in FP8 -------------------------------------------------------------------


def _fp8_count(policy):
  step = mpjax.make_train_step(loss_fn)
  return mpjax.init_fp8_state(step, _state(policy), _batch()).fp8.gemms


def test_keep_bf16_chooses_the_fp8_gemms():
  assert _fp8_count("mixed_fp8") == N_DENSE - 2
  assert _fp8_count(_policy(keep_bf16=())) == N_DENSE
  assert _fp8_count(_policy(keep_bf16=("first",))) == N_DENSE - 1
  assert _fp8_count(_policy(keep_bf16=("first", "last", "*Dense_2*"))) == N_DENSE - 3
  assert _fp8_count(_policy(keep_bf16=("first", "last", "*Nope*"))) == N_DENSE - 2

  # GEMMs of two computed values (attention scores, weighted values) are not FP8 GEMMs.
  def attention(p, x):
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    return jax.nn.softmax(q @ k.T) @ v

  w = {n: jnp.full((D_IN, 8), 0.1) for n in "qkv"}
  attn = mpjax.TrainState.create(
    apply_fn=attention, params=w, tx=optax.sgd(0.1), policy=_policy(keep_bf16=())
  )
  step = mpjax.make_train_step(lambda p, b: jnp.mean(attention(p, b["x"]) ** 2))
  assert mpjax.init_fp8_state(step, attn, _batch()).fp8.gemms == 3
  forward = str(jax.make_jaxpr(mpjax.autocast(attention, attn.policy))(w, _batch()["x"]))
  assert forward.count("dot_general") >= 5  # premise: five GEMMs ...
  assert forward.count("new_dtype=float8_e4m3fn") == 2 * 3  # ... of which three quantize
  # The glob kept Dense_2 itself: the kernel column of each state names its layer.
  state, batch = _state(_policy(keep_bf16=("*Dense_2*",))), _batch()
  s1, _ = jax.jit(mpjax.make_train_step(loss_fn))(state, batch)
  kernels = _kernel_amaxes(state.params)
  assert np.asarray(s1.fp8.amax_history[0, :, 1]).tolist() == [kernels[i] for i in (0, 1, 3, 4)]


def test_gemm_under_another_fp8_recipe_runs_in_fp8_without_delayed_state():
  # A rule gives Dense_2 an FP8 policy whose recipe is not the step's (a shorter history): the
  # train state's history cannot be its, so it runs in FP8 with current scaling and has no row.
  state, batch = _state(), _batch()
  rules = {"*Dense_2*": _policy(amax_history_len=16)}
  step = mpjax.make_train_step(loss_fn, autocast_rules=rules)
  assert mpjax.init_fp8_state(step, state, batch).fp8.gemms == 2
  s1, metrics = jax.jit(step)(state, batch)
  kernels = _kernel_amaxes(state.params)
  assert s1.fp8.amax_history.shape == (1024, 2, 3) and np.isfinite(float(metrics["loss"]))
  assert np.asarray(s1.fp8.amax_history[0, :, 1]).tolist() == [kernels[1], kernels[3]]

  # Premise: Dense_2 still runs in FP8 (as many quantizing GEMMs as without the rule, more than
  # with Dense_2 kept in bf16), and a rule whose policy has the step's recipe keeps its row.
  def quantized(policy, rules=None):
    forward = mpjax.autocast(MODEL.apply, policy, rules=rules)
    return str(jax.make_jaxpr(forward)(state.params, batch["x"])).count("new_dtype=float8_e4m3fn")

  assert quantized("mixed_fp8", rules) == quantized("mixed_fp8") == 2 * 3
  assert quantized(_policy(keep_bf16=("first", "last", "*Dense_2*"))) == 2 * 2
  same = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, fp8=mpjax.Fp8Recipe())
  assert same != state.policy and same.fp8 == state.policy.fp8
  step = mpjax.make_train_step(loss_fn, autocast_rules={"*Dense_2*": same})
  assert mpjax.init_fp8_state(step, state, batch).fp8.gemms == 3


def test_current_scaling_keeps_no_state_but_runs_in_fp8():
  state, batch = _state(_policy(scaling="current")), _batch()
  step = mpjax.make_train_step(loss_fn)
  assert mpjax.init_fp8_state(step, state, batch).fp8 is None
  text = str(jax.make_jaxpr(step)(state, batch))
  assert "f8_e4m3fn" in text and "f8_e5m2" in text
  # Premise: a bf16 step has no FP8 in it.
  assert "f8_e" not in str(jax.make_jaxpr(step)(_state("mixed_bf16"), batch))
  s1, metrics = jax.jit(step)(state, batch)
  assert s1.fp8 is None and np.isfinite(float(metrics["loss"]))


def test_autocast_alone_runs_fp8_with_current_scaling():
  params, x = _params(), _batch()["x"]
  out = jax.jit(mpjax.autocast(MODEL.apply, "mixed_fp8"))(params, x)
  current = jax.jit(mpjax.autocast(MODEL.apply, _policy(scaling="current")))(params, x)
  bf16 = jax.jit(mpjax.autocast(MODEL.apply, "mixed_bf16"))(params, x)
  assert out.dtype == jnp.float32
  _assert_bit_identical(out, current)
  # Premise: FP8 ran, a little off the bf16 result.
  diff, top = float(jnp.max(jnp.abs(out - bf16))), float(jnp.max(jnp.abs(bf16)))
  assert 1e-3 * top < diff < 0.2 * top


# --- 10. GEMMs in loops --------------------------------------------------------------------------


def _scan_model(params, x):
  h = jnp.tanh(x @ params["w_in"])

  def body(h, w):
    return jnp.tanh(h @ w), None

  h, _ = lax.scan(body, h, params["ws"])
  return h @ params["w_out"]


def _unrolled_model(params, x):
  h = jnp.tanh(x @ params["w_in"])
  for i in range(params["ws"].shape[0]):
    h = jnp.tanh(h @ params["ws"][i])
  return h @ params["w_out"]


def _subjaxprs(jaxpr):
  for eqn in jaxpr.eqns:
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield eqn.primitive.name, sub
          yield from _subjaxprs(sub)


def test_gemm_in_scan_runs_fp8_without_delayed_state():
  k = jax.random.split(jax.random.key(2), 3)
  params = {
    "w_in": jax.random.normal(k[0], (D_IN, 32)) / 4.0,
    "ws": jax.random.normal(k[1], (3, 32, 32)) / 6.0,
    "w_out": jax.random.normal(k[2], (32, 1)) / 6.0,
  }
  batch = _batch()

  def state_and_step(model, policy="mixed_fp8"):
    def loss(p, b):
      return jnp.mean((model(p, b["x"]).astype(jnp.float32) - b["y"]) ** 2)

    state = mpjax.TrainState.create(
      apply_fn=model, params=params, tx=optax.sgd(0.05), policy=policy
    )
    return state, mpjax.make_train_step(loss)

  state, step = state_and_step(_scan_model)
  assert mpjax.init_fp8_state(step, state, batch).fp8 is None
  jaxpr = jax.make_jaxpr(step)(state, batch).jaxpr
  scans = [str(sub) for name, sub in _subjaxprs(jaxpr) if name == "scan"]
  assert len(scans) >= 2
  # The forward scan quantizes to E4M3, the backward one the cotangent to E5M2.
  assert any("f8_e4m3fn" in s for s in scans) and any("f8_e5m2" in s for s in scans)
  s1, metrics = jax.jit(step)(state, batch)
  assert s1.fp8 is None and np.isfinite(float(metrics["loss"]))

  # With nothing kept in bf16, the GEMMs before and after the scan have delayed state, the one
  # inside has none: the two states belong to w_in and w_out.
  state, step = state_and_step(_scan_model, _policy(keep_bf16=()))
  s1, metrics = jax.jit(step)(state, batch)
  assert s1.fp8.gemms == 2 and np.isfinite(float(metrics["loss"]))
  assert np.asarray(s1.fp8.amax_history[0, :, 1]).tolist() == [
    float(jnp.max(jnp.abs(params[n]))) for n in ("w_in", "w_out")
  ]
  # Premise: the same GEMMs unrolled are FP8 GEMMs with delayed state.
  state, step = state_and_step(_unrolled_model)
  assert mpjax.init_fp8_state(step, state, batch).fp8.gemms == 3
  state, step = state_and_step(_unrolled_model, _policy(keep_bf16=()))
  assert mpjax.init_fp8_state(step, state, batch).fp8.gemms == 5


def test_a_gemm_inside_a_custom_vjp_runs_bf16_not_fp8():
  # As Fp8Recipe's docstring says: autocast runs a custom_vjp function's GEMMs as bf16 x bf16.
  w = jax.random.normal(jax.random.key(3), (32, 32)) / 6.0
  x = jax.random.normal(jax.random.key(4), (16, 32))

  @jax.custom_vjp
  def layer(w, x):
    return x @ w

  layer.defvjp(lambda w, x: (x @ w, (w, x)), lambda res, g: (res[1].T @ g, g @ res[0].T))

  def dtypes_of_gemms(fn):
    jaxpr = str(jax.make_jaxpr(jax.grad(mpjax.autocast(fn, _policy(keep_bf16=()))))(w, x))
    return {dtype for dtype in ("f8_e4m3fn", "f8_e5m2", "bf16") if dtype in jaxpr}

  plain = dtypes_of_gemms(lambda w, x: jnp.sum(x @ w))
  assert "f8_e4m3fn" in plain  # the premise: the same GEMM outside a custom_vjp runs in FP8
  wrapped = dtypes_of_gemms(lambda w, x: jnp.sum(layer(w, x)))
  assert "bf16" in wrapped and not wrapped & {"f8_e4m3fn", "f8_e5m2"}
  got = jax.jit(mpjax.autocast(lambda w, x: layer(w, x), _policy(keep_bf16=())))(w, x)
  np.testing.assert_allclose(got.astype(np.float32), x @ w, rtol=2e-2, atol=2e-2)


# --- 11. training -------------------------------------------------------------------------------


def test_fp8_training_tracks_bf16():
  # A noisy regression (noise variance 0.25) in minibatches of 64: 100 Adam steps bring both
  # runs near the noise floor, where the loss is the data's, not the GEMMs' precision.
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (512, D_IN))
  y = 2.0 * jnp.tanh(x @ jax.random.normal(k[1], (D_IN, 1)) / 2.0)
  y = y + 0.5 * jax.random.normal(k[2], y.shape)
  batches = [{"x": x[i : i + 64], "y": y[i : i + 64]} for i in range(0, 512, 64)]
  params = MODEL.init(jax.random.key(5), x[:1])
  losses = {}
  for policy in ("mixed_bf16", "mixed_fp8"):
    state = mpjax.TrainState.create(
      apply_fn=MODEL.apply, params=params, tx=optax.adam(1e-3), policy=policy
    )
    step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
    history = []
    for i in range(100):
      state, metrics = step(state, batches[i % len(batches)])
      history.append(float(metrics["loss"]))
    losses[policy] = np.array(history)
    if policy == "mixed_fp8":
      assert state.fp8.gemms == 3
    else:
      assert state.fp8 is None
  final = {policy: np.mean(history[-16:]) for policy, history in losses.items()}
  for policy, history in losses.items():
    assert np.all(np.isfinite(history))
    assert final[policy] < np.mean(history[:8]) / 5  # both learnt
  assert abs(final["mixed_fp8"] - final["mixed_bf16"]) < 0.1 * final["mixed_bf16"]
  # Premise: FP8 trained differently from bf16 (not the same GEMMs in disguise).
  assert np.max(np.abs(losses["mixed_fp8"] - losses["mixed_bf16"])) > 1e-3


# --- 12. errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "field, bad, accepted",
  [
    ("scaling", "delay", ("delayed", "current")),
    ("amax_compute_algo", "mean", ("max", "most_recent")),
    ("fwd_format", "e4m3fnuz", ("e4m3", "e5m2")),
    ("bwd_format", "e3m4", ("e4m3", "e5m2")),
  ],
)
def test_recipe_rejects_unknown_values_naming_the_accepted_ones(field, bad, accepted):
  with pytest.raises(ValueError, match=field) as info:
    mpjax.Fp8Recipe(**{field: bad})
  assert all(repr(a) in str(info.value) for a in accepted)


def test_recipe_and_policy_errors():
  with pytest.raises(ValueError, match="e5m2"):
    mpjax.Fp8Recipe(fwd_format="e5m2", bwd_format="e5m2")
  assert mpjax.Fp8Recipe(fwd_format="e4m3", bwd_format="e4m3").bwd_dtype == E4M3  # allowed
  with pytest.raises(ValueError, match="f32 params"):
    mpjax.Policy(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, fp8=mpjax.Fp8Recipe())
  policy = mpjax.get_policy("mixed_fp8")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
    jnp.float32,
    jnp.bfloat16,
    jnp.float32,
  )
  assert policy.fp8 == mpjax.Fp8Recipe()
  recipe = policy.fp8
  assert (recipe.scaling, recipe.amax_history_len, recipe.margin) == ("delayed", 1024, 0)
  assert (recipe.fwd_dtype, recipe.bwd_dtype, recipe.keep_bf16) == (E4M3, E5M2, ("first", "last"))
  assert recipe.amax_compute_algo in ("max", "most_recent")


def test_train_step_without_autocast_refuses_fp8():
  step = jax.jit(mpjax.make_train_step(loss_fn, autocast=False))
  with pytest.raises(ValueError, match="autocast"):
    step(_state(), _batch())
  # Premise: the same step runs a bf16 state.
  state, _ = step(_state("mixed_bf16"), _batch())
  assert int(state.step) == 1


@pytest.mark.parametrize("rows", [len(MIDDLE) - 1, len(MIDDLE) + 2])
def test_a_state_made_for_another_model_is_refused_by_name(rows):
  step = jax.jit(mpjax.make_train_step(loss_fn))
  state = _state()
  assert mpjax.init_fp8_state(step, state, _batch()).fp8.gemms == len(MIDDLE)  # the premise
  wrong = state.replace(fp8=mpjax.Fp8State.initial(state.policy.fp8, rows))
  with pytest.raises(ValueError, match=f"holds the state of {rows} FP8 GEMMs.*train_step=step"):
    step(wrong, _batch())


def test_a_weight_gathered_through_a_sharding_constraint_is_still_a_weight_in_fp8():
  # An FSDP model gathers each weight where it is used (``with_sharding_constraint``); the
  # weight stays the f32 master seen through a view: its GEMM is planned in FP8 and its amax is
  # the master's, not a bf16 copy's.
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  replicated = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("fsdp",)), P())
  policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(keep_bf16=()))
  params = [jax.random.normal(jax.random.key(i), (32, 32)) / 6 for i in range(3)]
  x = jax.random.normal(jax.random.key(9), (8, 32))
  first_amax = float(jnp.max(jnp.abs(params[0])))
  assert first_amax != float(jnp.max(jnp.abs(params[0].astype(jnp.bfloat16))))  # the premise

  def loss_fn(params, x):
    for w in params:
      x = jax.nn.relu(x @ jax.lax.with_sharding_constraint(w, replicated))
    return jnp.mean(x.astype(jnp.float32) ** 2)

  step = jax.jit(mpjax.make_train_step(loss_fn))
  state = mpjax.TrainState.create(
    apply_fn=None, params=params, tx=optax.sgd(0.1), policy=policy, train_step=step, example_batch=x
  )
  state, _ = step(state, x)
  assert state.fp8.gemms == 3
  assert float(state.fp8.amax_history[0, 0, 1]) == first_amax
