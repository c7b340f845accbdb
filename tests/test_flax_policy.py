import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from mpjax.flax_policy import linen_kwargs, nnx_apply_policy

GEMMS = ("dot_general", "conv_general_dilated")


def _gemms(jaxpr):
  """(primitive, operand dtypes, accumulation dtype) of every GEMM and conv, nested included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in GEMMS:
      accumulation = eqn.params["preferred_element_type"] or eqn.outvars[0].aval.dtype
      operands = tuple(str(v.aval.dtype) for v in eqn.invars)
      found.append((eqn.primitive.name, operands, str(np.dtype(accumulation))))
    for param in eqn.params.values():
      for inner in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          found += _gemms(inner)
  return found


def _assert_close(got, want, rel):
  """Each leaf within ``rel`` of the reference in relative norm: ||got - want|| <= rel ||want||.

  At initialisation, with random labels, the batch-mean gradient is a sum that largely
  cancels, so bf16 rounding (~0.4% per layer) shows up amplified: the nets below land
  0.5-3% from f32, as autocast does. The nets use GELU: a ReLU whose input bf16 rounds
  across zero flips, and those flips alone put some gradients 5-10% off.
  """
  errors = jax.tree.map(
    lambda g, w: float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w)), got, want
  )
  chex.assert_trees_all_close(errors, jax.tree.map(lambda _: 0.0, errors), atol=rel, rtol=0)


class LinenNet(nn.Module):
  policy: str

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3), use_bias=False, **linen_kwargs(self.policy, layer="conv"))(x)
    x = nn.BatchNorm(use_running_average=not train, **linen_kwargs(self.policy, layer="norm"))(x)
    x = nn.gelu(x).reshape(x.shape[0], -1)
    x = nn.gelu(nn.Dense(16, **linen_kwargs(self.policy))(x))
    return nn.Dense(4, **linen_kwargs(self.policy))(x)


def _linen_setup():
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (8, 6, 6, 3))
  y = jax.random.randint(ky, (8,), 0, 4)
  variables = LinenNet("fp32").init(jax.random.key(1), x, train=False)
  return variables, x, y


def _linen_loss(policy):
  model = LinenNet(policy)

  # BatchNorm in inference mode: train mode's backward pass (a difference of batch means)
  # amplifies bf16 rounding on the conv and BatchNorm gradients (autocast's too).
  def loss(params, batch_stats, x, y):
    logits = model.apply({"params": params, "batch_stats": batch_stats}, x, train=False)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

  return loss


def test_linen_kwargs_give_bf16_outputs_f32_params_and_f32_accumulating_gemms():
  variables, x, y = _linen_setup()
  model = LinenNet("mixed_bf16")
  chex.assert_trees_all_equal_structs(variables, model.init(jax.random.key(1), x, train=False))
  chex.assert_type(jax.tree.leaves(model.init(jax.random.key(1), x, train=False)), jnp.float32)
  out = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
  chex.assert_type(out, jnp.bfloat16)

  loss = _linen_loss("mixed_bf16")
  args = (variables["params"], variables["batch_stats"], x, y)
  gemms = _gemms(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr)
  # Forward conv + 2 dense, and the weight gradient of each (input gradients too, where needed).
  assert sum(name == "conv_general_dilated" for name, *_ in gemms) >= 2
  assert sum(name == "dot_general" for name, *_ in gemms) >= 5
  for name, operands, accumulation in gemms:
    assert operands == ("bfloat16", "bfloat16") and accumulation == "float32", name

  value, grads = jax.jit(jax.value_and_grad(loss))(*args)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(_linen_loss("fp32")))(*args)
  chex.assert_type(jax.tree.leaves(grads), jnp.float32)
  chex.assert_trees_all_close(value, ref_value, rtol=2e-2)
  _assert_close(grads, ref_grads, rel=4e-2)


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16", "mixed_fp16"])
def test_linen_batchnorm_running_statistics_stay_f32(policy):
  variables, x, _ = _linen_setup()
  model = LinenNet(policy)
  variables = model.init(jax.random.key(1), x, train=False)
  apply = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))
  _, updated = apply(variables, x * 3.0 + 1.0)
  chex.assert_type(jax.tree.leaves(updated["batch_stats"]), jnp.float32)
  before = variables["batch_stats"]["BatchNorm_0"]["mean"]
  assert not np.allclose(updated["batch_stats"]["BatchNorm_0"]["mean"], before)
  param_dtype = jnp.bfloat16 if policy == "pure_bf16" else jnp.float32
  chex.assert_type(variables["params"]["Dense_0"]["kernel"], param_dtype)


def test_linen_kwargs_per_policy_and_layer():
  assert linen_kwargs("fp32") == {"dtype": jnp.float32, "param_dtype": jnp.float32}
  pure = linen_kwargs("pure_bf16", layer=("dense", "conv"))
  assert pure == {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}  # Flax's own GEMMs
  mixed = linen_kwargs("p=f32,c=f16", layer=("dense", "conv"))
  assert sorted(mixed) == ["conv_general_dilated", "dot_general", "dtype", "param_dtype"]
  assert mixed["dtype"] == jnp.float16
  assert "dot_general" not in linen_kwargs("mixed_bf16", layer="norm")
  # The same policy gives the same functions, so modules compare equal.
  assert nn.Dense(3, **linen_kwargs("mixed_bf16")) == nn.Dense(3, **linen_kwargs("mixed_bf16"))
  assert linen_kwargs("mixed_fp16")["dot_general"] is not linen_kwargs()["dot_general"]


def test_linen_kwargs_bad_input():
  with pytest.raises(ValueError, match="Cannot read precision policy"):
    linen_kwargs("mixed_bf61")
  with pytest.raises(ValueError, match="layer='dens' is not one of"):
    linen_kwargs("mixed_bf16", layer="dens")
  with pytest.raises(ValueError, match="names no layer kind"):
    linen_kwargs("mixed_bf16", layer=())


class NnxNet(nnx.Module):
  def __init__(self, rngs, train=True):
    # The LayerNorm is on the input: in the middle of the net, its backward pass (which
    # removes the cotangent's mean and its component along the output) amplifies bf16
    # rounding in every gradient below it.
    self.norm = nnx.LayerNorm(3, rngs=rngs)
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.5, use_running_average=not train, rngs=rngs)
    self.body = nnx.Linear(8 * 36, 16, rngs=rngs)
    self.mix = nnx.Einsum("bi,io->bo", (16, 16), (16,), rngs=rngs)
    self.head = nnx.LinearGeneral(16, 4, rngs=rngs)

  def __call__(self, x):
    x = nnx.gelu(self.bn(self.conv(self.norm(x)))).reshape(x.shape[0], -1)
    return self.head(nnx.gelu(self.mix(nnx.gelu(self.body(x)))))


def _nnx_loss(graphdef, rest, x, y):
  def loss(params):
    logits = nnx.merge(graphdef, params, rest)(x)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

  return loss


def test_nnx_apply_policy_matches_f32_with_excluded_modules_kept():
  kx, ky = jax.random.split(jax.random.key(0))
  x, y = jax.random.normal(kx, (8, 6, 6, 3)), jax.random.randint(ky, (8,), 0, 4)
  reference = NnxNet(nnx.Rngs(0), train=False)  # see _linen_loss
  model = nnx_apply_policy(nnx.clone(reference), "mixed_bf16", exclude=(nnx.LayerNorm, "head"))
  assert model.body.dtype == jnp.bfloat16 and model.conv.dtype == jnp.bfloat16
  assert model.norm.dtype is None and model.head.dtype is None
  assert model.head.dot_general is None and model.body.dot_general is not lax.dot_general
  chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.Param)), jnp.float32)
  chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.BatchStat)), jnp.float32)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = _nnx_loss(graphdef, rest, x, y)
  gemms = _gemms(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  half = [g for g in gemms if g[1] == ("bfloat16", "bfloat16")]
  full = [g for g in gemms if g[1] == ("float32", "float32")]
  assert len(half) + len(full) == len(gemms)
  assert all(accumulation == "float32" for _, _, accumulation in gemms)
  assert sum(name == "conv_general_dilated" for name, *_ in half) >= 2
  assert sum(name == "dot_general" for name, *_ in half) >= 4  # body and einsum, fwd + bwd
  # The excluded head is f32: its forward GEMM and its two gradient GEMMs.
  assert len(full) == 3 and all(name == "dot_general" for name, *_ in full)

  ref_graphdef, ref_params, ref_rest = nnx.split(reference, nnx.Param, ...)
  ref_loss = _nnx_loss(ref_graphdef, ref_rest, x, y)
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(ref_loss))(ref_params)
  chex.assert_trees_all_close(value, ref_value, rtol=2e-2)
  _assert_close(grads, ref_grads, rel=4e-2)


def test_nnx_batchnorm_statistics_stay_f32_in_train_mode():
  x = jax.random.normal(jax.random.key(0), (8, 6, 6, 3)) * 2.0 + 5.0
  reference = NnxNet(nnx.Rngs(0))
  model = nnx_apply_policy(nnx.clone(reference), "mixed_bf16")
  for net in (model, reference):
    net(x)  # train mode: updates the running statistics in place
  chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.BatchStat)), jnp.float32)
  assert not np.allclose(model.bn.mean[...], 0.0)
  _assert_close(nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), rel=1e-2)


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16"])
def test_nnx_batchnorm_normalizes_with_f32_running_statistics(policy):
  # A feature of mean 3 + 1/300 and standard deviation 0.01: bf16 (resolution 1/64 at 3)
  # would round the mean to 3.0, an error of a third of a standard deviation.
  bn = nnx.BatchNorm(2, use_running_average=True, rngs=nnx.Rngs(0))
  bn.mean[...] = jnp.full((2,), 3.0 + 1 / 300, jnp.float32)
  bn.var[...] = jnp.full((2,), 1e-4, jnp.float32)
  nnx_apply_policy(bn, policy)
  chex.assert_type([bn.mean[...], bn.var[...]], jnp.float32)
  x = (3.0 + jnp.arange(-4.0, 4.0).reshape(4, 2) / 64).astype(jnp.bfloat16)  # exact in bf16
  want = (x.astype(jnp.float32) - bn.mean[...]) * lax.rsqrt(bn.var[...] + bn.epsilon)
  got = jax.jit(lambda x: bn(x))(x)
  chex.assert_type(got, jnp.bfloat16)
  chex.assert_trees_all_close(got.astype(jnp.float32), want, rtol=2**-8, atol=1e-2)


def test_nnx_apply_policy_pure_bf16_and_back_to_fp32():
  model = NnxNet(nnx.Rngs(0))
  kernel = np.asarray(model.body.kernel[...])
  nnx_apply_policy(model, "pure_bf16")
  chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.Param)), jnp.bfloat16)
  chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.BatchStat)), jnp.float32)
  assert model.body.dot_general is lax.dot_general  # no f32 accumulation override for pure
  nnx_apply_policy(model, "mixed_fp16")
  assert model.body.dot_general is not lax.dot_general and model.mix.einsum_op is not jnp.einsum
  chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.Param)), jnp.float32)
  nnx_apply_policy(model, "fp32")
  assert model.body.dot_general is lax.dot_general and model.head.dot_general is lax.dot_general
  assert (
    model.mix.einsum_op is jnp.einsum
    and model.conv.conv_general_dilated is lax.conv_general_dilated
  )
  assert model.body.dtype == jnp.float32
  # Through bf16 and back: the kernel was rounded once, to bf16.
  np.testing.assert_allclose(model.body.kernel[...], kernel, rtol=2**-8)


def test_nnx_apply_policy_keeps_a_users_own_dot_general():
  def my_dot(*args, **kwargs):
    return lax.dot_general(*args, **kwargs)

  layer = nnx.Linear(4, 4, dot_general=my_dot, rngs=nnx.Rngs(0))
  nnx_apply_policy(layer, "mixed_bf16")
  assert layer.dot_general is my_dot and layer.dtype == jnp.bfloat16


def test_nnx_apply_policy_bad_input():
  model = NnxNet(nnx.Rngs(0))
  with pytest.raises(TypeError, match="exclude entry int 3 is neither"):
    nnx_apply_policy(model, exclude=(3,))
  with pytest.raises(TypeError, match="exclude entry int is neither"):
    nnx_apply_policy(model, exclude=(int,))
  with pytest.raises(ValueError, match="'haed' matches no submodule path.*'head'"):
    nnx_apply_policy(model, exclude="haed")
  with pytest.raises(TypeError, match="must be an nnx.Module"):
    nnx_apply_policy(nn.Dense(3))
  with pytest.raises(ValueError, match="Cannot read precision policy"):
    nnx_apply_policy(model, "fp33")
  assert model.body.dtype is None  # nothing changed on error
