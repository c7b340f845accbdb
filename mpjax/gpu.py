"""The GPU program, compiled and measured without a GPU.

XLA compiles for an NVIDIA GPU on a machine that has none: given a device
description (a ``GpuTargetConfigProto``) and XLA's CUDA compiler plugin
(``jax-cuda12-pjrt`` or ``jax-cuda13-pjrt``, of jaxlib's very version),
``jax.jit(fn).lower(...)`` yields the optimized program XLA:GPU would run.
mpjax ships descriptions of the GPUs people train on (:data:`TARGETS`),
compiles any jitted function for one (:func:`compile_for`), and reads what
XLA made of it (:func:`kernel_report`):
kernels by kind, converts that stand alone, copies, temp memory, bytes moved
and a roofline estimate of the step time from the target's peak rates.

Programs are compiled in XLA's default mode, the one users run
(``gemm_backend="default"``: Triton GEMM fusions on). Deviceless compilation
cannot autotune, so there every GEMM stays a Triton fusion with placeholder
tiles, where a real GPU's autotuner picks a tile, or a cuBLASLt call, per GEMM.
``gemm_backend="cublaslt"`` turns Triton GEMMs off
(``--xla_gpu_enable_triton_gemm=false``): every GEMM a cuBLAS(Lt) call, as
XLA falls back to them. Both kinds are read, and every report says its mode.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax.audit import (
  CompiledGemm,
  _array,
  _backend_config,
  _called,
  _computations,
  _Instr,
  parse_compiled_gemms,
)

__all__ = [
  "GpuTarget",
  "KernelReport",
  "TARGETS",
  "compile_for",
  "describe_gemm_backend",
  "gemm_backend_options",
  "get_target",
  "kernel_report",
  "kernel_table",
  "on_target",
]

# XLA's CUDA compiler plugins: either one, at exactly jaxlib's version, compiles for every GPU
# target (jax[cuda12] or jax[cuda13] on a GPU machine brings one). Both are published at each
# jaxlib version mpjax supports; the first is what the README installs.
_PLUGINS = ("jax-cuda12-pjrt", "jax-cuda13-pjrt")


def _plugin_versions() -> dict[str, str]:
  """The installed compiler plugins and their versions."""
  installed = {}
  for name in _PLUGINS:
    try:
      installed[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return installed


def _installed_plugin() -> str:
  """The compiler plugin in use: one at jaxlib's version, else any installed, else the first."""
  import jaxlib

  installed = _plugin_versions()
  matching = [n for n, v in installed.items() if v == jaxlib.__version__]
  return (matching or list(installed) or list(_PLUGINS))[0]


PLUGIN = _installed_plugin()  # the compiler plugin installed ("jax-cuda12-pjrt" if none is)
# The GEMM modes compile_for takes: XLA's default (Triton GEMM fusions on) and cuBLASLt
# (Triton GEMMs off); "triton", the first name of "default", is still accepted.
GEMM_BACKENDS = ("default", "cublaslt", "triton")
_MODES = {
  "default": "XLA's default mode (Triton GEMMs on)",
  "cublaslt": "cuBLASLt mode (Triton GEMMs off: every GEMM a cuBLAS(Lt) call)",
}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU to compile for: its XLA device description and its peak rates.

  Rates are NVIDIA's dense (no sparsity) Tensor Core peaks and the memory
  bandwidth, from the product datasheets.

  Attributes:
    name: the short name (``"h100"``).
    device: the product name.
    compute_capability: e.g. ``"9.0"``.
    bf16_tflops: dense bf16 Tensor Core peak (fp16 is the same on these GPUs).
    fp8_tflops: dense fp8 peak, or ``None`` where the GPU has no fp8 Tensor Cores.
    tf32_tflops: dense TF32 peak (what an f32 GEMM runs at by default).
    memory_tbps: memory bandwidth in TB/s.

  Example:
    >>> import mpjax
    >>> h100 = mpjax.get_target("h100")
    >>> h100.compute_capability, round(h100.fp8_tflops / h100.bf16_tflops, 2)
    ('9.0', 2.0)
  """

  name: str
  device: str
  compute_capability: str
  bf16_tflops: float
  fp8_tflops: float | None
  tf32_tflops: float
  memory_tbps: float

  @property
  def fp16_tflops(self) -> float:
    return self.bf16_tflops

  @property
  def spec(self) -> str:
    """The ``GpuTargetConfigProto`` text shipped in ``mpjax/gpu_targets``."""
    return _read_spec(self.name)

  def peak_tflops(self, dtype: Any) -> float:
    """The Tensor Core peak for GEMM operands of ``dtype`` (f32 means TF32)."""
    name = np.dtype(dtype).name
    if name.startswith("float8"):
      if self.fp8_tflops is None:
        raise ValueError(f"{self.device} has no fp8 Tensor Cores.")
      return self.fp8_tflops
    if name in ("bfloat16", "float16"):
      return self.bf16_tflops
    return self.tf32_tflops


TARGETS: Mapping[str, GpuTarget] = {
  t.name: t
  for t in (
    GpuTarget("h100", "NVIDIA H100 SXM 80GB", "9.0", 989.4, 1978.9, 494.7, 3.35),
    GpuTarget("h200", "NVIDIA H200 141GB", "9.0", 989.4, 1978.9, 494.7, 4.8),
    GpuTarget("b200", "NVIDIA B200", "10.0", 2250.0, 4500.0, 1100.0, 8.0),
    GpuTarget("a100", "NVIDIA A100 SXM4 80GB", "8.0", 312.0, None, 156.0, 2.039),
    GpuTarget("l4", "NVIDIA L4 (Ada)", "8.9", 121.0, 242.0, 60.0, 0.3),
  )
}
"""The GPUs :func:`compile_for` knows, by short name."""


@functools.cache
def _read_spec(name: str) -> str:
  return importlib.resources.files("mpjax").joinpath(f"gpu_targets/{name}.txtpb").read_text()


def get_target(target: str | GpuTarget) -> GpuTarget:
  """The :class:`GpuTarget` named ``target`` (one of :data:`TARGETS`).

  Args:
    target: a short name such as ``"h100"``, or a :class:`GpuTarget`.

  Returns:
    The target.

  Raises:
    ValueError: for an unknown name; the message lists the known ones.

  Example:
    >>> import mpjax
    >>> mpjax.get_target("a100").bf16_tflops
    312.0
  """
  if isinstance(target, GpuTarget):
    return target
  key = str(target).strip().lower().replace("-", "").replace("_", "")
  if key not in TARGETS:
    raise ValueError(f"unknown GPU target {target!r}; use one of {sorted(TARGETS)}.")
  return TARGETS[key]


def _check_compiler() -> None:
  """Raises unless an XLA CUDA compiler plugin matching the installed jaxlib is there.

  The message gives the command that installs the right one, with jaxlib's version.
  """
  import jaxlib

  wanted = jaxlib.__version__
  installed = _plugin_versions()
  if wanted in installed.values():
    return
  name = next(iter(installed), _PLUGINS[0])
  others = " or ".join(n for n in _PLUGINS if n != name)
  fix = (
    f"pip install --no-deps {name}=={wanted}   (or {others}=={wanted}; --no-deps keeps "
    f"jaxlib {wanted})"
  )
  if not installed:
    raise RuntimeError(
      f"compiling for a GPU target needs XLA's CUDA compiler plugin ({' or '.join(_PLUGINS)}) "
      f"at exactly jaxlib's version, {wanted}; none is installed: {fix}"
    )
  raise RuntimeError(
    f"{name} {installed[name]} does not match jaxlib {wanted}: XLA's compiler plugin must be "
    f"the same version as jaxlib; {fix}"
  )


@functools.cache
def _mesh(name: str) -> jax.sharding.Mesh:
  from jax.experimental import topologies

  _check_compiler()
  topology = topologies.get_topology_desc(
    platform="cuda", target_config=_read_spec(name), topology="1x1x1"
  )
  return topologies.make_mesh(topology, (1,), ("x",))


def on_target(target: str | GpuTarget, tree: Any) -> Any:
  """Every array leaf of ``tree`` as a ``ShapeDtypeStruct`` placed on a GPU target's device.

  Traced with these, mpjax lowers for that GPU (see :func:`compile_for`).
  """
  return _on(_mesh(get_target(target).name), tree)


def _on(mesh: jax.sharding.Mesh, tree: Any) -> Any:
  """Every array leaf of ``tree`` as a ``ShapeDtypeStruct`` placed on ``mesh``."""
  sharding = NamedSharding(mesh, P())

  def one(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      return x
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False)
    )

  return jax.tree.map(one, tree)


def _gemm_mode(gemm_backend: str) -> str:
  """``"default"`` or ``"cublaslt"``: the mode ``gemm_backend`` names (``"triton"`` is default)."""
  if gemm_backend not in GEMM_BACKENDS:
    raise ValueError(
      f"gemm_backend={gemm_backend!r} is not one of {GEMM_BACKENDS} ('default': XLA's default "
      "mode, Triton GEMMs on; 'cublaslt': Triton GEMMs off; 'triton': same as 'default')."
    )
  return "default" if gemm_backend == "triton" else gemm_backend


def describe_gemm_backend(gemm_backend: str) -> str:
  """The GEMM mode ``gemm_backend`` names, in words, for reports.

  Example:
    >>> import mpjax.gpu
    >>> mpjax.gpu.describe_gemm_backend("default")
    "XLA's default mode (Triton GEMMs on)"
  """
  return _MODES[_gemm_mode(gemm_backend)]


def gemm_backend_options(gemm_backend: str) -> dict[str, Any]:
  """The XLA options :func:`compile_for` compiles with in the mode ``gemm_backend`` names.

  Example:
    >>> import mpjax.gpu
    >>> mpjax.gpu.gemm_backend_options("cublaslt")
    {'xla_gpu_enable_triton_gemm': False}
  """
  return {"xla_gpu_enable_triton_gemm": _gemm_mode(gemm_backend) == "default"}


def compile_for(
  fn: Callable[..., Any],
  *args: Any,
  target: str | GpuTarget = "h100",
  gemm_backend: str = "default",
  **kwargs: Any,
) -> jax.stages.Compiled:
  """Compiles ``fn(*args, **kwargs)`` for a GPU, on any machine.

  Arrays in ``args``/``kwargs`` only give shapes and dtypes (no buffer is
  read). A ``jax.jit`` function keeps its own options (``donate_argnums``,
  static arguments); a plain function is jitted as is.

  Args:
    fn: the function, e.g. a jitted train step.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    target: a :data:`TARGETS` name or a :class:`GpuTarget`.
    gemm_backend: ``"default"``, XLA's default mode, the one users run
      (Triton GEMM fusions on; compiled without a GPU nothing can autotune, so
      every GEMM is a Triton fusion with placeholder tiles, where a real GPU's
      autotuner picks tiles or a cuBLASLt call per GEMM), or ``"cublaslt"``
      (Triton GEMMs off, ``--xla_gpu_enable_triton_gemm=false``: every GEMM a
      cuBLAS(Lt) call). ``"triton"`` is accepted for ``"default"``.
    **kwargs: its keyword arguments.

  Returns:
    The compiled program: ``.as_text()`` is the optimized GPU HLO,
    ``.memory_analysis()`` its memory; it cannot run here.

  Raises:
    ValueError: for an unknown target or GEMM backend.
    RuntimeError: when the ``jax-cuda12-pjrt`` compiler plugin is missing or does
      not match jaxlib; the message gives the command that fixes it.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> x = jnp.ones((256, 512), jnp.bfloat16)
    >>> hlo = mpjax.compile_for(jnp.dot, x, x.T, target="h100").as_text()
    >>> "__triton" in hlo, "__cublas" in hlo  # XLA's default mode: a Triton GEMM fusion
    (True, False)
    >>> hlo = mpjax.compile_for(jnp.dot, x, x.T, target="h100", gemm_backend="cublaslt").as_text()
    >>> "__cublas$lt$matmul" in hlo, "__triton" in hlo
    (True, False)
  """
  target = get_target(target)
  options = gemm_backend_options(gemm_backend)
  mesh = _mesh(target.name)
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return jitted.lower(*_on(mesh, args), **_on(mesh, kwargs)).compile(options)


# --------------------------------------------------------------------------- kernels

# Instructions that launch nothing: they name, view or group buffers.
_FREE = frozenset(
  "parameter constant get-tuple-element tuple bitcast after-all partition-id replica-id "
  "opt-barrier optimization-barrier add-dependency domain".split()
)
_COPIES = frozenset({"copy", "copy-start", "copy-done", "transpose"})
_GEMM_KINDS = frozenset({"cublas_lt", "cublas_lt_f8", "cublas", "triton_gemm"})


def _bytes(type_str: str | None) -> int:
  """The bytes of every array in an HLO type (a tuple's elements summed)."""
  total = 0
  for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", type_str or ""):
    if dtype in ("token",):
      continue
    size = math.prod(int(d) for d in dims.split(",") if d)
    bits = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
    total += size * max(bits, 8) // 8
  return total


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

  @property
  def count(self) -> int:
    """Kernels per call."""
    return len(self.kernels)

  @property
  def by_kind(self) -> Counter:
    """Kernels per kind: ``gemm``, ``conv``, ``fusion``, ``copy``, ``conditional``, ``other``."""
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
  def fp8_gemms(self) -> int:
    """GEMM kernels that multiply FP8 operands (an FP8 cuBLASLt call or an f8 dot in a fusion)."""
    return sum(k.kind == "gemm" and _is_fp8_name(k.peak_dtype) for k in self.kernels)

  @property
  def bytes_moved(self) -> int:
    """Bytes read and written by all kernels (each operand once, each result once)."""
    return sum(k.bytes for k in self.kernels)

  @property
  def copy_bytes(self) -> int:
    """Bytes moved by copy and transpose kernels."""
    return sum(k.bytes for k in self.kernels if k.kind == "copy")

  @property
  def flops(self) -> float:
    """GEMM and convolution FLOPs."""
    return sum(k.flops for k in self.kernels)

  @property
  def estimated_seconds(self) -> float:
    """A roofline estimate, not a measurement: each kernel takes the longer of its
    GEMM FLOPs at the target's Tensor Core peak for the dtype it multiplies (the
    wider of its two operands: FP8 only where both are FP8, as in an
    ``__cublas$lt$matmul$f8`` call or an f8 x f8 dot in a Triton fusion) and its
    bytes at the memory bandwidth. Launch overheads and achieved (not peak)
    rates are left out, so a real step is slower."""
    total = 0.0
    for k in self.kernels:
      compute = 0.0
      if k.flops:
        fp8 = _is_fp8_name(k.peak_dtype) and self.target.fp8_tflops is None
        peak = self.target.peak_tflops("bfloat16" if fp8 else k.peak_dtype)
        compute = k.flops / (peak * 1e12)
      total += max(compute, k.bytes / (self.target.memory_tbps * 1e12))
    return total

  def to_dict(self) -> dict[str, Any]:
    return {
      "target": self.target.name,
      "gemm_backend": self.gemm_backend,
      "gemm_mode": describe_gemm_backend(self.gemm_backend),
      "kernels": self.count,
      "by_kind": dict(self.by_kind),
      "calls": dict(self.calls),
      "fp8_gemms": self.fp8_gemms,
      "standalone_converts": self.standalone_converts,
      "bytes_moved": self.bytes_moved,
      "copy_bytes": self.copy_bytes,
      "argument_bytes": self.argument_bytes,
      "temp_bytes": self.temp_bytes,
      "gemm_flops": self.flops,
      "estimated_ms": 1e3 * self.estimated_seconds,
    }


def _is_fp8_name(dtype: str | None) -> bool:
  return bool(dtype) and str(dtype).startswith("float8")


def _gemm_flops(gemms: list[CompiledGemm]) -> tuple[float, str | None]:
  """The FLOPs of a kernel's GEMMs, and the dtype they multiply: the wider operand's."""
  flops = 0.0
  dtype = None
  for g in gemms:
    if g.op == "dot" and g.dims:
      flops += 2.0 * g.dims["batch"] * g.dims["M"] * g.dims["N"] * g.dims["K"]
    elif g.op == "conv":
      # output elements x 2 x (kernel elements per output channel)
      out_channels = g.rhs_shape[-1] if g.rhs_shape else 1
      flops += 2.0 * math.prod(g.out_shape) * math.prod(g.rhs_shape) / max(out_channels, 1)
    dtype = max((g.lhs_dtype, g.rhs_dtype), key=lambda d: np.dtype(d).itemsize)
  return flops, dtype


def _kernels(
  comps: dict[str, list[_Instr]], comp: str, gemms: Mapping[str, list[CompiledGemm]]
) -> list[Kernel]:
  """The kernels that running computation ``comp`` launches, nested control flow included."""
  types = {i.name: i.type for i in comps.get(comp, ())}
  out: list[Kernel] = []
  for instr in comps.get(comp, ()):
    op = instr.opcode
    if op in _FREE or op in ("async-done", "async-update"):
      continue
    operand_bytes = sum(_bytes(t or types.get(n)) for n, t in instr.operands)
    moved = operand_bytes + _bytes(instr.type)
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
      trips = _backend_config(instr).get("known_trip_count", {}).get("n", 1)
      body = instr.attrs.get("body", "").lstrip("%")
      for _ in range(int(trips)):
        out += _kernels(comps, body, gemms)
    elif op in ("call", "async-start"):
      for called in _called(instr) or [instr.attrs.get("to_apply", "").lstrip("%")]:
        out += _kernels(comps, called, gemms)
    elif instr.name in gemms:
      flops, dtype = _gemm_flops(gemms[instr.name])
      kind = "conv" if gemms[instr.name][0].op == "conv" else "gemm"
      if op == "custom-call":  # the workspace (the result tuple's last element) is scratch
        result = _array(instr.type)
        moved = operand_bytes + (
          _bytes(f"{result[0]}[{','.join(map(str, result[1]))}]") if result else 0
        )
      out.append(Kernel(instr.name, kind, moved, flops, dtype, call=gemms[instr.name][0].kind))
    elif op == "fusion":
      fused = comps.get(next(iter(_called(instr)), ""), [])
      inner = {i.opcode for i in fused} - _FREE
      if inner <= _COPIES:
        out.append(Kernel(instr.name, "copy", moved, 0.0, None))
      else:
        out.append(Kernel(instr.name, "fusion", moved, 0.0, None, inner == {"convert"}))
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
    target: a :data:`TARGETS` name or a :class:`GpuTarget`.
    gemm_backend: ``"default"`` (XLA's default mode, Triton GEMMs on) or
      ``"cublaslt"`` (Triton GEMMs off); see :func:`compile_for`.
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
  mode = _gemm_mode(gemm_backend)
  compiled = compile_for(fn, *args, target=target, gemm_backend=mode, **kwargs)
  return report_from_hlo(compiled.as_text(), target, compiled.memory_analysis(), mode)


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
  comps = _computations(hlo_text)
  entry = re.search(r"^ENTRY\s+%?([^\s(]+)", hlo_text, re.MULTILINE)
  if entry is None:
    raise ValueError("report_from_hlo: no ENTRY computation in the HLO text.")
  gemms: dict[str, list[CompiledGemm]] = {}
  for gemm in parse_compiled_gemms(hlo_text):
    gemms.setdefault(gemm.name, []).append(gemm)
  kernels = _kernels(comps, entry.group(1), gemms)
  temp = int(getattr(memory, "temp_size_in_bytes", 0) or 0)
  arguments = int(getattr(memory, "argument_size_in_bytes", 0) or 0)
  return KernelReport(get_target(target), tuple(kernels), temp, arguments, _gemm_mode(gemm_backend))


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
  lines.append(
    f"\nCompiled for {t.device} without a GPU, in {mode}.{placeholder} The step time is a "
    "roofline estimate, not a measurement: each kernel takes the longer of its GEMM FLOPs at "
    f"the dense peak for the dtype it multiplies ({t.bf16_tflops:g} TFLOP/s bf16{fp8_peak}, "
    f"{t.tf32_tflops:g} TF32) and its bytes at {t.memory_tbps:g} TB/s; launch overheads and "
    "achieved rates are left out."
  )
  return "\n".join(lines)
