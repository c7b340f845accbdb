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


def _quiet_compile_only_cuda_plugin() -> None:
  """Keeps XLA's CUDA compiler plugin from logging a traceback on a machine without CUDA.

  With only ``jax-cuda12-pjrt`` installed (the ``gpu-aot`` extra, for compiling
  for a GPU target without one) JAX's start-up runs the plugin's CUDA version
  check, which cannot pass without the CUDA runtime and logs a "Jax plugin
  configuration error" traceback. That install can never run on a GPU, so the
  check is skipped (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``) and the plugin's
  "cuda_plugin_extension is not found" warning is dropped. A real GPU install
  (``jax[cuda12]``, which brings the extension) is left alone, as is a user's
  own setting. Must run before JAX starts its backends (mpjax's import does).
  """
  if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ:
    return
  try:
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
      return
    if any(importlib.util.find_spec(p) is not None for p in _EXTENSION_PACKAGES):
      return
  except (ImportError, ValueError):
    return
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  logging.getLogger("jax_plugins.xla_cuda12").addFilter(
    lambda record: "cuda_plugin_extension" not in record.getMessage()
  )


_quiet_compile_only_cuda_plugin()  # on import, before anything starts JAX's backends
