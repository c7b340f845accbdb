"""GEMM audit: which GEMMs and convolutions of a function run on the mixed-precision fast path.

:func:`audit` traces a function as ``jax.jit`` would compile it and lists every
``dot_general``, ``ragged_dot_general`` and ``conv_general_dilated`` of the program (inside ``jit``,
``custom_jvp``/``custom_vjp``, ``cond``, ``while``, ``scan``, ``remat`` and
``shard_map`` too), with its operand and result dtypes, shapes, FLOPs, module
path and precision, and whether its dimensions suit Tensor Cores. On a GPU it
also reads the compiled HLO to tell which call each GEMM became: cuBLASLt
(``__cublas$lt$matmul``), legacy cuBLAS (``__cublas$gemm``), fp8 cuBLASLt
(``__cublas$lt$matmul$f8``), an autotuned Triton GEMM fusion
(``__triton_gemm``), cuDNN (``__cudnn$conv*``), or a plain ``dot`` left in a
loop fusion. Each GEMM that misses the fast path gets a flag with its reason,
and the report ends with the share of GEMM FLOPs on the fast path:
half-precision operands (f16, bf16, fp8), f32 accumulation, aligned
dimensions.

:func:`parse_compiled_gemms` is the HLO reader on its own: a pure function of
the text that ``jax.jit(fn).lower(*args).compile().as_text()`` returns.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from mpjax.autocast import _dot_numbers, gemm_flops
from mpjax.jax_compat import dce_jaxpr, shard_map_manual_axes

__all__ = [
  "AuditReport",
  "CompiledGemm",
  "Flag",
  "GemmRow",
  "audit",
  "audit_jaxpr",
  "parse_compiled_gemms",
]

_F32 = np.dtype(jnp.float32)
_GEMM_PRIMITIVES = ("dot_general", "ragged_dot_general", "conv_general_dilated")
# The calls that run a GEMM on Tensor Cores (or the matrix units of the GPU at hand).
_FAST_CALLS = frozenset({"cublas_lt", "cublas_lt_f8", "cublas", "triton_gemm", "cudnn"})


class Flag(NamedTuple):
  """Why a GEMM misses the fast path: a short ``code`` and a one-line ``reason``."""

  code: str
  reason: str


# --------------------------------------------------------------------------- dtypes


def _is_half(dtype: Any) -> bool:
  """f16, bf16 or an 8-bit float: the operand dtypes of the fast path."""
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize <= 2


def _alignment(dtype: Any) -> int:
  """The multiple Tensor Cores want for a GEMM dimension: 16 for fp8, 8 for f16/bf16."""
  return 16 if np.dtype(dtype).itemsize == 1 else 8


def _short(dtype: Any) -> str:
  """``bf16``, ``f16``, ``f32``, ``f8_e4m3fn``, ``s8``: the names HLO uses."""
  name = np.dtype(dtype).name
  for long, short in (("bfloat", "bf"), ("float8_", "f8_"), ("float", "f"), ("uint", "u")):
    if name.startswith(long):
      return short + name[len(long) :]
  return name.replace("int", "s", 1) if name.startswith("int") else name


def _hlo_dtype(name: str) -> str:
  """An HLO element type (``bf16``, ``f8e4m3fn``, ``s8``, ``pred``) as a numpy dtype name."""
  if name == "bf16":
    return "bfloat16"
  if name.startswith("f8") or name.startswith("f4"):
    return f"float{name[1]}_{name[2:]}"
  match = re.fullmatch(r"([fsu])(\d+)", name)
  if match:
    kind, bits = match.groups()
    return {"f": "float", "s": "int", "u": "uint"}[kind] + bits
  return {"pred": "bool", "c64": "complex64", "c128": "complex128"}.get(name, name)


# --------------------------------------------------------------------------- HLO text


@dataclasses.dataclass(frozen=True)
class _Operands:
  """The operand and result shapes and dtypes (numpy names) that every GEMM record carries.

  A base of :class:`CompiledGemm` and :class:`GemmRow`: its fields come first
  in their constructors, ``repr`` and ``to_dict``.
  """

  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  lhs_dtype: str
  rhs_dtype: str
  out_dtype: str


@dataclasses.dataclass(frozen=True)
class CompiledGemm(_Operands):
  """One GEMM or convolution of compiled HLO, and the call it became.

  Attributes:
    name: the HLO instruction (the custom call, the fusion or the ``dot``).
    call: what runs it: the custom-call target (``"__cublas$lt$matmul"``,
      ``"__cudnn$convForward"``), the fusion kind (``"__triton_gemm"``), or
      ``"dot in kLoop fusion"`` / ``"dot"`` for a GEMM XLA emitted itself.
    kind: ``"cublas_lt"``, ``"cublas_lt_f8"``, ``"cublas"``, ``"triton_gemm"``,
      ``"cudnn"`` (the Tensor Core calls), ``"loop"`` (a plain ``dot`` or
      ``convolution``), or another custom fusion kind as written in the HLO.
    op: ``"dot"`` or ``"conv"``.
    lhs_shape: the left operand's shape.
    rhs_shape: the right operand's shape.
    out_shape: the result's shape (without a cuBLAS workspace).
    lhs_dtype: the left operand's dtype, as a numpy name (``"bfloat16"``).
    rhs_dtype: the right operand's dtype.
    out_dtype: the result's dtype.
    dims: for a dot, the ``batch``, ``M``, ``N`` and ``K`` sizes (products
      over each group of dimensions); empty for a convolution.
    op_name: the ``op_name`` of the instruction's metadata (JAX's name stack).
    epilogue: a cuBLASLt epilogue (``"BIAS"``, ``"GELU"``...) fused into the call.
    accumulation: the dtype the GEMM accumulates in, where the program says it
      (``"f32"``, ``"f16"``...), else ``"unknown"``: see :func:`_accumulation`.
  """

  name: str
  call: str
  kind: str
  op: str
  dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
  op_name: str = ""
  epilogue: str = ""
  accumulation: str = "unknown"

  @property
  def tensor_core(self) -> bool:
    """Whether the call is cuBLAS(Lt), a Triton GEMM or cuDNN."""
    return self.kind in _FAST_CALLS

  def to_dict(self) -> dict[str, Any]:
    """The fields as JSON-ready values."""
    out = dataclasses.asdict(self)
    out["dims"] = dict(self.dims)
    out["tensor_core"] = self.tensor_core
    return out


@dataclasses.dataclass
class _Instr:
  name: str
  type: str
  opcode: str
  operands: list[tuple[str, str | None]]
  attrs: dict[str, str]


_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([^\s(={}]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_START = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(){},\"]+)\s*=\s*(\(|[a-z][a-z0-9]*\[|token\[)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


def _close(text: str, start: int) -> int:
  """The index just past the bracket that closes the one at ``text[start]``, skipping strings."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = [pairs[text[start]]]
  i = start + 1
  while i < len(text) and stack:
    c = text[i]
    if c == '"':
      i += 1
      while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    elif c in pairs:
      stack.append(pairs[c])
    elif c == stack[-1]:
      stack.pop()
    i += 1
  return i


def _split_top(text: str) -> list[str]:
  """``text`` split at the commas outside brackets and strings."""
  parts, depth, start, i = [], 0, 0, 0
  while i < len(text):
    c = text[i]
    if c == '"':
      i += 1
      while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    elif c in "({[":
      depth += 1
    elif c in ")}]":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
    i += 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _parse_instr(text: str) -> _Instr | None:
  match = _START.match(text)
  if match is None:
    return None
  name = match.group(1)
  rest = text[match.start(2) :]
  if rest.startswith("("):
    end = _close(rest, 0)
  else:
    end = _close(rest, rest.index("[")) if "[" in rest else 0
    if end < len(rest) and rest[end] == "{":  # a layout
      end = _close(rest, end)
  type_str, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if op is None:
    return None
  close = _close(rest, op.end() - 1)
  operands = []
  for piece in _split_top(rest[op.end() : close - 1]):
    tokens = _COMMENT.sub("", piece).split()  # every fifth operand is marked /*index=N*/
    operand_type = " ".join(tokens[:-1]) if len(tokens) > 1 else None
    operands.append((tokens[-1].lstrip("%"), operand_type))
  attrs = {}
  for piece in _split_top(rest[close:]):
    key, sep, value = piece.partition("=")
    if sep:
      attrs[key.strip()] = value.strip()
  return _Instr(name, type_str, op.group(1), operands, attrs)


def _computations(hlo_text: str) -> dict[str, list[_Instr]]:
  """Each computation's instructions, by computation name, in the order printed."""
  comps: dict[str, list[_Instr]] = {}
  current: list[_Instr] | None = None
  pending: list[str] = []

  def flush():
    if pending and current is not None:
      instr = _parse_instr(" ".join(pending))
      if instr is not None:
        current.append(instr)
    pending.clear()

  for line in hlo_text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header and " = " not in line:
        current = comps.setdefault(header.group(1), [])
      continue
    if line.strip() == "}":
      flush()
      current = None
    elif _START.match(line):
      flush()
      pending.append(line.strip())
    elif pending:
      pending.append(line.strip())
  flush()
  return comps


def _array(type_str: str | None) -> tuple[str, tuple[int, ...]] | None:
  """The first array type in ``type_str`` (a tuple's first element) as (dtype, shape)."""
  match = _ARRAY.search(type_str or "")
  if match is None:
    return None
  shape = tuple(int(d) for d in match.group(2).split(",") if d)
  return _hlo_dtype(match.group(1)), shape


def _unquote(value: str) -> str:
  if len(value) >= 2 and value[0] == value[-1] == '"':
    return bytes(value[1:-1], "utf-8").decode("unicode_escape")
  return value


def _backend_config(instr: _Instr) -> dict[str, Any]:
  raw = instr.attrs.get("backend_config")
  if not raw:
    return {}
  try:
    config = json.loads(_unquote(raw))
  except (ValueError, UnicodeDecodeError):
    return {}
  return config if isinstance(config, dict) else {}


def _int_list(value: Any) -> list[int]:
  if isinstance(value, str):  # HLO text: {0,1}
    return [int(v) for v in re.findall(r"\d+", value)]
  return [int(v) for v in value or ()]


def _dot_dims(
  lhs: Sequence[int],
  rhs: Sequence[int],
  lc: Sequence[int],
  rc: Sequence[int],
  lb: Sequence[int],
  rb: Sequence[int],
) -> dict[str, int]:
  """A dot's batch, M (lhs free), N (rhs free) and K (contracting) sizes, each a product."""
  return {
    "batch": math.prod(lhs[d] for d in lb),
    "M": math.prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb),
    "N": math.prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb),
    "K": math.prod(lhs[d] for d in lc),
  }


def _metadata_op_name(instr: _Instr) -> str:
  match = re.search(r'op_name="((?:[^"\\]|\\.)*)"', instr.attrs.get("metadata", ""))
  return match.group(1) if match else ""


def _accumulation(
  instr: _Instr, kind: str, config: Mapping[str, Any], lhs_dtype: str, out_dtype: str
) -> str:
  """The dtype a compiled GEMM accumulates in, where the program says it, else ``"unknown"``.

  Read from, in order: a dot algorithm (``precision_config.algorithm`` of a
  cuBLAS(Lt) call's config, or a ``dot``'s ``algorithm=`` attribute, e.g.
  ``ALG_DOT_BF16_BF16_F32``: its accumulation type); a result of f32 or wider
  (the GEMM sums in it); an ``__cublas$lt$matmul$f8`` call (cuBLASLt's FP8 GEMMs
  have an f32 compute type only); a cuBLAS(Lt) call or Triton GEMM fusion of
  8- or 16-bit float operands with no algorithm set, which XLA emits with an
  f32 accumulator (its cuBLAS compute type and its Triton emitter's rule for an
  unset algorithm). Anything else, e.g. a half-precision ``dot`` left in a loop
  fusion or a cuDNN convolution writing bf16, does not say: ``"unknown"``.
  """
  precision = config.get("precision_config") or {}
  algorithm = str(precision.get("algorithm", "") or instr.attrs.get("algorithm", "")).upper()
  named = re.fullmatch(r"(?:ALG_)?DOT_.*_(BF16|F16|F32|F64|TF32)(?:_X\d+|_FAST_ACCUM)?", algorithm)
  if named:
    return {"TF32": "f32"}.get(named.group(1), named.group(1).lower())
  if out_dtype in ("float32", "float64", "complex64", "complex128"):
    return _short(out_dtype)
  if kind == "cublas_lt_f8":
    return "f32"
  unset = algorithm in ("", "ALG_UNSET")
  if unset and kind in ("cublas_lt", "cublas", "triton_gemm") and _is_half(lhs_dtype):
    return "f32"
  return "unknown"


def _gemm_of(
  instr: _Instr, types: Mapping[str, str], call: str, kind: str, config: Mapping[str, Any]
) -> CompiledGemm | None:
  """A :class:`CompiledGemm` from a ``dot``, ``convolution`` or GEMM/conv custom call."""
  if len(instr.operands) < 2:
    return None
  arrays = [_array(t or types.get(n)) for n, t in instr.operands[:2]]
  out = _array(instr.type)
  if any(a is None for a in (*arrays, out)):
    return None
  (lhs_t, lhs), (rhs_t, rhs) = arrays
  is_conv = instr.opcode == "convolution" or (instr.opcode == "custom-call" and kind == "cudnn")
  dims: dict[str, int] = {}
  if not is_conv:
    numbers = config.get("dot_dimension_numbers")
    if numbers is not None:
      lc = _int_list(numbers.get("lhs_contracting_dimensions"))
      rc = _int_list(numbers.get("rhs_contracting_dimensions"))
      lb = _int_list(numbers.get("lhs_batch_dimensions"))
      rb = _int_list(numbers.get("rhs_batch_dimensions"))
    else:
      lc = _int_list(instr.attrs.get("lhs_contracting_dims", ""))
      rc = _int_list(instr.attrs.get("rhs_contracting_dims", ""))
      lb = _int_list(instr.attrs.get("lhs_batch_dims", ""))
      rb = _int_list(instr.attrs.get("rhs_batch_dims", ""))
    if not lc and not rc and lhs and rhs:  # no dimension numbers: [..., M, K] x [..., K, N]
      lc, rc = [len(lhs) - 1], [max(0, len(rhs) - 2)]
      lb, rb = list(range(len(lhs) - 2)), list(range(len(rhs) - 2))
    dims = _dot_dims(lhs, rhs, lc, rc, lb, rb)
  return CompiledGemm(
    name=instr.name,
    call=call,
    kind=kind,
    op="conv" if is_conv else "dot",
    lhs_shape=lhs,
    rhs_shape=rhs,
    out_shape=out[1],
    lhs_dtype=lhs_t,
    rhs_dtype=rhs_t,
    out_dtype=out[0],
    dims=dims,
    op_name=_metadata_op_name(instr),
    epilogue=str(config.get("epilogue", "")),
    accumulation=_accumulation(instr, kind, config, lhs_t, out[0]),
  )


def _called(instr: _Instr) -> list[str]:
  value = instr.attrs.get("calls", "")
  return [name.lstrip("%") for name in re.findall(r"%?[\w.\-$]+", value)]


def _custom_call_kind(target: str) -> str | None:
  if target.startswith("__cublas$lt$matmul"):
    return "cublas_lt_f8" if "$f8" in target else "cublas_lt"
  if target.startswith("__cublas$gemm"):
    return "cublas"
  if target.startswith("__cudnn$conv"):
    return "cudnn"
  return None


def _fusion_kind(instr: _Instr, config: Mapping[str, Any], opcode: str) -> tuple[str, str]:
  """``(call, kind)`` for a fusion that holds a ``dot`` or ``convolution`` (``opcode``)."""
  fusion_config = config.get("fusion_backend_config") or config.get("fusion_config") or config
  custom = str(fusion_config.get("kind", "")) if isinstance(fusion_config, dict) else ""
  if "triton" in custom and "gemm" in custom:
    return custom, "triton_gemm"
  if custom.startswith("__cudnn"):
    return custom, "cudnn"
  if custom:
    return custom, custom
  return f"{opcode} in {instr.attrs.get('kind', 'kLoop')} fusion", "loop"


def parse_compiled_gemms(hlo_text: str) -> list[CompiledGemm]:
  """Every GEMM and convolution of compiled HLO text, with the call each became.

  Reads the text of ``jax.jit(fn).lower(*args).compile().as_text()`` (or an
  XLA dump ``*.after_optimizations.txt``): cuBLAS and cuBLASLt custom calls
  (their ``dot_dimension_numbers`` come from ``backend_config``), cuDNN
  convolution custom calls, fusions that hold a ``dot`` (Triton GEMM fusions by
  their ``backend_config`` kind, loop fusions otherwise), and plain ``dot`` and
  ``convolution`` instructions outside fusions. Operands printed without a
  type are looked up in their computation.

  Args:
    hlo_text: HLO module text.

  Returns:
    The GEMMs in the order they are printed (fused computations first, as
    XLA prints them).

  Raises:
    TypeError: if ``hlo_text`` is not a string.

  Example:
    >>> from mpjax.audit import parse_compiled_gemms
    >>> text = '''ENTRY %main (p0: bf16[256,512], p1: bf16[512,1024]) -> bf16[256,1024] {
    ...   %p0 = bf16[256,512]{1,0} parameter(0)
    ...   %p1 = bf16[512,1024]{1,0} parameter(1)
    ...   ROOT %custom-call.1 = (bf16[256,1024]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1),
    ...     custom_call_target="__cublas$lt$matmul"
    ... }'''
    >>> gemm, = parse_compiled_gemms(text)
    >>> gemm.kind, gemm.dims["M"], gemm.dims["N"], gemm.dims["K"]
    ('cublas_lt', 256, 1024, 512)
  """
  if not isinstance(hlo_text, str):
    raise TypeError(
      f"parse_compiled_gemms: hlo_text must be HLO module text (a str), got "
      f"{type(hlo_text).__name__}; pass compiled.as_text()."
    )
  comps = _computations(hlo_text)
  types = {name: {i.name: i.type for i in instrs} for name, instrs in comps.items()}
  fused = {
    c for instrs in comps.values() for i in instrs if i.opcode == "fusion" for c in _called(i)
  }

  def gemms_in(comp: str, seen: frozenset[str] = frozenset()) -> Iterator[tuple[str, _Instr]]:
    """The dots and convolutions of a fused computation, nested fusions included."""
    for instr in comps.get(comp, ()):
      if instr.opcode in ("dot", "convolution"):
        yield comp, instr
      elif instr.opcode == "fusion":
        for inner in _called(instr):
          if inner not in seen:
            yield from gemms_in(inner, seen | {comp})

  found: list[CompiledGemm] = []
  for comp, instrs in comps.items():
    if comp in fused:
      continue
    for instr in instrs:
      gemm = None
      if instr.opcode == "custom-call":
        target = _unquote(instr.attrs.get("custom_call_target", ""))
        kind = _custom_call_kind(target)
        if kind is not None:
          config = _backend_config(instr)
          gemm_config = config.get("gemm_backend_config", config)
          gemm = _gemm_of(instr, types[comp], target, kind, gemm_config)
      elif instr.opcode == "fusion":
        config = _backend_config(instr)
        for called in _called(instr)[:1]:
          for inner_comp, op in gemms_in(called):
            call, kind = _fusion_kind(instr, config, op.opcode)
            inner = _gemm_of(op, types[inner_comp], call, kind, {})
            if inner is not None:
              op_name = inner.op_name or _metadata_op_name(instr)
              found.append(dataclasses.replace(inner, name=instr.name, op_name=op_name))
      elif instr.opcode in ("dot", "convolution"):
        gemm = _gemm_of(instr, types[comp], instr.opcode, "loop", {})
      if gemm is not None:
        found.append(gemm)
  return found


# --------------------------------------------------------------------------- jaxpr


@dataclasses.dataclass(frozen=True)
class GemmRow(_Operands):
  """One GEMM or convolution of the audited program.

  Attributes:
    op: ``"dot_general"``, ``"ragged_dot_general"`` (grouped GEMMs) or
      ``"conv_general_dilated"``.
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

  @property
  def dtypes(self) -> str:
    """``"bf16 x bf16 -> f32"``."""
    return f"{_short(self.lhs_dtype)} x {_short(self.rhs_dtype)} -> {_short(self.out_dtype)}"

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
  (lc, rc), (lb, rb) = _dot_numbers(eqn)
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "ragged_dot_general":  # a weight's group dim is not part of N
    rb = (*rb, *eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions)
  return _dot_dims(lhs, rhs, lc, rc, lb, rb)


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
  if _is_half(lhs_dtype) and _is_half(rhs_dtype):
    alignment = max(_alignment(lhs_dtype), _alignment(rhs_dtype))
  checked = ("M", "N", "K") if is_dot else ("C_in", "C_out")
  misaligned = tuple(
    f"{d}={dims[d]}" for d in checked if alignment is not None and dims[d] % alignment
  )
  flops = gemm_flops(eqn)
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
  )


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[str, Any]]:
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


def _is_fp8(dtype: Any) -> bool:
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize == 1


def _walk(
  jaxpr: Any,
  prefix: str,
  count: int,
  note: str,
  rows: list[GemmRow],
  fp8_of: dict[Any, np.dtype] | None = None,
) -> None:
  """Appends a row for each GEMM of ``jaxpr`` and of every jaxpr nested in it.

  ``fp8_of`` maps the values dequantized from FP8 (``convert(q) * scale``) to
  their FP8 dtype.
  """
  fp8_of = {} if fp8_of is None else fp8_of
  for eqn in jaxpr.eqns:
    local = str(eqn.source_info.name_stack)
    path = "/".join(p for p in (prefix, local) if p)
    name = eqn.primitive.name
    invars = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if name == "convert_element_type" and _is_fp8(eqn.invars[0].aval.dtype):
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
    # custom_vjp_call / custom_jvp_call: their call_jaxpr is what runs when they
    # are not differentiated; under jax.grad their fwd and bwd rules are already
    # traced into plain equations of the outer jaxpr.
    repeat = _repeat(eqn)
    for key, sub in _sub_jaxprs(eqn):
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
      _walk(sub, path, count * repeat, inner_note, rows, inner_fp8)


# --------------------------------------------------------------------------- flags and matching


def _signature(op: str, lhs: Sequence[int], rhs: Sequence[int], out: Sequence[int], dims) -> tuple:
  """What a GEMM keeps through XLA's rewrites: sizes up to transposes and operand swaps."""
  if op == "dot":
    return ("dot", dims["batch"], tuple(sorted((dims["M"], dims["N"]))), dims["K"])
  if op == "conv":
    return ("conv", tuple(sorted(tuple(sorted(s)) for s in (lhs, rhs, out))))
  return (op,)


def _row_signature(row: GemmRow) -> tuple:
  # A ragged dot becomes a loop of dots or a custom call of other sizes: it matches none.
  op = {"dot_general": "dot", "conv_general_dilated": "conv"}.get(row.op, row.op)
  return _signature(op, row.lhs_shape, row.rhs_shape, row.out_shape, row.dims)


def _gemm_signature(gemm: CompiledGemm) -> tuple:
  return _signature(gemm.op, gemm.lhs_shape, gemm.rhs_shape, gemm.out_shape, gemm.dims)


def _padded_signature(signature: tuple) -> tuple:
  """A dot's signature with M, N and K rounded up to 16: XLA pads misaligned GEMMs (8 or 16)."""
  if signature[0] != "dot":
    return signature
  _, batch, mn, k = signature
  up = lambda n: -(-n // 16) * 16  # noqa: E731
  return ("dot", batch, tuple(sorted(map(up, mn))), up(k))


def _split_k_signature(signature: tuple) -> tuple:
  """A dot's signature up to split-K: XLA's Triton GEMMs may split K into a batch dim."""
  if signature[0] != "dot":
    return signature
  _, batch, mn, k = signature
  return ("dot", mn, batch * k)


def _match(
  rows: Sequence[GemmRow], compiled: Sequence[CompiledGemm]
) -> tuple[list[CompiledGemm | None], list[CompiledGemm]]:
  """Pairs each row with a compiled GEMM of the same sizes (dtypes, then op_name break ties).

  Exact sizes first; then, for rows left over, sizes up to split-K (a Triton
  GEMM fusion that splits the contracting dim over a new batch dim); then
  sizes up to XLA's padding of misaligned GEMMs.
  """
  unused = list(compiled)
  matched: list[CompiledGemm | None] = [None] * len(rows)
  for loosen in (lambda s: s, _split_k_signature, _padded_signature):
    for i, row in enumerate(rows):
      if matched[i] is not None:
        continue
      signature = loosen(_row_signature(row))
      candidates = [g for g in unused if loosen(_gemm_signature(g)) == signature]

      def score(g: CompiledGemm, row: GemmRow = row) -> int:
        same_dtypes = {g.lhs_dtype, g.rhs_dtype} == {row.lhs_dtype, row.rhs_dtype}
        same_path = bool(row.path) and row.path in g.op_name
        return 2 * same_dtypes + same_path

      best = max(candidates, key=score, default=None)
      if best is not None:
        unused.remove(best)
      matched[i] = best
  return matched, unused


def _flags(row: GemmRow, platform: str) -> tuple[Flag, ...]:
  flags = []
  operand_dtypes = {np.dtype(row.lhs_dtype), np.dtype(row.rhs_dtype)}
  if np.dtype(jnp.float64) in operand_dtypes:
    flags.append(Flag("f64-operands", "f64 operands: no Tensor Core or fast CPU kernel runs f64."))
  elif _F32 in operand_dtypes:
    flags.append(
      Flag(
        "f32-operands",
        "f32 operands miss the half-precision fast path (bf16/f16 x bf16/f16 -> f32); "
        "autocast the function or cast the operands.",
      )
    )
    if platform == "gpu":
      if row.precision == "HIGHEST":
        flags.append(
          Flag("f32-highest", "precision HIGHEST runs full f32 on CUDA cores, no Tensor Cores.")
        )
      elif row.precision in ("DEFAULT", "HIGH"):
        flags.append(
          Flag(
            "tf32",
            f"precision {row.precision} runs this f32 dot as TF32 on Ampere+ GPUs: "
            "Tensor Cores, at half the bf16 rate and twice the bytes.",
          )
        )
  fp8 = _is_fp8(row.lhs_dtype) or _is_fp8(row.rhs_dtype)
  if row.misaligned:
    cost = (
      "on a GPU XLA pads the operands with copies"
      if row.op != "conv_general_dilated"
      else "cuDNN falls back to slower kernels (XLA does not pad half convolutions)"
    )
    if fp8:
      cost = "FP8 cuBLASLt GEMMs need multiples of 16; XLA pads the operands with copies"
    flags.append(
      Flag(
        "misaligned",
        f"{', '.join(row.misaligned)} not a multiple of {row.alignment}: {cost}; pad the size "
        "with mpjax.xla.pad_to_multiple.",
      )
    )
  half_result = _is_half(row.out_dtype) and _is_half(row.lhs_dtype) and _is_half(row.rhs_dtype)
  if platform == "cpu" and half_result:
    flags.append(
      Flag(
        "half-result-on-cpu",
        f"{_short(row.out_dtype)} result: XLA:CPU upcasts a half x half -> half GEMM to f32 and "
        "back, slower than f32; accumulate in f32 (preferred_element_type=jnp.float32).",
      )
    )
  if fp8 and row.compiled_dtypes is not None and not _compiled_fp8(row):
    multiplied = row.compiled_dtypes.split(" ->")[0]
    wider = max(multiplied.split(" x "), key=lambda d: int(re.sub(r"\D", "", d[:4]) or 0))
    flags.append(
      Flag(
        "fp8-lost",
        f"planned FP8, but the compiled GEMM multiplies {multiplied}: the FP8 was lost (XLA "
        f"widened the f8 operands, or folded their converts away), so it runs at the {wider} "
        "rate. A quantize -> dequantize -> dot stays FP8 only with Triton GEMMs off, on a GPU "
        "with FP8 Tensor Cores (compute capability >= 8.9); give lax.dot_general the f8 operands "
        "themselves, with the scales applied to its output.",
      )
    )
  if row.accumulation not in (None, "unknown", "f32", "f64"):
    flags.append(
      Flag(
        "low-precision-accumulation",
        f"the compiled GEMM accumulates in {row.accumulation}, not f32: long sums lose precision.",
      )
    )
  if row.call_kind is not None and row.call_kind not in _FAST_CALLS:
    flags.append(
      Flag(
        "not-tensor-core",
        f"became {row.call}, neither a cuBLAS(Lt) call nor a Triton GEMM fusion.",
      )
    )
  return tuple(flags)


def _compiled_fp8(row: GemmRow) -> bool:
  """Whether the compiled GEMM matched to ``row`` multiplies FP8 by FP8."""
  operands = (row.compiled_dtypes or "").split(" ->")[0].split(" x ")
  return all(o.startswith("f8") for o in operands)


def _is_fast(row: GemmRow) -> bool:
  half = _is_half(row.lhs_dtype) and _is_half(row.rhs_dtype)
  if row.accumulation not in (None, "unknown"):  # the compiled program says it
    f32_accumulation = row.accumulation in ("f32", "f64")
  else:
    # No compiled GEMM read (or it does not say): a half result counts, as on a GPU
    # cuBLAS(Lt) and Triton accumulate half-result GEMMs in f32; on a CPU a half
    # result is flagged above.
    f32_accumulation = np.dtype(row.out_dtype) == _F32 or _is_half(row.out_dtype)
  return half and f32_accumulation and not row.flags


# --------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """Every GEMM and convolution of a function, and the share of their FLOPs on the fast path.

  Attributes:
    rows: one :class:`GemmRow` per GEMM or convolution, in program order.
    platform: the backend the flags are for (``"cpu"``, ``"gpu"``, ``"tpu"``).
    compiled_note: what was read from the compiled HLO, or why it was not.
    compiled_only: compiled GEMMs that match no row (merged by XLA, or
      introduced by it).
  """

  rows: tuple[GemmRow, ...]
  platform: str
  compiled_note: str
  compiled_only: tuple[CompiledGemm, ...] = ()

  @property
  def total_flops(self) -> float:
    """FLOPs of all floating-point GEMMs and convolutions per call."""
    return sum(r.flops for r in self.rows if _floating(r))

  @property
  def fast_flops(self) -> float:
    """Of those, the FLOPs on the fast path."""
    return sum(r.flops for r in self.rows if r.fast)

  @property
  def fast_path_share(self) -> float:
    """``fast_flops / total_flops`` (1.0 for a function with no GEMM: nothing misses it)."""
    return self.fast_flops / self.total_flops if self.total_flops else 1.0

  @property
  def flagged(self) -> tuple[GemmRow, ...]:
    """The rows with at least one flag."""
    return tuple(r for r in self.rows if r.flags)

  def to_dict(self) -> dict[str, Any]:
    """The report as JSON-ready values."""
    return {
      "platform": self.platform,
      "compiled_note": self.compiled_note,
      "total_flops": self.total_flops,
      "fast_flops": self.fast_flops,
      "fast_path_share": self.fast_path_share,
      "rows": [r.to_dict() for r in self.rows],
      "compiled_only": [g.to_dict() for g in self.compiled_only],
    }

  def to_markdown(self) -> str:
    """A markdown table (path, shape, dtypes, FLOPs, call, flags), the flags' reasons, the share."""
    with_call = any(r.call is not None for r in self.rows)
    header = ["#", "path", "shape", "dtypes", "precision", "GFLOP"]
    header += ["call", "compiled dtypes", "accumulation"] if with_call else []
    header += ["flags"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, r in enumerate(self.rows):
      count = f" (x{r.count})" if r.count != 1 else ""
      cells = [
        str(i),
        (r.path or "(top)").replace("|", "\\|"),
        r.shape + count,
        r.dtypes,
        r.precision,
        f"{r.flops / 1e9:.4g}",
      ]
      if with_call:
        cells += [f"`{r.call}`", r.compiled_dtypes or "-", r.accumulation or "-"]
      cells += [", ".join(f.code for f in r.flags) or "-"]
      lines.append("| " + " | ".join(cells) + " |")
    reasons = Counter(f for r in self.rows for f in r.flags)
    if reasons:
      lines += ["", "Flags:"]
      lines += [f"- `{f.code}` ({n} GEMMs): {f.reason}" for f, n in reasons.items()]
    notes = sorted({r.note for r in self.rows if r.note})
    if notes:
      lines += ["", "Counts: " + "; ".join(notes) + "."]
    if self.compiled_only:
      lines += ["", "Compiled GEMMs with no GEMM of the program to match (merged or added by XLA):"]
      lines += [
        f"- `{g.name}`: `{g.call}` {g.lhs_dtype} {g.lhs_shape} x {g.rhs_dtype} {g.rhs_shape}"
        for g in self.compiled_only
      ]
    fp8 = [r for r in self.rows if _is_fp8(r.lhs_dtype) or _is_fp8(r.rhs_dtype)]
    if fp8:
      compiled = [r for r in fp8 if r.compiled_dtypes is not None]
      kept = [r for r in compiled if _compiled_fp8(r)]
      f8_calls = sum(r.call_kind == "cublas_lt_f8" for r in kept)
      lines += [
        "",
        f"FP8: {len(fp8)} GEMMs planned with FP8 operands"
        + (
          f"; compiled, {len(kept)} multiply FP8 x FP8 ({f8_calls} FP8 cuBLASLt calls "
          f"`__cublas$lt$matmul$f8`, {len(kept) - f8_calls} f8 dots in fusions) and "
          f"{len(compiled) - len(kept)} lost their FP8 (`fp8-lost`)."
          if with_call
          else "."
        ),
      ]
    unknown = sum(r.accumulation == "unknown" for r in self.rows)
    if unknown:
      lines += [
        "",
        f"Accumulation: the compiled program does not say it for {unknown} GEMMs (`unknown`); "
        "the fast-path share counts those that write f32 or a half dtype as accumulating in f32.",
      ]
    lines += [
      "",
      f"Compiled HLO ({self.platform}): {self.compiled_note}",
      "",
      f"Fast path: {100 * self.fast_path_share:.1f}% of {self.total_flops / 1e9:.4g} GFLOP in "
      f"{len(self.rows)} GEMMs (half-precision operands, f32 accumulation, aligned"
      + (", on Tensor Cores" if with_call else "")
      + f"); {len(self.flagged)} flagged.",
    ]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.to_markdown()


def _floating(row: GemmRow) -> bool:
  return all(jnp.issubdtype(np.dtype(d), jnp.floating) for d in (row.lhs_dtype, row.rhs_dtype))


def audit_jaxpr(jaxpr: Any, *, platform: str = "cpu", hlo_text: str | None = None) -> AuditReport:
  """Audits the GEMMs of a traced program, optionally with its compiled HLO.

  :func:`audit` traces and compiles a function and calls this; call it
  directly on a jaxpr you have, or to read HLO compiled elsewhere.

  Args:
    jaxpr: a ``ClosedJaxpr`` or ``Jaxpr`` (``jax.make_jaxpr(fn)(*args)``).
    platform: the backend the flags are for: ``"gpu"`` adds the TF32 / full
      f32 flags, ``"cpu"`` the half-result flag.
    hlo_text: the compiled HLO text of the same program; each GEMM is matched
      to the compiled GEMM of the same sizes and gets its call.

  Returns:
    An :class:`AuditReport`.

  Raises:
    TypeError: if ``jaxpr`` is not a jaxpr.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpjax.audit import audit_jaxpr
    >>> x = jnp.ones((8, 100), jnp.bfloat16)
    >>> jaxpr = jax.make_jaxpr(lambda a: a @ a.T)(x)
    >>> [f.code for f in audit_jaxpr(jaxpr).rows[0].flags]
    ['misaligned', 'half-result-on-cpu']
  """
  inner = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
  if not isinstance(inner, jcore.Jaxpr):
    raise TypeError(
      f"audit_jaxpr: jaxpr must be a jaxpr from jax.make_jaxpr(fn)(*args), got "
      f"{type(jaxpr).__name__}; to audit a function, call mpjax.audit.audit(fn, *args)."
    )
  # Audit what the program computes: a GEMM whose result nothing uses (the
  # gradient of a convolution with respect to the input image, which a VJP
  # computes and no one asks for) is removed here, as XLA removes it.
  inner, _ = dce_jaxpr(inner, [True] * len(inner.outvars))
  rows: list[GemmRow] = []
  _walk(inner, "", 1, "", rows)
  compiled_only: tuple[CompiledGemm, ...] = ()
  if hlo_text is not None:
    compiled = parse_compiled_gemms(hlo_text)
    matched, unused = _match(rows, compiled)
    rows = [
      dataclasses.replace(
        r,
        call=g.call if g is not None else "(not found)",
        call_kind=g.kind if g is not None else None,
        compiled_dtypes=(
          f"{_short(g.lhs_dtype)} x {_short(g.rhs_dtype)} -> {_short(g.out_dtype)}"
          if g is not None
          else None
        ),
        accumulation=g.accumulation if g is not None else None,
      )
      for r, g in zip(rows, matched, strict=True)
    ]
    compiled_only = tuple(unused)
    found = sum(g is not None for g in matched)
    note = f"{found} of {len(rows)} GEMMs matched to {len(compiled)} compiled GEMMs."
  elif platform == "gpu":
    note = "not read (no compiled HLO text given)."
  else:
    note = (
      f"not read: the backend is {platform}; which call each GEMM becomes (cuBLASLt, Triton) "
      "is only known on a GPU."
    )
  final = []
  for r in rows:
    r = dataclasses.replace(r, flags=_flags(r, platform))
    final.append(dataclasses.replace(r, fast=_is_fast(r)))
  return AuditReport(tuple(final), platform, note, compiled_only)


def _abstract(tree: Any) -> Any:
  """Arrays as ``ShapeDtypeStruct`` s: tracing reads no buffer, so donated ones do too."""

  def one(x):
    if not isinstance(x, jax.Array):
      return x
    try:
      sharding = x.sharding
    except (RuntimeError, ValueError):
      sharding = None
    # A typed PRNG key array has no weak_type.
    weak_type = getattr(x, "weak_type", False)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak_type)

  return jax.tree.map(one, tree)


def audit(
  fn: Callable[..., Any],
  *args: Any,
  print_report: bool = False,
  target: Any = None,
  gemm_backend: str = "default",
  **kwargs: Any,
) -> AuditReport:
  """Audits every GEMM and convolution of ``fn(*args, **kwargs)`` as ``jax.jit`` compiles it.

  The function is traced (``jax.make_jaxpr``: every leaf of ``args`` and
  ``kwargs`` is an input, as under ``jax.jit``; a ``TrainState``'s static
  fields stay static; no buffer is read, so donated arrays are fine) and every
  GEMM of the program is listed, nested ones included. Audit what runs: for a
  training step pass the step (or ``jax.grad`` of the loss), so that the
  backward GEMMs are there too. On a GPU the function is also compiled and each
  GEMM gets the call it became.

  Args:
    fn: any JAX function, e.g. a train step ``step(state, batch)``.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    print_report: print the report as a markdown table.
    target: a GPU to audit for on any machine (``"h100"``, a
      :data:`mpjax.TARGETS` name): the function is traced and compiled for it
      (:func:`mpjax.compile_for`, which needs XLA's CUDA compiler plugin) and each
      GEMM is matched to the call it became there.
    gemm_backend: with ``target``, the GEMM mode to compile in:
      ``"default"``, XLA's default mode as users run it (Triton GEMMs on), or
      ``"cublaslt"`` (Triton GEMMs off); see :func:`mpjax.compile_for`. The
      report's ``compiled_note`` says which.
    **kwargs: its keyword arguments.

  Returns:
    An :class:`AuditReport`: ``report.rows``, ``report.flagged``,
    ``report.fast_path_share``, ``str(report)`` (markdown), ``report.to_dict()``.

  Raises:
    TypeError: if ``fn`` is not callable.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpjax.audit import audit
    >>> x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 32), jnp.bfloat16)
    >>> report = audit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x, w)
    >>> report.rows[0].dtypes, report.rows[0].flops, report.fast_path_share
    ('bf16 x bf16 -> f32', 8192.0, 1.0)
  """
  if not callable(fn):
    raise TypeError(
      f"audit: fn must be the function to audit, e.g. a train step, got {type(fn).__name__}."
    )
  args, kwargs = _abstract(args), _abstract(kwargs)

  def flat(a, k):
    return fn(*a, **k)

  # mpjax.gpu reads HLO with this module: imported here, when needed.
  from mpjax.gpu import compile_for, describe_gemm_backend, get_target, on_target  # noqa: PLC0415

  if target is not None:
    mode = describe_gemm_backend(gemm_backend)  # an unknown mode raises before compiling
    args, kwargs = on_target(target, (args, kwargs))
    jaxpr = jax.make_jaxpr(flat)(args, kwargs)
    hlo_text = compile_for(flat, args, kwargs, target=target, gemm_backend=gemm_backend).as_text()
    report = audit_jaxpr(jaxpr, platform="gpu", hlo_text=hlo_text)
    where = f"Compiled for {get_target(target).device} without a GPU, in {mode}."
    report = dataclasses.replace(report, compiled_note=f"{report.compiled_note} {where}")
    if print_report:
      print(report)
    return report
  jaxpr = jax.make_jaxpr(flat)(args, kwargs)
  platform = jax.default_backend()
  hlo_text = None
  if platform == "gpu":
    hlo_text = jax.jit(flat).lower(args, kwargs).compile().as_text()
  report = audit_jaxpr(jaxpr, platform=platform, hlo_text=hlo_text)
  if hlo_text is not None:
    off = re.search(r"--xla_gpu_enable_triton_gemm=(false|0)\b", os.environ.get("XLA_FLAGS", ""))
    mode = describe_gemm_backend("cublaslt" if off else "default")
    report = dataclasses.replace(
      report, compiled_note=f"{report.compiled_note} Compiled here, in {mode} (from XLA_FLAGS)."
    )
  if print_report:
    print(report)
  return report
