"""bf16 params and optimizer state: stochastic rounding, Kahan summation, the bf16_sr preset."""

import json
import os
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax

BF16, F32 = jnp.bfloat16, jnp.float32
NEAREST_BF16 = mpjax.Policy(BF16, BF16, F32, opt_state_dtype=BF16, rounding="nearest")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(32)(x))
    return nn.Dense(4)(x)


MODEL = MLP()


def _batch(n=32, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (n, 8)), "y": jax.random.randint(ky, (n,), 0, 4)}


def loss_fn(params, batch):
  logits = MODEL.apply(params, batch["x"]).astype(F32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


ADAMW = optax.adamw(1e-2)  # one object: every state built with it shares a compiled step
STEP = jax.jit(mpjax.make_train_step(loss_fn))
CHECKED_STEP = jax.jit(mpjax.make_train_step(loss_fn, skip_nonfinite=True))


def _state(policy="bf16_sr", tx=ADAMW, **kwargs):
  params = MODEL.init(jax.random.key(1), jnp.ones((1, 8)))
  return mpjax.TrainState.create(
    apply_fn=MODEL.apply, params=params, tx=tx, policy=policy, **kwargs
  )


def _host(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize(
  "kwargs,fix",
  [
    (dict(rounding="up"), "rounding='stochastic'"),
    (dict(rounding="kahan"), "param_dtype=jnp.bfloat16"),
    (dict(rounding="stochastic"), "set param_dtype or opt_state_dtype to jnp.bfloat16"),
    (dict(opt_state_dtype=jnp.float16), "opt_state_dtype=jnp.bfloat16"),
    (dict(opt_state_dtype=jnp.int32), "not a floating dtype"),
  ],
)
def test_bad_rounding_options_are_refused_with_the_fix(kwargs, fix):
  with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(".", r"\.")):
    mpjax.Policy(F32, BF16, F32, **kwargs)


def test_bf16_sr_preset_and_f32_masters_with_bf16_moments():
  policy = mpjax.get_policy("bf16_sr")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (BF16, BF16, F32)
  assert (policy.opt_state_dtype, policy.rounding) == (BF16, "stochastic")
  assert "rounding='stochastic'" in repr(policy)
  assert str(policy) != str(mpjax.get_policy("p=bf16,c=bf16,o=f32"))
  # Any preset's params with bf16 moments: f32 masters, stochastically rounded moments.
  mixed = mpjax.Policy(F32, BF16, F32, opt_state_dtype=BF16, rounding="stochastic")
  state, _ = STEP(_state(mixed), _batch())
  chex.assert_type(jax.tree.leaves(state.params), F32)
  adam = state.opt_state.inner[0]
  chex.assert_type(jax.tree.leaves((adam.mu, adam.nu)), BF16)
  chex.assert_type(adam.count, jnp.int32)


def test_the_spec_grammar_carries_the_storage_and_str_reads_back():
  for name in ("bf16_sr", "bf16_kahan"):
    assert mpjax.get_policy(str(mpjax.get_policy(name))) == mpjax.get_policy(name)
  policy = mpjax.get_policy("p=f32,c=bf16,o=f32,opt=bf16,rounding=stochastic")
  assert (policy.param_dtype, policy.opt_state_dtype, policy.rounding) == (F32, BF16, "stochastic")
  with pytest.raises(ValueError, match="param_dtype=jnp.bfloat16"):
    mpjax.get_policy("p=f32,c=bf16,rounding=kahan")


def test_bf16_sr_train_state_is_half_of_mixed_bf16s():
  sizes = {}
  for policy in ("mixed_bf16", "bf16_sr", "bf16_kahan"):
    state = _state(policy)
    sizes[policy] = mpjax.state_bytes(state.params, state.opt_state)
  scalars = 16  # the key's uint32[2], the update count, half of Adam's count
  assert sizes["bf16_sr"] <= sizes["mixed_bf16"] / 2 + scalars, sizes
  assert sizes["bf16_kahan"] <= sizes["mixed_bf16"] * 2 / 3 + scalars, sizes


def test_stochastic_round_is_unbiased_exact_on_bf16_values_and_keeps_specials():
  bits = jax.random.bits(jax.random.key(0), (200_000,), jnp.uint32)
  sr = jax.jit(mpjax.stochastic_round)
  x = jnp.full(bits.shape, 1.0 + 3 * 2.0**-10)  # 3/8 of bf16's spacing above 1
  y = sr(x, bits)
  chex.assert_type(y, BF16)
  assert set(np.unique(np.asarray(y, np.float32))) == {1.0, 1.0 + 2.0**-7}
  assert abs(float(jnp.mean(y.astype(F32))) - float(x[0])) < 5e-5  # nearest: 1.0, off 2.3e-3
  specials = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 1.5, -3.0, 3e38, -1e-40])
  all_ones = jnp.full(specials.shape, 0xFFFFFFFF, jnp.uint32)
  for b in (all_ones, jnp.zeros_like(all_ones)):
    out = np.asarray(sr(specials, b), np.float32)
    np.testing.assert_array_equal(out[:2], [np.inf, -np.inf])
    assert np.isnan(out[2])
    np.testing.assert_array_equal(out[3:7], [0.0, -0.0, 1.5, -3.0])
    assert np.signbit(out[4]) and np.isfinite(out[7]) and out[8] <= 0


def _below_spacing_run(policy, steps=64, n=4096):
  """Adam on w = 1 with a constant gradient: each update lr = 2**-11, a sixteenth of
  bf16's spacing at 1, far below half of it."""
  params = {"w": jnp.ones((n,), F32)}
  state = mpjax.TrainState.create(
    apply_fn=None, params=params, tx=optax.adam(2.0**-11), policy=policy
  )
  step = jax.jit(
    mpjax.make_train_step(lambda p, b: jnp.sum(p["w"].astype(F32) * b)), donate_argnums=0
  )
  for _ in range(steps):
    state, _ = step(state, jnp.ones((n,), F32))
  return float(jnp.mean(1.0 - state.params["w"].astype(F32)))


def test_updates_below_bf16_spacing_stall_to_nearest_and_are_kept_by_sr_and_kahan():
  moved = {p: _below_spacing_run(p) for p in ("fp32", NEAREST_BF16, "bf16_sr", "bf16_kahan")}
  f32 = moved["fp32"]
  assert abs(f32 - 64 * 2.0**-11) < 1e-4  # f32 masters move 2**-5
  assert moved[NEAREST_BF16] == 0.0  # round to nearest loses every update
  sr_error, kahan_error = abs(moved["bf16_sr"] - f32), abs(moved["bf16_kahan"] - f32)
  assert sr_error < 0.02 * f32, moved  # within 2% of f32 over 64 steps (sd of mean ~1%)
  assert kahan_error < 0.002 * f32 and kahan_error < sr_error, moved


def _run(state, batches, step):
  metrics = []
  for batch in batches:
    state, m = step(state, batch)
    metrics.append(m["loss"])
  return state, metrics


def test_runs_are_bit_identical_resume_continues_exactly_and_the_key_decides():
  step = STEP
  batches = [_batch(seed=i) for i in range(6)]
  a, _ = _run(_state(), batches, step)
  b, _ = _run(_state(), batches, step)
  chex.assert_trees_all_equal(_host(a.params), _host(b.params))
  chex.assert_trees_all_equal(_host(a.opt_state), _host(b.opt_state))
  # Interrupted after 3 steps, saved to host memory, resumed: the same bits.
  half, _ = _run(_state(), batches[:3], step)
  resumed = jax.tree.map(jnp.asarray, jax.device_get(half))
  resumed, _ = _run(resumed, batches[3:], step)
  chex.assert_trees_all_equal(_host(resumed.params), _host(a.params))
  chex.assert_trees_all_equal(_host(resumed.opt_state), _host(a.opt_state))
  # Another key rounds otherwise.
  c, _ = _run(_state(rounding_key=jax.random.key(7)), batches, step)
  assert any(
    not np.array_equal(x, y)
    for x, y in zip(jax.tree.leaves(_host(a.params)), jax.tree.leaves(_host(c.params)), strict=True)
  )


def test_a_skipped_step_changes_nothing_key_and_count_included():
  step = CHECKED_STEP
  state, _ = _run(_state(), [_batch(seed=0)], step)
  before = _host((state.params, state.opt_state, state.step))
  poisoned = dict(_batch(seed=1), x=_batch(seed=1)["x"].at[2, 3].set(jnp.nan))
  skipped, metrics = step(state, poisoned)
  assert not bool(metrics["grads_finite"])
  chex.assert_trees_all_equal(_host((skipped.params, skipped.opt_state, skipped.step)), before)
  assert int(skipped.opt_state.count) == 1
  # The next step rounds as if the bad batch had never come.
  after_skip, _ = step(skipped, _batch(seed=2))
  direct, _ = step(state, _batch(seed=2))
  chex.assert_trees_all_equal(_host(after_skip.params), _host(direct.params))


@pytest.mark.parametrize(
  "tx",
  [
    ADAMW,
    optax.sgd(0.1, momentum=0.9),
    optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(1e-2)),
  ],
  ids=["adamw", "sgd_momentum", "clip_injected_adam"],
)
@pytest.mark.parametrize("policy", ["bf16_sr", "bf16_kahan"])
def test_any_optax_optimizer_trains_with_bf16_state_under_jit(tx, policy):
  state = _state(policy, tx)
  batch = _batch()
  first = None
  for _ in range(20):
    state, metrics = STEP(state, batch)
    first = metrics["loss"] if first is None else first
  assert float(metrics["loss"]) < 0.8 * float(first)
  chex.assert_type(jax.tree.leaves(state.params), BF16)
  for leaf in jax.tree.leaves(state.opt_state.inner):
    if jnp.ndim(leaf) > 0:  # per-parameter state in bf16
      chex.assert_type(leaf, BF16)
    elif jnp.issubdtype(leaf.dtype, jnp.floating):  # injected hyperparameters stay f32
      chex.assert_type(leaf, F32)
  assert (state.opt_state.compensation is None) == (policy == "bf16_sr")
  assert int(state.opt_state.count) == 20


def test_a_checkpoint_keeps_the_key_and_the_restored_run_rounds_on_exactly(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  batches = [_batch(seed=i) for i in range(4)]
  uninterrupted, _ = _run(_state(rounding_key=3), batches, STEP)
  half, _ = _run(_state(rounding_key=3), batches[:2], STEP)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(2, args=ocp.args.StandardSave(half))
    manager.wait_until_finished()
  # The restore target: a fresh state (another key: the checkpoint's must win).
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(rounding_key=0))
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    restored = manager.restore(2, args=ocp.args.StandardRestore(target))
  chex.assert_trees_all_equal(_host(restored.opt_state.key), _host(half.opt_state.key))
  resumed, _ = _run(restored, batches[2:], STEP)
  chex.assert_trees_all_equal(_host(resumed.params), _host(uninterrupted.params))
  chex.assert_trees_all_equal(_host(resumed.opt_state), _host(uninterrupted.opt_state))


def test_experiment_resumed_from_a_checkpoint_ends_where_an_unbroken_run_ends(tmp_path):
  ex = pytest.importorskip("mpjax.experiment")
  ocp = pytest.importorskip("orbax.checkpoint")
  overrides = ["policy=bf16_sr", "steps=40", "checkpoint_every=20", "log_every=10"]
  config = ex.load_config("digits_mlp", overrides)
  run = tmp_path / "run"
  full = ex.train(config, run_dir=run)
  exp = ex.Experiment(config)

  def restore():
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, exp.init_state())
    with ocp.CheckpointManager(run / "checkpoints") as manager:
      return manager.latest_step(), manager.restore(
        manager.latest_step(), args=ocp.args.StandardRestore(target)
      )

  step, a = restore()
  assert step == 40 and isinstance(a.opt_state, mpjax.RoundingState)
  # As if killed after the checkpoint of step 20: the same command resumes from it.
  for path in (run / "checkpoints" / "40", run / "summary.json"):
    subprocess.run(["rm", "-rf", str(path)], check=True)
  resumed = ex.train(config, run_dir=run)
  assert resumed["steps"] == 40
  step, b = restore()
  chex.assert_trees_all_equal(_host(a.params), _host(b.params))
  chex.assert_trees_all_equal(_host(a.opt_state), _host(b.opt_state))
  assert full["test_loss"] == resumed["test_loss"]


_EIGHT_DEVICES = """
import jax, jax.numpy as jnp, numpy as np, optax, mpjax
from jax.sharding import NamedSharding, PartitionSpec as P
import flax.linen as nn
assert jax.device_count() == 8
# Auto axes, as data parallelism is usually written: under jax 0.12's Explicit axes (the
# default of make_mesh) the gradient of optax's integer-label cross entropy is refused by JAX
# itself, mpjax or not (an ambiguous scatter sharding).
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
model = nn.Sequential([nn.Dense(64), nn.gelu, nn.Dense(4)])
def loss_fn(params, batch):
  logits = model.apply(params, batch["x"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
def batch(i):
  kx, ky = jax.random.split(jax.random.key(i))
  b = {"x": jax.random.normal(kx, (64, 16)), "y": jax.random.randint(ky, (64,), 0, 4)}
  return jax.device_put(b, NamedSharding(mesh, P("data")))
params = model.init(jax.random.key(1), jnp.ones((1, 16)))
def replicated_copies_agree(state):
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == 8 and all(np.array_equal(shards[0], s) for s in shards), leaf
for policy in ("bf16_sr", "bf16_kahan"):
  state = mpjax.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2),
                                  policy=policy)
  host = jax.device_get(state)
  state = jax.device_put(state, NamedSharding(mesh, P()))
  # jit with shardings: the batch split over 8 devices, the state replicated.
  step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
  jitted = state
  for i in range(5):
    jitted, _ = step(jitted, batch(i))
  replicated_copies_agree(jitted)
  # shard_map: each device its own copy, gradients averaged over "data"; out_specs P()
  # makes JAX check that every device's new state is the same value.
  sm = jax.jit(jax.shard_map(mpjax.make_train_step(loss_fn, axis_name="data"), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=(P(), P())))
  mapped = jax.device_put(host, NamedSharding(mesh, P()))
  for i in range(5):
    mapped, _ = sm(mapped, batch(i))
  replicated_copies_agree(mapped)
  assert int(mapped.opt_state.count) == 5
print("ok")
"""


def test_data_parallel_replicas_round_identically_over_eight_host_devices():
  env = {k: v for k, v in os.environ.items() if k != "MPJAX_POLICY"}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", _EIGHT_DEVICES], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.usefixtures("gpu_compiler")
def test_h100_step_of_bf16_sr_costs_no_byte_and_no_kernel_per_leaf_over_nearest(tmp_path):
  sys.path.insert(0, str(os.path.join(os.path.dirname(__file__), "..", "scripts")))
  import state_memory

  out = tmp_path / "state.json"
  argv = ["--small", "--models", "mlp", "--policies", "fp32,pure_bf16,bf16_sr", "--json", str(out)]
  state_memory.main(argv)
  record = json.loads(out.read_text())
  assert record["jax"] == jax.__version__ and record["target"] == "h100"
  assert record["gemm_modes"]["default"]["xla_options"] == {"xla_gpu_enable_triton_gemm": True}
  assert record["gemm_modes"]["cublaslt"]["xla_options"] == {"xla_gpu_enable_triton_gemm": False}
  r = record["results"]["mlp"]
  assert r["bf16_sr"]["state_bytes_per_param"] <= r["fp32"]["state_bytes_per_param"] / 2 + 0.02
  for mode in ("default", "cublaslt"):
    sr, nearest = r["bf16_sr"][mode], r["pure_bf16"][mode]
    # The rounding fuses into the update: no kernel per leaf, which would add six or more. Since
    # both policies autocast (2026-12-07), the default mode's untuned program has 25 kernels
    # against 22 (cuBLASLt mode: at most one more, the step's seed). (The full-size MLP moves
    # the same bytes as pure_bf16; this tiny one a few kB more.)
    assert sr["bytes_moved"] <= nearest["bytes_moved"] * 1.1, mode
    assert sr["kernels"] <= nearest["kernels"] + (3 if mode == "default" else 1), mode
    assert sr["bytes_ratio"] == sr["bytes_moved"] / r["fp32"][mode]["bytes_moved"]
  # Autocast's casts (the f32 batch, each bf16 GEMM's operands) on this tiny MLP: 25 kernels
  # against fp32's 21 in the default mode since bf16_sr autocasts; its bytes stay about half.
  assert r["bf16_sr"]["default"]["kernels"] <= r["fp32"]["default"]["kernels"] * 1.25
  assert r["fp32"]["cublaslt"]["split_k_bytes"] == 0


@pytest.mark.usefixtures("gpu_compiler")
def test_h100_update_of_many_leaves_is_one_fused_kernel_not_one_per_leaf():
  policy, tx, n = mpjax.get_policy("bf16_sr"), optax.adamw(1e-3), 512 * 512
  params = {f"w{i}": jax.ShapeDtypeStruct((512, 512), BF16) for i in range(8)}
  opt_state = jax.eval_shape(lambda p: mpjax.init_opt_state(tx, policy, p), params)
  grads = {k: jax.ShapeDtypeStruct(v.shape, F32) for k, v in params.items()}
  update = jax.jit(lambda g, s, p: mpjax.rounded_update(tx, policy, g, s, p))
  report = mpjax.kernel_report(update, grads, opt_state, params, target="h100")
  # Every leaf's seeds come from one vector of them, which the eight same-shaped updates share:
  # XLA fuses them into one kernel (a kernel per leaf before: 13 in all). Each parameter is
  # read (bf16 param, mu, nu; f32 grad) and written (param, mu, nu) once: 16 bytes.
  big = [k for k in report.kernels if k.bytes > n]
  assert len(big) == 1 and report.count < 8, [(k.name, k.bytes) for k in report.kernels]
  assert report.bytes_moved <= 8 * n * 16 + 4096


def test_the_rounding_key_takes_numpy_and_0d_integer_seeds_in_and_out_of_jit():
  tx, params = optax.sgd(1e-3), {"w": jnp.zeros(3, BF16)}
  policy = mpjax.get_policy("bf16_sr")
  expected = np.asarray(mpjax.init_opt_state(tx, policy, params, jax.random.key(3)).key)
  init = jax.jit(lambda seed: mpjax.init_opt_state(tx, policy, params, seed).key)
  for seed in (3, np.int64(3), np.uint32(3), np.array(3), jnp.int32(3)):
    np.testing.assert_array_equal(mpjax.init_opt_state(tx, policy, params, seed).key, expected)
  np.testing.assert_array_equal(init(jnp.int32(3)), expected)
  with pytest.raises(ValueError, match=r"got float32\[\]"):
    mpjax.init_opt_state(tx, policy, params, np.float32(3))


def test_an_optimizer_that_rounds_its_own_state_is_warned_of():
  params = {"w": jnp.zeros(3, BF16)}
  with pytest.warns(UserWarning, match="mu_dtype=jnp.bfloat16.*opt_state_dtype instead"):
    mpjax.TrainState.create(
      apply_fn=None, params=params, tx=optax.adam(1e-3, mu_dtype=BF16), policy="bf16_sr"
    )


def test_experiment_rounding_key_follows_the_seed():
  ex = pytest.importorskip("mpjax.experiment")
  tiny = ["model.features=()"]  # the head alone: the state without a hidden layer to initialise
  keys = [
    np.asarray(
      ex.Experiment(ex.load_config("digits_mlp", ["policy=bf16_sr", f"seed={seed}", *tiny]))
      .init_state()
      .opt_state.key
    )
    for seed in (1, 2)
  ]
  assert not np.array_equal(keys[0], keys[1])


def test_state_memory_without_fp32_is_refused_at_parsing(capsys):
  sys.path.insert(0, str(os.path.join(os.path.dirname(__file__), "..", "scripts")))
  import state_memory

  with pytest.raises(SystemExit):
    state_memory.main(["--small", "--models", "mlp", "--policies", "pure_bf16,bf16_sr"])
  assert "must include fp32" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    state_memory.main(["--small", "--models", "mlp", "--gemm_backends", "cublas"])
  assert "--gemm_backends cublas: gemm_backend='cublas' is not one of" in capsys.readouterr().err


class DeclaresF32(nn.Module):
  """A model as Flax's lm1b example and nanodo write one: every layer declares dtype=float32."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 32, dtype=F32)(tokens)
    h = nn.LayerNorm(dtype=F32)(x)
    mask = nn.make_causal_mask(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, dtype=F32)(h, h, mask=mask)
    h = nn.LayerNorm(dtype=F32)(x)
    x = x + nn.Dense(32, dtype=F32)(nn.gelu(nn.Dense(64, dtype=F32)(h)))
    return nn.Dense(64, dtype=F32)(nn.LayerNorm(dtype=F32)(x))


def _declares_f32_step(policy, **step_kwargs):
  model = DeclaresF32()
  tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 64)

  def lm_loss(params, tokens):
    logits = model.apply(params, tokens[:, :-1]).astype(F32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  params = model.init(jax.random.key(1), tokens[:, :-1])
  state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.adamw(1e-3), policy=policy
  )
  return jax.jit(mpjax.make_train_step(lm_loss, **step_kwargs)), state, tokens


# The declared-f32 model's step: 9 forward GEMMs (4 projections and 2 attention einsums, 2 MLP
# Dense layers, the head) and 18 backward ones (the first projections' input gradients summed
# into one by XLA), as the compiled program counts them.
DECLARED_F32_GEMMS = 27


@pytest.mark.parametrize("policy", ["bf16_sr", "pure_bf16", "bf16_kahan"])
def test_bf16_storage_runs_a_declared_f32_models_gemms_in_bf16_with_f32_accumulation(policy):
  from mpjax.audit import parse_compiled_gemms

  step, state, tokens = _declares_f32_step(policy)
  gemms = parse_compiled_gemms(step.lower(state, tokens).compile().as_text())
  assert len(gemms) == DECLARED_F32_GEMMS
  assert {(g.lhs_dtype, g.rhs_dtype, g.accumulation) for g in gemms} == {
    ("bfloat16", "bfloat16", "f32")
  }
  # The premise: casting the params to bf16 (the step before autocast ran these policies) leaves
  # the model's declared f32 to widen every weight again, so every GEMM runs in f32.
  old, _, _ = _declares_f32_step(policy, autocast=False)
  old_gemms = parse_compiled_gemms(old.lower(state, tokens).compile().as_text())
  assert {(g.lhs_dtype, g.rhs_dtype) for g in old_gemms} == {("float32", "float32")}
  # The state stays in bf16 storage, the loss is f32 and close to the f32 model's.
  new_state, metrics = step(state, tokens)
  assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype(BF16)}
  assert metrics["loss"].dtype == F32
  f32_step, f32_state, _ = _declares_f32_step("fp32")
  _, f32_metrics = f32_step(f32_state, tokens)
  np.testing.assert_allclose(metrics["loss"], f32_metrics["loss"], rtol=2e-2)


def test_bf16_storage_keeps_softmax_norms_and_the_loss_in_f32():
  from jax.extend import core as jcore

  def eqns(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for inner in jcore.jaxprs_in_params(eqn.params):
        yield from eqns(getattr(inner, "jaxpr", inner))

  step, state, tokens = _declares_f32_step("pure_bf16")
  # Read from the traced step: every exp (softmax, GELU's tanh aside), rsqrt (LayerNorm) and log
  # (the loss's log-softmax) runs in f32, forward and backward, as autocast runs them.
  dtypes = {}
  for eqn in eqns(jax.make_jaxpr(step)(state, tokens).jaxpr):
    if eqn.primitive.name in ("exp", "rsqrt", "log"):
      dtypes.setdefault(eqn.primitive.name, set()).add(np.dtype(eqn.outvars[0].aval.dtype))
  assert dtypes == {"exp": {np.dtype(F32)}, "rsqrt": {np.dtype(F32)}, "log": {np.dtype(F32)}}


@pytest.mark.usefixtures("gpu_compiler")
@pytest.mark.parametrize("policy", ["bf16_sr", "pure_bf16"])
def test_bf16_storage_runs_a_declared_f32_models_gemms_in_bf16_compiled_for_h100(policy):
  from mpjax.audit import parse_compiled_gemms

  step, state, tokens = _declares_f32_step(policy)
  hlo = mpjax.compile_for(step, state, tokens, target="h100").as_text()
  gemms = parse_compiled_gemms(hlo)
  # The GEMMs of mixed_bf16's step of the same model (XLA:GPU merges a few of the CPU's), each
  # a Tensor Core call multiplying bf16 x bf16 and accumulating in f32.
  mixed, mixed_state, _ = _declares_f32_step("mixed_bf16")
  mixed_gemms = parse_compiled_gemms(
    mpjax.compile_for(mixed, mixed_state, tokens, target="h100").as_text()
  )

  def shapes(gemms):
    return sorted(tuple(sorted(g.dims.items())) for g in gemms)

  assert shapes(gemms) == shapes(mixed_gemms)
  assert all(g.tensor_core for g in gemms)
  assert {(g.lhs_dtype, g.rhs_dtype, g.accumulation) for g in gemms} == {
    ("bfloat16", "bfloat16", "f32")
  }
  old, _, _ = _declares_f32_step(policy, autocast=False)  # the premise, as on the CPU
  old_gemms = parse_compiled_gemms(mpjax.compile_for(old, state, tokens, target="h100").as_text())
  assert {(g.lhs_dtype, g.rhs_dtype) for g in old_gemms} == {("float32", "float32")}
