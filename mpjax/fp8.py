"""FP8 GEMMs: E4M3 operands forward, E5M2 gradients backward, scaled per tensor.

An FP8 format holds few values (E4M3: 448 at most, 3 mantissa bits; E5M2:
57344, 2 bits), so each operand is divided by a scale that brings its largest
magnitude (its *amax*) near the format's largest value before the cast, and the
GEMM multiplies the scale back in. *Current* scaling takes the scale from the
operand's amax at that moment; *delayed* scaling takes it from the amaxes of
the steps before (a history kept in the train state), which needs no pass over
the operand before it is cast.

Each FP8 GEMM, forward and both backward, is a direct FP8 dot: the FP8
operands go into ``dot_general`` themselves and the product of their scales
multiplies the result, ``dot(q_lhs, q_rhs) * (s_lhs * s_rhs)``; backward
``d_lhs = dot(q_g, q_rhs) * (s_g * s_rhs)`` with the E5M2 output gradient and
``d_rhs = dot(q_lhs, q_g) * (s_lhs * s_g)``. XLA:GPU keeps that FP8 in both
of its modes: an FP8 x FP8 dot inside a Triton GEMM fusion (the default), or
one ``__cublas$lt$matmul$f8`` call with the scale passed to cuBLASLt (Triton
GEMMs off), accumulating in f32 either way. (Quantize -> dequantize -> dot,
the form XLA's cuBLASLt rewriter matches, becomes a bf16 x bf16 Triton GEMM in
the default mode: XLA folds the f32 -> FP8 -> bf16 converts, and no FP8 value
is left.) A bf16 GEMM writes bf16 and the scale multiplies it there, which XLA
fuses into the GEMM (no pass of its own over the output); an fp16 one writes
f32, the range an unscaled sum of FP8 products can need.

XLA:CPU has no FP8 GEMM: there the FP8 values are widened to bf16 (exactly:
every E4M3 and E5M2 value is a bf16 value) and multiplied by the fast
bf16 x bf16 -> f32 kernel, then by the scale in f32. The CPU thus computes
on the very FP8 operands a GPU does, with f32 accumulation; only the rounding
of the result differs (a GPU's bf16 GEMM rounds it to bf16 before the scale,
unless XLA keeps the excess precision, as cuBLASLt does).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mpjax._backend import lowering_platform
from mpjax.gemm import backward_gemms, forward_gemm

__all__ = ["Fp8Recipe", "Fp8State", "FP8_FORMATS"]

FP8_FORMATS: dict[str, Any] = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
"""The FP8 formats a recipe names, and their dtypes (E4M3 without infinities, as on H100)."""

SCALINGS = ("delayed", "current")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
_POSITIONS = ("first", "last")

# The order of a GEMM's three tensors in the columns of an Fp8State.
LHS, RHS, GRAD = 0, 1, 2


def check_choice(recipe: str, field: str, value: Any, accepted: tuple[str, ...]) -> None:
  """Raises a ``ValueError`` naming the accepted values where ``value`` is not one of them."""
  if value not in accepted:
    near = difflib.get_close_matches(str(value), accepted, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise ValueError(
      f"{recipe}: {field}={value!r} is not one of {', '.join(map(repr, accepted))}.{hint}"
    )


def keep_bf16_globs(recipe: str, keep_bf16: Any) -> tuple[str, ...]:
  """A recipe's ``keep_bf16`` as a tuple of strings (one string is one pattern)."""
  keep = (keep_bf16,) if isinstance(keep_bf16, str) else keep_bf16
  if not all(isinstance(k, str) for k in keep):
    raise ValueError(
      f"{recipe}: keep_bf16={keep_bf16!r} must be a tuple of 'first', 'last' and name-stack "
      "globs such as '*/head/*'."
    )
  return tuple(keep)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How a policy's FP8 GEMMs are scaled, and which GEMMs stay in the compute dtype.

  The GEMMs an FP8 policy runs in FP8 are those of a layer: a ``dot_general``
  of which at least one operand is an input of the function (a weight, or the
  model's input). GEMMs of two computed values (attention scores and the
  attention-weighted values) stay in the compute dtype, as in Transformer
  Engine's recipes, and so do convolutions and grouped GEMMs.

  Attributes:
    scaling: ``"delayed"`` (each operand's scale comes from the amax history
      of the steps before; the train state keeps the histories) or
      ``"current"`` (each operand's scale comes from its own amax, taken when
      it is cast: one more pass over it, no state). Where there is no state
      to keep (:func:`mpjax.autocast` on its own, GEMMs inside ``scan`` and
      ``while`` bodies, whose amaxes a single history cannot follow), delayed
      scaling runs as current scaling. GEMMs inside ``custom_jvp`` and
      ``custom_vjp`` functions are not run in FP8 at all: autocast runs them
      as bf16 x bf16 -> f32 GEMMs.
    amax_history_len: how many steps of amaxes delayed scaling keeps.
    amax_compute_algo: how delayed scaling reads the history: ``"max"`` (the
      largest amax it holds) or ``"most_recent"`` (the last step's).
    margin: the scale leaves ``2**margin`` of headroom below the format's
      largest value.
    fwd_format: the format of the forward GEMMs' operands (``"e4m3"``).
    bwd_format: the format of the output gradient in the backward GEMMs
      (``"e5m2"``, the range gradients need). Together the default is what
      Transformer Engine calls HYBRID; ``"e4m3"`` for both is its E4M3.
    keep_bf16: the GEMMs that stay in the compute dtype: ``"first"`` and
      ``"last"`` (the first and last FP8-eligible GEMM of the forward pass in
      program order, e.g. a network's input projection and its output head,
      the layers FP8 hurts most), and globs over the name-stack path (as
      autocast's ``rules``), e.g. ``"*/head/*"``.

  Raises:
    ValueError: for a value not among the accepted ones (the message lists
      them) or E5M2 in both directions (cuBLASLt has no E5M2 x E5M2 GEMM).

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> recipe = mpjax.Fp8Recipe(scaling="current", keep_bf16=("last",))
    >>> policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=recipe)
    >>> mpjax.get_policy("mixed_fp8").fp8.scaling, policy.fp8.scaling
    ('delayed', 'current')
  """

  scaling: str = "delayed"
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  margin: int = 0
  fwd_format: str = "e4m3"
  bwd_format: str = "e5m2"
  keep_bf16: tuple[str, ...] = ("first", "last")

  def __post_init__(self):
    check_choice("Fp8Recipe", "scaling", self.scaling, SCALINGS)
    check_choice("Fp8Recipe", "amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
    check_choice("Fp8Recipe", "fwd_format", self.fwd_format, tuple(FP8_FORMATS))
    check_choice("Fp8Recipe", "bwd_format", self.bwd_format, tuple(FP8_FORMATS))
    if self.fwd_format == self.bwd_format == "e5m2":
      raise ValueError(
        "Fp8Recipe: fwd_format='e5m2' with bwd_format='e5m2': a backward GEMM would be "
        "E5M2 x E5M2, which cuBLASLt does not run. Use fwd_format='e4m3'."
      )
    if (
      isinstance(self.amax_history_len, bool)
      or not isinstance(self.amax_history_len, int | np.integer)
      or self.amax_history_len < 1
    ):
      raise ValueError(
        f"Fp8Recipe: amax_history_len={self.amax_history_len!r} must be a positive integer "
        "(1024 is Transformer Engine's default)."
      )
    if isinstance(self.margin, bool) or not isinstance(self.margin, int | np.integer):
      raise ValueError(f"Fp8Recipe: margin={self.margin!r} must be an integer (0 is the default).")
    object.__setattr__(self, "keep_bf16", keep_bf16_globs("Fp8Recipe", self.keep_bf16))
    object.__setattr__(self, "amax_history_len", int(self.amax_history_len))
    object.__setattr__(self, "margin", int(self.margin))

  @property
  def fwd_dtype(self) -> np.dtype:
    """The dtype of the forward operands."""
    return np.dtype(FP8_FORMATS[self.fwd_format])

  @property
  def bwd_dtype(self) -> np.dtype:
    """The dtype of the output gradient."""
    return np.dtype(FP8_FORMATS[self.bwd_format])


class Fp8State(struct.PyTreeNode):
  """The delayed-scaling state of a function's FP8 GEMMs: scales and amax histories.

  Row ``i`` belongs to the ``i``-th FP8 GEMM with delayed scaling in program
  order; its three columns to the GEMM's left operand, right operand and output
  gradient. The train state keeps one (``TrainState.fp8``); each step scales
  every tensor from the history, then pushes the step's amaxes, all GEMMs at
  once (a handful of small kernels per step, not per GEMM).

  Attributes:
    scale: f32 ``(gemms, 3)``: the dequantization scale each tensor used last
      (a value ``x`` is stored as ``x / scale`` in FP8).
    amax_history: f32 ``(amax_history_len, gemms, 3)``: row 0 holds the latest
      step's amaxes, row ``i`` those of ``i`` steps before.

  Example:
    >>> import mpjax
    >>> state = mpjax.Fp8State.initial(mpjax.Fp8Recipe(amax_history_len=16), gemms=2)
    >>> state.scale.tolist(), state.amax_history.shape
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], (16, 2, 3))
  """

  scale: jax.Array
  amax_history: jax.Array

  @classmethod
  def initial(cls, recipe: Fp8Recipe, gemms: int) -> Fp8State:
    """Scales of 1 and an empty (all-zero) history, as Transformer Engine starts."""
    return cls(
      scale=jnp.ones((gemms, 3), jnp.float32),
      amax_history=jnp.zeros((recipe.amax_history_len, gemms, 3), jnp.float32),
    )

  @property
  def gemms(self) -> int:
    """How many FP8 GEMMs the state is for."""
    return self.scale.shape[0]


def fp8_max(dtype: Any) -> float:
  """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
  return float(jnp.finfo(dtype).max)


def amax(x: jax.Array) -> jax.Array:
  """The largest magnitude of ``x``, as an f32 scalar."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def gradient_amax(g: jax.Array) -> jax.Array:
  """The largest magnitude of an output gradient ``g``, as an f32 scalar: :func:`amax`'s value.

  Taken per feature first (a max over every dimension but the last), then
  over the features. The XLA:GPU kernels that make an output gradient also sum
  it over those leading dimensions (a bias gradient, LayerNorm's scale and
  offset gradients): a per-feature max is a reduction of the same kind, which
  XLA computes in the same kernel, with the FP8 cast. A max over the whole
  array is a reduction of another kind, which cannot share that kernel: XLA
  then moved the sums, or the cast, to kernels of their own that read the
  gradient again (GPT-2 small's mixed_fp8 step on H100: 1.3% of its estimated
  time). The convert between the two maxes keeps XLA from merging them back
  into one whole-array max.
  """
  a = jnp.abs(g)
  if a.ndim >= 2:
    a = jnp.max(a, axis=tuple(range(a.ndim - 1))).astype(jnp.float32)
  return jnp.max(a).astype(jnp.float32)


def _scale_for(amax_value: jax.Array, scale: jax.Array, fmax: Any, margin: int) -> jax.Array:
  new = amax_value * (2.0**margin / jnp.asarray(fmax, jnp.float32))
  ok = jnp.isfinite(amax_value) & (amax_value > 0) & (new > 0)
  return jnp.where(ok, new, scale).astype(jnp.float32)


def compute_scale(
  amax_value: jax.Array, scale: jax.Array, dtype: Any, margin: int = 0
) -> jax.Array:
  """The dequantization scale that maps ``amax_value`` to the format's largest value.

  ``amax * 2**margin / max``; where ``amax`` is zero or not finite the old
  ``scale`` is kept, so a scale is never zero, inf or NaN.
  """
  return _scale_for(amax_value, scale, fp8_max(dtype), margin)


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``x * (1 / scale)`` in the FP8 ``dtype``, saturating: beyond its range becomes its max.

  In f32, with the reciprocal taken once (what XLA makes of a division by a
  scalar on some backends, written out so that every backend rounds alike);
  NaN stays NaN.
  """
  big = fp8_max(dtype)
  inverse = 1.0 / scale.astype(jnp.float32)
  return jnp.clip(x.astype(jnp.float32) * inverse, -big, big).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q * scale`` in ``dtype``: the value an FP8 ``q`` stands for."""
  return q.astype(dtype) * scale.astype(dtype)


def history_amax(history: jax.Array, algo: str) -> jax.Array:
  """Per column, the amax delayed scaling uses: the history's max, or its latest row."""
  return history[0] if algo == "most_recent" else jnp.max(history, axis=0)


def push_amax(history: jax.Array, amaxes: jax.Array) -> jax.Array:
  """The history with ``amaxes`` as its new row 0 and its oldest row dropped.

  A non-finite amax is recorded as 0 (no information), so that one overflow
  cannot hold the scale for the length of the history.
  """
  amaxes = jnp.where(jnp.isfinite(amaxes), amaxes, 0.0).astype(history.dtype)
  return jnp.concatenate([amaxes[None], history[:-1]], axis=0)


def delayed_scales(state: Fp8State, recipe: Fp8Recipe) -> jax.Array:
  """The ``(gemms, 3)`` scales this step uses: each tensor's from its history.

  Where the history holds no amax yet (all zero) the last scale is kept.
  """
  fmax = [fp8_max(recipe.fwd_dtype)] * 2 + [fp8_max(recipe.bwd_dtype)]
  source = history_amax(state.amax_history, recipe.amax_compute_algo)
  return _scale_for(source, state.scale, fmax, recipe.margin)


def advance(state: Fp8State, scales: jax.Array, amaxes: jax.Array) -> Fp8State:
  """The state after a step that used ``scales`` and saw ``amaxes`` (both ``(gemms, 3)``)."""
  return Fp8State(scale=scales, amax_history=push_amax(state.amax_history, amaxes))


def _current(
  x: jax.Array, dtype: Any, recipe: Fp8Recipe, amax_of: Callable[[jax.Array], jax.Array] = amax
) -> jax.Array:
  return compute_scale(amax_of(x), jnp.float32(1.0), dtype, recipe.margin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def fp8_dot(lhs, rhs, scales, dimension_numbers, recipe, compute_dtype, out_sharding=None):
  """``dot_general`` with FP8 operands forward and an FP8 output gradient backward.

  ``scales`` is the GEMM's ``(3,)`` row of :func:`delayed_scales` (delayed
  scaling) or ``None`` (current scaling: each tensor's own amax now). Under
  differentiation, the cotangent returned for ``scales`` is this step's
  ``(3,)`` amaxes of the left operand, the right operand and the output
  gradient, which the train step pushes into the history (Flax's "overwrite
  with gradient" trick). The result is in ``compute_dtype``; the gradients in
  each operand's own dtype.
  """
  return _fp8_dot_fwd(lhs, rhs, scales, dimension_numbers, recipe, compute_dtype, out_sharding)[0]


def _written(compute_dtype: Any, platform: str) -> np.dtype:
  """The dtype an FP8 GEMM writes, before its scale multiplies it.

  On a CPU f32, the fast kernel's result. Elsewhere bf16 for a bf16 compute
  dtype: a bf16 GEMM whose scale XLA fuses into it (cuBLASLt's scale operand, a
  Triton fusion's epilogue). f32 otherwise: an fp16 result of FP8 products
  before their scale (up to 448 x 57344 each) can overflow.
  """
  if platform != "cpu" and np.dtype(compute_dtype) == jnp.bfloat16:
    return np.dtype(jnp.bfloat16)
  return np.dtype(jnp.float32)


def _gemm_operands(platform: str, *qs: jax.Array) -> list[jax.Array]:
  """The FP8 arrays as a GEMM takes them: themselves, or on a CPU widened to bf16.

  XLA:CPU has no FP8 GEMM; E4M3 and E5M2 values are all bf16 values, so the
  widening is exact and the CPU's fast bf16 x bf16 -> f32 kernel multiplies
  the very FP8 operands.
  """
  return [q.astype(jnp.bfloat16) for q in qs] if platform == "cpu" else list(qs)


def _scaled(product: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``product * scale`` (the scale in the product's dtype), as ``dtype``."""
  return (product * scale.astype(product.dtype)).astype(dtype)


def _fp8_dot_fwd(lhs, rhs, scales, dimension_numbers, recipe, compute_dtype, out_sharding):
  fwd = recipe.fwd_dtype
  if scales is None:
    s_lhs, s_rhs = _current(lhs, fwd, recipe), _current(rhs, fwd, recipe)
  else:
    s_lhs, s_rhs = scales[LHS], scales[RHS]
  q_lhs, q_rhs = quantize(lhs, fwd, s_lhs), quantize(rhs, fwd, s_rhs)
  platform = lowering_platform(lhs, rhs)
  written = _written(compute_dtype, platform)
  product = forward_gemm(
    *_gemm_operands(platform, q_lhs, q_rhs), dimension_numbers, written, out_sharding, platform
  )
  out = _scaled(product, s_lhs * s_rhs, compute_dtype)
  # The backward GEMMs read the FP8 operands (1 byte each) and their scales;
  # delayed scaling reports the operands' amaxes there.
  amaxes = None if scales is None else jnp.stack([amax(lhs), amax(rhs)])
  dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
  residuals = (q_lhs, q_rhs, jnp.stack([s_lhs, s_rhs]), amaxes, scales, *dtypes)
  return out, residuals


def _fp8_dot_bwd(dimension_numbers, recipe, compute_dtype, out_sharding, residuals, g):
  q_lhs, q_rhs, used, amaxes, scales, lhs_dtype, rhs_dtype = residuals
  bwd = recipe.bwd_dtype
  s_g = _current(g, bwd, recipe, gradient_amax) if scales is None else scales[GRAD]
  q_g = quantize(g, bwd, s_g)
  platform = lowering_platform(q_lhs, q_rhs)
  written = _written(compute_dtype, platform)
  # d_lhs = dot(q_g, q_rhs), d_rhs = dot(q_lhs, q_g) as JAX transposes them,
  # each written in ``written`` (an FP8 cotangent: backward_gemms' GEMMs write
  # the dtypes they are given), then scaled into the operand's own dtype.
  d_lhs, d_rhs = backward_gemms(
    *_gemm_operands(platform, q_g, q_lhs, q_rhs), dimension_numbers, written, written, platform
  )
  d_lhs = _scaled(d_lhs, s_g * used[RHS], lhs_dtype.dtype)
  d_rhs = _scaled(d_rhs, used[LHS] * s_g, rhs_dtype.dtype)
  seen = None if scales is None else jnp.concatenate([amaxes, gradient_amax(g)[None]])
  return d_lhs, d_rhs, seen


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)
