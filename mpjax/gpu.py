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
import math
import re
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
  "published_plugins",
  "on_target",
  "target_mesh",
]

# XLA's CUDA compiler plugins: either one, at exactly jaxlib's version, compiles for every GPU
# target (jax[cuda12] or jax[cuda13] on a GPU machine brings one). The first is published at
# every jaxlib mpjax supports (0.7.2 to 0.12.1 and on) and is what the README installs; the
# second stops at jaxlib 0.12.0.1.
_PLUGINS = ("jax-cuda13-pjrt", "jax-cuda12-pjrt")

# What jax raises when it traces cuDNN's fused attention with no GPU (jax 0.10.2 to 0.12).
_NO_CUDNN = "cuDNN is not detected."

# PCIe Gen4 x16, GB/s one direction: how GPUs without NVLink (L4) reach each other in a node.
_PCIE_GEN4_GBPS = 32.0


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


PLUGIN = _installed_plugin()  # the compiler plugin installed ("jax-cuda13-pjrt" if none is)
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
    fp8_tflops: dense fp8 peak, or ``None`` where the GPU has no fp8 Tensor Cores
      (MXFP8 runs at it on Blackwell).
    fp4_tflops: dense FP4 (NVFP4) peak, or ``None`` where the GPU has no FP4 Tensor Cores.
    tf32_tflops: dense TF32 peak (what an f32 GEMM runs at by default).
    memory_tbps: memory bandwidth in TB/s.
    nvlink_gbps: NVLink bandwidth per GPU in GB/s, one direction (half the
      datasheet's both-directions figure: H100/H200 NVLink 4 900 -> 450, B200
      NVLink 5 1800 -> 900, A100 NVLink 3 600 -> 300), or ``None`` where GPUs
      talk over PCIe (L4): see :attr:`node_link_gbps`.
    network_gbps: bandwidth between nodes per GPU in GB/s, one direction,
      assuming one NIC per GPU as in NVIDIA's HGX/DGX reference designs:
      400 Gb/s (NDR InfiniBand or 400G Ethernet) = 50 GB/s for H100, H200
      and A100 nodes, 800 Gb/s = 100 GB/s for B200; 200 Gb/s = 25 GB/s
      assumed for an L4 server.
    max_gpus_per_node: the most GPUs one node holds (8 on an HGX board).

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
  nvlink_gbps: float | None = None
  network_gbps: float = 50.0
  max_gpus_per_node: int = 8
  fp4_tflops: float | None = None

  @property
  def node_link_gbps(self) -> float:
    """GB/s per GPU, one direction, to a GPU of the same node: NVLink, else PCIe Gen4 x16."""
    return self.nvlink_gbps if self.nvlink_gbps is not None else _PCIE_GEN4_GBPS

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
    if name.startswith("float4"):
      if self.fp4_tflops is None:
        raise ValueError(f"{self.device} has no FP4 Tensor Cores.")
      return self.fp4_tflops
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
    GpuTarget("h100", "NVIDIA H100 SXM 80GB", "9.0", 989.4, 1978.9, 494.7, 3.35, 450.0, 50.0),
    GpuTarget("h200", "NVIDIA H200 141GB", "9.0", 989.4, 1978.9, 494.7, 4.8, 450.0, 50.0),
    GpuTarget("b200", "NVIDIA B200", "10.0", 2250.0, 4500.0, 1100.0, 8.0, 900.0, 100.0, 8, 9000.0),
    GpuTarget("a100", "NVIDIA A100 SXM4 80GB", "8.0", 312.0, None, 156.0, 2.039, 300.0, 50.0),
    GpuTarget("l4", "NVIDIA L4 (Ada)", "8.9", 121.0, 242.0, 60.0, 0.3, None, 25.0),
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


# The last jaxlib at which jax-cuda12-pjrt is published (jax 0.12.1 ships CUDA 13 only).
_LAST_CUDA12_JAXLIB = (0, 12, 0, 1)


def published_plugins(jaxlib_version: str) -> tuple[str, ...]:
  """The XLA CUDA compiler plugins published on PyPI at ``jaxlib_version``.

  ``jax-cuda13-pjrt`` is published at every jaxlib from 0.7.2 on;
  ``jax-cuda12-pjrt`` stops at 0.12.0.1.

  Example:
    >>> import mpjax.gpu
    >>> mpjax.gpu.published_plugins("0.12.1"), mpjax.gpu.published_plugins("0.10.2")
    (('jax-cuda13-pjrt',), ('jax-cuda13-pjrt', 'jax-cuda12-pjrt'))
  """
  version = tuple(int(p) for p in re.findall(r"\d+", jaxlib_version))
  return tuple(n for n in _PLUGINS if n != "jax-cuda12-pjrt" or version <= _LAST_CUDA12_JAXLIB)


# What XLA (jaxlib >= 0.12) says when it cannot compile a cuDNN call without a GPU.
_NO_DEVICELESS_CUDNN = "deviceless cuDNN compilation is not enabled"


def _check_compiler() -> None:
  """Raises unless an XLA CUDA compiler plugin matching the installed jaxlib is there.

  The message gives the command that installs the right one, with jaxlib's version, naming only
  a plugin published at that version.
  """
  import jaxlib

  wanted = jaxlib.__version__
  installed = installed_plugins()
  if wanted in installed.values():
    return
  published = published_plugins(wanted)
  name = next((n for n in installed if n in published), published[0])
  others = " or ".join(f"{n}=={wanted}" for n in published if n != name)
  fix = f"pip install --no-deps {name}=={wanted}   (" + (f"or {others}; " if others else "")
  fix += f"--no-deps keeps jaxlib {wanted})"
  if not installed:
    raise RuntimeError(
      f"compiling for a GPU target needs XLA's CUDA compiler plugin ({' or '.join(published)}) "
      f"at exactly jaxlib's version, {wanted}; none is installed: {fix}"
    )
  have = ", ".join(f"{n} {v}" for n, v in installed.items())
  raise RuntimeError(
    f"{have} does not match jaxlib {wanted}: XLA's compiler plugin must be the same version as "
    f"jaxlib; {fix}"
  )


@functools.cache
def _mesh(name: str) -> jax.sharding.Mesh:
  from jax.experimental import topologies

  _check_compiler()
  topology = topologies.get_topology_desc(
    platform="cuda", target_config=_read_spec(name), topology="1x1x1"
  )
  return topologies.make_mesh(topology, (1,), ("x",))


def target_mesh(
  target: str | GpuTarget, axes: Mapping[str, int], nodes: int = 1
) -> jax.sharding.Mesh:
  """A ``Mesh`` of a GPU target's devices, for compiling a multi-GPU program without GPUs.

  The devices are ``nodes`` nodes of ``prod(axes.values()) // nodes`` GPUs
  (XLA's topology ``"1x{nodes}x{gpus_per_node}"``), numbered node by node:
  device ``i`` sits in node ``i // gpus_per_node`` (its ``process_index``).
  They fill the mesh in order, so the axes listed first span the nodes and the
  last ones stay within a node: list ``axes`` from outer (across nodes) to
  inner (within a node), e.g. ``{"data": 2, "fsdp": 8}`` for 2 nodes of 8.
  Place arguments on it with ``jax.ShapeDtypeStruct(shape, dtype,
  sharding=NamedSharding(mesh, spec))`` and :func:`compile_for` keeps those
  shardings; :func:`mpjax.collective_report` reads the collectives.

  Args:
    target: a :data:`TARGETS` name or a :class:`GpuTarget`.
    axes: mesh axis name -> size, outer to inner.
    nodes: how many nodes the devices span.

  Returns:
    The mesh (cached: the same arguments give the same mesh).

  Raises:
    ValueError: for an unknown target, an axis size below 1, a device count that
      ``nodes`` does not divide, or more GPUs per node than the target's nodes hold.
    RuntimeError: when the compiler plugin is missing or does not match jaxlib.

  Example:
    >>> import mpjax
    >>> mesh = mpjax.target_mesh("h100", {"data": 2, "fsdp": 8}, nodes=2)
    >>> dict(mesh.shape), mesh.devices[1, 0].id, mesh.devices[1, 0].process_index
    ({'data': 2, 'fsdp': 8}, 8, 1)
  """
  target = get_target(target)
  sizes = {str(k): v for k, v in dict(axes).items()}
  if not sizes or not all(_is_count(n) for n in sizes.values()):
    raise ValueError(f"target_mesh: axes must map names to integer sizes >= 1, got {dict(axes)}.")
  if not _is_count(nodes):
    raise ValueError(f"target_mesh: nodes must be an integer >= 1, got {nodes!r}.")
  sizes, nodes = {k: int(n) for k, n in sizes.items()}, int(nodes)
  total = math.prod(sizes.values())
  if total % nodes:
    raise ValueError(
      f"target_mesh: axes {sizes} hold {total} devices, which {nodes} nodes cannot share "
      f"equally; make the product of the axis sizes a multiple of nodes={nodes}."
    )
  per_node = total // nodes
  if per_node > target.max_gpus_per_node:
    fewest = -(-total // target.max_gpus_per_node)
    raise ValueError(
      f"target_mesh: {total} devices on {nodes} node(s) is {per_node} GPUs per node, but a "
      f"{target.device} node holds at most {target.max_gpus_per_node}; pass nodes={fewest} "
      "or more (dividing the device count), or shrink the axes."
    )
  return _target_mesh(target.name, tuple(sizes.items()), nodes)


def _is_count(n: Any) -> bool:
  return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1


@functools.cache
def _target_mesh(name: str, axes: tuple[tuple[str, int], ...], nodes: int) -> jax.sharding.Mesh:
  from jax.experimental import topologies

  per_node = math.prod(n for _, n in axes) // nodes
  _check_compiler()
  topology = topologies.get_topology_desc(
    platform="cuda", target_config=_read_spec(name), topology=f"1x{nodes}x{per_node}"
  )
  names = tuple(k for k, _ in axes)
  return topologies.make_mesh(topology, tuple(n for _, n in axes), names)


def on_target(target: str | GpuTarget, tree: Any) -> Any:
  """Every array leaf of ``tree`` as a ``ShapeDtypeStruct`` placed on a GPU target's device.

  Traced with these, mpjax lowers for that GPU (see :func:`compile_for`). Leaves already placed
  on a :func:`target_mesh` keep their sharding; the others go replicated on the same mesh.
  """
  target = get_target(target)
  return _on(_args_mesh(target, tree) or _mesh(target.name), tree, keep=True)


def _on(mesh: jax.sharding.Mesh, tree: Any, keep: bool = False) -> Any:
  """Every array leaf of ``tree`` as a ``ShapeDtypeStruct`` placed on ``mesh``: replicated, or
  with ``keep``, as its own sharding where that is a ``NamedSharding`` over ``mesh``."""
  replicated = NamedSharding(mesh, P())

  def one(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      return x
    own = getattr(x, "sharding", None)
    sharding = own if keep and _placed_mesh(x) == mesh else replicated
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False)
    )

  return jax.tree.map(one, tree)


def _placed_mesh(x: Any) -> jax.sharding.Mesh | None:
  """The mesh of GPU devices a leaf is placed on (a ``NamedSharding``, e.g. over a
  :func:`target_mesh`), else ``None``."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
    return None
  return sharding.mesh if sharding.mesh.devices.flat[0].platform == "gpu" else None


def _args_mesh(target: GpuTarget, tree: Any) -> jax.sharding.Mesh | None:
  """The one GPU mesh that leaves of ``tree`` are placed on, if any.

  Raises:
    ValueError: for leaves on two different meshes, or on a mesh of another GPU than ``target``.
  """
  meshes = {m for m in map(_placed_mesh, jax.tree.leaves(tree)) if m is not None}
  if len(meshes) > 1:
    raise ValueError(
      f"compile_for: the arguments are placed on {len(meshes)} different meshes "
      f"({', '.join(str(dict(m.shape)) for m in meshes)}); place them all on one target_mesh."
    )
  if not meshes:
    return None
  mesh = meshes.pop()
  kind, want = mesh.devices.flat[0].device_kind, _mesh(target.name).devices.flat[0].device_kind
  if kind != want:
    raise ValueError(
      f"compile_for: the arguments are placed on {kind} devices but target={target.name!r} "
      f"is {want}; pass the target the mesh was made for, or build the mesh with "
      f"target_mesh({target.name!r}, ...)."
    )
  return mesh


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
  read), and are placed on one GPU of the target. To compile a multi-GPU
  program, place them on a :func:`target_mesh` instead (``jax.ShapeDtypeStruct``
  s with a ``NamedSharding`` over it): those keep their shardings, and every
  other array leaf is replicated (``P()``) over that mesh. A ``jax.jit``
  function keeps its own options (``donate_argnums``, static arguments); a
  plain function is jitted as is. Pallas kernels (Triton
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
    ValueError: for an unknown target or GEMM backend, or arguments placed on
      two meshes or on a mesh of another GPU than ``target``.
    RuntimeError: when the compiler plugin (``jax-cuda12-pjrt`` or ``jax-cuda13-pjrt``) is
      missing or does not match jaxlib; the message gives the command that fixes it. Also
      when ``fn`` calls cuDNN's fused attention, which jax traces only with a GPU; the
      message names what compiles instead. Also when XLA cannot compile a cuDNN
      block-scaled GEMM without a GPU (jaxlib >= 0.12 without cuDNN and a driver here).

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
  placed = _args_mesh(target, (args, kwargs))
  mesh = placed if placed is not None else _mesh(target.name)
  keep = placed is not None
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  with lowering_for(mesh):
    try:
      lowered = jitted.lower(*_on(mesh, args, keep), **_on(mesh, kwargs, keep))
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
  try:
    return lowered.compile(options)
  except jax.errors.JaxRuntimeError as e:
    if _NO_DEVICELESS_CUDNN not in str(e):
      raise
    raise RuntimeError(
      f"compile_for({target.name!r}): the program has a cuDNN block-scaled GEMM "
      f"(__cudnn$blockScaledDot: jax.nn.scaled_matmul, mpjax's mixed_mxfp8 and mixed_nvfp4), and "
      f"jaxlib {jax.__version__}'s XLA compiles cuDNN calls without a GPU only through cuDNN's "
      "deviceless mode, which needs cuDNN >= 9.15 and the CUDA driver library (libcuda.so.1) "
      "on this machine; XLA said: "
      f"{str(e).splitlines()[0]}. Compile it with jax 0.10.2 (whose XLA needs no cuDNN for it), "
      "or on a machine with an NVIDIA driver; or compile for 'h100', where the GEMM is a bf16 "
      "one (emulated)."
    ) from e
