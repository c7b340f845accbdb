"""Which backend a traced program is being compiled for, read while tracing."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import jax


def lowering_platform(*trees: Any) -> str:
  """``"cpu"``, ``"gpu"`` or ``"tpu"``: the backend the arrays in ``trees`` are traced for.

  An argument placed on devices of a kind (``jax.jit(f).lower`` with a
  ``NamedSharding``, as :func:`mpjax.compile_for` does for a GPU on a CPU-only
  machine) carries its platform in its abstract value; otherwise it is JAX's
  default backend. Read at trace time, so a program compiled for a GPU and one
  for the CPU are different traces (their arguments' shardings differ).
  """
  for leaf in jax.tree.leaves(trees):
    try:
      mesh = jax.typeof(leaf).sharding.mesh
    except (AttributeError, TypeError):
      continue
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    if platform:
      return str(platform)
  return jax.default_backend()


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
