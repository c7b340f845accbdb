"""Dtype predicates shared by the modules of mpjax."""

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

# The only dtypes mpjax moves values between. Integers, booleans, PRNG keys and
# float64 are never touched by a cast.
T = TypeVar("T")

CASTABLE = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))


def is_castable_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is f16, bf16 or f32 (``None`` and extended dtypes are not)."""
  if dtype is None:
    return False
  try:
    return np.dtype(dtype) in CASTABLE
  except TypeError:  # extended dtypes such as PRNG key types
    return False


def is_floating(x: Any) -> bool:
  """Whether ``x`` has a floating dtype (PRNG keys and other extended dtypes do not)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:
    return False


def to_f32(x: Any) -> Any:
  """A half-precision floating leaf in f32; f32, f64 and non-floating leaves as they are."""
  if is_floating(x) and jnp.finfo(x.dtype).bits < 32:
    return x.astype(jnp.float32)
  return x


def _castable_leaf(x: Any) -> bool:
  """An f16/bf16/f32 array, or a numpy float64 one where JAX would make it f32 anyway.

  With ``jax_enable_x64`` off (JAX's default) a numpy float64 batch (from
  ``np.random.randn``) becomes f32 the moment JAX touches it, so it is cast as
  f32 is; with x64 on, float64 is kept, as asked.
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  if is_castable_dtype(x.dtype):
    return True
  return (
    not isinstance(x, jax.Array) and x.dtype == np.float64 and not jax.config.read("jax_enable_x64")
  )


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts the f16/bf16/f32 array leaves of ``tree`` to ``dtype``; other leaves stay.

  Numpy float64 leaves count as f32 while ``jax_enable_x64`` is off.
  """
  dtype = np.dtype(dtype)

  def cast(x):
    if _castable_leaf(x):
      return x.astype(dtype) if x.dtype != dtype else x
    return x

  return jax.tree.map(cast, tree)
