"""What mpjax takes from JAX's internals, and what differs between the JAX versions it supports.

Supported: jax (and jaxlib) 0.10.2 to 0.12.x, tested on 0.10.2 (Python 3.11),
0.11.2 and 0.12.0.1 (Python 3.13; jax 0.11 and newer need Python >= 3.12).
Every import of ``jax._src`` in mpjax is here, so that a new JAX release breaks
one module; where ``jax.extend`` or ``jax`` offers the same object publicly, that
is what is used.

What differs per version:

* ``scan``'s parameters. Up to jax 0.10 its equation carries ``num_consts`` and
  ``num_carry`` (its inputs are consts, then carries, then scanned arrays; its
  outputs carries, then stacked results). From jax 0.11 it carries ``ft_in``
  and ``ft_out`` instead, flat trees of the same groups (``ft_in``: consts,
  carries, scanned arrays; ``ft_out``: carries, stacked results), whose leaf
  counts give the same numbers. :func:`scan_layout` reads either.
* ``shard_map``'s manual axes: ``manual_axes`` up to jax 0.10.1,
  ``newly_manual_axes`` from 0.10.2 on. :func:`shard_map_manual_axes` reads
  either.
* Pallas's Triton lowering and the GPU it lowers for. From jax 0.11 it reads
  the GPU (its compute capability) from the abstract mesh in context and,
  outside one and with no GPU attached, raises "No supported GPU devices
  found"; :func:`lowering_for` enters the target's abstract mesh there. jax
  0.10.2 reads the attached devices and, finding no GPU, lowers a Pallas
  kernel for compute capability 9.0 whatever the target (right for H100 and
  H200, not for A100, L4 or B200); nothing is entered there.
* ``jax._src.interpreters.partial_eval.dce_jaxpr`` gained a ``live_inputs``
  keyword in jax 0.12 (unused here; its positional arguments are the same).
* Unchanged from 0.10.2 to 0.12.x, but private: the transpose rules of
  ``dot_general``, ``ragged_dot_general`` and ``conv_general_dilated``,
  ``UndefinedPrimal``, ``trace_context`` (the key ``jax.jit`` caches traces by),
  ``saved_residuals`` and whether the backends have started.

Public: ``jax.extend.source_info_util`` (name stacks and tracebacks) and
``jax.softmax_custom_jvp`` are re-exported from their public homes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
from jax._src import config as _config
from jax._src import xla_bridge as _xla_bridge
from jax._src.ad_checkpoint import saved_residuals
from jax._src.interpreters.ad import UndefinedPrimal
from jax._src.interpreters.partial_eval import dce_jaxpr
from jax._src.lax.convolution import (
  _conv_general_dilated_transpose_lhs as conv_general_dilated_transpose_lhs,
)
from jax._src.lax.convolution import (
  _conv_general_dilated_transpose_rhs as conv_general_dilated_transpose_rhs,
)
from jax._src.lax.lax import _dot_general_transpose_lhs as dot_general_transpose_lhs
from jax._src.lax.lax import _dot_general_transpose_rhs as dot_general_transpose_rhs
from jax._src.lax.lax import (
  _ragged_dot_general_transpose_rule as ragged_dot_general_transpose_rule,
)
from jax.extend import source_info_util

__all__ = [
  "MIN_JAX",
  "NEXT_UNSUPPORTED_JAX",
  "UndefinedPrimal",
  "backends_are_initialized",
  "conv_general_dilated_transpose_lhs",
  "conv_general_dilated_transpose_rhs",
  "dce_jaxpr",
  "dot_general_transpose_lhs",
  "dot_general_transpose_rhs",
  "jax_version",
  "lowering_for",
  "ragged_dot_general_transpose_rule",
  "saved_residuals",
  "scan_layout",
  "shard_map_manual_axes",
  "softmax_custom_jvp",
  "source_info_util",
  "trace_context",
]

MIN_JAX = (0, 10, 2)  # the oldest jax tested
NEXT_UNSUPPORTED_JAX = (0, 13)  # the first jax not tested (pyproject: jax<0.13)

# The context manager (and ``.value``) that makes jax.nn.softmax a custom-JVP function.
softmax_custom_jvp = jax.softmax_custom_jvp

# JAX's tracing configuration, hashable: what jax.jit keys its trace cache by.
trace_context = _config.trace_context


def jax_version() -> tuple[int, ...]:
  """The running jax's version as integers, e.g. ``(0, 12, 0, 1)``."""
  return tuple(int(p) for p in jax.__version__.split(".") if p.isdigit())


def lowering_for(mesh: jax.sharding.Mesh) -> contextlib.AbstractContextManager[Any]:
  """The context to lower a function for ``mesh``'s GPU in, with no GPU attached.

  From jax 0.11 this is ``mesh``'s abstract mesh, from which Pallas's Triton
  lowering reads the GPU; on jax 0.10 nothing (see the module's notes).
  """
  if jax_version() >= (0, 11):
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
  return contextlib.nullcontext()


def scan_layout(params: Mapping[str, Any]) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation, from its parameters.

  The equation's inputs are the consts, the initial carries and the scanned
  arrays, in that order; its body's outputs are the new carries, then one slice
  of each stacked result.
  """
  if "num_consts" in params:  # jax <= 0.10
    return int(params["num_consts"]), int(params["num_carry"])
  consts, carry, _ = params["ft_in"].unpack()  # jax >= 0.11
  return len(consts), len(carry)


def shard_map_manual_axes(params: Mapping[str, Any]) -> frozenset[Any]:
  """The mesh axes a ``shard_map`` equation makes manual (its ``axis_names``)."""
  axes = params.get("newly_manual_axes", params.get("manual_axes", ()))
  return frozenset(axes)


def backends_are_initialized() -> bool:
  """Whether JAX has started its backends (after which XLA reads no new flags)."""
  started = getattr(_xla_bridge, "backends_are_initialized", None)
  return started() if started is not None else bool(_xla_bridge._backends)
