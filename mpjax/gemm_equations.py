"""What a GEMM or convolution equation of a jaxpr says: its dimension numbers and its FLOPs.

Shared by autocast's interpreter (which counts the FLOPs it lowers) and the
audit's jaxpr walk (:mod:`mpjax.jaxpr_gemms`).
"""

from __future__ import annotations

import math
from typing import Any

BLOCK_SCALED_PRIMITIVE = "scaled_matmul_wrapper"
"""The primitive of :func:`jax.nn.scaled_matmul`: ``(B, M, K) x (B, N, K) -> (B, M, N)`` of
block-quantized operands, with their scales as two more operands."""


def dot_numbers(eqn: Any) -> Any:
  """A dot's ``((lhs, rhs) contracting, (lhs, rhs) batch)`` dims, ragged, block-scaled or not."""
  if eqn.primitive.name == BLOCK_SCALED_PRIMITIVE:
    return ((2,), (2,)), ((0,), (0,))
  if eqn.primitive.name == "ragged_dot_general":
    return eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
  return eqn.params["dimension_numbers"]


def gemm_flops(eqn: Any) -> float:
  """The FLOPs (2 per multiply-add) of a GEMM or convolution equation; 0 for any other."""
  name = eqn.primitive.name
  out = math.prod(eqn.outvars[0].aval.shape)
  if name in ("dot_general", "ragged_dot_general", BLOCK_SCALED_PRIMITIVE):
    (lc, _), _ = dot_numbers(eqn)
    lhs = eqn.invars[0].aval.shape
    flops = 2.0 * out * math.prod(lhs[d] for d in lc)
    if (
      name == "ragged_dot_general"
      and not eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
    ):
      # The ragged dimension is contracted: the result has a group dimension
      # and each group contracts only its own rows.
      flops /= eqn.invars[2].aval.shape[0]
    return flops
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, *spatial)
    per_output = math.prod(rhs[d] for d in spec[1:])
    # An input dilation (the input gradient of a strided convolution) inserts zeros that no
    # multiply touches: of each window's taps only 1 in prod(lhs_dilation) is real.
    dilation = math.prod(eqn.params.get("lhs_dilation") or (1,))
    return 2.0 * out * per_output / eqn.params["batch_group_count"] / dilation
  return 0.0
