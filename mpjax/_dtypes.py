"""Dtype predicates shared by the modules of mpjax."""

from typing import Any

import jax.numpy as jnp


def is_floating(x: Any) -> bool:
  """Whether ``x`` has a floating dtype (PRNG keys and other extended dtypes do not)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:
    return False
