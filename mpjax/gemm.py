"""GEMMs in half precision with f32 accumulation, forward and backward.

A bf16 x bf16 -> bf16 ``dot_general`` (what Flax's ``dtype=bfloat16`` emits) is
upcast by XLA:CPU to an f32 dot and back, slower than f32; a bf16 x bf16 -> f32
one (``preferred_element_type=f32``) runs on the fast kernel. ``jax.grad`` of the
latter still takes its backward GEMMs with an f32 cotangent, so they run in f32.
:func:`mixed_dot_general` fixes both: every GEMM of the forward pass and of its
gradient takes compute-dtype operands and accumulates in f32, the left operand
is laid out with its contracting dimensions last (what the fast kernel needs),
and the backward pass keeps the operands as they were given (an f32 weight is
not copied to low precision here; a caller that casts it first, as Flax's
``dtype=bfloat16`` modules do, hands in a copy that is kept).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

__all__ = ["mixed_dot_general"]

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _free(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
  return [d for d in range(ndim) if d not in contracting and d not in batch]


def _transpose_to(x: jax.Array, order: Sequence[int]) -> jax.Array:
  if list(order) == list(range(x.ndim)):
    return x
  # The barrier keeps XLA from folding the transpose back into the dot, which
  # would take the slow (upcasting) path again.
  return lax.optimization_barrier(jnp.transpose(x, order))


def _dot_f32(a: jax.Array, b: jax.Array, dimension_numbers: DimensionNumbers) -> jax.Array:
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
  return lax.dot_general(a, b, ((new_ac, bc), (new_ab, bb)), preferred_element_type=jnp.float32)


def _grad_dots(
  g: jax.Array, lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers
) -> tuple[jax.Array, jax.Array]:
  """The two GEMMs of a ``dot_general``'s gradient, each accumulated in f32."""
  (lc, rc), (lb, rb) = (list(map(list, p)) for p in dimension_numbers)
  lf, rf = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
  nb = len(lb)
  g_batch = list(range(nb))
  g_lf = list(range(nb, nb + len(lf)))
  g_rf = list(range(nb + len(lf), g.ndim))

  def best(candidates, ndim):
    """The first candidate whose result needs no transpose, else the first."""
    for operands, dims, position in candidates:
      if [position(d) for d in range(ndim)] == list(range(ndim)):
        return _dot_f32(*operands, dims)
    operands, dims, position = candidates[0]
    return jnp.transpose(_dot_f32(*operands, dims), [position(d) for d in range(ndim)])

  def lhs_pos_a(d):  # dot(g, rhs) -> [batch, lhs free, rc sorted]
    if d in lb:
      return lb.index(d)
    if d in lf:
      return nb + lf.index(d)
    return nb + len(lf) + sorted(rc).index(rc[lc.index(d)])

  def lhs_pos_b(d):  # dot(rhs, g) -> [batch, rc sorted, lhs free]
    if d in lb:
      return lb.index(d)
    if d in lc:
      return nb + sorted(rc).index(rc[lc.index(d)])
    return nb + len(rc) + lf.index(d)

  def rhs_pos_a(d):  # dot(lhs, g) -> [batch, lc sorted, rhs free]
    if d in rb:
      return rb.index(d)
    if d in rc:
      return nb + sorted(lc).index(lc[rc.index(d)])
    return nb + len(lc) + rf.index(d)

  def rhs_pos_b(d):  # dot(g, lhs) -> [batch, rhs free, lc sorted]
    if d in rb:
      return rb.index(d)
    if d in rf:
      return nb + rf.index(d)
    return nb + len(rf) + sorted(lc).index(lc[rc.index(d)])

  d_lhs = best(
    [
      ((g, rhs), ((g_rf, rf), (g_batch, rb)), lhs_pos_a),
      ((rhs, g), ((rf, g_rf), (rb, g_batch)), lhs_pos_b),
    ],
    lhs.ndim,
  )
  d_rhs = best(
    [
      ((lhs, g), ((lf, g_lf), (lb, g_batch)), rhs_pos_a),
      ((g, lhs), ((g_lf, lf), (g_batch, lb)), rhs_pos_b),
    ],
    rhs.ndim,
  )
  return d_lhs, d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed_dot(lhs, rhs, dimension_numbers, compute_dtype):
  out = _dot_f32(lhs.astype(compute_dtype), rhs.astype(compute_dtype), dimension_numbers)
  return out.astype(compute_dtype)


def _mixed_dot_fwd(lhs, rhs, dimension_numbers, compute_dtype):
  # Keep the operands as they came: a weight stays its f32 self (alive anyway),
  # an activation is already in the compute dtype.
  return _mixed_dot(lhs, rhs, dimension_numbers, compute_dtype), (lhs, rhs)


def _mixed_dot_bwd(dimension_numbers, compute_dtype, residuals, g):
  lhs, rhs = residuals
  d_lhs, d_rhs = _grad_dots(
    g.astype(compute_dtype),
    lhs.astype(compute_dtype),
    rhs.astype(compute_dtype),
    dimension_numbers,
  )
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_mixed_dot.defvjp(_mixed_dot_fwd, _mixed_dot_bwd)


def mixed_dot_general(compute_dtype: DTypeLike = jnp.bfloat16) -> Callable[..., jax.Array]:
  """A drop-in ``lax.dot_general`` whose GEMMs, forward and backward, accumulate in f32.

  The returned function casts both operands to ``compute_dtype``, accumulates
  in f32 and returns the result in ``compute_dtype``; its gradient's two GEMMs
  do the same and return gradients in each operand's own dtype (f32 for f32
  master weights). An explicit ``precision`` or ``preferred_element_type`` is
  honoured by falling back to ``lax.dot_general`` as asked.

  Args:
    compute_dtype: the operand dtype, usually ``jnp.bfloat16`` or ``jnp.float16``.

  Returns:
    A function with ``lax.dot_general``'s signature, to pass as a Flax
    ``Dense``/``DenseGeneral``/``Einsum`` ``dot_general``.

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
    **kwargs: Any,
  ) -> jax.Array:
    if precision is not None or preferred_element_type is not None or kwargs:
      return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
      )
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    return _mixed_dot(jnp.asarray(lhs), jnp.asarray(rhs), dims, compute_dtype)

  return dot_general
