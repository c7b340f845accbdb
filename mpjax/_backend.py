"""Which backend a traced program is being compiled for, read while tracing."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
from jax import lax


def lowering_platform(*trees: Any) -> str:
  """``"cpu"``, ``"gpu"`` or ``"tpu"``: the backend the arrays in ``trees`` are placed on.

  Read at trace time, from where the computation is placed, first to last:

  - an argument placed on devices of a kind in its abstract value
    (``jax.jit(f).lower`` with a ``NamedSharding``, as :func:`mpjax.compile_for`
    does for a GPU on a CPU-only machine);
  - a concrete array's devices (outside ``jit``: the devices it is committed to);
  - the default device in effect (``jax.default_device(jax.devices("cpu")[0])``,
    part of ``jit``'s cache key, so a CPU and a GPU trace are different traces);
  - JAX's default backend.

  Inside ``jit`` an argument committed to a device (``jax.device_put(x, cpu)``)
  is a tracer that does not say where it is; code whose choice must follow that
  placement too uses :func:`by_platform`, which XLA resolves when it lowers.
  """
  for leaf in jax.tree.leaves(trees):
    try:
      mesh = jax.typeof(leaf).sharding.mesh
    except (AttributeError, TypeError):
      continue
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    if platform:
      return platform_kind(str(platform))
  for leaf in jax.tree.leaves(trees):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      try:
        return platform_kind(next(iter(leaf.devices())).platform)
      except (RuntimeError, StopIteration):  # deleted (donated), or no device
        continue
  default = jax.config.jax_default_device
  if default is not None:
    return platform_kind(default if isinstance(default, str) else default.platform)
  return jax.default_backend()


def platform_kind(platform: str) -> str:
  """A platform as ``jax.default_backend()`` names it: CUDA and ROCm are ``"gpu"``."""
  platform = platform.lower()
  return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def by_platform(*args: Any, cpu: Callable[..., Any], other: Callable[..., Any]) -> Any:
  """``cpu(*args)`` in a program lowered for a CPU, ``other(*args)`` in any other.

  XLA picks the branch when it lowers the program (``jax.lax.platform_dependent``),
  so the choice follows where the computation really runs: a ``jit`` on arguments
  committed to the CPU of a GPU machine, or :func:`mpjax.compile_for` a GPU on a
  CPU-only one. Only the chosen branch is compiled. Both must return values of
  the same types; outside ``jit`` the branch of the default backend runs.
  """
  return lax.platform_dependent(*args, cpu=cpu, default=other)


_EXTENSION_PACKAGES = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jaxlib.cuda")
# XLA's CUDA compiler plugins (jax-cuda12-pjrt, jax-cuda13-pjrt), as JAX discovers them.
_CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _found(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


def _quiet_compile_only_cuda_plugin() -> None:
  """Keeps XLA's CUDA compiler plugin from logging a traceback on a machine without CUDA.

  With only ``jax-cuda12-pjrt`` or ``jax-cuda13-pjrt`` installed (for compiling
  for a GPU target without one), JAX's start-up runs the plugin's CUDA version
  check, which cannot pass without the CUDA runtime: it logs a "Jax plugin
  configuration error" traceback and the plugin is not registered, so compiling
  for a GPU fails ("topology not implemented for cuda"). That install can never
  run on a GPU, so the check is skipped (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``) and
  the plugin's "cuda_plugin_extension is not found" warning is dropped. A real
  GPU install (``jax[cuda12]`` or ``jax[cuda13]``, which bring the extension) is
  left alone, as is a user's own setting. Must run before JAX starts its
  backends (mpjax's import does).
  """
  if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ:
    return
  plugins = [m for m in _CUDA_PLUGIN_MODULES if _found(m)]
  if not plugins or any(_found(p) for p in _EXTENSION_PACKAGES):
    return
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  for module in plugins:
    logging.getLogger(module).addFilter(
      lambda record: "cuda_plugin_extension" not in record.getMessage()
    )


_quiet_compile_only_cuda_plugin()  # on import, before anything starts JAX's backends
