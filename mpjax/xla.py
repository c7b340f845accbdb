"""XLA settings for the fast path, and sizes that GEMMs like."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mpjax.jax_compat import backends_are_initialized

__all__ = ["configure_xla", "pad_to_multiple"]


def _backend_started() -> bool:
  return backends_are_initialized()


def configure_xla(
  *, cublaslt: bool = True, triton_gemm: bool | None = None, extra_flags: Sequence[str] = ()
) -> str:
  """Sets the XLA flags that route GEMMs to cuBLASLt on NVIDIA GPUs.

  Flags are merged into ``XLA_FLAGS``: a flag set here replaces the same flag
  already there, and every other flag is kept. XLA reads them once, when JAX
  starts its backend, so call this at the top of the program, before the first
  array, ``jax.devices()`` or ``jit``. The flags are harmless on CPU and TPU.

  Args:
    cublaslt: set ``--xla_gpu_enable_cublaslt`` (GEMMs as ``__cublas$lt$matmul``
      calls, which fuse bias and activation epilogues).
    triton_gemm: if not ``None``, set ``--xla_gpu_enable_triton_gemm``;
      ``False`` pins every GEMM to cuBLAS(Lt) instead of autotuned Triton fusions.
    extra_flags: further flags, each ``"--name=value"``.

  Returns:
    The new value of ``XLA_FLAGS``.

  Raises:
    RuntimeError: if JAX's backend has already started, when the flags could
      no longer take effect.
    ValueError: if an extra flag is not of the form ``--name=value``.

  Example:
    >>> import mpjax
    >>> mpjax.configure_xla()  # doctest: +SKIP
    '--xla_gpu_enable_cublaslt=true'
  """
  for flag in extra_flags:
    if not (flag.startswith("--") and "=" in flag):
      raise ValueError(f"configure_xla: extra flag {flag!r} must look like '--name=value'.")
  if _backend_started():
    raise RuntimeError(
      "configure_xla: JAX's backend has already started, so XLA would ignore new flags. "
      "Call mpjax.configure_xla() at the top of the program, before any array, "
      "jax.devices() or jit, or set XLA_FLAGS in the environment before Python starts."
    )
  wanted = {"--xla_gpu_enable_cublaslt": str(bool(cublaslt)).lower()}
  if triton_gemm is not None:
    wanted["--xla_gpu_enable_triton_gemm"] = str(bool(triton_gemm)).lower()
  for flag in extra_flags:
    name, _, value = flag.partition("=")
    wanted[name] = value
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.partition("=")[0] not in wanted]
  flags = " ".join([*kept, *(f"{name}={value}" for name, value in wanted.items())])
  os.environ["XLA_FLAGS"] = flags
  return flags


def pad_to_multiple(size: int, multiple: int = 8) -> int:
  """The smallest multiple of ``multiple`` that is >= ``size``.

  Tensor Cores want f16/bf16 GEMM dimensions in multiples of 8 (fp8: 16); XLA
  pads others with copies. Pad a vocabulary or hidden size once, at model
  definition, instead.

  Args:
    size: a dimension, >= 1.
    multiple: the alignment, >= 1 (8 for f16/bf16, 16 for fp8).

  Returns:
    The padded size.

  Example:
    >>> import mpjax
    >>> mpjax.pad_to_multiple(50257), mpjax.pad_to_multiple(50257, 16)
    (50264, 50272)
  """
  for name, value in (("size", size), ("multiple", multiple)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"pad_to_multiple: {name}={value!r} must be an integer >= 1.")
  return -(-size // multiple) * multiple
