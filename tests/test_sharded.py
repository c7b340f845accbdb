"""Sharded training under ``jax.jit``: the step keeps the layout it is given and compiles once.

Each case runs in a subprocess with 8 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), as a user shards a Flax model over a
``Mesh`` with ``nn.with_partitioning`` and ``NamedSharding``.
"""

import os
import subprocess
import sys

import pytest

_LAYOUT = """
import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mpjax

AXES, POLICIES = {axes!r}, {policies!r}
mesh = Mesh(np.array(jax.devices()).reshape(tuple(AXES.values())), tuple(AXES))

def partitioned(*names):  # the model's own annotations, over axes this mesh may not have
  names = tuple(n if n in AXES else None for n in names)
  return nn.with_partitioning(nn.initializers.lecun_normal(), names)

class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64, kernel_init=partitioned("fsdp", "tensor"))(x))
    x = nn.LayerNorm()(x)  # replicated scale and bias: XLA would return them sharded
    x = nn.Dense(64, kernel_init=partitioned("tensor", "fsdp"))(x)
    return nn.Dense(8, kernel_init=partitioned("fsdp", None))(x)

model = Model()
x, y = jnp.ones((16, 32)), jnp.arange(16) % 8
abstract = jax.eval_shape(model.init, jax.random.key(0), x)
shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(abstract))
params = nn.unbox(jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x))
batch_axes = tuple(a for a in AXES if a != "tensor")
batch = jax.device_put({{"x": x, "y": y}}, NamedSharding(mesh, P(batch_axes)))

def loss_fn(params, batch):
  logits = model.apply(params, batch["x"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

def described(state):
  leaves = jax.tree_util.tree_leaves_with_path(state)
  return [(jax.tree_util.keystr(p), x.sharding) for p, x in leaves]

for policy in POLICIES:
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  state = mpjax.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3),
                                  policy=policy, train_step=step, example_batch=batch)
  given = described(state)
  # What create makes beside the params is on their mesh: scalars replicated, Adam's moments
  # sharded like their params.
  assert all(isinstance(s, NamedSharding) and s.mesh == mesh for _, s in given), given
  moments = [(k, s) for k, s in given if ".mu[" in k or ".nu[" in k]
  kernels = dict((k, s) for k, s in given if k.startswith(".params"))
  assert moments and all(s == kernels[".params" + k[k.index("['params']"):]] for k, s in moments)
  assert {{s.spec for k, s in given if "LayerNorm" in k}} == {{P()}}
  for i in range(3):
    state, metrics = step(state, batch)
    assert described(state) == given, [
      (a, b) for a, b in zip(given, described(state)) if a != b][:4]
  assert step._cache_size() == 1, (policy, step._cache_size())
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 3, policy
  print(policy, "ok")
print("all ok")
"""

POLICIES = ("fp32", "mixed_bf16", "mixed_fp16", "mixed_fp8", "bf16_sr")


@pytest.mark.parametrize(
  "axes", [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}]
)
def test_a_sharded_step_keeps_every_leafs_layout_and_compiles_once(axes):
  env = {k: v for k, v in os.environ.items() if k != "MPJAX_POLICY"}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  script = _LAYOUT.format(axes=axes, policies=POLICIES)
  proc = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0 and proc.stdout.strip().endswith("all ok"), (
    proc.stdout[-2000:] + proc.stderr[-4000:]
  )
