"""Sharded training under ``jax.jit``: the step keeps the layout it is given and compiles once.

Each case runs in a subprocess with 8 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), as a user shards a Flax model over a
``Mesh`` with ``nn.with_partitioning`` and ``NamedSharding``.
"""

import os
import re
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
  # 8 host devices on 2 loaded cores: a device thread can wait past XLA:CPU's default collective
  # timeout (seen once in CI: "only 6 of them arrived on time"), which is not what this tests.
  flags = "--xla_force_host_platform_device_count=8"
  flags += " --xla_cpu_collective_call_terminate_timeout_seconds=900"
  env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  script = _LAYOUT.format(axes=axes, policies=POLICIES)
  proc = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0 and proc.stdout.strip().endswith("all ok"), (
    proc.stdout[-2000:] + proc.stderr[-4000:]
  )


def _fsdp_parts(policy, fsdp=8, width=256):
  """An MLP's train step, its state and batch sharded over ``fsdp`` H100s (abstract values)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpjax

  def loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"]).astype(jnp.float32) ** 2)

  params = {"w1": jnp.ones((width, 1024)), "w2": jnp.ones((1024, width))}
  state = mpjax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), policy=policy)
  mesh = mpjax.target_mesh("h100", {"fsdp": fsdp})

  def placed(x, spec):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  state = jax.tree.map(lambda x: placed(x, P("fsdp") if x.ndim == 2 else P()), state)
  batch = {"x": placed(jnp.ones((64, width)), P("fsdp"))}
  return state.keep_layout(), batch, jax.jit(mpjax.make_train_step(loss_fn))


def _fsdp_step_for_h100(policy, fsdp=8):
  """The step of :func:`_fsdp_parts`, compiled here for ``fsdp`` H100s."""
  import mpjax

  state, batch, step = _fsdp_parts(policy, fsdp)
  return mpjax.compile_for(step, state, batch, target="h100")


@pytest.mark.parametrize(
  "spec, reduced",
  [
    ("mixed_bf16", "bfloat16"),
    ("p=f32,c=bf16,reduce=f32", "float32"),
    ("p=f32,c=bf16,reduce=bf16", "bfloat16"),
  ],
)
@pytest.mark.usefixtures("gpu_compiler")
def test_reduce_dtype_is_the_dtype_of_every_gradient_reduction_compiled_for_8_h100s(spec, reduced):
  from mpjax.collectives import collective_report

  report = collective_report(_fsdp_step_for_h100(spec), target="h100", reduce_dtype="float32")
  # The weights' gradients: one reduce-scatter each over the 8 devices (the loss's mean is a
  # scalar all-reduce), in the policy's reduce dtype: f32 moves twice bf16's bytes.
  grads = [c for c in report.collectives if c.kind == "reduce-scatter"]
  assert len(grads) >= 1 and {c.dtype for c in grads} == {reduced}, report
  grad_bytes = sum(c.bytes * c.count for c in grads)
  assert grad_bytes == 2 * 256 * 1024 * (4 if reduced == "float32" else 2)
  # Read against an f32 reduce dtype, a bf16 reduction is flagged, an f32 one is not.
  assert all(("reduce-narrow" in c.flags) == (reduced == "bfloat16") for c in grads)
  # The forward's weight all-gathers stay in the compute dtype.
  assert {c.dtype for c in report.collectives if c.kind == "all-gather"} == {"bfloat16"}


@pytest.mark.usefixtures("gpu_compiler")
def test_the_step_gathers_sharded_params_in_bf16_where_xla_would_gather_f32_jax_23543():
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpjax
  from mpjax.collectives import collective_report

  mesh = mpjax.target_mesh("h100", {"fsdp": 8})

  def loss_fn(params, batch):
    # jax#23543's pattern: the weight gathered whole, then cast for the GEMM. The barrier keeps
    # XLA from moving the convert before the gather, as it does in the programs of that issue.
    w = lax.optimization_barrier(
      lax.with_sharding_constraint(params["w"], NamedSharding(mesh, P()))
    )
    return jnp.mean((batch["x"] @ w).astype(jnp.float32) ** 2)

  def placed(x, spec):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  state = mpjax.TrainState.create(
    apply_fn=None, params={"w": jnp.ones((1024, 1024))}, tx=optax.sgd(0.1), policy="mixed_bf16"
  )
  state = jax.tree.map(lambda x: placed(x, P("fsdp") if x.ndim == 2 else P()), state)
  batch = {"x": placed(jnp.ones((64, 1024)), P("fsdp"))}
  step = jax.jit(mpjax.make_train_step(loss_fn))

  def gathers(state):
    report = collective_report(mpjax.compile_for(step, state, batch, target="h100"))
    return [c for c in report.collectives if c.kind == "all-gather" and c.bytes >= 2**20]

  # The premise: with no layout recorded, the f32 master crosses the wire whole, flagged.
  (wide,) = gathers(state)
  assert wide.dtype == "float32" and wide.bytes == 1024 * 1024 * 4 and "gather-wide" in wide.flags
  # With the layout (the one TrainState.create records for a state it places), the step casts
  # each shard to bf16 before it leaves its device: half the bytes, nothing flagged.
  (narrow,) = gathers(state.keep_layout())
  assert narrow.dtype == "bfloat16" and narrow.bytes == 1024 * 1024 * 2 and not narrow.flags


@pytest.mark.usefixtures("gpu_compiler")
def test_the_audit_and_the_kernel_report_of_a_sharded_step_read_its_collectives():
  import jax

  import mpjax

  compiled_state, batch, step = _fsdp_parts("p=f32,c=bf16,reduce=f32")
  audited = mpjax.audit(step, compiled_state, batch, target="h100")
  kinds = {(c.kind, c.dtype) for c in audited.collectives.collectives}
  # The forward's bf16 all-gathers and the f32 gradient reduce-scatters the policy asks for.
  assert {("all-gather", "bfloat16"), ("reduce-scatter", "float32")} <= kinds, kinds
  assert "Collectives" in audited.to_markdown() and "reduce-scatter" in audited.to_markdown()
  assert audited.to_dict()["collectives"]["total_bytes"] == audited.collectives.total_bytes
  report = mpjax.kernel_report(step, compiled_state, batch, target="h100")
  assert report.collectives.total_bytes == audited.collectives.total_bytes
  # One device's program: the audit of an unsharded step has no collective to read.
  single = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (compiled_state, batch))
  assert mpjax.audit(step, *single, target="h100").collectives.collectives == ()


@pytest.mark.usefixtures("gpu_compiler")
def test_fp16_and_fp8_weights_cross_the_wire_narrow_and_no_gradient_is_gathered_whole():
  import jax.numpy as jnp

  import mpjax
  from mpjax.collectives import collective_report

  def gathered(policy):
    """Bytes per device of every all-gather, by dtype (a combined gather's parts apart)."""
    report = collective_report(_fsdp_step_for_h100(policy), target="h100")
    parts = [c.dtypes for c in report.collectives if c.kind == "all-gather" and c.bytes >= 1024]
    return {d: sum(p.get(d, 0) for p in parts) for d in set().union(*parts)}

  fp32 = gathered("fp32")
  assert set(fp32) == {"float32"} and sum(fp32.values()) >= 2 * 256 * 1024 * 4  # the premise
  # fp16 checks its gradients; the finite check must not concatenate the sharded f32 gradients
  # (XLA gathered each whole onto every device: more bytes than fp32 moves).
  fp16 = gathered("mixed_fp16")
  assert "float32" not in fp16 and sum(fp16.values()) <= 0.52 * sum(fp32.values()), fp16
  # Both weights in FP8: each travels in e4m3, a quarter of its f32 bytes.
  fp8 = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(keep_bf16=()))
  fp8 = gathered(fp8)
  assert fp8.get("float8_e4m3fn", 0) >= 2 * 256 * 1024 and "float32" not in fp8, fp8


@pytest.mark.usefixtures("gpu_compiler")
def test_block_scaled_gemms_whose_blocks_8_devices_cannot_share_compile_for_8_h100s(monkeypatch):
  import jax.numpy as jnp

  import mpjax
  from mpjax import block_scaled
  from mpjax.collectives import collective_report

  # The first weight, (128, 1024) and sharded over 8 devices along its 128 rows, is contracted
  # along them: 4 MXFP8 blocks of 32, which 8 devices cannot share. Under the state's mesh (the
  # step enters it) such an operand is quantized whole on each device: the step compiles, and
  # no E8M0 scale crosses the wire.
  every = mpjax.BlockScaledRecipe(keep_bf16=())
  every = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=every)
  state, batch, step = _fsdp_parts(every, width=128)
  assert state.params["w1"].shape[0] // every.fp8.block_size % 8 != 0  # the premise
  # One compile read twice: its GEMMs and its collectives. Five GEMMs are block-scaled (the
  # input's gradient is not asked for), as on one device.
  audited = mpjax.audit(step, state, batch, target="h100")
  assert sum(r.block_scales == "f8_e8m0fnu per 32" for r in audited.rows) == 5, audited.rows
  fixed = audited.collectives
  dtypes = {c.dtype for c in fixed.collectives}
  assert "float8_e8m0fnu" not in dtypes, dtypes
  # Left to XLA's partitioner, the blocks are split across devices. jax 0.10.2: jax's
  # partitioning of the cuDNN GEMM fails, or XLA gathers the E8M0 scales with an all-reduce,
  # which NCCL cannot run. Shardy in jax >= 0.11: the step compiles, replicating the split
  # blocks ("involuntary full rematerialization") at more than 1.5 times the bytes.
  monkeypatch.setattr(block_scaled, "_whole_blocks_on_each_device", lambda x, axis, block: x)
  state, batch, step = _fsdp_parts(every, width=128)  # a new jit: traced again
  try:
    split = collective_report(mpjax.compile_for(step, state, batch, target="h100"))
  except Exception as e:
    assert re.search("f8e8m0fnu not supported by NCCL|not divisible", str(e)), e
  else:
    assert split.total_bytes > 1.5 * fixed.total_bytes, (split, fixed)
