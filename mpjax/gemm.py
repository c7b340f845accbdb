"""GEMMs in half precision with f32 accumulation, forward and backward.

A bf16 x bf16 -> bf16 ``dot_general`` (what Flax's ``dtype=bfloat16`` emits) is
upcast by XLA:CPU to an f32 dot and back, slower than f32; a bf16 x bf16 -> f32
one (``preferred_element_type=f32``) runs on the fast kernel. ``jax.grad`` of the
latter still takes its backward GEMMs with an f32 cotangent, so they run in f32.
:func:`mixed_dot_general` fixes both: every GEMM of the forward pass and of its
gradient takes compute-dtype operands and accumulates in f32, the left operand
is laid out with its contracting dimensions last and transposed operands are
stored row-major (what the fast kernel needs), and the backward pass keeps the
operands as they were given (an f32 weight is not copied to low precision here;
a caller that casts it first, as Flax's ``dtype=bfloat16`` modules do, hands in
a copy that is kept).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from mpjax._backend import lowering_platform
from mpjax.jax_compat import (
  UndefinedPrimal,
  conv_general_dilated_transpose_lhs,
  conv_general_dilated_transpose_rhs,
  dot_general_transpose_lhs,
  dot_general_transpose_rhs,
  ragged_dot_general_transpose_rule,
)

__all__ = ["mixed_dot_general"]

# The checkpoint name of what autocast's remat keeps for the backward pass.
SAVED = "mpjax.autocast"

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _free(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
  return [d for d in range(ndim) if d not in contracting and d not in batch]


def _row_major(x: jax.Array) -> jax.Array:
  """``x``, stored in row-major order: what the fast bf16 kernel needs of its operands.

  XLA first treats a transpose as a change of layout, and upcasts a bf16 dot
  whose operand is laid out that way to f32. Flattening behind a barrier makes
  a transpose that reaches here a copy into row-major order; an operand stored
  that way already passes for free. An explicitly sharded ``x`` keeps its
  layout: reshaping it would need a sharding for the flat array.
  """
  sharding = _sharding_like(x, range(x.ndim))
  if sharding is not None and any(axis is not None for axis in sharding.spec):
    return lax.optimization_barrier(x)
  return lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def _transpose_to(x: jax.Array, order: Sequence[int]) -> jax.Array:
  if list(order) == list(range(x.ndim)):
    return _row_major(x)
  return _row_major(jnp.transpose(x, order))


def _sharding_like(target: jax.Array, labels: Sequence[int]) -> Any:
  """The explicit sharding of ``target``, for an array whose dim ``i`` is its dim ``labels[i]``.

  ``None`` unless ``target`` is sharded explicitly (``jax.sharding.AxisType.Explicit``),
  where a GEMM that contracts a sharded dimension must be told its output sharding.
  """
  sharding = getattr(jax.typeof(target), "sharding", None)
  spec = getattr(sharding, "spec", None)
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  if spec is None or jax.sharding.AxisType.Explicit not in axis_types:
    return None
  spec = tuple(spec) + (None,) * (target.ndim - len(spec))
  return jax.sharding.NamedSharding(sharding.mesh, P(*(spec[d] for d in labels)))


def _dot_f32(
  a: jax.Array, b: jax.Array, dimension_numbers: DimensionNumbers, out_sharding: Any = None
) -> jax.Array:
  """``dot_general(a, b)`` accumulated in f32, with ``a`` laid out as [batch, free, contracting].

  Batched dots also get ``b`` as [batch, contracting, free]: XLA:CPU cannot run
  some batched bf16 x bf16 -> f32 dots in other layouts.
  """
  (ac, bc), (ab, bb) = dimension_numbers
  ac, bc, ab, bb = list(ac), list(bc), list(ab), list(bb)
  af, bf = _free(a.ndim, ac, ab), _free(b.ndim, bc, bb)
  a = _transpose_to(a, ab + af + ac)
  nb = len(ab)
  new_ab, new_ac = list(range(nb)), list(range(nb + len(af), a.ndim))
  if nb:
    b = _transpose_to(b, bb + bc + bf)
    bb, bc = list(range(nb)), list(range(nb, nb + len(bc)))
  else:
    b = _row_major(b)
  out = lax.dot_general(
    a,
    b,
    ((new_ac, bc), (new_ab, bb)),
    preferred_element_type=jnp.float32,
    out_sharding=out_sharding,
  )
  return lax.optimization_barrier(out)


def _dot_into(target, a, a_labels, b, b_labels, dims):
  """``dot_general(a, b, dims)`` laid out as the operand whose dims the labels name.

  ``a_labels``/``b_labels`` give, for each dim of ``a``/``b``, the target dim it
  becomes (``None`` where it is contracted away). A dot's result is [batch dims
  of ``a``, free dims of ``a``, free dims of ``b``], so the labels tell how to
  transpose it. Returns ``(needs_transpose, compute)``.
  """
  (ac, bc), (ab, bb) = dims
  labels = [a_labels[d] for d in ab + _free(a.ndim, ac, ab)]
  labels += [b_labels[d] for d in _free(b.ndim, bc, bb)]
  order = [labels.index(d) for d in range(target.ndim)]
  needs_transpose = order != list(range(target.ndim))

  def compute():
    out = _dot_f32(a, b, dims, _sharding_like(target, labels))
    return jnp.transpose(out, order) if needs_transpose else out

  return needs_transpose, compute


def _grad_dots(
  g: jax.Array, lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers
) -> tuple[jax.Array, jax.Array]:
  """The two GEMMs of a ``dot_general``'s gradient, each accumulated in f32.

  Each can be taken with either operand on the left; the one whose result is
  already in the operand's layout wins (no transpose of an f32 gradient).
  """
  (lc, rc), (lb, rb) = (list(map(list, p)) for p in dimension_numbers)
  lf, rf = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
  nb = len(lb)
  g_batch = list(range(nb))
  g_lf = list(range(nb, nb + len(lf)))
  g_rf = list(range(nb + len(lf), g.ndim))

  def best(*candidates):
    for needs_transpose, compute in candidates:
      if not needs_transpose:
        return compute()
    return candidates[0][1]()

  # d_lhs: contract g's rhs-free dims with rhs's free dims, batch with batch.
  g_to_lhs = {**dict(zip(g_batch, lb, strict=True)), **dict(zip(g_lf, lf, strict=True))}
  g_to_lhs = [g_to_lhs.get(d) for d in range(g.ndim)]
  rhs_to_lhs = {**dict(zip(rb, lb, strict=True)), **dict(zip(rc, lc, strict=True))}
  rhs_to_lhs = [rhs_to_lhs.get(d) for d in range(rhs.ndim)]
  d_lhs = best(
    _dot_into(lhs, g, g_to_lhs, rhs, rhs_to_lhs, ((g_rf, rf), (g_batch, rb))),
    _dot_into(lhs, rhs, rhs_to_lhs, g, g_to_lhs, ((rf, g_rf), (rb, g_batch))),
  )
  # d_rhs: contract g's lhs-free dims with lhs's free dims, batch with batch.
  g_to_rhs = {**dict(zip(g_batch, rb, strict=True)), **dict(zip(g_rf, rf, strict=True))}
  g_to_rhs = [g_to_rhs.get(d) for d in range(g.ndim)]
  lhs_to_rhs = {**dict(zip(lb, rb, strict=True)), **dict(zip(lc, rc, strict=True))}
  lhs_to_rhs = [lhs_to_rhs.get(d) for d in range(lhs.ndim)]
  d_rhs = best(
    _dot_into(rhs, lhs, lhs_to_rhs, g, g_to_rhs, ((lf, g_lf), (lb, g_batch))),
    _dot_into(rhs, g, g_to_rhs, lhs, lhs_to_rhs, ((g_lf, lf), (g_batch, lb))),
  )
  return d_lhs, d_rhs


def forward_gemm(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: DimensionNumbers,
  compute_dtype: Any,
  out_sharding: Any,
  platform: str,
) -> jax.Array:
  """The GEMM of compute-dtype operands, accumulated in f32, result in the compute dtype.

  On a CPU every GEMM is bf16 x bf16 -> f32, the fast kernel, with operands
  laid out as it needs (row-major, the result behind a barrier so that XLA
  cannot fold a transpose into a layout XLA:CPU cannot run). Elsewhere (GPU,
  TPU) the GEMM writes the compute dtype itself: cuBLASLt and the TPU
  accumulate a half x half -> half GEMM in f32, and XLA:GPU folds transposes
  into the call, so no f32 intermediate and no separate convert kernel is
  written. FP8 operands (``mpjax.fp8``) go in as they are, writing
  ``compute_dtype``; on a CPU the caller widens them to bf16 first.
  """
  if platform == "cpu":
    return _dot_f32(lhs, rhs, dimension_numbers, out_sharding).astype(compute_dtype)
  return lax.dot_general(
    lhs, rhs, dimension_numbers, preferred_element_type=compute_dtype, out_sharding=out_sharding
  )


def backward_gemms(
  g: jax.Array,
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: DimensionNumbers,
  lhs_dtype: Any,
  rhs_dtype: Any,
  platform: str,
  reduce_dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """The two GEMMs of a ``dot_general``'s gradient, from compute-dtype ``g``, ``lhs``, ``rhs``.

  Each accumulates in f32 and returns its operand's dtype (``lhs_dtype``,
  ``rhs_dtype``: f32 for an f32 master weight). On a CPU each GEMM writes f32,
  its fast kernel's result, so an f32 master's gradient keeps f32 precision.
  Elsewhere (GPU, TPU) a bf16 GEMM writes bf16 (cuBLASLt accumulates it in f32
  all the same) and an f32 master's gradient is that result widened, the convert
  fused into the optimizer's kernel: half the bytes for the GEMM to write and
  the update to read, and the one rounding (2^-9 relative) that torch.autocast,
  Flax's ``dtype=bfloat16`` and jmp give every weight gradient. fp16, whose
  range a loss-scaled weight gradient (a sum over the whole batch) can exceed,
  keeps writing f32 there. An FP8 ``g`` (``mpjax.fp8``, with FP8 ``lhs`` and
  ``rhs``) makes both GEMMs write ``lhs_dtype`` and ``rhs_dtype`` themselves.

  ``reduce_dtype`` (a policy's :attr:`mpjax.Policy.reduce_dtype`), where given,
  is what both GEMMs write whatever the backend: under ``jit`` with a sharded
  batch each device's GEMM writes a partial sum that XLA sums across devices in
  the dtype the GEMM wrote, so this is the dtype of the gradient reductions.
  """
  f32 = np.dtype(jnp.float32)
  if platform == "cpu" and (reduce_dtype is None or np.dtype(reduce_dtype) == f32):
    # The cotangent may arrive transposed (through a transpose after the GEMM).
    d_lhs, d_rhs = _grad_dots(_row_major(g), lhs, rhs, dimension_numbers)
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)

  # JAX's own transpose rules; a bf16 GEMM writes bf16, an fp16 one its operand's dtype.
  def written(dtype):
    if reduce_dtype is not None:
      return reduce_dtype
    return g.dtype if g.dtype == jnp.bfloat16 else dtype

  kw = dict(dimension_numbers=dimension_numbers, precision=None, out_sharding=None)
  d_lhs = dot_general_transpose_lhs(
    g,
    UndefinedPrimal(jax.typeof(lhs).update(dtype=written(lhs_dtype))),
    rhs,
    preferred_element_type=written(lhs_dtype),
    **kw,
  )
  d_rhs = dot_general_transpose_rhs(
    g,
    lhs,
    UndefinedPrimal(jax.typeof(rhs).update(dtype=written(rhs_dtype))),
    preferred_element_type=written(rhs_dtype),
    **kw,
  )
  return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def mixed_dot(lhs, rhs, dimension_numbers, compute_dtype, out_sharding=None, reduce_dtype=None):
  """``dot_general`` with compute-dtype operands and f32 accumulation, forward and backward.

  Lowered for the backend it is traced for (``lowering_platform``, see
  :func:`forward_gemm`); its gradient GEMMs write ``reduce_dtype`` where given
  (see :func:`backward_gemms`).
  """
  return forward_gemm(
    lhs.astype(compute_dtype),
    rhs.astype(compute_dtype),
    dimension_numbers,
    compute_dtype,
    out_sharding,
    lowering_platform(lhs, rhs),
  )


def _mixed_dot_fwd(lhs, rhs, dimension_numbers, compute_dtype, out_sharding, reduce_dtype):
  dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
  if lowering_platform(lhs, rhs) == "cpu":
    # Keep the operands as they came: a weight stays its f32 self (alive
    # anyway), an activation is already in the compute dtype.
    out = mixed_dot(lhs, rhs, dimension_numbers, compute_dtype, out_sharding, reduce_dtype)
    return out, (lhs, rhs, *dtypes)
  # GPU/TPU: cast each operand once and keep the compute-dtype copies for the
  # backward GEMMs (a weight's cast is half its f32 size; casting it again in
  # the backward pass would be a kernel reading the f32 master a second time).
  # Zero-size arrays carry the operands' own dtypes, which the gradients take.
  lhs_c, rhs_c = (checkpoint_name(x.astype(compute_dtype), SAVED) for x in (lhs, rhs))
  out = forward_gemm(lhs_c, rhs_c, dimension_numbers, compute_dtype, out_sharding, "gpu")
  return out, (lhs_c, rhs_c, *dtypes)


def _mixed_dot_bwd(dimension_numbers, compute_dtype, out_sharding, reduce_dtype, residuals, g):
  lhs, rhs, lhs_dtype, rhs_dtype = residuals
  return backward_gemms(
    g.astype(compute_dtype),
    lhs.astype(compute_dtype),
    rhs.astype(compute_dtype),
    dimension_numbers,
    lhs_dtype.dtype,
    rhs_dtype.dtype,
    lowering_platform(lhs, rhs),
    reduce_dtype,
  )


mixed_dot.defvjp(_mixed_dot_fwd, _mixed_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def mixed_conv(lhs, rhs, params, compute_dtype):
  """``conv_general_dilated`` with compute-dtype operands, both ways.

  ``params`` is the sorted ``(name, value)`` tuple of the convolution's other
  parameters (strides, padding, dilations, dimension numbers, group counts).
  Lowered for the backend it is traced for (``lowering_platform``): on a GPU
  the convolution writes the compute dtype (:func:`_conv_written`), elsewhere
  it accumulates into an f32 result, rounded to the compute dtype after.
  Inside ``jit`` an argument committed to the CPU of a GPU machine does not say
  where it is; ``jax.default_device(jax.devices("cpu")[0])`` makes it the CPU's.
  """
  platform = lowering_platform(lhs, rhs)
  out = lax.conv_general_dilated_p.bind(
    lhs.astype(compute_dtype),
    rhs.astype(compute_dtype),
    **dict(params),
    precision=None,
    preferred_element_type=_conv_written(compute_dtype, compute_dtype, platform),
  )
  return out.astype(compute_dtype)


def _conv_written(compute_dtype, dtype, platform):
  """The result dtype of a compute-dtype convolution whose result becomes ``dtype``.

  XLA:GPU gives cuDNN a convolution's operands in its result dtype: a bf16 x bf16
  -> f32 convolution compiles as an f32 x f32 cuDNN call (converts, then the
  f32 rate), whatever the channel counts. So on a GPU a bf16 convolution writes
  bf16, as a bf16 GEMM does (:func:`backward_gemms`; an f32 master's gradient is
  that result widened), and an fp16 one the dtype its result becomes (f32 for an
  f32 master's gradient, whose range fp16 can exceed: compiled f32 x f32, which
  the audit flags). Elsewhere it writes f32.
  """
  if platform != "gpu":
    return jnp.float32
  return compute_dtype if np.dtype(compute_dtype) == np.dtype(jnp.bfloat16) else dtype


def _mixed_conv_fwd(lhs, rhs, params, compute_dtype):
  return mixed_conv(lhs, rhs, params, compute_dtype), (lhs, rhs)


def _mixed_conv_bwd(params, compute_dtype, residuals, g):
  # JAX's own transpose rules, given a compute-dtype cotangent: each casts the
  # other operand to it and returns the operand's own dtype.
  lhs, rhs = residuals
  platform = lowering_platform(lhs, rhs)
  g = g.astype(compute_dtype)
  kw = dict(params, precision=None)
  d_lhs = conv_general_dilated_transpose_lhs(
    g,
    lhs,
    rhs.astype(compute_dtype),
    preferred_element_type=_conv_written(compute_dtype, lhs.dtype, platform),
    **kw,
  )
  d_rhs = conv_general_dilated_transpose_rhs(
    g,
    lhs.astype(compute_dtype),
    rhs,
    preferred_element_type=_conv_written(compute_dtype, rhs.dtype, platform),
    **kw,
  )
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


mixed_conv.defvjp(_mixed_conv_fwd, _mixed_conv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def mixed_ragged_dot(lhs, rhs, group_sizes, dimension_numbers, compute_dtype):
  """``ragged_dot_general`` (grouped GEMMs, as in mixture-of-experts layers) the same way.

  Compute-dtype operands and f32 accumulation, forward and backward; the
  gradients come back in each operand's own dtype. ``group_sizes`` (integers)
  gets no gradient.
  """
  out = lax.ragged_dot_general(
    lhs.astype(compute_dtype),
    rhs.astype(compute_dtype),
    group_sizes,
    dimension_numbers,
    preferred_element_type=jnp.float32,
  )
  return out.astype(compute_dtype)


def _mixed_ragged_dot_fwd(lhs, rhs, group_sizes, dimension_numbers, compute_dtype):
  out = mixed_ragged_dot(lhs, rhs, group_sizes, dimension_numbers, compute_dtype)
  return out, (lhs, rhs, group_sizes)


def _mixed_ragged_dot_bwd(dimension_numbers, compute_dtype, residuals, g):
  # JAX's own transpose rule, given a compute-dtype cotangent and operand: it
  # accumulates in f32 and returns the dtype of the operand it is told is
  # unknown (the operand's own, f32 for an f32 weight).
  lhs, rhs, group_sizes = residuals
  g = g.astype(compute_dtype)
  kw = dict(
    ragged_dot_dimension_numbers=dimension_numbers,
    precision=None,
    preferred_element_type=jnp.float32,
    group_offset=None,
  )
  transpose = ragged_dot_general_transpose_rule
  d_lhs = transpose(
    g, UndefinedPrimal(jax.typeof(lhs)), rhs.astype(compute_dtype), group_sizes, **kw
  )[0]
  d_rhs = transpose(
    g, lhs.astype(compute_dtype), UndefinedPrimal(jax.typeof(rhs)), group_sizes, **kw
  )[1]
  return d_lhs, d_rhs, None


mixed_ragged_dot.defvjp(_mixed_ragged_dot_fwd, _mixed_ragged_dot_bwd)


def same_as_operands(lhs: jax.Array, rhs: jax.Array, preferred_element_type: Any) -> bool:
  """Whether ``preferred_element_type`` only restates the operands' own dtype.

  ``jnp.einsum`` passes the operands' result dtype explicitly; that asks for
  nothing a plain GEMM would not give, so it does not turn f32 accumulation off.
  """
  return (
    preferred_element_type is not None
    and lhs.dtype == rhs.dtype
    and np.dtype(preferred_element_type) == np.dtype(lhs.dtype)
  )


def mixed_dot_general(compute_dtype: DTypeLike = jnp.bfloat16) -> Callable[..., jax.Array]:
  """A drop-in ``lax.dot_general`` whose GEMMs, forward and backward, accumulate in f32.

  The returned function casts both operands to ``compute_dtype``, accumulates
  in f32 and returns the result in ``compute_dtype``; its gradient's two GEMMs
  do the same and return gradients in each operand's own dtype (f32 for f32
  master weights). An explicit ``precision`` or ``preferred_element_type`` is
  honoured by falling back to ``lax.dot_general`` as asked, except a
  ``preferred_element_type`` that only restates the operands' own dtype (as
  ``jnp.einsum`` passes): that one only sets the result's dtype.
  ``out_sharding`` (which NNX's ``Linear`` passes, even as ``None``) is
  honoured on the f32-accumulating path.

  Args:
    compute_dtype: the operand dtype, usually ``jnp.bfloat16`` or ``jnp.float16``.

  Returns:
    A function with ``lax.dot_general``'s signature, to pass as a Flax
    ``Dense``/``DenseGeneral`` ``dot_general``, an NNX ``Linear``'s, or
    ``jnp.einsum``'s ``_dot_general``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import mpjax
    >>> layer = nn.Dense(8, dtype=jnp.bfloat16, dot_general=mpjax.mixed_dot_general())
    >>> x = jnp.ones((2, 4))
    >>> params = layer.init(jax.random.key(0), x)
    >>> layer.apply(params, x).dtype, params["params"]["kernel"].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  compute_dtype = np.dtype(jnp.dtype(compute_dtype))
  if not jnp.issubdtype(compute_dtype, jnp.floating):
    raise ValueError(f"mixed_dot_general: compute_dtype={compute_dtype} is not a floating dtype.")

  def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    precision: Any = None,
    preferred_element_type: DTypeLike | None = None,
    out_sharding: Any = None,
    **kwargs: Any,
  ) -> jax.Array:
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    result_dtype = None
    if same_as_operands(lhs, rhs, preferred_element_type):
      result_dtype, preferred_element_type = preferred_element_type, None
    if precision is not None or preferred_element_type is not None or kwargs:
      return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
        **kwargs,
      )
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    out = mixed_dot(lhs, rhs, dims, compute_dtype, out_sharding)
    return out if result_dtype is None else out.astype(result_dtype)

  dot_general.__name__ = dot_general.__qualname__ = f"mixed_dot_general_{compute_dtype.name}"
  return dot_general
