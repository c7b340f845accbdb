"""Block-scaled GEMMs (MXFP8, NVFP4) on the CPU: quantization bit for bit against a reference
written from the OCP MX spec, the GEMMs against NumPy, the residuals, the presets in training."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import mpjax
from mpjax.jax_compat import saved_residuals

E4M3, E5M2, E2M1 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn


# --- a reference MX quantizer, from the OCP Microscaling spec v1.0 (section 6.3), in float64 ---


def _reference_mx(x, element, rounding, block=32):
  """(element bytes, E8M0 codes) of ``x`` (f32, last dim blocked), computed in float64.

  Spec: X = 2**(floor(log2(amax)) - emax_elem), each value cast to the element format with
  round-to-nearest-even, saturating. ``rounding="up"`` is NVIDIA's variant: the exponent one
  more where amax / X would exceed the format's max. A zero block gets X = 2**-127 (code 0),
  a block with an inf or NaN the NaN scale (code 255). Where the spec allows X = 2**-127 for
  a nonzero block mpjax takes 2**-126, and f32 subnormals count as zero: XLA flushes f32
  subnormals on the CPU.
  """
  x = np.asarray(x, np.float32).astype(np.float64)
  x = np.where(np.abs(x) < 2.0**-126, np.copysign(0.0, x), x)
  fmax = float(ml_dtypes.finfo(element).max)
  emax = math.floor(math.log2(fmax))
  blocks = x.reshape(-1, block)
  codes, values = [], []
  for b in blocks:
    amax = np.max(np.abs(b))
    if not np.isfinite(amax):
      codes.append(255)
      values.append(np.full(block, np.nan).astype(element))
      continue
    if amax == 0:
      exponent = -127
    else:
      mantissa, e = math.frexp(amax)  # amax = mantissa * 2**e, mantissa in [0.5, 1)
      exponent = (e - 1) - emax
      if rounding == "up" and 2 * mantissa > fmax / 2**emax:
        exponent += 1
      exponent = min(max(exponent, -126), 127)  # mpjax: 2**-127 is f32-subnormal, flushed
    codes.append(exponent + 127)
    values.append(np.clip(b / 2.0**exponent, -fmax, fmax).astype(element))
  shape = np.shape(x)
  return (
    np.stack(values).reshape(shape).view(np.uint8),
    np.array(codes, np.uint8).reshape(*shape[:-1], shape[-1] // block),
  )


def _hard_blocks():
  """Blocks of 32 that exercise the edge cases, one per row."""
  rng = np.random.default_rng(0)
  rows = [
    np.zeros(32),  # all zero
    rng.normal(size=32) * 2.0 ** rng.integers(-30, 30),  # ordinary
    np.r_[448.0, rng.normal(size=31) * 1e-3],  # tiny next to the amax: E4M3 subnormals
    np.r_[1.0, rng.normal(size=31) * 2.0**-30],  # E5M2 subnormals (E4M3, E2M1: zeros)
    np.r_[449.0 * 2**-5, rng.normal(size=31)],  # mantissa just above 1.75: rounds up
    np.r_[480.0, -479.0, rng.normal(size=30) * 100],  # saturates under floor rounding
    np.r_[1.75 * 2**20, rng.normal(size=31)],  # mantissa exactly 1.75
    np.r_[np.nan, rng.normal(size=31)],  # NaN
    np.r_[np.inf, rng.normal(size=31)],  # inf
    np.r_[1e-40, -3e-39, np.zeros(30)],  # f32 subnormals only: flushed
    np.r_[3e38, rng.normal(size=31)],  # near f32's max
    np.r_[2.0**-120, rng.normal(size=31) * 2.0**-125],  # near f32's min normal: scale 2**-126
    -np.abs(rng.normal(size=32)) * 7.0,  # all negative
  ]
  return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize(
  "element, rounding",
  [("e4m3", "up"), ("e4m3", "floor"), ("e5m2", "up"), ("e2m1", "up"), ("e2m1", "floor")],
)
def test_mx_quantization_matches_the_ocp_reference_bit_for_bit(element, rounding):
  x = np.concatenate([_hard_blocks(), _hard_blocks()[::-1] * 0.37], axis=1)  # 2 blocks a row
  recipe = mpjax.BlockScaledRecipe(element_format=element, scale_rounding=rounding)
  q = jax.jit(mpjax.quantize_blocks, static_argnums=1)(jnp.asarray(x), recipe)
  dtype = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}[element]
  ref_values, ref_codes = _reference_mx(x, dtype, rounding)
  assert q.values.dtype == dtype and q.scales.dtype == jnp.float8_e8m0fnu
  assert q.tensor_scale is None
  codes = np.asarray(q.scales).view(np.uint8)
  np.testing.assert_array_equal(codes, ref_codes)
  values = np.asarray(q.values).view(np.uint8)
  nan = np.isnan(np.asarray(q.values).astype(np.float32))
  ref_nan = np.isnan(ref_values.view(dtype).astype(np.float32))
  np.testing.assert_array_equal(nan, ref_nan)
  np.testing.assert_array_equal(np.where(nan, 0, values), np.where(ref_nan, 0, ref_values))
  # Blocked along the first axis (the backward GEMMs' "columnwise" copies), of x transposed: the
  # same bits, computed without moving x.
  cols = jax.jit(mpjax.quantize_blocks, static_argnums=(1, 2))(jnp.asarray(x.T), recipe, 0)
  np.testing.assert_array_equal(np.asarray(cols.scales).view(np.uint8), codes)
  col_values = np.asarray(cols.values).view(np.uint8)
  np.testing.assert_array_equal(np.where(nan, 0, col_values), np.where(nan, 0, values))
  assert np.isnan(np.asarray(cols.values).astype(np.float32)[nan]).all()
  # Premises: each edge case happens.
  assert (codes == 255).any() and (codes == 0).any()  # NaN and zero blocks
  if element != "e2m1":  # the 2**-120 block: its spec scale 2**-127 or below, raised to 2**-126
    assert (codes == 1).any()
  decoded = np.asarray(q.values).astype(np.float32)
  fmax = float(ml_dtypes.finfo(dtype).max)
  tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
  assert ((np.abs(decoded) < tiny) & (decoded != 0)).any()  # element subnormals
  if element == "e4m3":  # the 480 block: floor's scale 1 clips 480 and -479 to 448
    clipped = np.abs(decoded[5, :2]) == fmax
    assert clipped.all() if rounding == "floor" else not clipped.any()
  # The rounding matters: the other one gives other scales.
  other = mpjax.BlockScaledRecipe(
    element_format=element, scale_rounding="floor" if rounding == "up" else "up"
  )
  assert (
    np.asarray(mpjax.quantize_blocks(jnp.asarray(x), other).scales).view(np.uint8) != codes
  ).any()


def test_an_mxfp8_round_trip_is_within_e4m3s_precision_and_never_saturates():
  x = jax.random.normal(jax.random.key(0), (64, 256)) * jnp.exp(
    jax.random.normal(jax.random.key(1), (64, 1)) * 5
  )
  q = jax.jit(mpjax.quantize_blocks, static_argnums=1)(x, mpjax.MXFP8)
  back = mpjax.dequantize_blocks(q)
  blocks = jnp.abs(x).reshape(64, 8, 32).max(-1, keepdims=True)
  err = jnp.abs(back - x).reshape(64, 8, 32)
  # E4M3: 3 mantissa bits, half an ulp of relative error for normals; subnormals absolute.
  assert bool((err <= jnp.maximum(jnp.abs(x).reshape(64, 8, 32) * 2**-4, blocks * 2**-18)).all())
  assert float(jnp.abs(q.values.astype(jnp.float32)).max()) <= 448  # rounded up: no clipping
  assert float(jnp.max(jnp.abs(back))) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=2**-4)


def test_nvfp4_quantization_has_two_levels_and_zero_blocks_stay_zero():
  x = jax.random.normal(jax.random.key(0), (8, 64)) * 1000.0
  x = x.at[0, :16].set(0.0)
  q = jax.jit(mpjax.quantize_blocks, static_argnums=1)(x, mpjax.NVFP4)
  assert q.values.dtype == jnp.float4_e2m1fn and q.scales.dtype == jnp.float8_e4m3fn
  assert q.scales.shape == (8, 4)
  # The tensor scale brings the largest block scale to E4M3's max: amax / (6 * 448).
  assert float(q.tensor_scale) == pytest.approx(float(jnp.max(jnp.abs(x))) / (6 * 448), rel=1e-6)
  back = mpjax.dequantize_blocks(q)
  assert bool((back[0, :16] == 0).all()) and not bool(jnp.isnan(back).any())
  # E2M1 has 1 mantissa bit: within a quarter of each block's amax (half of its spacing at 6).
  amax = jnp.abs(x).reshape(8, 4, 16).max(-1, keepdims=True)
  assert bool((jnp.abs(back - x).reshape(8, 4, 16) <= amax / 6 + 1e-3).all())
  assert float(jnp.abs(back - x).mean()) > 1.0  # premise: FP4 is coarse
  cols = jax.jit(mpjax.quantize_blocks, static_argnums=(1, 2))(x.T, mpjax.NVFP4, 0)
  for got, want in zip(cols, q, strict=True):  # along the first axis: the same bits
    assert got.shape == want.shape and np.asarray(got).tobytes() == np.asarray(want).tobytes()
  # A tensor too small for an f32-normal tensor scale quantizes to finite values, not 0 / 0.
  tiny = jnp.array([[2.0**-120] * 16 + [0.0] * 16])
  back = mpjax.dequantize_blocks(
    jax.jit(mpjax.quantize_blocks, static_argnums=1)(tiny, mpjax.NVFP4)
  )
  assert not bool(jnp.isnan(back).any())
  # An inf is never hidden: its block (with a tensor scale, the whole tensor) becomes NaN.
  for recipe in (mpjax.NVFP4, mpjax.BlockScaledRecipe("e2m1", "e4m3", 16, "nearest")):
    q = mpjax.quantize_blocks(x.at[1, 0].set(jnp.inf), recipe)
    assert bool(jnp.isnan(mpjax.dequantize_blocks(q)[1, :16]).all())


def test_recipes_refuse_bad_fields_early_with_the_fix():
  with pytest.raises(
    ValueError, match="element_format='e4m2' is not one of 'e4m3', 'e5m2', 'e2m1'"
  ):
    mpjax.BlockScaledRecipe(element_format="e4m2")
  with pytest.raises(ValueError, match="block_size=0 must be a positive integer"):
    mpjax.BlockScaledRecipe(block_size=0)
  with pytest.raises(ValueError, match="an e4m3 scale rounds 'nearest'"):
    mpjax.BlockScaledRecipe(scale_format="e4m3")
  with pytest.raises(ValueError, match="backward='fp4'"):
    mpjax.BlockScaledRecipe(backward="fp4")
  with pytest.raises(ValueError, match="FP8 GEMMs need f32 params"):
    mpjax.Policy(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, fp8=mpjax.MXFP8)
  with pytest.raises(ValueError, match="not a multiple of the block size 32"):
    mpjax.quantize_blocks(jnp.ones((4, 48)), mpjax.MXFP8)
  with pytest.raises(ValueError, match="dimension 0 of a .* not a multiple of the block size 32"):
    mpjax.quantize_blocks(jnp.ones((48, 64)), mpjax.MXFP8, axis=0)
  with pytest.raises(ValueError, match="axis 2 is out of range for a .*; give one of its"):
    mpjax.quantize_blocks(jnp.ones((4, 64)), mpjax.MXFP8, axis=2)
  assert mpjax.get_policy("mixed_mxfp8").fp8 is mpjax.MXFP8
  assert mpjax.get_policy("mixed_nvfp4").fp8.name == "nvfp4"
  with pytest.raises(ValueError, match="gradient_rounding='random' is not one of"):
    mpjax.BlockScaledRecipe(gradient_rounding="random")
  with pytest.raises(ValueError, match="backward='bf16' quantizes none; set backward='same'"):
    mpjax.BlockScaledRecipe(backward="bf16", gradient_rounding="stochastic")
  with pytest.raises(ValueError, match="24 x 24 Hadamard matrix, .* power of two only"):
    mpjax.BlockScaledRecipe(block_size=24, hadamard_wgrad=True)
  assert mpjax.MXFP8.backward_recipe is mpjax.MXFP8 and mpjax.NVFP4.backward_recipe is mpjax.MXFP8
  full = mpjax.NVFP4_FP4_GRADIENTS
  assert full.backward_recipe is full and full.name == "nvfp4"
  assert mpjax.BlockScaledRecipe(backward="mxfp8").backward_recipe is mpjax.MXFP8
  # auto never picks a block-scaled preset (here: a CPU).
  assert mpjax.get_policy("auto").fp8 is None


# --- the GEMMs, forward and backward, against NumPy on reference-quantized operands ----------


def _np_quantize_along_last(x):
  values, codes = _reference_mx(x, E4M3, "up")
  scale = np.exp2(codes.astype(np.float64) - 127)
  return values.view(E4M3).astype(np.float64) * np.repeat(scale, 32, axis=-1)


def test_an_mxfp8_layer_matches_numpy_forward_and_both_gradients():
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (128, 96)) * 3.0
  w = jax.random.normal(kw, (96, 64)) * 0.05
  ct = jax.random.normal(kg, (128, 64)).astype(jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))

  def layer(x, w):
    return mpjax.block_scaled_dot(x, w, dims, mpjax.MXFP8, jnp.bfloat16)

  out, vjp = jax.jit(lambda x, w: jax.vjp(layer, x, w))(x, w)
  dx, dw = jax.jit(vjp)(ct)
  xn, wn, gn = (np.asarray(a, np.float32) for a in (x, w, ct.astype(jnp.float32)))
  ref_out = _np_quantize_along_last(xn) @ _np_quantize_along_last(wn.T).T  # blocks along K
  ref_dx = _np_quantize_along_last(gn) @ _np_quantize_along_last(wn).T  # blocks along N
  ref_dw = _np_quantize_along_last(xn.T) @ _np_quantize_along_last(gn.T).T  # blocks along M
  for got, ref in ((out, ref_out), (dx, ref_dx), (dw, ref_dw)):
    got = np.asarray(got, np.float64)
    # The products are exact; f32 sums and a bf16 result round: half a bf16 ulp and a bit.
    tol = 2**-8 * np.abs(ref) + 1e-5 * np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= tol), np.max(np.abs(got - ref) / (np.abs(ref) + 1e-9))
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  # Premise: block scaling changed the result: the unquantized product differs by much more.
  exact = xn.astype(np.float64) @ wn
  assert np.max(np.abs(exact - ref_out)) > 4 * np.max(2**-8 * np.abs(ref_out))


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.gelu(nn.Dense(256)(x))
    return nn.Dense(32)(x)


def _saved_bytes(policy, model, params, x):
  loss = lambda p, x: jnp.sum(mpjax.autocast(model.apply, policy)(p, x) ** 2)  # noqa: E731
  saved = [a for a, where in saved_residuals(loss, params, x) if "from the argument" not in where]
  return sum(a.size * a.dtype.itemsize for a in saved), {str(a.dtype) for a in saved}


def test_residuals_are_saved_quantized_about_half_of_mixed_bf16s():
  model = _Mlp()
  x = jax.random.normal(jax.random.key(0), (512, 128))
  params = model.init(jax.random.key(1), x)
  every = mpjax.Policy(
    jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.BlockScaledRecipe(keep_bf16=())
  )
  bf16, bf16_dtypes = _saved_bytes("mixed_bf16", model, params, x)
  mx, mx_dtypes = _saved_bytes(every, model, params, x)
  assert "float8_e4m3fn" in mx_dtypes and "float8_e8m0fnu" in mx_dtypes
  assert "float8_e4m3fn" not in bf16_dtypes
  # Each GEMM's activation in E4M3 with a scale per 32 (1 + 1/32 bytes, not 2); GELU's input
  # stays bf16 in both.
  assert mx < 0.8 * bf16, mx / bf16
  # A weight is not saved again: its f32 master is an argument, quantized in the backward pass.
  assert mx < bf16 - 3 * 256 * 256 // 2


def test_mixed_mxfp8_and_nvfp4_train_an_unchanged_model_close_to_mixed_bf16():
  model = _Mlp()
  kx, kt = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (256, 128))
  teacher = jax.random.normal(kt, (128, 32)) / 11.0
  batch = {"x": x, "y": jnp.tanh(x @ teacher)}
  params = model.init(jax.random.key(1), x)

  def loss_fn(p, b):
    return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

  step = jax.jit(mpjax.make_train_step(loss_fn))
  losses, firsts = {}, {}
  for policy in ("mixed_bf16", "mixed_mxfp8", "mixed_nvfp4"):
    state = mpjax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(3e-3), policy=policy
    )
    state = mpjax.init_fp8_state(step, state, batch)
    assert state.fp8 is None  # block scaling keeps no delayed state
    first = None
    for _ in range(60):
      state, metrics = step(state, batch)
      first = float(metrics["loss"]) if first is None else first
    losses[policy], firsts[policy] = float(metrics["loss"]), first
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32  # f32 masters
    assert losses[policy] < 0.5 * first, (policy, first, losses[policy])
  assert firsts["mixed_mxfp8"] == pytest.approx(firsts["mixed_bf16"], rel=0.05)
  # Of the loss the first step saw, MXFP8 ends within 0.2% of bf16; NVFP4, coarser, within 2%.
  gap = {p: (losses[p] - losses["mixed_bf16"]) / firsts["mixed_bf16"] for p in losses}
  assert abs(gap["mixed_mxfp8"]) < 0.002 and abs(gap["mixed_nvfp4"]) < 0.02, (gap, firsts)
  assert losses["mixed_mxfp8"] != losses["mixed_bf16"]  # premise: the GEMMs were quantized


def test_the_plan_runs_the_middle_gemms_block_scaled_and_keeps_misfit_ones_bf16():
  model = _Mlp()
  x = jnp.ones((64, 128))
  params = model.init(jax.random.key(1), x)
  forward = jax.jit(mpjax.autocast(model.apply, "mixed_mxfp8"))
  rows = mpjax.audit(forward, params, x).rows
  # The two middle Dense layers multiply E4M3 operands (dequantized on a CPU, as the audit
  # reads); the first and the last stay bf16, as mixed_fp8 keeps them.
  assert [r.dtypes.split(" ->")[0] for r in rows] == [
    "bf16 x bf16",
    "f8_e4m3fn x f8_e4m3fn",
    "f8_e4m3fn x f8_e4m3fn",
    "bf16 x bf16",
  ]
  # A batch of 48 rows is no multiple of 32: no GEMM can be blocked along M; all stay bf16.
  odd = jnp.ones((48, 128))
  rows = mpjax.audit(forward, params, odd).rows
  assert {r.dtypes.split(" ->")[0] for r in rows} == {"bf16 x bf16"}


# --- NVFP4's gradients: stochastic rounding, 16 x 16 weight blocks, the Hadamard transform ----


def _finite_values(element):
  """Every finite value of an element format, as float64."""
  codes = np.arange(16 if element == E2M1 else 256, dtype=np.uint8)
  values = codes.view(element).astype(np.float64)
  return values[np.isfinite(values)]


def _reference_stochastic(v, element, bits):
  """``v`` rounded to the format's value below or above it, the one above where the top 24 of
  ``bits`` as a fraction fall under the distance from the one below over their distance."""
  grid = np.unique(np.abs(_finite_values(element)))
  a = np.abs(v.astype(np.float64))
  i = np.searchsorted(grid, a, side="right") - 1
  lower, upper = grid[i], grid[np.minimum(i + 1, grid.size - 1)]
  p = np.where(upper > lower, (a - lower) / np.where(upper > lower, upper - lower, 1), 0.0)
  u = (bits >> 8).astype(np.float64) * 2.0**-24
  return np.copysign(np.where(u < p, upper, lower), v).astype(np.float32)


@pytest.mark.parametrize("element", [E2M1, E4M3])
def test_stochastic_rounding_matches_a_reference_bit_for_bit(element):
  from mpjax.rounding import round_stochastically

  rng = np.random.default_rng(0)
  fmax = float(ml_dtypes.finfo(element).max)
  grid = _finite_values(element)
  v = np.concatenate(
    [
      rng.uniform(-fmax, fmax, 4000),
      np.exp2(rng.uniform(-12, math.log2(fmax), 4000)) * rng.choice([-1, 1], 4000),  # subnormals
      grid,  # exact values stay
      [0.0, -0.0, fmax, -fmax],
    ]
  ).astype(np.float32)
  bits = rng.integers(0, 2**32, v.size, dtype=np.uint32)
  round_ = jax.jit(round_stochastically, static_argnums=1)
  got = np.asarray(round_(jnp.asarray(v), np.dtype(element), jnp.asarray(bits)))
  want = _reference_stochastic(v, element, bits)
  assert got.tobytes() == want.tobytes()  # signs of zeros included
  assert set(np.unique(np.abs(got))) <= set(np.abs(grid))  # the format's values, as is
  assert not np.array_equal(got, np.asarray(jnp.asarray(v).astype(element).astype(jnp.float32)))
  assert bool(
    jnp.isnan(round_(jnp.array([jnp.nan]), np.dtype(element), jnp.array([7], jnp.uint32)))[0]
  )


def _eye_layer(recipe, w):
  """``x @ w`` with ``x`` the identity (exact in any format): forward result and ``vjp``."""
  dims = (((1,), (0,)), ((), ()))
  layer = lambda x, w: mpjax.block_scaled_dot(x, w, dims, recipe, jnp.bfloat16, (False, True))  # noqa: E731
  return jax.jit(lambda x, w: jax.vjp(layer, x, w))(jnp.eye(w.shape[0]), w)


def test_stochastically_rounded_gradients_are_right_on_average_and_new_with_new_values():
  # Blocks of 16 along N of [6, 1.2 x 15]: the block scale is exact, each 1.2 is 1.2 of E2M1's
  # spacing 0.5 above 1.0; nearest rounds every one to 1.0, stochastic to 1.5 with p = 0.4.
  g = jnp.tile(jnp.array([6.0] + [1.2] * 15), (2048, 4)).astype(jnp.bfloat16)
  w = jnp.eye(64)  # quantized exactly: the input gradient is the quantized gradient itself
  x = jnp.ones((2048, 64))
  dims = (((1,), (0,)), ((), ()))
  recipe = mpjax.NVFP4_FP4_GRADIENTS

  def input_gradient(recipe, g):
    layer = lambda x, w: mpjax.block_scaled_dot(x, w, dims, recipe, jnp.bfloat16, (False, True))  # noqa: E731
    return jax.jit(lambda x, w, g: jax.vjp(layer, x, w)[1](g)[0])(x, w, g)

  dx = np.asarray(input_gradient(recipe, g), np.float64)
  nearest = np.asarray(input_gradient(dataclasses.replace(recipe, gradient_rounding="nearest"), g))
  ones = np.tile(np.arange(64) % 16 != 0, (2048, 1))
  assert set(np.unique(dx[ones])) == {1.0, 1.5}
  assert dx[ones].mean() == pytest.approx(1.2, abs=0.005)  # unbiased
  assert np.all(nearest[ones] == 1.0)  # premise: rounding to nearest loses 0.2 of each
  assert np.all(dx[~ones] == 6.0)
  # A pure function of the values: the same gradient rounds alike; one block's amax changed
  # draws new bits for every block.
  assert np.array_equal(dx, np.asarray(input_gradient(recipe, g), np.float64))
  other = np.asarray(input_gradient(recipe, g.at[0, :16].multiply(0.5)), np.float64)
  assert np.mean(other[1:][ones[1:]] != dx[1:][ones[1:]]) > 0.3


def test_square_weight_blocks_give_the_forward_and_the_input_gradient_the_same_weight():
  # Rows of very different magnitudes: a row-wise block scale differs from a tile's.
  w = jax.random.normal(jax.random.key(0), (64, 64)) * jnp.exp2(jnp.arange(64) % 7)[:, None]
  for square in (True, False):
    recipe = dataclasses.replace(mpjax.NVFP4_FP4_GRADIENTS, square_weight_blocks=square)
    out, vjp = _eye_layer(recipe, w)
    dx, _ = jax.jit(vjp)(jnp.eye(64, dtype=jnp.bfloat16))  # dx = g @ w.T with g = I: w.T
    same = np.array_equal(np.asarray(out), np.asarray(dx.astype(jnp.bfloat16)).T)
    assert same == square, square  # premise: with 1 x 16 blocks the two copies differ
  assert float(jnp.abs(out.astype(jnp.float32) - w).max()) > 0  # and w was quantized


def test_the_hadamard_transform_is_orthogonal_and_the_weight_gradient_multiplies_its_operands():
  from mpjax.block_scaled import _hadamard, _hadamard_matrix

  q = _hadamard_matrix(16)
  assert np.allclose(q @ q.T, np.eye(16), atol=1e-12) and set(np.unique(np.abs(q))) == {0.25}
  x = jax.random.normal(jax.random.key(1), (128, 48)) * 10.0
  got = np.asarray(jax.jit(_hadamard, static_argnums=(1, 2))(x, 0, 16), np.float64)
  want = np.einsum("jsk,st->jtk", np.asarray(x, np.float64).reshape(8, 16, 48), q).reshape(128, 48)
  assert np.max(np.abs(got - want)) <= 2e-6 * np.max(np.abs(want))
  # The weight gradient of an NVFP4 layer: both operands transformed along M, then quantized.
  recipe = dataclasses.replace(mpjax.NVFP4_FP4_GRADIENTS, gradient_rounding="nearest")
  kw, kg = jax.random.split(jax.random.key(2))
  w = jax.random.normal(kw, (48, 64)) * 0.05
  g = jax.random.normal(kg, (128, 64)).astype(jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))

  def weight_gradient(recipe):
    layer = lambda x, w: mpjax.block_scaled_dot(x, w, dims, recipe, jnp.bfloat16, (False, True))  # noqa: E731
    return np.asarray(jax.jit(lambda x, w, g: jax.vjp(layer, x, w)[1](g)[1])(x, w, g), np.float64)

  @jax.jit
  def along_m(a):  # the transformed operand quantized along M, dequantized: (cols, M)
    cols = mpjax.quantize_blocks(_hadamard(a.astype(jnp.float32), 0, 16), recipe, axis=0)
    return mpjax.dequantize_blocks(cols)

  dw = weight_gradient(recipe)
  ref = np.asarray(along_m(x), np.float64) @ np.asarray(along_m(g), np.float64).T
  tol = 2**-8 * np.abs(ref) + 1e-5 * np.abs(ref).max()
  assert np.all(np.abs(dw - ref) <= tol), np.max(np.abs(dw - ref) / (np.abs(ref) + 1e-9))
  exact = np.asarray(x, np.float64).T @ np.asarray(g.astype(jnp.float32), np.float64)
  assert np.linalg.norm(dw - exact) < 0.3 * np.linalg.norm(exact)  # the product, kept
  untransformed = weight_gradient(dataclasses.replace(recipe, hadamard_wgrad=False))
  assert np.max(np.abs(untransformed - dw)) > 10 * np.max(tol)  # premise: it changed the GEMM
