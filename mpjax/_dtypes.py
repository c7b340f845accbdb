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


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts the f16/bf16/f32 array leaves of ``tree`` to ``dtype``; other leaves stay."""
  dtype = np.dtype(dtype)

  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and is_castable_dtype(x.dtype):
      return x.astype(dtype) if x.dtype != dtype else x
    return x

  return jax.tree.map(cast, tree)
