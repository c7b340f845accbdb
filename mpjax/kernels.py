"""The kernel report: what XLA:GPU made of a program, read from its compiled HLO.

:func:`kernel_report` compiles a function for a GPU target
(:func:`mpjax.compile_for`, on any machine) and :func:`report_from_hlo` reads
the program: kernels by kind, GEMM calls (cuBLASLt, Triton, cuDNN), converts
that stand alone, copies, temp memory, bytes moved and a roofline estimate of
the step time from the target's peak rates. :func:`kernel_table` sets reports
side by side. The HLO is read with :mod:`mpjax.hlo`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mpjax.collectives import CollectiveReport, collective_report
from mpjax.gpu import GpuTarget, compile_for, describe_gemm_backend, gemm_mode, get_target
from mpjax.hlo import (
  CompiledGemm,
  Instruction,
  backend_config,
  called_computations,
  computations,
  entry_computation,
  metadata_op_name,
  parse_compiled_gemms,
  type_bytes,
)

__all__ = [
  "Kernel",
  "KernelReport",
  "kernel_report",
  "kernel_table",
  "report_from_hlo",
]

# Instructions that launch nothing: they name, view or group buffers.
_FREE = frozenset(
  "parameter constant get-tuple-element tuple bitcast after-all partition-id replica-id "
  "opt-barrier optimization-barrier add-dependency domain".split()
)
_COPIES = frozenset({"copy", "copy-start", "copy-done", "transpose"})


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of the compiled program: what it is, what it moves, what it computes."""

  name: str
  kind: str
  bytes: int
  flops: float
  peak_dtype: str | None
  standalone_convert: bool = False
  call: str | None = None  # for a GEMM or convolution: "cublas_lt", "triton_gemm", "cudnn"...
  # for a GEMM or convolution: the dtype it accumulates in where the compiled program says it
  # ("f32", "f16"...), else "unknown" (see mpjax.hlo.CompiledGemm.accumulation)
  accumulation: str | None = None
  # for a GEMM that splits K: the bytes of the partial sums it writes (one per slice of K),
  # which another kernel reads back and adds
  split_k_partial_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """What XLA:GPU made of a program: its kernels, memory and an estimated time.

  Attributes:
    target: the :class:`GpuTarget` it was compiled for.
    kernels: each kernel launched per call, in program order (a conditional's
      branches and a loop body counted once per trip where XLA knows the trip
      count).
    temp_bytes: XLA's temp buffer size (``memory_analysis()``).
    argument_bytes: the size of the arguments (the train state and batch).
    gemm_backend: the GEMM mode it was compiled in: ``"default"`` (XLA's
      default, Triton GEMMs on) or ``"cublaslt"`` (Triton GEMMs off).
    collectives: the program's collectives (:func:`mpjax.collective_report`);
      their time is not in the estimate, which is one device's kernels.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> x = jnp.ones((256, 512), jnp.bfloat16)
    >>> report = mpjax.kernel_report(lambda a: jax.nn.relu(a @ a.T), x, target="h100")
    >>> report.by_kind["gemm"], report.flops
    (1, 67108864.0)
  """

  target: GpuTarget
  kernels: tuple[Kernel, ...]
  temp_bytes: int
  argument_bytes: int
  gemm_backend: str
  collectives: CollectiveReport | None = None

  @property
  def count(self) -> int:
    """Kernels per call."""
    return len(self.kernels)

  @property
  def by_kind(self) -> Counter:
    """Kernels per kind: ``gemm``, ``conv``, ``fusion``, ``copy``, ``conditional``,
    ``custom`` (a custom call that is no GEMM: a Pallas or Triton kernel, cuDNN attention),
    ``other``."""
    return Counter(k.kind for k in self.kernels)

  @property
  def standalone_converts(self) -> int:
    """Fusions that do nothing but convert dtypes: a cast XLA could not fold into a neighbour."""
    return sum(k.standalone_convert for k in self.kernels)

  @property
  def calls(self) -> Counter:
    """GEMM and convolution kernels per call kind (``cublas_lt``, ``triton_gemm``, ``cudnn``...)."""
    return Counter(k.call for k in self.kernels if k.call)

  @property
  def accumulation(self) -> Counter:
    """GEMM and convolution kernels per accumulation dtype, as the compiled program says it
    (``"f32"``, ``"f16"``...), ``"unknown"`` where it does not (e.g. a cuDNN convolution)."""
    return Counter(k.accumulation for k in self.kernels if k.call)

  @property
  def fp8_gemms(self) -> int:
    """GEMM kernels that multiply FP8 (or FP4) operands: an FP8 cuBLASLt call, an f8 dot in a
    fusion, a block-scaled cuDNN call."""
    return sum(k.kind == "gemm" and _is_fp8_name(k.peak_dtype) for k in self.kernels)

  @property
  def bytes_moved(self) -> int:
    """Bytes read and written by all kernels (each operand once, each result once)."""
    return sum(k.bytes for k in self.kernels)

  @property
  def split_k_gemms(self) -> int:
    """GEMM kernels that split K: each writes a partial sum per slice of K, another adds them."""
    return sum(k.split_k_partial_bytes > 0 for k in self.kernels)

  @property
  def split_k_bytes(self) -> int:
    """Bytes moved by split-K partial sums: written by their GEMMs, read back by the kernels
    that add them (part of :attr:`bytes_moved`). Compiled without a GPU these are the choices
    of untuned placeholder tiles; a real GPU's autotuner decides per GEMM whether to split."""
    return 2 * sum(k.split_k_partial_bytes for k in self.kernels)

  @property
  def custom_kernels(self) -> int:
    """Custom-call kernels that are no GEMM (a Pallas or Triton kernel, cuDNN attention): the
    report cannot read their FLOPs, so :attr:`estimated_seconds` counts only their bytes."""
    return sum(k.kind == "custom" for k in self.kernels)

  @property
  def copy_bytes(self) -> int:
    """Bytes moved by copy and transpose kernels."""
    return sum(k.bytes for k in self.kernels if k.kind == "copy")

  @property
  def flops(self) -> float:
    """GEMM and convolution FLOPs."""
    return sum(k.flops for k in self.kernels)

  def kernel_seconds(self, kernel: Kernel) -> float:
    """One kernel's part of :attr:`estimated_seconds`: the longer of its GEMM FLOPs at the
    peak for the dtype it multiplies and its bytes at the memory bandwidth."""
    compute = 0.0
    if kernel.flops:
      dtype = kernel.peak_dtype
      if str(dtype).startswith("float4") and self.target.fp4_tflops is None:
        dtype = "float8_e4m3fn"
      if _is_fp8_name(dtype) and self.target.fp8_tflops is None:
        dtype = "bfloat16"
      peak = self.target.peak_tflops(dtype)
      compute = kernel.flops / (peak * 1e12)
    return max(compute, kernel.bytes / (self.target.memory_tbps * 1e12))

  @property
  def estimated_seconds(self) -> float:
    """A roofline estimate, not a measurement: each kernel takes the longer of its
    GEMM FLOPs at the target's Tensor Core peak for the dtype it multiplies (the
    wider of its two operands: FP8 only where both are FP8, as in an
    ``__cublas$lt$matmul$f8`` call or an f8 x f8 dot in a Triton fusion) and its
    bytes at the memory bandwidth. Launch overheads and achieved (not peak)
    rates are left out, so a real step is slower."""
    return sum(self.kernel_seconds(k) for k in self.kernels)

  @property
  def estimated_gemm_seconds(self) -> float:
    """The part of :attr:`estimated_seconds` in GEMM and convolution kernels (with what XLA
    fused into them); the rest is every other kernel's."""
    return sum(self.kernel_seconds(k) for k in self.kernels if k.call)

  def to_dict(self) -> dict[str, Any]:
    return {
      "target": self.target.name,
      "gemm_backend": self.gemm_backend,
      "gemm_mode": describe_gemm_backend(self.gemm_backend),
      "kernels": self.count,
      "by_kind": dict(self.by_kind),
      "calls": dict(self.calls),
      "accumulation": dict(self.accumulation),
      "fp8_gemms": self.fp8_gemms,
      "standalone_converts": self.standalone_converts,
      "bytes_moved": self.bytes_moved,
      "split_k_gemms": self.split_k_gemms,
      "split_k_bytes": self.split_k_bytes,
      "custom_kernels": self.custom_kernels,
      "copy_bytes": self.copy_bytes,
      "argument_bytes": self.argument_bytes,
      "temp_bytes": self.temp_bytes,
      "gemm_flops": self.flops,
      "estimated_ms": 1e3 * self.estimated_seconds,
      "estimated_gemm_ms": 1e3 * self.estimated_gemm_seconds,
    }


def _is_fp8_name(dtype: str | None) -> bool:
  return bool(dtype) and str(dtype).startswith(("float8", "float4"))


def _gemm_flops(gemms: list[CompiledGemm]) -> tuple[float, str | None]:
  """The FLOPs of a kernel's GEMMs, and the dtype they multiply: the wider operand's."""
  flops = sum(g.flops for g in gemms)
  dtype = None
  for g in gemms:
    dtype = max((g.lhs_dtype, g.rhs_dtype), key=lambda d: np.dtype(d).itemsize)
  return flops, dtype


def _split_k_partials(
  comps: dict[str, list[Instruction]], comp: str, gemms: Mapping[str, list[CompiledGemm]]
) -> dict[str, int]:
  """The GEMMs of computation ``comp`` that split K, each with the bytes of its partial sums.

  A split-K GEMM writes one partial sum per slice of K along a new dimension; a ``reduce``
  that carries the dot's own ``op_name`` adds them, in a fusion of its own or in the next kernel.
  """
  instrs = comps.get(comp, ())
  by_name = {i.name: i for i in instrs}
  viewed: dict[str, str] = {}  # a bitcast's name -> the buffer it views
  for i in instrs:
    if i.opcode == "bitcast" and i.operands:
      viewed[i.name] = viewed.get(i.operands[0][0], i.operands[0][0])
  partials: dict[str, int] = {}
  for consumer in (i for i in instrs if i.opcode == "fusion"):  # XLA:GPU wraps every reduce
    body = comps.get(next(iter(called_computations(consumer)), ""), [])
    added = {metadata_op_name(r) for r in body if r.opcode == "reduce"} - {""}
    for operand, _ in consumer.operands:
      gemm = by_name.get(viewed.get(operand, operand))
      if gemm is not None and gemm.name in gemms and metadata_op_name(gemm) in added:
        partials[gemm.name] = type_bytes(gemm.type)
  return partials


def _kernels(
  comps: dict[str, list[Instruction]], comp: str, gemms: Mapping[str, list[CompiledGemm]]
) -> list[Kernel]:
  """The kernels that running computation ``comp`` launches, nested control flow included."""
  types = {i.name: i.type for i in comps.get(comp, ())}
  partials = _split_k_partials(comps, comp, gemms)
  out: list[Kernel] = []
  for instr in comps.get(comp, ()):
    op = instr.opcode
    if op in _FREE or op in ("async-done", "async-update"):
      continue
    operand_bytes = sum(type_bytes(t or types.get(n)) for n, t in instr.operands)
    moved = operand_bytes + type_bytes(instr.type)
    if op == "conditional":
      out.append(Kernel(instr.name, "conditional", 0, 0.0, None))
      branches = re.findall(r"%?([\w.\-]+)", instr.attrs.get("branch_computations", ""))
      branches += [
        instr.attrs[k].lstrip("%")
        for k in ("true_computation", "false_computation")
        if k in instr.attrs
      ]
      for branch in branches:
        out += _kernels(comps, branch, gemms)
    elif op == "while":
      trips = backend_config(instr).get("known_trip_count", {}).get("n", 1)
      body = instr.attrs.get("body", "").lstrip("%")
      for _ in range(int(trips)):
        out += _kernels(comps, body, gemms)
    elif op in ("call", "async-start"):
      for called in called_computations(instr) or [instr.attrs.get("to_apply", "").lstrip("%")]:
        out += _kernels(comps, called, gemms)
    elif instr.name in gemms:
      flops, dtype = _gemm_flops(gemms[instr.name])
      kind = "conv" if gemms[instr.name][0].op == "conv" else "gemm"
      if op == "custom-call":  # the workspace (the result tuple's last element) is scratch
        moved = operand_bytes + type_bytes(instr.type, first_only=True)
      said = {g.accumulation for g in gemms[instr.name]}
      acc = said.pop() if len(said) == 1 else "unknown"
      call = gemms[instr.name][0].kind
      out.append(
        Kernel(
          instr.name,
          kind,
          moved,
          flops,
          dtype,
          call=call,
          accumulation=acc,
          split_k_partial_bytes=partials.get(instr.name, 0),
        )
      )
    elif op == "fusion":
      fused = comps.get(next(iter(called_computations(instr)), ""), [])
      inner = {i.opcode for i in fused} - _FREE
      if inner <= _COPIES:
        out.append(Kernel(instr.name, "copy", moved, 0.0, None))
      else:
        out.append(Kernel(instr.name, "fusion", moved, 0.0, None, inner == {"convert"}))
    elif op == "custom-call":  # a kernel of its own (Pallas, Triton, cuDNN): FLOPs unknown
      out.append(Kernel(instr.name, "custom", moved, 0.0, None))
    else:
      out.append(Kernel(instr.name, "copy" if op in _COPIES else "other", moved, 0.0, None))
  return out


def kernel_report(
  fn: Callable[..., Any],
  *args: Any,
  target: str | GpuTarget = "h100",
  gemm_backend: str = "default",
  **kwargs: Any,
) -> KernelReport:
  """Compiles ``fn(*args, **kwargs)`` for a GPU target and reads its kernels.

  Args:
    fn: the function, e.g. a jitted (and donating) train step.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    target: a :data:`mpjax.TARGETS` name or a :class:`GpuTarget`.
    gemm_backend: ``"default"`` (XLA's default mode, Triton GEMMs on) or
      ``"cublaslt"`` (Triton GEMMs off); see :func:`mpjax.compile_for`.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`KernelReport`.

  Raises:
    ValueError: for an unknown target or GEMM backend.
    RuntimeError: when the compiler plugin is missing or mismatched.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> x = jnp.ones((1024, 1024), jnp.float32)
    >>> mpjax.kernel_report(lambda a: jnp.maximum(a, 0.0) * 2, x, target="a100").count
    1
  """
  target = get_target(target)
  mode = gemm_mode(gemm_backend)
  compiled = compile_for(fn, *args, target=target, gemm_backend=mode, **kwargs)
  report = report_from_hlo(compiled.as_text(), target, compiled.memory_analysis(), mode)
  # From the compiled program, whose mesh says which node each device is in.
  return dataclasses.replace(report, collectives=collective_report(compiled, target=target))


def report_from_hlo(
  hlo_text: str, target: str | GpuTarget, memory: Any = None, gemm_backend: str = "default"
) -> KernelReport:
  """A :class:`KernelReport` from compiled GPU HLO text (e.g. from a real GPU's compile).

  Args:
    hlo_text: ``compiled.as_text()``.
    target: the target whose rates the estimate uses.
    memory: ``compiled.memory_analysis()``, for the temp and argument sizes.
    gemm_backend: the GEMM mode the program was compiled in, for the record:
      ``"default"`` (XLA's default, as on a GPU with no flags set) or
      ``"cublaslt"`` (``--xla_gpu_enable_triton_gemm=false``).

  Returns:
    A :class:`KernelReport`.
  """
  comps = computations(hlo_text)
  entry = entry_computation(hlo_text)
  if entry is None:
    raise ValueError("report_from_hlo: no ENTRY computation in the HLO text.")
  gemms: dict[str, list[CompiledGemm]] = {}
  for gemm in parse_compiled_gemms(hlo_text):
    gemms.setdefault(gemm.name, []).append(gemm)
  kernels = _kernels(comps, entry, gemms)
  temp = int(getattr(memory, "temp_size_in_bytes", 0) or 0)
  arguments = int(getattr(memory, "argument_size_in_bytes", 0) or 0)
  collectives = collective_report(hlo_text, target=target)
  return KernelReport(
    get_target(target), tuple(kernels), temp, arguments, gemm_mode(gemm_backend), collectives
  )


def kernel_table(reports: Mapping[str, KernelReport]) -> str:
  """Kernel reports side by side as a markdown table, with ratios to the first one.

  Args:
    reports: label -> :class:`KernelReport`, the baseline (e.g. fp32) first.

  Returns:
    The table and a line saying that the step time is a roofline estimate.
  """
  if not reports:
    raise ValueError("kernel_table: no reports.")
  base = next(iter(reports.values()))

  def ratio(value: float, ref: float) -> str:
    return f" ({value / ref:.2f}x)" if ref else ""

  lines = [
    "| variant | kernels | GEMMs | fusions | copies | conditionals | standalone converts "
    "| bytes moved MB | copied MB | temp MB | est. step ms |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for label, r in reports.items():
    kinds = r.by_kind
    lines.append(
      f"| {label} | {r.count}{ratio(r.count, base.count)} | {kinds['gemm'] + kinds['conv']} "
      f"| {kinds['fusion']} | {kinds['copy']} | {kinds['conditional']} "
      f"| {r.standalone_converts} "
      f"| {r.bytes_moved / 1e6:.1f}{ratio(r.bytes_moved, base.bytes_moved)} "
      f"| {r.copy_bytes / 1e6:.1f} | {r.temp_bytes / 1e6:.1f} "
      f"| {r.estimated_seconds * 1e3:.3f}{ratio(r.estimated_seconds, base.estimated_seconds)} |"
    )
  modes = {label: describe_gemm_backend(r.gemm_backend) for label, r in reports.items()}
  mode = (
    next(iter(modes.values()))
    if len(set(modes.values())) == 1
    else "; ".join(f"{label}: {text}" for label, text in modes.items())
  )
  t = base.target
  fp8_peak = f", {t.fp8_tflops:g} FP8" if t.fp8_tflops else ""
  placeholder = (
    " Without a GPU nothing autotunes: Triton GEMMs keep placeholder tiles, where a real GPU "
    "picks tiles, or a cuBLASLt call, per GEMM."
    if any(r.gemm_backend == "default" for r in reports.values())
    else ""
  )
  split = [
    f"{label} {r.split_k_gemms} ({r.split_k_bytes / 1e6:.1f} MB)"
    for label, r in reports.items()
    if r.split_k_gemms
  ]
  if split:
    placeholder += (
      " GEMMs that split K, with the bytes of their f32 partial sums (written, then read back "
      f"and added; in bytes moved): {', '.join(split)}."
    )
  custom = [f"{label} {r.custom_kernels}" for label, r in reports.items() if r.custom_kernels]
  if custom:
    placeholder += (
      " Custom-call kernels that are no GEMM (Pallas, Triton or cuDNN kernels), whose FLOPs "
      f"the report cannot read, so the estimate counts only their bytes: {', '.join(custom)}."
    )
  lines.append(
    f"\nCompiled for {t.device} without a GPU, in {mode}.{placeholder} The step time is a "
    "roofline estimate, not a measurement: each kernel takes the longer of its GEMM FLOPs at "
    f"the dense peak for the dtype it multiplies ({t.bf16_tflops:g} TFLOP/s bf16{fp8_peak}, "
    f"{t.tf32_tflops:g} TF32) and its bytes at {t.memory_tbps:g} TB/s; launch overheads and "
    "achieved rates are left out."
  )
  return "\n".join(lines)
