"""The GEMMs of a traced program: one :class:`GemmRow` per GEMM or convolution of a jaxpr.

:func:`jaxpr_gemms` walks a jaxpr (``jax.make_jaxpr(fn)(*args)``) and every
jaxpr nested in it (``jit``, ``custom_jvp``/``custom_vjp``, ``cond``,
``while``, ``scan``, ``remat``, ``shard_map``) and lists each
``dot_general``, ``ragged_dot_general`` and ``conv_general_dilated`` with its
operand and result dtypes, shapes, FLOPs, module path and precision, and
whether its dimensions suit Tensor Cores. An operand dequantized from FP8 right
before the GEMM counts as an FP8 operand. A custom kernel (a Pallas
``pallas_call``) is not walked into: its program is one block of a kernel
grid, whose dots are not the GEMMs XLA compiles; :func:`jaxpr_custom_kernels`
lists where they are. The traced side of the audit, as
:mod:`mpjax.hlo` is the compiled side; :mod:`mpjax.audit` matches the two and
flags what misses the fast path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from mpjax.gemm_equations import BLOCK_SCALED_PRIMITIVE, dot_numbers, gemm_flops
from mpjax.hlo import GemmOperands, dot_dims, is_fp8, is_half, short_dtype
from mpjax.jax_compat import shard_map_manual_axes

__all__ = ["Flag", "GemmRow", "jaxpr_custom_kernels", "jaxpr_gemms"]

_GEMM_PRIMITIVES = (
  "dot_general",
  "ragged_dot_general",
  "conv_general_dilated",
  BLOCK_SCALED_PRIMITIVE,
)
# Primitives that hold a kernel's own program (one grid block of it): a custom call once compiled.
_KERNEL_PRIMITIVES = ("pallas_call",)


class Flag(NamedTuple):
  """Why a GEMM misses the fast path: a short ``code`` and a one-line ``reason``."""

  code: str
  reason: str


def _alignment(dtype: Any) -> int:
  """The multiple Tensor Cores want for a GEMM dimension: 16 for fp8, 8 for f16/bf16."""
  return 16 if np.dtype(dtype).itemsize == 1 else 8


@dataclasses.dataclass(frozen=True)
class GemmRow(GemmOperands):
  """One GEMM or convolution of the audited program.

  Attributes:
    op: ``"dot_general"``, ``"ragged_dot_general"`` (grouped GEMMs),
      ``"conv_general_dilated"`` or ``"scaled_matmul_wrapper"`` (a block-scaled
      GEMM, :func:`jax.nn.scaled_matmul`: ``(B, M, K) x (B, N, K)``).
    path: the module path (the equation's name stack, e.g.
      ``"transpose(jvp(MLP))/Dense_1"``; empty at the top level).
    lhs_shape: the left operand's shape.
    rhs_shape: the right operand's shape.
    out_shape: the result's shape.
    lhs_dtype: the left operand's dtype (numpy name, e.g. ``"bfloat16"``).
    rhs_dtype: the right operand's dtype.
    out_dtype: the result (accumulation) dtype: ``preferred_element_type``
      where given, else the operands'.
    precision: ``"DEFAULT"``, ``"HIGH"``, ``"HIGHEST"`` or a dot algorithm
      preset name (from the equation, else ``jax_default_matmul_precision``).
    dims: a dot's ``batch``, ``M``, ``N``, ``K`` (products over each group of
      dimensions); a convolution's ``M`` (batch x output pixels), ``N``
      (``C_out``), ``K`` (``C_in`` per group x window), ``C_in`` and ``C_out``.
    alignment: 8 for f16/bf16 operands, 16 for fp8, ``None`` otherwise.
    misaligned: the dimensions that are not a multiple of ``alignment``, e.g.
      ``("K=100",)`` (channels for a convolution).
    count: how many times the GEMM runs per call (a ``scan`` body's GEMM runs
      once per iteration; a ``shard_map`` body's once per device).
    flops: FLOPs per call, ``2 * batch * M * N * K * count`` for a dot.
    note: where the count is a guess (``while`` bodies and ``cond`` branches
      count once), else empty.
    call: on a GPU, the call the GEMM became in the compiled HLO
      (``"__cublas$lt$matmul"``, ``"__triton_gemm"``...); ``"(not found)"``
      where XLA fused, merged or removed it; ``None`` when no HLO was read.
    call_kind: the :attr:`CompiledGemm.kind` of ``call``, or ``None``.
    compiled_dtypes: the dtypes the compiled GEMM multiplies and writes
      (``"bf16 x bf16 -> f32"``): where XLA widened FP8 operands, or folded
      their converts away, they differ from :attr:`dtypes`; ``None`` when no
      compiled GEMM was matched.
    accumulation: the compiled GEMM's accumulation dtype where the program
      says it (``"f32"``), ``"unknown"`` where it does not, ``None`` when no
      compiled GEMM was matched (see :attr:`CompiledGemm.accumulation`).
    flags: why the GEMM misses the fast path, each a :class:`Flag`.
    fast: whether it is on the fast path: half-precision operands (FP8 ones
      still FP8 in the compiled GEMM), f32 accumulation, aligned, and on a GPU
      a Tensor Core call.
    block_scales: a block-scaled GEMM's scales, e.g. ``"f8_e8m0fnu per 32"``;
      empty for any other.
  """

  op: str
  path: str
  precision: str
  dims: Mapping[str, int]
  alignment: int | None
  misaligned: tuple[str, ...]
  count: int
  flops: float
  note: str = ""
  call: str | None = None
  call_kind: str | None = None
  compiled_dtypes: str | None = None
  accumulation: str | None = None
  flags: tuple[Flag, ...] = ()
  fast: bool = False
  block_scales: str = ""

  @property
  def dtypes(self) -> str:
    """``"bf16 x bf16 -> f32"``."""
    lhs, rhs, out = (short_dtype(d) for d in (self.lhs_dtype, self.rhs_dtype, self.out_dtype))
    return f"{lhs} x {rhs} -> {out}"

  @property
  def shape(self) -> str:
    """``"256x512 @ 512x1024 -> 256x1024"`` (``*`` for a convolution)."""
    sep = " * " if self.op == "conv_general_dilated" else " @ "
    lhs, rhs, out = ("x".join(map(str, s)) or "()" for s in self._shapes)
    return f"{lhs}{sep}{rhs} -> {out}"

  @property
  def _shapes(self) -> tuple[tuple[int, ...], ...]:
    return self.lhs_shape, self.rhs_shape, self.out_shape

  def to_dict(self) -> dict[str, Any]:
    """The fields as JSON-ready values."""
    out = dataclasses.asdict(self)
    out["dims"] = dict(self.dims)
    out["flags"] = [f._asdict() for f in self.flags]
    out["dtypes"] = self.dtypes
    return out


def _precision_name(precision: Any) -> str:
  if precision is None:
    configured = jax.config.jax_default_matmul_precision
    if configured is None:
      return "DEFAULT"
    aliases = {
      "highest": "HIGHEST",
      "float32": "HIGHEST",
      "high": "HIGH",
      "tensorfloat32": "HIGH",
      "default": "DEFAULT",
      "bfloat16": "DEFAULT",
      "fastest": "DEFAULT",
    }
    return aliases.get(str(configured).lower(), str(configured).upper())
  if isinstance(precision, tuple | list):
    names = list(dict.fromkeys(_precision_name(p) for p in precision))
    return names[0] if len(names) == 1 else ",".join(names)
  return str(getattr(precision, "name", precision))


def _dot_row_dims(eqn: Any) -> dict[str, int]:
  (lc, rc), (lb, rb) = dot_numbers(eqn)
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "ragged_dot_general":  # a weight's group dim is not part of N
    rb = (*rb, *eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions)
  return dot_dims(lhs, rhs, lc, rc, lb, rb)


def _conv_row_dims(eqn: Any) -> dict[str, int]:
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  out = eqn.outvars[0].aval.shape
  spec = eqn.params["dimension_numbers"]
  c_in = rhs[spec.rhs_spec[1]]  # per feature group
  c_out = rhs[spec.rhs_spec[0]]
  return {
    "M": out[spec.out_spec[0]] * math.prod(out[d] for d in spec.out_spec[2:]),
    "N": c_out,
    "K": c_in * math.prod(rhs[d] for d in spec.rhs_spec[2:]),
    "C_in": c_in,
    "C_out": c_out,
  }


def _row(eqn: Any, path: str, count: int, note: str, fp8_of: Mapping[Any, np.dtype]) -> GemmRow:
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  # An operand dequantized from FP8 right before the GEMM is an FP8 operand
  # (what XLA's GPU rewriter makes of it): the row says so.
  lhs_dtype, rhs_dtype = (fp8_of.get(v, v.aval.dtype) for v in eqn.invars[:2])
  out = eqn.outvars[0].aval
  is_dot = eqn.primitive.name != "conv_general_dilated"
  dims = _dot_row_dims(eqn) if is_dot else _conv_row_dims(eqn)
  alignment = None
  if is_half(lhs_dtype) and is_half(rhs_dtype):
    alignment = max(_alignment(lhs_dtype), _alignment(rhs_dtype))
  checked = ("M", "N", "K") if is_dot else ("C_in", "C_out")
  misaligned = tuple(
    f"{d}={dims[d]}" for d in checked if alignment is not None and dims[d] % alignment
  )
  flops = gemm_flops(eqn)
  block_scales = ""
  if eqn.primitive.name == BLOCK_SCALED_PRIMITIVE:
    scales = eqn.invars[2].aval
    block_scales = f"{short_dtype(scales.dtype)} per {lhs.shape[-1] // scales.shape[-1]}"
  return GemmRow(
    op=eqn.primitive.name,
    path=path,
    lhs_shape=tuple(lhs.shape),
    rhs_shape=tuple(rhs.shape),
    out_shape=tuple(out.shape),
    lhs_dtype=np.dtype(lhs_dtype).name,
    rhs_dtype=np.dtype(rhs_dtype).name,
    out_dtype=np.dtype(out.dtype).name,
    precision=_precision_name(eqn.params.get("precision")),
    dims=dims,
    alignment=alignment,
    misaligned=misaligned,
    count=count,
    flops=flops * count,
    note=note,
    block_scales=block_scales,
  )


def sub_jaxprs(eqn: Any) -> Iterator[tuple[str, Any]]:
  """The jaxprs an equation holds in its params (a call's, a loop's body, a kernel's), by param."""
  for key, value in eqn.params.items():
    for v in value if isinstance(value, tuple | list) else (value,):
      if isinstance(v, jcore.ClosedJaxpr):
        yield key, v.jaxpr
      elif isinstance(v, jcore.Jaxpr):
        yield key, v


def _repeat(eqn: Any) -> int:
  name = eqn.primitive.name
  if name == "scan":
    return int(eqn.params["length"])
  if name == "shard_map":
    mesh = eqn.params.get("mesh")
    sizes = dict(getattr(mesh, "shape", {}) or {})
    return math.prod(int(sizes.get(a, 1)) for a in shard_map_manual_axes(eqn.params))
  return 1


# Ops between an FP8 value's widening and the GEMM that XLA's GPU rewriter
# looks through: the scale's multiply, and moves of the data.
_DEQUANTIZE_PATH = frozenset(
  "mul reshape transpose broadcast_in_dim squeeze expand_dims copy copy_p".split()
)


def _walk(
  jaxpr: Any,
  prefix: str,
  count: int,
  note: str,
  rows: list[GemmRow],
  kernels: list[str],
  fp8_of: dict[Any, np.dtype] | None = None,
) -> None:
  """Appends a row for each GEMM of ``jaxpr`` and of every jaxpr nested in it, and the path
  of each custom kernel to ``kernels`` (``count`` times).

  ``fp8_of`` maps the values dequantized from FP8 (``convert(q) * scale``) to
  their FP8 dtype.
  """
  fp8_of = {} if fp8_of is None else fp8_of
  for eqn in jaxpr.eqns:
    local = str(eqn.source_info.name_stack)
    path = "/".join(p for p in (prefix, local) if p)
    name = eqn.primitive.name
    invars = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if name == "convert_element_type" and is_fp8(eqn.invars[0].aval.dtype):
      fp8_of[eqn.outvars[0]] = np.dtype(eqn.invars[0].aval.dtype)
    elif name in _DEQUANTIZE_PATH and any(v in fp8_of for v in invars):
      fp8_of[eqn.outvars[0]] = next(fp8_of[v] for v in invars if v in fp8_of)
    elif name == "optimization_barrier":  # the CPU lowering's layout barrier
      for i, o in zip(eqn.invars, eqn.outvars, strict=True):
        if not isinstance(i, jcore.Literal) and i in fp8_of:
          fp8_of[o] = fp8_of[i]
    if name in _GEMM_PRIMITIVES:
      rows.append(_row(eqn, path, count, note, fp8_of))
      continue
    if name in _KERNEL_PRIMITIVES:
      kernels += [path or name] * count
      continue
    # custom_vjp_call / custom_jvp_call: their call_jaxpr is what runs when they
    # are not differentiated; under jax.grad their fwd and bwd rules are already
    # traced into plain equations of the outer jaxpr.
    repeat = _repeat(eqn)
    for key, sub in sub_jaxprs(eqn):
      inner_note = note
      if name == "while":
        inner_note = f"while {'body' if key == 'body_jaxpr' else 'condition'}: counted once"
      elif name == "cond":
        inner_note = "cond branch: counted as if taken"
      inner_fp8 = {}
      if len(sub.invars) == len(eqn.invars):  # a call: its inputs are the equation's
        inner_fp8 = {
          i: fp8_of[o]
          for i, o in zip(sub.invars, eqn.invars, strict=True)
          if not isinstance(o, jcore.Literal) and o in fp8_of
        }
      _walk(sub, path, count * repeat, inner_note, rows, kernels, inner_fp8)


def jaxpr_gemms(jaxpr: Any) -> list[GemmRow]:
  """One :class:`GemmRow` per GEMM or convolution of ``jaxpr`` and the jaxprs nested in it.

  Args:
    jaxpr: a ``Jaxpr`` (``jax.make_jaxpr(fn)(*args).jaxpr``).

  Returns:
    The rows in program order, without a call, flags or fast-path verdict
    (:func:`mpjax.audit.audit_jaxpr` adds them).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpjax.jaxpr_gemms import jaxpr_gemms
    >>> x = jnp.ones((8, 16), jnp.bfloat16)
    >>> (row,) = jaxpr_gemms(jax.make_jaxpr(lambda a: a @ a.T)(x).jaxpr)
    >>> row.dtypes, row.dims["K"], row.flops
    ('bf16 x bf16 -> bf16', 16, 2048.0)
  """
  rows: list[GemmRow] = []
  _walk(jaxpr, "", 1, "", rows, [])
  return rows


def jaxpr_custom_kernels(jaxpr: Any) -> list[str]:
  """The name-stack path of each custom kernel (a Pallas ``pallas_call``) of ``jaxpr``.

  Its GEMMs are not among :func:`jaxpr_gemms`' rows: its program is one block
  of the kernel's grid, and it compiles to a custom call whose GEMMs the
  compiled HLO does not show either. A kernel in a ``scan`` body is listed once
  per iteration.

  Args:
    jaxpr: a ``Jaxpr`` (``jax.make_jaxpr(fn)(*args).jaxpr``).

  Returns:
    The paths in program order (the primitive's name where there is no path).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import pallas as pl
    >>> from mpjax.jaxpr_gemms import jaxpr_custom_kernels
    >>> def square(x_ref, o_ref):
    ...   o_ref[...] = x_ref[...] @ x_ref[...]
    >>> def kernel(x):
    ...   return pl.pallas_call(square, out_shape=x, interpret=True)(x)
    >>> jaxpr_custom_kernels(jax.make_jaxpr(kernel)(jnp.ones((16, 16))).jaxpr)
    ['pallas_call']
  """
  kernels: list[str] = []
  _walk(jaxpr, "", 1, "", [], kernels)
  return kernels
