"""The reader of compiled HLO: instructions, computations, types, and the GEMMs they hold.

Everything here is a pure function of the text that
``jax.jit(fn).lower(*args).compile().as_text()`` returns (or of an XLA dump
``*.after_optimizations.txt``): it needs no GPU and imports nothing else of mpjax.
:func:`computations` splits the text into computations of :class:`Instruction` s;
:func:`array_type`, :func:`type_bytes` and :func:`backend_config` read their
types and configs; :func:`parse_compiled_gemms` lists every GEMM and
convolution with the call it became: cuBLASLt (``__cublas$lt$matmul``), legacy
cuBLAS (``__cublas$gemm``), fp8 cuBLASLt (``__cublas$lt$matmul$f8``), an
autotuned Triton GEMM fusion (``__triton_gemm``), cuDNN (``__cudnn$conv*``), or
a plain ``dot`` left in a loop fusion, and the dtype it accumulates in where the
program says it.

:mod:`mpjax.audit` matches these GEMMs to the program's; :mod:`mpjax.kernels`
counts the kernels they and the other instructions launch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
  "TENSOR_CORE_KINDS",
  "CompiledGemm",
  "GemmOperands",
  "Instruction",
  "array_type",
  "backend_config",
  "called_computations",
  "computations",
  "conv_dims",
  "dot_dims",
  "entry_computation",
  "is_fp8",
  "is_half",
  "parse_compiled_gemms",
  "short_dtype",
  "type_bytes",
]

# The calls that run a GEMM on Tensor Cores (or the matrix units of the GPU at hand).
TENSOR_CORE_KINDS = frozenset(
  {"cublas_lt", "cublas_lt_f8", "cublas", "triton_gemm", "cudnn", "cudnn_block_scaled"}
)
BLOCK_SCALED_CALL = "__cudnn$blockScaledDot"
"""cuDNN's block-scaled GEMM (MXFP8, NVFP4), what XLA makes of a block-scaled dot on Blackwell."""

# --------------------------------------------------------------------------- dtypes


def is_half(dtype: Any) -> bool:
  """f16, bf16 or an 8-bit float: the operand dtypes of the fast path."""
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize <= 2


def is_fp8(dtype: Any) -> bool:
  """An 8-bit float (``float8_e4m3fn``, ``float8_e5m2``...): the FP8 operand dtypes."""
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize == 1


def short_dtype(dtype: Any) -> str:
  """``bf16``, ``f16``, ``f32``, ``f8_e4m3fn``, ``s8``: the names HLO uses."""
  name = np.dtype(dtype).name
  for long, short in (("bfloat", "bf"), ("float8_", "f8_"), ("float", "f"), ("uint", "u")):
    if name.startswith(long):
      return short + name[len(long) :]
  return name.replace("int", "s", 1) if name.startswith("int") else name


def _numpy_name(name: str) -> str:
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


# --------------------------------------------------------------------------- GEMM records


@dataclasses.dataclass(frozen=True)
class GemmOperands:
  """The operand and result shapes and dtypes (numpy names) that every GEMM record carries.

  A base of :class:`CompiledGemm` and :class:`mpjax.audit.GemmRow`: its fields come first
  in their constructors, ``repr`` and ``to_dict``.
  """

  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  lhs_dtype: str
  rhs_dtype: str
  out_dtype: str


@dataclasses.dataclass(frozen=True)
class CompiledGemm(GemmOperands):
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
      over each group of dimensions); for a convolution, the forward
      convolution's ``output_elements``, the filter's ``window`` (its spatial
      size) and ``input_features`` (per feature group), read through its
      ``dim_labels``: see :func:`conv_dims`.
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
  def flops(self) -> float:
    """Multiply-adds times two: ``2 batch M N K`` for a dot; for a convolution
    ``2 output_elements window input_features``, whatever layout XLA gave the filter."""
    d = self.dims
    if self.op == "dot" and d:
      return 2.0 * d["batch"] * d["M"] * d["N"] * d["K"]
    if self.op == "conv" and d:
      return 2.0 * d["output_elements"] * d["window"] * d["input_features"]
    return 0.0

  @property
  def tensor_core(self) -> bool:
    """Whether the call is cuBLAS(Lt), a Triton GEMM or cuDNN."""
    return self.kind in TENSOR_CORE_KINDS

  def to_dict(self) -> dict[str, Any]:
    """The fields as JSON-ready values."""
    out = dataclasses.asdict(self)
    out["dims"] = dict(self.dims)
    out["tensor_core"] = self.tensor_core
    return out


# --------------------------------------------------------------------------- HLO text


@dataclasses.dataclass
class Instruction:
  """One HLO instruction, as printed.

  Attributes:
    name: its name, without ``%``.
    type: its result type as written (``"bf16[256,1024]{1,0}"``, a tuple ``"(...)"``).
    opcode: ``"fusion"``, ``"custom-call"``, ``"dot"``...
    operands: each operand's name and its type where printed with it, else ``None``.
    attrs: the attributes after the operands (``calls``, ``backend_config``...), as text.
  """

  name: str
  type: str
  opcode: str
  operands: list[tuple[str, str | None]]
  attrs: dict[str, str]


_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([^\s(={}]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_START = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(){},\"]+)\s*=\s*(\(|[a-z][a-z0-9]*\[|token\[)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_ENTRY = re.compile(r"^ENTRY\s+%?([^\s(]+)", re.MULTILINE)


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


def _parse_instr(text: str) -> Instruction | None:
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
  return Instruction(name, type_str, op.group(1), operands, attrs)


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
  """Each computation's instructions, by computation name, in the order printed."""
  comps: dict[str, list[Instruction]] = {}
  current: list[Instruction] | None = None
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


def entry_computation(hlo_text: str) -> str | None:
  """The name of the ``ENTRY`` computation, or ``None`` where the text has none."""
  match = _ENTRY.search(hlo_text)
  return match.group(1) if match else None


def array_type(type_str: str | None) -> tuple[str, tuple[int, ...]] | None:
  """The first array type in ``type_str`` (a tuple's first element) as (dtype, shape)."""
  match = _ARRAY.search(type_str or "")
  if match is None:
    return None
  shape = tuple(int(d) for d in match.group(2).split(",") if d)
  return _numpy_name(match.group(1)), shape


def type_bytes(type_str: str | None, *, first_only: bool = False) -> int:
  """The bytes of every array in an HLO type (a tuple's elements summed).

  With ``first_only``, of its first array only (a custom call's result without its workspace).
  """
  arrays = _ARRAY.findall(type_str or "")
  total = 0
  for dtype, dims in arrays[:1] if first_only else arrays:
    if dtype in ("token",):
      continue
    size = math.prod(int(d) for d in dims.split(",") if d)
    bits = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
    total += size * max(bits, 8) // 8
  return total


def _unquote(value: str) -> str:
  if len(value) >= 2 and value[0] == value[-1] == '"':
    return bytes(value[1:-1], "utf-8").decode("unicode_escape")
  return value


def backend_config(instr: Instruction) -> dict[str, Any]:
  """The instruction's ``backend_config`` JSON as a dict (empty where it has none)."""
  raw = instr.attrs.get("backend_config")
  if not raw:
    return {}
  try:
    config = json.loads(_unquote(raw))
  except (ValueError, UnicodeDecodeError):
    return {}
  return config if isinstance(config, dict) else {}


def called_computations(instr: Instruction) -> list[str]:
  """The computations an instruction's ``calls=`` names (a fusion's fused computation)."""
  value = instr.attrs.get("calls", "")
  return [name.lstrip("%") for name in re.findall(r"%?[\w.\-$]+", value)]


def _int_list(value: Any) -> list[int]:
  if isinstance(value, str):  # HLO text: {0,1}
    return [int(v) for v in re.findall(r"\d+", value)]
  return [int(v) for v in value or ()]


# --------------------------------------------------------------------------- GEMMs


def dot_dims(
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


_DIM_LABELS = re.compile(r"([^_\s]+)_([^-\s]+)->(\S+)")


def conv_dims(
  dim_labels: str,
  lhs: Sequence[int],
  rhs: Sequence[int],
  out: Sequence[int],
  target: str = "",
) -> dict[str, int]:
  """A convolution's output elements, filter window and input features per group.

  XLA:GPU lays filters out for cuDNN (``o01i``, ``oi01``...), so the filter's
  last dimension need not be its output features: the ``dim_labels``
  (``lhs_rhs->out``, e.g. ``b01f_o01i->b01f``) say which dimension is which:
  ``i`` the filter's input features (already divided by the feature group
  count), digits its spatial dimensions. A cuDNN backward call keeps the
  forward convolution's labels: ``__cudnn$convBackwardInput`` takes the
  forward output (its first operand) and the filter and returns the input's
  gradient; ``__cudnn$convBackwardFilter`` takes the input and the forward
  output (its second operand) and returns the filter's gradient. Its FLOPs are
  ``2 * output_elements * window * input_features``, those of the forward
  convolution.

  Args:
    dim_labels: the instruction's ``dim_labels`` (``"b01f_01io->b01f"`` if it has none).
    lhs: the first operand's shape.
    rhs: the second operand's shape.
    out: the result's shape (without a cuDNN workspace).
    target: the cuDNN custom-call target, or ``""`` for an HLO ``convolution``.

  Returns:
    ``{"output_elements": ..., "window": ..., "input_features": ...}``.

  Example:
    >>> from mpjax.hlo import conv_dims
    >>> conv_dims("b01f_o01i->b01f", (8, 32, 32, 32), (64, 3, 3, 32), (8, 32, 32, 64))
    {'output_elements': 524288, 'window': 9, 'input_features': 32}
  """
  match = _DIM_LABELS.fullmatch(dim_labels.strip() or "b01f_01io->b01f")
  if match is None:
    raise ValueError(f"conv_dims: cannot read dim_labels {dim_labels!r} (e.g. 'b01f_o01i->b01f').")
  if "BackwardInput" in target:
    forward_out, kernel = lhs, rhs
  elif "BackwardFilter" in target:
    forward_out, kernel = rhs, out
  else:
    forward_out, kernel = out, rhs
  labels = match.group(2)
  if len(labels) != len(kernel):
    raise ValueError(f"conv_dims: dim_labels {dim_labels!r} do not fit a filter of shape {kernel}.")
  return {
    "output_elements": math.prod(forward_out),
    "window": math.prod(n for label, n in zip(labels, kernel, strict=True) if label.isdigit()),
    "input_features": kernel[labels.index("i")],
  }


def metadata_op_name(instr: Instruction) -> str:
  """The ``op_name`` of an instruction's metadata (JAX's name stack), ``""`` where none."""
  match = re.search(r'op_name="((?:[^"\\]|\\.)*)"', instr.attrs.get("metadata", ""))
  return match.group(1) if match else ""


def _accumulation(
  instr: Instruction, kind: str, config: Mapping[str, Any], lhs_dtype: str, out_dtype: str
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
    return short_dtype(out_dtype)
  if kind in ("cublas_lt_f8", "cudnn_block_scaled"):  # FP8/FP4 Tensor Core GEMMs sum in f32
    return "f32"
  unset = algorithm in ("", "ALG_UNSET")
  if unset and kind in ("cublas_lt", "cublas", "triton_gemm") and is_half(lhs_dtype):
    return "f32"
  return "unknown"


def _gemm_of(
  instr: Instruction, types: Mapping[str, str], call: str, kind: str, config: Mapping[str, Any]
) -> CompiledGemm | None:
  """A :class:`CompiledGemm` from a ``dot``, ``convolution`` or GEMM/conv custom call."""
  if len(instr.operands) < 2:
    return None
  arrays = [array_type(t or types.get(n)) for n, t in instr.operands[:2]]
  out = array_type(instr.type)
  if any(a is None for a in (*arrays, out)):
    return None
  (lhs_t, lhs), (rhs_t, rhs) = arrays
  is_conv = instr.opcode == "convolution" or (instr.opcode == "custom-call" and kind == "cudnn")
  dims: dict[str, int] = {}
  if kind == "cudnn_block_scaled":  # (B, M, K) x (B, N, K), its scales the next two operands
    dims = dot_dims(lhs, rhs, [2], [2], [0], [0])
  elif is_conv:
    target = call if instr.opcode == "custom-call" else ""
    dims = conv_dims(instr.attrs.get("dim_labels", ""), lhs, rhs, out[1], target)
  else:
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
    dims = dot_dims(lhs, rhs, lc, rc, lb, rb)
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
    op_name=metadata_op_name(instr),
    epilogue=str(config.get("epilogue", "")),
    accumulation=_accumulation(instr, kind, config, lhs_t, out[0]),
  )


def _custom_call_kind(target: str) -> str | None:
  if target.startswith("__cublas$lt$matmul"):
    return "cublas_lt_f8" if "$f8" in target else "cublas_lt"
  if target.startswith("__cublas$gemm"):
    return "cublas"
  if target.startswith("__cudnn$conv"):
    return "cudnn"
  if target == BLOCK_SCALED_CALL:
    return "cudnn_block_scaled"
  return None


def _fusion_kind(instr: Instruction, config: Mapping[str, Any], opcode: str) -> tuple[str, str]:
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
    >>> from mpjax.hlo import parse_compiled_gemms
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
  comps = computations(hlo_text)
  types = {name: {i.name: i.type for i in instrs} for name, instrs in comps.items()}
  fused = {
    c
    for instrs in comps.values()
    for i in instrs
    if i.opcode == "fusion"
    for c in called_computations(i)
  }

  def gemms_in(comp: str, seen: frozenset[str] = frozenset()) -> Iterator[tuple[str, Instruction]]:
    """The dots and convolutions of a fused computation, nested fusions included."""
    for instr in comps.get(comp, ()):
      if instr.opcode in ("dot", "convolution"):
        yield comp, instr
      elif instr.opcode == "fusion":
        for inner in called_computations(instr):
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
          config = backend_config(instr)
          gemm_config = config.get("gemm_backend_config", config)
          gemm = _gemm_of(instr, types[comp], target, kind, gemm_config)
      elif instr.opcode == "fusion":
        config = backend_config(instr)
        for called in called_computations(instr)[:1]:
          for inner_comp, op in gemms_in(called):
            call, kind = _fusion_kind(instr, config, op.opcode)
            inner = _gemm_of(op, types[inner_comp], call, kind, {})
            if inner is not None:
              op_name = inner.op_name or metadata_op_name(instr)
              found.append(dataclasses.replace(inner, name=instr.name, op_name=op_name))
      elif instr.opcode in ("dot", "convolution"):
        gemm = _gemm_of(instr, types[comp], instr.opcode, "loop", {})
      if gemm is not None:
        found.append(gemm)
  return found
