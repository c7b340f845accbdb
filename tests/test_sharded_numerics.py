"""Numerics of sharded steps: gradient reductions, stochastic rounding and FP8 amaxes.

Sharding a step must change its numbers only where the wire dtype says so: a bf16 gradient
reduction loses more the more devices it spans, an f32 one does not lose measurably; a
stochastically rounded bf16 leaf rounds with the same bits however it is sharded; an FP8
tensor's amax is the max over all of its shards. The last two run in a subprocess with 8 host
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), as tests/test_sharded.py does.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

# --------------------------------------------------------------------------- reductions


def _ring_all_reduce(partials, wire):
  """The sum over devices of ``partials`` (``[devices, n]``), as NCCL's ring computes it.

  The vector is cut into one chunk per device; chunk ``c`` travels the ring from device
  ``c + 1`` on, and each of its ``devices - 1`` hops adds the next device's partial to the
  running sum in f32 and rounds it to the ``wire`` dtype before it is sent on (NCCL's
  reduction of a bf16 buffer: widen, add, round to nearest).
  """
  devices = partials.shape[0]
  out = np.empty(partials.shape[1], np.float32)
  for c, chunk in enumerate(np.array_split(np.arange(partials.shape[1]), devices)):
    total = partials[(c + 1) % devices, chunk].astype(wire).astype(np.float32)
    for hop in range(2, devices + 1):
      total = total + partials[(c + hop) % devices, chunk].astype(wire).astype(np.float32)
      total = total.astype(wire).astype(np.float32)
    out[chunk] = total
  return out


def test_bf16_gradient_reductions_lose_more_with_more_devices_and_f32_ones_do_not():
  """The error of a data-parallel step's gradient reduction, over 2, 4, 8 and 16 H100s.

  The wire dtype is read from the step compiled for that many H100s (``mpjax.target_mesh``, 16
  = 2 nodes of 8; the batch sharded over every device, the params replicated): the
  policy's ``reduce_dtype`` is the dtype of the weight gradients' all-reduce. The reduction
  itself is modelled here, not run: XLA:CPU promotes every bf16 all-reduce to f32 (its pass
  ``all-reduce-promotion``; its runtime has no bf16 reduction), so host devices cannot show a
  bf16 reduction's rounding, while on a GPU the all-reduce stays bf16 and NCCL's ring rounds
  the running sum to bf16 at each of its ``N - 1`` hops (:func:`_ring_all_reduce`). Each
  device's partial gradient is the policy's own computation on its shard of the batch
  (``jax.grad`` of ``mpjax.autocast``, under ``jit``): with ``reduce=bf16`` the weight GEMMs
  write bf16, as the GPU's do. Strong scaling: one global batch of 256, split over ``N``
  devices, so every ``N`` has the same full-batch gradient to be measured against (the f64 sum
  of the f32 partials).

  Measured (seed 0, relative L2 error of the reduced weight gradients against that
  reference): bf16 wire 2.3e-3, 2.6e-3, 3.3e-3, 4.3e-3 at 2, 4, 8, 16 devices (over seeds 0-7:
  8 devices 1.36-1.46x of 2, 16 devices 1.80-1.91x); f32 wire 2.9e-8, 3.8e-8, 4.8e-8, 6.0e-8.
  The f32 error grows by about the same factor (2.0x at 16: the same hops, rounding at 2^-24
  instead of 2^-9), but its whole growth is 3e-8, five orders of magnitude below bf16's error.
  """
  import functools
  import importlib.metadata

  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpjax
  import mpjax.gpu

  try:
    importlib.metadata.version(mpjax.gpu.PLUGIN)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"needs XLA's CUDA compiler plugin ({mpjax.gpu.PLUGIN})")

  def loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return jnp.mean(((h @ params["w2"]).astype(jnp.float32) - batch["y"]) ** 2)

  def example(seed, batch_size=256):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {
      "w1": jax.random.normal(k[0], (64, 256)) / 8,
      "w2": jax.random.normal(k[1], (256, 16)) / 16,
    }
    batch = {
      "x": jax.random.normal(k[2], (batch_size, 64)),
      "y": jax.random.normal(k[3], (batch_size, 16)),
    }
    return params, batch

  params, batch = example(0)
  weights = sum(x.size for x in jax.tree.leaves(params))
  meshes = {
    2: mpjax.target_mesh("h100", {"data": 2}),
    4: mpjax.target_mesh("h100", {"data": 4}),
    8: mpjax.target_mesh("h100", {"data": 8}),
    16: mpjax.target_mesh("h100", {"node": 2, "data": 8}, nodes=2),
  }
  specs = {"bfloat16": "p=f32,c=bf16,reduce=bf16", "float32": "p=f32,c=bf16,reduce=f32"}
  step = jax.jit(mpjax.make_train_step(loss_fn))

  def wire_dtype(spec, mesh):
    """The dtype of the compiled step's weight-gradient all-reduce over ``mesh``'s H100s."""

    def placed(x, spec):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    state = mpjax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), policy=spec)
    state = jax.tree.map(lambda x: placed(x, P()), state)
    placed_batch = jax.tree.map(lambda x: placed(x, P(mesh.axis_names)), batch)
    report = mpjax.collective_report(mpjax.compile_for(step, state, placed_batch, target="h100"))
    reductions = [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")]
    assert reductions and all(c.group_size == mesh.size for c in reductions), report
    assert all(c.crosses_nodes == (mesh.size > 8) for c in reductions), report
    by_dtype = {}
    for c in reductions:
      for dtype, n in c.dtypes.items():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n * c.count
    # Every weight gradient crosses the wire in one dtype; beside it only the loss (f32[]).
    (wire,) = [d for d, n in by_dtype.items() if n >= weights * np.dtype(d).itemsize]
    assert by_dtype[wire] - 4 * (wire == "float32") == weights * np.dtype(wire).itemsize
    assert sum(by_dtype.values()) - by_dtype[wire] <= 4, by_dtype
    return np.dtype(jnp.dtype(wire))

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def partial_grads(spec, params, batch, devices):
    policy = mpjax.get_policy(spec)
    grad = jax.grad(lambda p, b: mpjax.autocast(loss_fn, policy)(p, b) / devices)
    shards = jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), batch)
    return jax.lax.map(lambda b: grad(params, b), shards)

  def partial_gradients(spec, params, batch, devices):
    """Each device's weight gradient, ``[devices, weights]``: its shard's share of the mean."""
    grads = partial_grads(spec, params, batch, devices)
    return np.concatenate([np.asarray(g).reshape(devices, -1) for g in jax.tree.leaves(grads)], 1)

  full_grad = jax.jit(jax.grad(mpjax.autocast(loss_fn, mpjax.get_policy(specs["float32"]))))
  errors = {}
  for seed in (0, 1):
    params, batch = example(seed)
    full = np.concatenate([np.ravel(g) for g in jax.tree.leaves(full_grad(params, batch))])
    for n, mesh in meshes.items():
      reference = partial_gradients(specs["float32"], params, batch, n).astype(np.float64).sum(0)
      # The premise of the split: the partials add up to the full batch's gradient.
      np.testing.assert_allclose(reference, full, rtol=1e-4, atol=1e-6)
      for name, spec in specs.items():
        wire = wire_dtype(spec, mesh) if seed == 0 else errors[name, n, 0][0]
        assert wire.name == name, (spec, n, wire)
        partials = partial_gradients(spec, params, batch, n)
        # What each GPU's weight GEMMs write: bf16 values under reduce=bf16.
        assert np.array_equal(partials, partials.astype(wire).astype(np.float32)), spec
        reduced = _ring_all_reduce(partials, wire)
        error = np.linalg.norm(reduced - reference) / np.linalg.norm(reference)
        errors[name, n, seed] = (wire, error)

  for seed in (0, 1):
    bf16 = [errors["bfloat16", n, seed][1] for n in meshes]
    f32 = [errors["float32", n, seed][1] for n in meshes]
    table = {"bf16": bf16, "f32": f32}
    # bf16: each hop rounds the running sum again; more devices, more error.
    assert all(a < b for a, b in zip(bf16, bf16[1:], strict=False)), table
    assert bf16[2] >= 1.25 * bf16[0] and bf16[3] >= 1.5 * bf16[0], table
    assert 1e-3 < bf16[0] < 1e-2, table  # about bf16's half spacing, 2^-9
    # f32: the same hops lose nothing that matters, at any device count.
    assert max(f32) < 1e-6 and max(f32) < bf16[0] / 1000, table
    assert f32[3] - f32[0] < (bf16[3] - bf16[0]) / 1000, table


# --------------------------------------------------------------------------- 8 host devices


def _run_on_eight_host_devices(script):
  env = {k: v for k, v in os.environ.items() if k != "MPJAX_POLICY"}
  # 8 host devices on 2 loaded cores: a device thread can wait past XLA:CPU's default collective
  # timeout, which is not what these test (see tests/test_sharded.py). Excess precision off:
  # XLA:CPU then contracts no multiply-add into an FMA, which it may do with other operands in
  # a sharded program than in an unsharded one (Adam's 0.1 * g + 0.9 * mu under cancellation:
  # fma(0.1, g, 0.9 * mu) = 6.0e-11 on one device, fma(0.9, mu, 0.1 * g) = 3.6e-11 sharded);
  # both programs then round every operation as it is written. LLVM's level 0: as conftest.py.
  flags = "--xla_force_host_platform_device_count=8"
  flags += " --xla_cpu_collective_call_terminate_timeout_seconds=900"
  flags += " --xla_allow_excess_precision=false --xla_backend_optimization_level=0"
  env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
    proc.stdout[-2000:] + proc.stderr[-6000:]
  )


_STOCHASTIC_ROUNDING = """
import functools
import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mpjax
from mpjax.rounding import random_bits

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
one = jax.devices()[0]
one_mesh = Mesh(np.array([one]), ("fsdp",))

class Dense(nn.Module):
  # FSDP written out: the kernel and bias are stored sharded and gathered whole where they are
  # used, so every GEMM runs whole on each device, as on one. (Left to XLA, a GEMM over a
  # sharded dimension adds the devices' partial sums in another order than one device does:
  # no bitwise equality to test.)
  features: int
  names: tuple
  gathered: NamedSharding

  @nn.compact
  def __call__(self, x):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), self.names)
    kernel = self.param("kernel", init, (x.shape[-1], self.features))
    init = nn.with_partitioning(nn.initializers.normal(0.1), ("fsdp",))
    bias = self.param("bias", init, (self.features,))
    kernel, bias = (jax.lax.with_sharding_constraint(v, self.gathered) for v in (kernel, bias))
    return x @ kernel + bias

class Model(nn.Module):
  gathered: NamedSharding

  @nn.compact
  def __call__(self, x):
    x = nn.relu(Dense(64, (None, "fsdp"), self.gathered)(x))
    x = nn.relu(Dense(64, ("fsdp", None), self.gathered)(x))
    return Dense(8, ("fsdp", None), self.gathered)(x)

def batch(i):
  kx, ky = jax.random.split(jax.random.key(10 + i))
  return {"x": jax.random.normal(kx, (16, 32)), "y": jax.random.randint(ky, (16,), 0, 8)}

tx = optax.adamw(1e-2)

def train(m, params, policy, steps=3):
  model = Model(NamedSharding(m, P()))
  def loss_fn(params, b):
    logits = model.apply(params, b["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  state = mpjax.TrainState.create(apply_fn=model.apply, params=params, tx=tx, policy=policy,
                                  rounding_key=3)
  for i in range(steps):
    state, _ = step(state, jax.device_put(batch(i), NamedSharding(m, P())))
  return state

init_model = Model(NamedSharding(mesh, P()))
abstract = jax.eval_shape(init_model.init, jax.random.key(0), jnp.ones((1, 32)))
shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(abstract))
params = nn.unbox(jax.jit(init_model.init, out_shardings=shardings)(jax.random.key(0),
                                                                     jnp.ones((1, 32))))
host = jax.device_get(params)

def leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get((state.params, state.opt_state)))]

sharded = train(mesh, params, "bf16_sr")
single = train(one_mesh, jax.device_put(host, one), "bf16_sr")
# The premise of the layout: the params and Adam's moments stayed sharded, each written (and
# rounded) on its own shard, with the params' specs.
specs = [x.sharding.spec for x in jax.tree.leaves(sharded.params)]
assert {tuple(s) for s in specs} == {("fsdp",), (None, "fsdp")}, specs
inner = sharded.opt_state.inner[0]
for moment in (inner.mu, inner.nu):
  assert [x.sharding.spec for x in jax.tree.leaves(moment)] == specs
assert {d for x in jax.tree.leaves(single) for d in x.devices()} == {one}

# The claim: sharded over 8 devices, every stored bit is that of the run on one device.
a, b = leaves(sharded), leaves(single)
assert len(a) == len(b) == 21
for x, y in zip(a, b):
  np.testing.assert_array_equal(x, y)

# The premise, 1: the rounding decides bits. Rounded to nearest, the same run stores other
# values in every param leaf.
nearest = train(mesh, jax.device_put(host, shardings),
                mpjax.Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32,
                             opt_state_dtype=jnp.bfloat16, rounding="nearest"))
differs = [int(np.sum(x != y)) for x, y in zip(leaves(nearest), a)]
assert all(d > 0 for d in differs[:6]) and sum(differs) > 1000, differs

# The premise, 2: shard-local indices draw other bits. Each sharded leaf's bits over its
# shape, sliced to a shard, are not what the shard's own shape would draw (but for shard 0 of
# a leaf sharded along its first axis, whose local and global indices coincide).
key, count = sharded.opt_state.key, sharded.opt_state.count - 1
bits = jax.jit(random_bits, static_argnums=(2, 3))
for stream, leaf in enumerate(jax.tree.leaves(sharded.params)):
  whole = np.asarray(bits(key, count, stream, leaf.shape))
  local = [np.asarray(bits(key, count, stream, s.data.shape)) for s in leaf.addressable_shards]
  other = [not np.array_equal(b, whole[s.index]) for b, s in zip(local, leaf.addressable_shards)]
  assert sum(other) >= 7, (stream, leaf.sharding.spec, other)

# The premise, 3: an update that drew from shard-local indices would store other values. The
# same rounded update, from the trained state, of the same gradients: under jit (sharded as
# the step runs it) it is bitwise the one device's; under shard_map (each device sees its own
# shard's shape, so its indices start at 0) it is not.
policy = sharded.policy
grads = jax.tree.map(lambda p: (jnp.sin(jnp.arange(p.size, dtype=jnp.float32) * 0.37)
                                .reshape(p.shape) * 1e-3), host)
update = jax.jit(functools.partial(mpjax.rounded_update, tx, policy))
on_mesh = update(jax.device_put(grads, shardings), sharded.opt_state, sharded.params)
on_one = update(jax.device_put(grads, one), single.opt_state, single.params)
for x, y in zip(jax.tree.leaves(jax.device_get(on_mesh)), jax.tree.leaves(jax.device_get(on_one))):
  np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
spec = lambda tree: jax.tree.map(lambda x: x.sharding.spec, tree)
local_update = jax.jit(jax.shard_map(
  functools.partial(mpjax.rounded_update, tx, policy), mesh=mesh,
  in_specs=(spec(sharded.params), spec(sharded.opt_state), spec(sharded.params)),
  out_specs=(spec(sharded.params), spec(sharded.opt_state))))
local = local_update(jax.device_put(grads, shardings), sharded.opt_state, sharded.params)
differs = [int(np.sum(np.asarray(x) != np.asarray(y))) for x, y in
           zip(jax.tree.leaves(jax.device_get(local[0])),
               jax.tree.leaves(jax.device_get(on_mesh[0])))]
assert all(d > 0 for d in differs), differs
print("ok")
"""


def test_a_sharded_bf16_sr_leaf_rounds_exactly_as_the_same_leaf_unsharded():
  """A bf16_sr model FSDP-sharded over 8 host devices trains bit for bit as on one device.

  Stochastic rounding hashes each element's index into its bits (``mpjax.rounding``); under
  ``jit`` that is the element's index in the whole leaf, whatever shard holds it, so three
  steps of the sharded run store exactly what the unsharded run stores: params, Adam's
  moments, the key and the count. The premises: the rounding changes the stored values (round
  to nearest stores others), and an index local to the shard would have drawn other bits and
  stored other values (the same update under ``shard_map``, where each device sees its own
  shard's shape).
  """
  _run_on_eight_host_devices(_STOCHASTIC_ROUNDING)


_FP8_AMAX = """
import dataclasses
import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mpjax
from mpjax.fp8 import LHS

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
one = jax.devices()[0]
replicated = NamedSharding(mesh, P())

def dense(features, names):
  init = nn.with_partitioning(nn.initializers.lecun_normal(), names)
  return nn.Dense(features, kernel_init=init,
                  bias_init=nn.with_partitioning(nn.initializers.zeros, (names[-1],)))

class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(dense(64, (None, "fsdp"))(x))
    x = nn.relu(dense(64, ("fsdp", None))(x))
    return dense(8, ("fsdp", None))(x)

model = Model()
# mixed_fp8 with every Dense in FP8 (the preset keeps the first and last in bf16): the first
# GEMM's left operand is the batch itself.
policy = dataclasses.replace(mpjax.get_policy("mixed_fp8"), fp8=mpjax.Fp8Recipe(keep_bf16=()))
kx, ky = jax.random.split(jax.random.key(1))
x = jax.random.normal(kx, (64, 32))
x = x.at[56:].multiply(100.0)  # the last device's shard of the batch is 100x the others
batch = {"x": x, "y": jax.random.randint(ky, (64,), 0, 8)}

def loss_fn(params, b):
  logits = model.apply(params, b["x"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

def one_step(params, b):
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  state = mpjax.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3),
                                  policy=policy, train_step=step, example_batch=b)
  made = [state.fp8.scale.sharding, state.fp8.amax_history.sharding]
  state, _ = step(state, b)
  return state, made

abstract = jax.eval_shape(model.init, jax.random.key(0), x[:1])
shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(abstract))
params = nn.unbox(jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x[:1]))
kernels = [p for path, p in jax.tree_util.tree_leaves_with_path(params) if "kernel" in str(path)]
assert len(kernels) == 3 and all("fsdp" in p.sharding.spec for p in kernels), kernels
sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
sharded, made = one_step(params, sharded_batch)
single, _ = one_step(jax.device_put(jax.device_get(params), one), jax.device_put(batch, one))
assert sharded.fp8.gemms == single.fp8.gemms == 3

# The FP8 state is replicated on the mesh when made, and stays so after the step.
assert made == [replicated, replicated], made
assert sharded.fp8.scale.sharding == sharded.fp8.amax_history.sharding == replicated

# The claim: the sharded step records the unsharded step's amaxes (and scales), bit for bit.
for a, b in [(sharded.fp8.amax_history, single.fp8.amax_history),
             (sharded.fp8.scale, single.fp8.scale)]:
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
history = np.asarray(sharded.fp8.amax_history)
assert np.all(history[0] > 0) and np.all(history[1:] == 0), history[:2]

# The premise: the shards differ, and the recorded amax is not the first shard's. The first
# GEMM's left operand is the batch: its amax is the max over all 8 shards, 100x shard 0's.
(first,) = [s for s in sharded_batch["x"].addressable_shards if s.index[0].start in (0, None)]
first_max = float(np.max(np.abs(np.asarray(first.data))))
assert np.asarray(first.data).shape == (8, 32)
assert history[0, 0, LHS] == np.max(np.abs(np.asarray(x))) > 10 * first_max, (history[0], first_max)
print("ok")
"""


def test_fp8_amax_of_a_sharded_tensor_is_the_max_over_all_its_shards():
  """A mixed_fp8 step, FSDP-sharded params and a batch over 8 host devices, records global amaxes.

  The batch's last shard is 100x the others: one step's amax history is bitwise the
  unsharded run's, and the first GEMM's recorded amax (its left operand is the batch) is the
  max over all 8 shards, not shard 0's. The FP8 state (scales, history) is replicated on the
  mesh when ``TrainState.create`` makes it and stays so after the step.
  """
  _run_on_eight_host_devices(_FP8_AMAX)
