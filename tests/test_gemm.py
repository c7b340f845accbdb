import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpjax

CASES = {
  "dense": ((16, 32), (32, 8), (((1,), (0,)), ((), ()))),
  "rhs_transposed": ((16, 32), (8, 32), (((1,), (1,)), ((), ()))),
  "lhs_transposed": ((32, 16), (32, 8), (((0,), (0,)), ((), ()))),
  "dense_on_4d": ((2, 5, 7, 16), (16, 12), (((3,), (0,)), ((), ()))),
  "attention_scores": ((2, 4, 6, 8), (2, 4, 10, 8), (((3,), (3,)), ((0, 1), (0, 1)))),
  "attention_values": ((2, 4, 6, 10), (2, 4, 10, 8), (((3,), (2,)), ((0, 1), (0, 1)))),
  "scattered_batch": ((6, 2, 4, 8), (2, 10, 4, 8), (((3,), (3,)), ((1, 2), (0, 2)))),
  "two_contracting": ((3, 5, 7), (7, 3, 2), (((2, 0), (0, 1)), ((), ()))),
}


def _dots(jaxpr):
  """(operand dtypes, accumulation dtype) of every dot_general, nested jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      accumulation = eqn.params["preferred_element_type"] or eqn.outvars[0].aval.dtype
      found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(accumulation)))
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        found += _dots(inner)
  return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_both_backward_gemms_are_bf16_with_f32_accumulation(case):
  lhs_shape, rhs_shape, dims = CASES[case]
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  lhs, rhs = jax.random.normal(k1, lhs_shape), jax.random.normal(k2, rhs_shape)
  dot = mpjax.mixed_dot_general(jnp.bfloat16)
  reference = lax.dot_general(lhs, rhs, dims, precision="highest")
  cotangent = jax.random.normal(k3, reference.shape)

  def loss(dot_general, lhs, rhs, **kw):
    return jnp.sum(dot_general(lhs, rhs, dims, **kw).astype(jnp.float32) * cotangent)

  out = jax.jit(lambda a, b: dot(a, b, dims))(lhs, rhs)
  chex.assert_shape(out, reference.shape)
  chex.assert_type(out, jnp.bfloat16)
  grads = jax.jit(jax.grad(lambda a, b: loss(dot, a, b), (0, 1)))(lhs, rhs)
  ref_grads = jax.grad(lambda a, b: loss(lax.dot_general, a, b, precision="highest"), (0, 1))(
    lhs, rhs
  )
  chex.assert_type(grads, jnp.float32)  # gradients w.r.t. f32 inputs are f32
  for got, want in [(out.astype(jnp.float32), reference), *zip(grads, ref_grads, strict=True)]:
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2
  dots = _dots(jax.make_jaxpr(jax.grad(lambda a, b: loss(dot, a, b), (0, 1)))(lhs, rhs).jaxpr)
  assert len(dots) == 3
  assert set(dots) == {(("bfloat16", "bfloat16"), "float32")}


def _compiled_dot_operands(fn, *args):
  """The operand dtypes of every dot in the program XLA compiles ``fn`` to, fused ones included."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  found = []
  for computation in text.split("\n\n"):
    dtypes = dict(re.findall(r"%([\w.-]+) = (\w+)\[", computation))
    found += [
      (dtypes[a], dtypes[b]) for a, b in re.findall(r" dot\(%([\w.-]+), %([\w.-]+)\)", computation)
    ]
  return found


@pytest.mark.parametrize("case", ["dense", "attention_values"])
@pytest.mark.parametrize("transposed_output", [False, True])
def test_compiled_gradient_gemms_keep_bf16_operands(case, transposed_output):
  # XLA:CPU silently runs a bf16 dot whose operand is stored transposed as an f32
  # dot: the weight gradient's transposed activation, or a cotangent that comes
  # back through a transpose and reshape of the GEMM's output (as attention's does).
  lhs_shape, rhs_shape, dims = CASES[case]
  lhs, rhs = jax.random.normal(jax.random.key(0), lhs_shape), jnp.ones(rhs_shape)
  dot = mpjax.mixed_dot_general(jnp.bfloat16)

  def loss(lhs, rhs):
    out = dot(lhs, rhs, dims)
    out = jnp.swapaxes(out, 0, 1).reshape(-1) if transposed_output else out
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  operands = _compiled_dot_operands(jax.grad(loss, (0, 1)), lhs, rhs)
  assert len(operands) == 3  # the forward GEMM (sin needs its output) and its two gradients
  assert set(operands) == {("bf16", "bf16")}


def test_flax_dense_keeps_f32_weights_and_gets_f32_gradients():
  layer = nn.Dense(8, dtype=jnp.bfloat16, dot_general=mpjax.mixed_dot_general())
  x = jax.random.normal(jax.random.key(0), (4, 16))
  params = layer.init(jax.random.key(1), x)
  ref = nn.Dense(8)

  def loss(module, params):
    return jnp.mean(module.apply(params, x).astype(jnp.float32) ** 2)

  grads = jax.jit(jax.grad(lambda p: loss(layer, p)))(params)
  ref_grads = jax.grad(lambda p: loss(ref, p))(params)
  chex.assert_type(jax.tree.leaves(grads), jnp.float32)
  chex.assert_trees_all_close(grads, ref_grads, rtol=3e-2, atol=3e-3)


def test_explicit_choices_fall_back_to_lax():
  dot = mpjax.mixed_dot_general()
  a, b = jnp.ones((4, 8)), jnp.ones((8, 2))
  dims = (((1,), (0,)), ((), ()))
  assert dot(a, b, dims, precision=lax.Precision.HIGHEST).dtype == jnp.float32
  half = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  assert dot(*half, dims, preferred_element_type=jnp.float32).dtype == jnp.float32
  assert dot(*half, dims, preferred_element_type=jnp.float32, out_sharding=None).dtype == (
    jnp.float32
  )
  jaxpr = jax.make_jaxpr(lambda a, b: dot(a, b, dims, precision=lax.Precision.HIGHEST))(a, b)
  assert _dots(jaxpr.jaxpr) == [(("float32", "float32"), "float32")]
  np.testing.assert_array_equal(dot(a, b, dims), np.full((4, 2), 8.0))


@pytest.mark.parametrize(
  "kwargs",
  [
    {"out_sharding": None},  # what NNX's Linear passes
    {"preferred_element_type": jnp.float32},  # the operands' own dtype, as jnp.einsum passes it
    {"preferred_element_type": jnp.float32, "out_sharding": None},
  ],
)
def test_restated_defaults_keep_f32_accumulation_under_jit(kwargs):
  lhs_shape, rhs_shape, dims = CASES["dense"]
  lhs, rhs = jax.random.normal(jax.random.key(0), lhs_shape), jnp.ones(rhs_shape)
  dot = mpjax.mixed_dot_general(jnp.bfloat16)

  def loss(lhs, rhs):
    return jnp.sum(dot(lhs, rhs, dims, **kwargs).astype(jnp.float32))

  out = jax.jit(lambda a, b: dot(a, b, dims, **kwargs))(lhs, rhs)
  # the result comes in the dtype asked for, from the same bf16 GEMM
  chex.assert_type(out, kwargs.get("preferred_element_type", jnp.bfloat16))
  plain = jax.jit(lambda a, b: dot(a, b, dims))(lhs, rhs)
  np.testing.assert_array_equal(out, plain.astype(out.dtype))
  grads = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
  chex.assert_type(grads, jnp.float32)
  dots = _dots(jax.make_jaxpr(jax.jit(jax.grad(loss, (0, 1))))(lhs, rhs).jaxpr)
  assert len(dots) == 3
  assert set(dots) == {(("bfloat16", "bfloat16"), "float32")}


def test_einsum_through_mixed_dot_general_accumulates_in_f32():
  # jnp.einsum passes preferred_element_type (the operands' result dtype) explicitly.
  dot = mpjax.mixed_dot_general(jnp.bfloat16)
  q, k = jax.random.normal(jax.random.key(0), (2, 6, 4, 8)), jnp.ones((2, 10, 4, 8))

  def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, _dot_general=dot)

  out = jax.jit(scores)(q, k)
  chex.assert_type(out, jnp.float32)  # einsum's own result dtype, from a bf16 GEMM
  np.testing.assert_allclose(out, jnp.einsum("bqhd,bkhd->bhqk", q, k), rtol=1e-2, atol=1e-1)
  assert _dots(jax.make_jaxpr(jax.jit(scores))(q, k).jaxpr) == [
    (("bfloat16", "bfloat16"), "float32")
  ]


def test_bad_compute_dtype():
  with pytest.raises(ValueError, match="not a floating dtype"):
    mpjax.mixed_dot_general(jnp.int8)


@pytest.mark.parametrize("half, rounded", [(jnp.bfloat16, True), (jnp.float16, False)])
def test_on_a_gpu_a_bf16_weight_gradient_is_written_in_bf16_and_an_fp16_one_in_f32(
  half, rounded, monkeypatch
):
  kx, kw = jax.random.split(jax.random.key(0))
  x, w = jax.random.normal(kx, (64, 96)), jax.random.normal(kw, (96, 48))

  def loss(w, x):
    y = mpjax.mixed_dot_general(half)(x, w, (((1,), (0,)), ((), ())))
    return jnp.sum(y.astype(jnp.float32) ** 2)

  cpu = jax.jit(jax.grad(loss))(w, x)
  # The program XLA:GPU gets, run here (XLA:CPU widens a bf16 x bf16 -> bf16 dot).
  monkeypatch.setattr("mpjax.gemm.lowering_platform", lambda *trees: "gpu")
  gpu = jax.jit(jax.grad(loss))(w, x)
  assert cpu.dtype == gpu.dtype == jnp.float32  # the f32 master's gradient
  as_half = np.asarray(gpu.astype(half).astype(jnp.float32))
  assert not np.array_equal(np.asarray(cpu.astype(half).astype(jnp.float32)), np.asarray(cpu))
  assert np.array_equal(as_half, np.asarray(gpu)) == rounded
  np.testing.assert_allclose(gpu, cpu, rtol=2**-8 if rounded else 1e-5, atol=1e-4)
