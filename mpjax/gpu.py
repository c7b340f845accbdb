"""GPU targets, and the GPU program compiled without a GPU.

XLA compiles for an NVIDIA GPU on a machine that has none: given a device
description (a ``GpuTargetConfigProto``) and XLA's CUDA compiler plugin
(``jax-cuda12-pjrt`` or ``jax-cuda13-pjrt``, of jaxlib's very version),
``jax.jit(fn).lower(...)`` yields the optimized program XLA:GPU would run.
mpjax ships descriptions of the GPUs people train on (:data:`TARGETS`) and
compiles any jitted function for one (:func:`compile_for`). What XLA made of it
is read by :mod:`mpjax.kernels` (:func:`mpjax.kernel_report`: kernels, bytes,
a roofline estimate) and :mod:`mpjax.audit` (each GEMM's call).

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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax.jax_compat import lowering_for

__all__ = [
  "GEMM_BACKENDS",
  "GpuTarget",
  "TARGETS",
  "compile_for",
  "describe_gemm_backend",
  "gemm_backend_options",
  "gemm_mode",
  "get_target",
  "installed_plugins",
  "on_target",
]

# XLA's CUDA compiler plugins: either one, at exactly jaxlib's version, compiles for every GPU
# target (jax[cuda12] or jax[cuda13] on a GPU machine brings one). Both are published at each
# jaxlib version mpjax supports; the first is what the README installs.
_PLUGINS = ("jax-cuda12-pjrt", "jax-cuda13-pjrt")

# What jax raises when it traces cuDNN's fused attention with no GPU (jax 0.10.2 to 0.12).
_NO_CUDNN = "cuDNN is not detected."


def installed_plugins() -> dict[str, str]:
  """The installed XLA CUDA compiler plugins (``jax-cuda12-pjrt``...) and their versions.

  Example:
    >>> import mpjax.gpu
    >>> set(mpjax.gpu.installed_plugins()) <= {"jax-cuda12-pjrt", "jax-cuda13-pjrt"}
    True
  """
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

  installed = installed_plugins()
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
  installed = installed_plugins()
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


def gemm_mode(gemm_backend: str) -> str:
  """``"default"`` or ``"cublaslt"``: the mode ``gemm_backend`` names (``"triton"`` is default).

  Raises:
    ValueError: for a name not in :data:`GEMM_BACKENDS`.
  """
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
  return _MODES[gemm_mode(gemm_backend)]


def gemm_backend_options(gemm_backend: str) -> dict[str, Any]:
  """The XLA options :func:`compile_for` compiles with in the mode ``gemm_backend`` names.

  Example:
    >>> import mpjax.gpu
    >>> mpjax.gpu.gemm_backend_options("cublaslt")
    {'xla_gpu_enable_triton_gemm': False}
  """
  return {"xla_gpu_enable_triton_gemm": gemm_mode(gemm_backend) == "default"}


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
  static arguments); a plain function is jitted as is. Pallas kernels (Triton
  backend) compile too: from jax 0.11 for the target's own GPU, while jax
  0.10.2 lowers them for compute capability 9.0 whatever the target.

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
    RuntimeError: when the compiler plugin (``jax-cuda12-pjrt`` or ``jax-cuda13-pjrt``) is
      missing or does not match jaxlib; the message gives the command that fixes it. Also
      when ``fn`` calls cuDNN's fused attention, which jax traces only with a GPU; the
      message names what compiles instead.

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
  with lowering_for(mesh):
    try:
      lowered = jitted.lower(*_on(mesh, args), **_on(mesh, kwargs))
    except RuntimeError as e:
      if str(e) != _NO_CUDNN:
        raise
      raise RuntimeError(
        f"compile_for({target.name!r}): the function calls cuDNN's fused attention "
        "(jax.nn.dot_product_attention(..., implementation='cudnn')), which jax traces only with "
        f"a GPU attached (it raised {_NO_CUDNN!r}). To compile it here, use "
        "implementation='xla' or None (jax's default, XLA's attention on a GPU too) or a Pallas "
        "kernel (jax.experimental.pallas.ops.gpu.attention.mha compiles for the target); or "
        "compile on the GPU."
      ) from e
  return lowered.compile(options)
