import os
import subprocess
import sys

import jax
import pytest

import mpjax


def test_configure_xla_before_the_backend_starts():
  script = (
    "import os, jax, mpjax\n"
    "flags = mpjax.configure_xla(triton_gemm=False, extra_flags=['--xla_gpu_autotune_level=0'])\n"
    "assert os.environ['XLA_FLAGS'] == flags, flags\n"
    "jax.devices()\n"  # XLA accepts the flags on this backend
    "print(flags)\n"
  )
  env = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_gpu_enable_cublaslt=false",
    "JAX_PLATFORMS": "cpu",
  }
  out = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-4000:]
  flags = out.stdout.split()
  assert flags == [
    "--xla_force_host_platform_device_count=2",  # kept
    "--xla_gpu_enable_cublaslt=true",  # replaced, not duplicated
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_autotune_level=0",
  ]


def test_configure_xla_after_the_backend_started_says_so():
  jax.devices()
  before = os.environ.get("XLA_FLAGS")
  with pytest.raises(RuntimeError, match="already started.*top of the program"):
    mpjax.configure_xla()
  assert os.environ.get("XLA_FLAGS") == before


def test_configure_xla_rejects_malformed_flags():
  with pytest.raises(ValueError, match="--name=value"):
    mpjax.configure_xla(extra_flags=["xla_gpu_enable_cublaslt"])


def test_pad_to_multiple():
  assert [mpjax.pad_to_multiple(n) for n in (1, 8, 9, 50257)] == [8, 8, 16, 50264]
  assert mpjax.pad_to_multiple(50257, 16) == 50272
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match="integer >= 1"):
      mpjax.pad_to_multiple(bad)
