"""A matmul as a Pallas kernel, forward and backward: a custom kernel with GEMMs of its own.

The tests of what the audit and the kernel report do with custom kernels (GEMMs inside a
``pallas_call`` are no GEMM of the program XLA compiles) use it. It exists in every jax
mpjax supports, unlike jax's own Triton flash attention (gone in jax 0.12.1). One program
computes the whole product, so shapes stay small (a block per operand).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _matmul_kernel(x_ref, w_ref, o_ref):
  o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32).astype(
    o_ref.dtype
  )


def _kernel_matmul(x, w, interpret):
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
  # Triton's parameters: the kernel compiles with Pallas's Triton backend on a GPU target.
  params = plt.CompilerParams(num_warps=4, num_stages=1)
  call = pl.pallas_call(_matmul_kernel, out_shape=out, interpret=interpret, compiler_params=params)
  return call(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def pallas_matmul(x: jax.Array, w: jax.Array, interpret: bool = False) -> jax.Array:
  """``x @ w`` in a Pallas kernel; its gradients in two more (``interpret`` on a CPU)."""
  return _kernel_matmul(x, w, interpret)


def _forward(x, w, interpret):
  return _kernel_matmul(x, w, interpret), (x, w)


def _backward(interpret, residuals, g):
  x, w = residuals
  return _kernel_matmul(g, w.T, interpret), _kernel_matmul(x.T, g, interpret)


pallas_matmul.defvjp(_forward, _backward)


def loss(x: jax.Array, w: jax.Array, interpret: bool = False) -> jax.Array:
  """A projection XLA compiles, then the kernel's matmul: a scalar to differentiate.

  Squared, so the gradient needs the kernel's forward value: every jax version keeps all three
  kernels (forward, and the gradients of both operands).
  """
  h = (x @ w).astype(jnp.bfloat16)
  out = pallas_matmul(h, w.astype(jnp.bfloat16), interpret).astype(jnp.float32)
  return jnp.sum(out * out)
