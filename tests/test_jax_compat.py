"""mpjax.jax_compat on the running JAX: each layout read from real jaxprs, each internal at work."""

import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import jax_compat as jc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jcore.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _scans(closed):
  return [e for e in _eqns(closed.jaxpr) if e.primitive.name == "scan"]


def _rand(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_the_running_jax_is_in_the_tested_range_that_pyproject_states():
  assert jc.MIN_JAX <= jc.jax_version() < jc.NEXT_UNSUPPORTED_JAX, jax.__version__
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  (jax_dep,) = [d for d in deps if re.match(r"jax\b", d)]
  low = ".".join(map(str, jc.MIN_JAX))
  high = ".".join(map(str, jc.NEXT_UNSUPPORTED_JAX))
  assert jax_dep.replace(" ", "") == f"jax>={low},<{high}"


def test_no_module_of_mpjax_but_jax_compat_imports_jax_internals():
  for path in (ROOT / "mpjax").rglob("*.py"):
    if path.name != "jax_compat.py":
      assert "jax._src" not in path.read_text(), path.relative_to(ROOT)


def test_scan_layout_reads_consts_and_carries_of_a_real_scan():
  w, b = _rand(0, (4, 4)), _rand(1, (4,))  # closed over: the scan's two consts

  def fn(carry, xs):
    def body(c, x):
      h, (n, extra) = c
      h = jnp.tanh(h @ w + x + b)
      return (h, (n + 1, extra * 2.0)), (h.sum(), x.mean())

    return lax.scan(body, carry, xs)

  carry = (jnp.zeros((4,)), (jnp.int32(0), jnp.ones((3,))))  # three carries, nested
  xs = _rand(2, (5, 4))
  (eqn,) = _scans(jax.make_jaxpr(fn)(carry, xs))
  assert jc.scan_layout(eqn.params) == (2, 3)
  body = eqn.params["jaxpr"]
  in_avals = [v.aval for v in eqn.invars]
  assert in_avals[2:5] == list(body.out_avals[:3])  # carries in and out agree
  assert [a.shape for a in in_avals[:2]] == [(4, 4), (4,)]
  assert len(eqn.outvars) == 3 + 2  # carries, then two stacked results


def test_scan_layout_of_the_scans_jax_makes_for_a_gradient():
  # JVP and transpose rebind scan with layouts of their own (on jax >= 0.11 nested flat trees).
  w = _rand(0, (4, 4))

  def loss(w, h, xs):
    h, ys = lax.scan(lambda h, x: (jnp.sin(h @ w + x), h * x), h, xs)
    return h.sum() + ys.sum()

  scans = _scans(jax.make_jaxpr(jax.grad(loss, (0, 1)))(w, _rand(1, (4,)), _rand(2, (6, 4))))
  assert len(scans) >= 2
  for eqn in scans:
    nc, ncarry = jc.scan_layout(eqn.params)
    body = eqn.params["jaxpr"]
    assert 0 <= nc and 0 < ncarry and nc + ncarry <= len(eqn.invars)
    carries_in = [v.aval for v in eqn.invars[nc : nc + ncarry]]
    assert carries_in == list(body.out_avals[:ncarry])
    assert [a.shape for a in carries_in] == [a.shape for a in body.in_avals[nc : nc + ncarry]]
    # The scanned inputs, sliced, are what the body takes after the carries.
    for v, a in zip(eqn.invars[nc + ncarry :], body.in_avals[nc + ncarry :], strict=True):
      assert v.aval.shape[1:] == a.shape


def test_autocast_enters_a_scan_with_consts_and_matches_f32():
  w = _rand(0, (16, 16)) * 0.3

  def fn(w, h, xs):
    return lax.scan(lambda h, x: (jnp.tanh(h @ w + x), (h @ w).sum()), h, xs)

  args = (w, _rand(1, (2, 16)), _rand(2, (5, 2, 16)))
  out = mpjax.autocast(fn, "mixed_bf16")(*args)
  ref = fn(*args)
  np.testing.assert_allclose(out[0], ref[0], atol=5e-2)
  np.testing.assert_allclose(out[1], ref[1], rtol=5e-2, atol=5e-1)
  grads = jax.grad(lambda *a: mpjax.autocast(fn, "mixed_bf16")(*a)[0].sum(), (0, 1))(*args)
  assert [g.dtype for g in grads] == [jnp.float32, jnp.float32]


def _shard_map_loss(w, x):
  mesh = jax.make_mesh((1,), ("data",))
  body = jax.shard_map(
    lambda a, b: lax.psum(a @ b, "data"), mesh=mesh, in_specs=(P(), P()), out_specs=P()
  )
  return body(x, w).sum()


def test_shard_map_manual_axes_of_a_real_shard_map_and_autocast_enters_it():
  w, x = _rand(0, (8, 8)), _rand(1, (4, 8))
  (eqn,) = [e for e in _eqns(jax.make_jaxpr(_shard_map_loss)(w, x).jaxpr) if "shard_map" in str(e)]
  assert jc.shard_map_manual_axes(eqn.params) == {"data"}
  out = mpjax.autocast(_shard_map_loss, "mixed_bf16")(w, x)
  np.testing.assert_allclose(out, _shard_map_loss(w, x), rtol=2e-2)
  (row,) = mpjax.audit(_shard_map_loss, w, x).rows
  assert (row.count, row.flops) == (1, 2 * 4 * 8 * 8)  # once per device of its manual axes


def test_the_dot_general_transpose_rules_give_the_vjp():
  x, y = _rand(0, (3, 5, 4)), _rand(1, (3, 4, 6))
  dn = (((2,), (1,)), ((0,), (0,)))
  out, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dn), x, y)
  g = _rand(2, out.shape)
  kw = dict(dimension_numbers=dn, precision=None, preferred_element_type=None, out_sharding=None)
  dx = jc.dot_general_transpose_lhs(g, jc.UndefinedPrimal(jax.typeof(x)), y, **kw)
  dy = jc.dot_general_transpose_rhs(g, x, jc.UndefinedPrimal(jax.typeof(y)), **kw)
  for got, want in zip((dx, dy), vjp(g), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_conv_transpose_rules_give_the_vjp():
  x, k = _rand(0, (2, 3, 9, 9)), _rand(1, (4, 3, 3, 3))
  conv = dict(window_strides=(1, 1), padding=((1, 1), (1, 1)))
  out, vjp = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, **conv), x, k)
  g = _rand(2, out.shape)
  (eqn,) = jax.make_jaxpr(lambda a, b: lax.conv_general_dilated(a, b, **conv))(x, k).eqns
  kw = dict(eqn.params, precision=None, preferred_element_type=None)
  dx = jc.conv_general_dilated_transpose_lhs(g, x, k, **kw)
  dk = jc.conv_general_dilated_transpose_rhs(g, x, k, **kw)
  for got, want in zip((dx, dk), vjp(g), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_ragged_dot_transpose_rule_gives_the_vjp():
  x, w = _rand(0, (6, 4)), _rand(1, (2, 4, 5))
  sizes = jnp.array([2, 4], jnp.int32)
  out, vjp = jax.vjp(lambda a, b: lax.ragged_dot(a, b, sizes), x, w)
  g = _rand(2, out.shape)
  (eqn,) = jax.make_jaxpr(lambda a, b: lax.ragged_dot(a, b, sizes))(x, w).eqns
  kw = dict(
    ragged_dot_dimension_numbers=eqn.params["ragged_dot_dimension_numbers"],
    precision=None,
    preferred_element_type=None,
    group_offset=None,
  )
  rule = jc.ragged_dot_general_transpose_rule
  dx = rule(g, jc.UndefinedPrimal(jax.typeof(x)), w, sizes, **kw)[0]
  dw = rule(g, x, jc.UndefinedPrimal(jax.typeof(w)), sizes, **kw)[1]
  for got, want in zip((dx, dw), vjp(g), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dce_jaxpr_drops_an_unused_gemm():
  def fn(a, b):
    _ = a @ b  # unused
    return jnp.sin(a)

  jaxpr = jax.make_jaxpr(fn)(jnp.ones((2, 2)), jnp.ones((2, 2))).jaxpr
  assert "dot_general" in {e.primitive.name for e in jaxpr.eqns}
  pruned, used = jc.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  assert {e.primitive.name for e in pruned.eqns} == {"sin"}
  assert list(used) == [True, False]


def test_trace_context_and_softmax_custom_jvp():
  before = jc.trace_context()
  hash(before)
  old = jc.softmax_custom_jvp.value
  with jc.softmax_custom_jvp(not old):
    assert jc.softmax_custom_jvp.value is (not old)
    assert jc.trace_context() != before  # a jit trace cache key sees the setting
  assert jc.softmax_custom_jvp.value is old
  assert jc.trace_context() == before


def test_source_info_util_name_stacks():
  seen = []

  def fn(x):
    with jax.named_scope("outer"):
      seen.append(str(jc.source_info_util.current_name_stack()))
      with jc.source_info_util.user_context(None, name_stack=jc.source_info_util.new_name_stack()):
        return jnp.sin(x)

  jax.make_jaxpr(fn)(1.0)
  assert seen and "outer" in seen[0]


def test_saved_residuals_and_backends_started():
  res = jc.saved_residuals(lambda x: jnp.sin(jnp.sin(x)), jnp.ones(3))
  assert len(res) >= 1 and all(isinstance(why, str) for _, why in res)
  jnp.ones(1).block_until_ready()
  assert jc.backends_are_initialized()


@pytest.mark.parametrize("name", jc.__all__)
def test_every_name_is_there(name):
  assert getattr(jc, name) is not None
