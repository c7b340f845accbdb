"""GEMM audit: which GEMMs and convolutions of a function run on the mixed-precision fast path.

:func:`audit` traces a function as ``jax.jit`` would compile it and lists every
``dot_general``, ``ragged_dot_general`` and ``conv_general_dilated`` of the
program, nested ones too (:mod:`mpjax.jaxpr_gemms`). On a GPU, or for a GPU
target on any machine (:func:`mpjax.compile_for`), it also reads the compiled
HLO (:mod:`mpjax.hlo`) and matches each GEMM to the call it became: cuBLASLt,
legacy cuBLAS, fp8 cuBLASLt, a Triton GEMM fusion, cuDNN, or a plain ``dot``
left in a loop fusion. Each GEMM that misses the fast path gets a flag with
its reason, and the report ends with the share of GEMM FLOPs on the fast
path: half-precision operands (f16, bf16, fp8), f32 accumulation, aligned
dimensions.

:func:`parse_compiled_gemms` (the HLO reader on its own) and the record types
:class:`CompiledGemm`, :class:`GemmRow` and :class:`Flag` are re-exported here
from their modules.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from mpjax.collectives import CollectiveReport, collective_report
from mpjax.gemm_equations import BLOCK_SCALED_PRIMITIVE
from mpjax.gpu import compile_for, describe_gemm_backend, get_target, on_target
from mpjax.hlo import (
  TENSOR_CORE_KINDS,
  CompiledGemm,
  is_fp8,
  is_half,
  parse_compiled_gemms,
  short_dtype,
)
from mpjax.jax_compat import dce_jaxpr
from mpjax.jaxpr_gemms import Flag, GemmRow, jaxpr_custom_kernels, jaxpr_gemms

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
  op = {"dot_general": "dot", "conv_general_dilated": "conv", BLOCK_SCALED_PRIMITIVE: "dot"}.get(
    row.op, row.op
  )
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


def _block_padded_signature(signature: tuple) -> tuple:
  """A dot's signature with M, N and K rounded up to 128: XLA pads a block-scaled cuDNN GEMM's
  operands to the 128-row tiles its scale layout comes in."""
  if signature[0] != "dot":
    return signature
  _, batch, mn, k = signature
  up = lambda n: -(-n // 128) * 128  # noqa: E731
  return ("dot", batch, tuple(sorted(map(up, mn))), up(k))


def _match(
  rows: Sequence[GemmRow], compiled: Sequence[CompiledGemm]
) -> tuple[list[CompiledGemm | None], list[CompiledGemm]]:
  """Pairs each row with a compiled GEMM of the same sizes (dtypes, then op_name break ties).

  Block-scaled rows first take the block-scaled cuDNN calls of their sizes
  (exact, then up to XLA's padding of them to 128); then every row left: exact sizes first;
  then, for rows left over, sizes up to split-K (a Triton GEMM fusion that
  splits the contracting dim over a new batch dim); then sizes up to XLA's
  padding of misaligned GEMMs.
  """
  unused = list(compiled)
  matched: list[CompiledGemm | None] = [None] * len(rows)
  block_scaled = lambda row, g: bool(row.block_scales) and g.kind == "cudnn_block_scaled"  # noqa: E731
  passes = [(lambda s: s, block_scaled), (_block_padded_signature, block_scaled)] + [
    (loosen, lambda row, g: True) for loosen in (lambda s: s, _split_k_signature, _padded_signature)
  ]
  for loosen, allowed in passes:
    for i, row in enumerate(rows):
      if matched[i] is not None:
        continue
      signature = loosen(_row_signature(row))
      candidates = [
        g for g in unused if allowed(row, g) and loosen(_gemm_signature(g)) == signature
      ]

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
  fp8 = is_fp8(row.lhs_dtype) or is_fp8(row.rhs_dtype)
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
  half_result = is_half(row.out_dtype) and is_half(row.lhs_dtype) and is_half(row.rhs_dtype)
  if platform == "cpu" and half_result:
    flags.append(
      Flag(
        "half-result-on-cpu",
        f"{short_dtype(row.out_dtype)} result: XLA:CPU upcasts a half x half -> half GEMM to f32 "
        "and back, slower than f32; accumulate in f32 (preferred_element_type=jnp.float32).",
      )
    )
  if row.block_scales and row.call_kind is not None and row.call_kind != "cudnn_block_scaled":
    flags.append(
      Flag(
        "block-scaled-emulated",
        f"a block-scaled GEMM ({short_dtype(row.lhs_dtype)}, scales {row.block_scales}) that "
        f"compiled as {row.compiled_dtypes} ({row.call}): this GPU has no block-scaled Tensor "
        "Cores (Blackwell, compute capability 10.x, has), so XLA dequantized the operands and "
        "runs it at the bf16 rate or slower, the MXFP8/NVFP4 numerics with no speed-up; use "
        "mixed_bf16 here, or mixed_fp8 (per-tensor FP8) on an H100.",
      )
    )
  elif fp8 and row.compiled_dtypes is not None and not _compiled_fp8(row):
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
  lost = _half_lost(row, platform)
  if lost is not None:
    flags.append(lost)
  if row.accumulation not in (None, "unknown", "f32", "f64"):
    flags.append(
      Flag(
        "low-precision-accumulation",
        f"the compiled GEMM accumulates in {row.accumulation}, not f32: long sums lose precision.",
      )
    )
  if row.call_kind is not None and row.call_kind not in TENSOR_CORE_KINDS:
    flags.append(
      Flag(
        "not-tensor-core",
        f"became {row.call}, neither a cuBLAS(Lt) call nor a Triton GEMM fusion.",
      )
    )
  return tuple(flags)


def _half_lost(row: GemmRow, platform: str) -> Flag | None:
  """``half-lost``: a GEMM planned with f16/bf16 operands that compiled with wider ones.

  Read from the compiled GEMM matched to ``row``, where one was (FP8 has its
  own flag, ``fp8-lost``). Not on a CPU, where XLA:CPU widens half GEMMs of
  its own (a half result, flagged ``half-result-on-cpu``; f16 GEMMs, bf16
  convolutions) and the audit judges the planned dtypes.
  """
  planned = {np.dtype(row.lhs_dtype), np.dtype(row.rhs_dtype)}
  if platform == "cpu" or row.compiled_dtypes is None or not all(map(is_half, planned)):
    return None
  if any(map(is_fp8, planned)):
    return None
  multiplied = row.compiled_dtypes.split(" ->")[0]
  if not any(re.fullmatch(r"f(32|64)", d) for d in multiplied.split(" x ")):
    return None
  half = " x ".join(sorted({short_dtype(d) for d in planned}))
  if row.op == "conv_general_dilated" and np.dtype(row.out_dtype).itemsize > 2:
    why = (
      f"XLA:GPU gives cuDNN a convolution's operands in its result dtype, here "
      f"{short_dtype(row.out_dtype)}: let the convolution write {half} and widen its result "
      "after (mpjax.autocast's bf16 convolutions do on a GPU)"
    )
  else:
    why = "XLA widened the operands before the call"
  return Flag(
    "half-lost",
    f"planned in {half}, compiled as {multiplied} ({row.call}): the GEMM runs at the "
    f"{max(multiplied.split(' x '))} rate, not the {half} one; {why}.",
  )


def _compiled_fp8(row: GemmRow) -> bool:
  """Whether the compiled GEMM matched to ``row`` multiplies FP8 (or FP4) by FP8 (or FP4)."""
  operands = (row.compiled_dtypes or "").split(" ->")[0].split(" x ")
  return all(o.startswith(("f8", "f4")) for o in operands)


def _f32_accumulation(row: GemmRow) -> bool | None:
  """Whether the GEMM accumulates in f32 or wider; ``None`` where nothing says it.

  The compiled GEMM's accumulation where it was read and says it; with no
  compiled GEMM, an f32 (or f64) result, which the program sums in. A half
  result with no compiled program, or a compiled GEMM that does not say it
  (``"unknown"``: a cuDNN convolution, a ``dot`` in a loop fusion), is not known.
  """
  if row.accumulation not in (None, "unknown"):  # the compiled program says it
    return row.accumulation in ("f32", "f64")
  if row.accumulation is None and np.dtype(row.out_dtype) in (_F32, np.dtype(jnp.float64)):
    return True
  return None


def _is_fast(row: GemmRow) -> bool:
  half = is_half(row.lhs_dtype) and is_half(row.rhs_dtype)
  return half and _f32_accumulation(row) is True and not row.flags


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
    custom_kernels: the path of each custom kernel (a Pallas ``pallas_call``):
      the GEMMs inside it are not audited, nor counted in the share (see
      :func:`mpjax.jaxpr_gemms.jaxpr_custom_kernels`).
    collectives: compiled for a GPU target, the program's collectives
      (:func:`mpjax.collective_report`: all-gathers and gradient reductions of
      a sharded step, their dtypes and bytes); ``None`` otherwise.
  """

  rows: tuple[GemmRow, ...]
  platform: str
  compiled_note: str
  compiled_only: tuple[CompiledGemm, ...] = ()
  custom_kernels: tuple[str, ...] = ()
  collectives: CollectiveReport | None = None

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
  def accumulation_unknown(self) -> tuple[GemmRow, ...]:
    """Half-precision GEMMs whose accumulation nothing says (``None`` or ``"unknown"``).

    The compiled GEMM does not say it (a cuDNN convolution, a ``dot`` in a loop
    fusion), or no compiled program was read and the GEMM writes a half dtype.
    They are not counted on the fast path: f32 accumulation is not assumed.
    """
    return tuple(
      r
      for r in self.rows
      if is_half(r.lhs_dtype) and is_half(r.rhs_dtype) and _f32_accumulation(r) is None
    )

  @property
  def half_lost(self) -> tuple[GemmRow, ...]:
    """GEMMs planned with f16/bf16 operands that compiled with f32 (or f64) ones: ``half-lost``."""
    return tuple(r for r in self.rows if any(f.code == "half-lost" for f in r.flags))

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
      "accumulation_unknown": len(self.accumulation_unknown),
      "accumulation_unknown_flops": sum(r.flops for r in self.accumulation_unknown),
      "half_lost": len(self.half_lost),
      "half_lost_flops": sum(r.flops for r in self.half_lost),
      "rows": [r.to_dict() for r in self.rows],
      "compiled_only": [g.to_dict() for g in self.compiled_only],
      "custom_kernels": list(self.custom_kernels),
      "collectives": None if self.collectives is None else self.collectives.to_dict(),
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
    if self.collectives is not None and self.collectives.collectives:
      lines += ["", "Collectives (a sharded program's all-gathers and reductions):", ""]
      lines += [str(self.collectives)]
    blocked = [r for r in self.rows if r.block_scales]
    fp8 = [
      r for r in self.rows if (is_fp8(r.lhs_dtype) or is_fp8(r.rhs_dtype)) and not r.block_scales
    ]
    if blocked:
      native = [r for r in blocked if r.call_kind == "cudnn_block_scaled"]
      emulated = [r for r in blocked if "block-scaled-emulated" in {f.code for f in r.flags}]
      scales = ", ".join(sorted({r.block_scales for r in blocked}))
      lines += [
        "",
        f"Block scaling: {len(blocked)} block-scaled GEMMs (MXFP8/NVFP4, scales {scales})"
        + (
          f"; compiled, {len(native)} are cuDNN block-scaled calls (`__cudnn$blockScaledDot`) "
          f"and {len(emulated)} are emulated in wider GEMMs (`block-scaled-emulated`: this GPU "
          "has no block-scaled Tensor Cores)."
          if with_call
          else "."
        ),
      ]
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
    lost = self.half_lost
    if lost:
      lines += [
        "",
        f"Half precision lost: {len(lost)} GEMMs planned with f16/bf16 operands compiled with "
        f"wider ones ({sum(r.flops for r in lost) / 1e9:.4g} GFLOP, `half-lost`): not counted on "
        "the fast path.",
      ]
    unknown = self.accumulation_unknown
    if unknown:
      said = sum(r.accumulation == "unknown" for r in unknown)
      lines += [
        "",
        f"Accumulation: not known for {len(unknown)} half-precision GEMMs "
        f"({sum(r.flops for r in unknown) / 1e9:.4g} GFLOP; the compiled program does not say "
        f"it for {said} (`unknown`), {len(unknown) - said} have no compiled GEMM read and write "
        "a half dtype): the fast-path share does not count them as accumulating in f32.",
      ]
    if self.custom_kernels:
      where = Counter(self.custom_kernels)
      lines += [
        "",
        f"Not audited: {len(self.custom_kernels)} custom kernels (Pallas `pallas_call`), whose "
        "GEMMs run inside them: neither the traced program (one block of each kernel) nor the "
        "compiled one (a custom call on a GPU) shows their shapes, dtypes or FLOPs, so they are "
        "not rows and not in the share. At: "
        + ", ".join(f"`{path}`" + (f" (x{n})" if n > 1 else "") for path, n in where.items())
        + ".",
      ]
    lines += [
      "",
      f"Compiled HLO ({self.platform}): {self.compiled_note}",
      "",
      f"Fast path: {100 * self.fast_path_share:.1f}% of {self.total_flops / 1e9:.4g} GFLOP in "
      f"{len(self.rows)} GEMMs (half-precision operands, f32 accumulation, aligned"
      + (", on Tensor Cores" if with_call else "")
      + f"); {len(self.flagged)} flagged"
      + (f", {len(lost)} compiled wider than planned" if lost else "")
      + (f", {len(unknown)} of unknown accumulation." if unknown else "."),
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
  rows = jaxpr_gemms(inner)
  kernels = tuple(jaxpr_custom_kernels(inner))
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
          f"{short_dtype(g.lhs_dtype)} x {short_dtype(g.rhs_dtype)} -> {short_dtype(g.out_dtype)}"
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
  return AuditReport(tuple(final), platform, note, compiled_only, kernels)


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

  if target is not None:
    mode = describe_gemm_backend(gemm_backend)  # an unknown mode raises before compiling
    args, kwargs = on_target(target, (args, kwargs))
    jaxpr = jax.make_jaxpr(flat)(args, kwargs)
    compiled = compile_for(flat, args, kwargs, target=target, gemm_backend=gemm_backend)
    report = audit_jaxpr(jaxpr, platform="gpu", hlo_text=compiled.as_text())
    where = f"Compiled for {get_target(target).device} without a GPU, in {mode}."
    report = dataclasses.replace(
      report,
      compiled_note=f"{report.compiled_note} {where}",
      collectives=collective_report(compiled, target=target),
    )
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
