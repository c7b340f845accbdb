"""Experiments from configs and the ``mpjax`` command line, run as a user runs them."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import mpjax.collectives
from mpjax import cli, models
from mpjax import experiment as ex
from mpjax.experiment.config import mesh_shape
from mpjax.experiment.metrics import read_health
from mpjax.experiment.sharding import param_specs
from mpjax.layout import fsdp_spec

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py"))


def _restore(run_dir, exp):
  state = exp.init_state()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  with ocp.CheckpointManager(Path(run_dir) / "checkpoints") as manager:
    return manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))


# ------------------------------------------------------------------ configs and bad input


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_loads_and_builds(name):
  config = ex.load_config(name)
  exp = ex.Experiment(config)
  assert config.name == name and exp.mesh.size == len(jax.local_devices())


def test_overrides_keep_types_and_nested_keys():
  config = ex.load_config("default", ["--config.steps=7", "model.d_model=64", "policy=fp32"])
  assert (config.steps, config.model.d_model, config.policy) == (7, 64, "fp32")
  config = ex.load_config("default", ["learning_rate=1"])  # an int where a float is expected
  assert config.learning_rate == 1.0 and isinstance(config.learning_rate, float)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["train", "no_such_config"], "unknown config 'no_such_config'"),
    (["train", "missing/file.py"], "does not exist"),
    (["train", "--config.stepz=3"], "unknown config key 'stepz'"),
    (["train", "--config.model.widht=3"], "unknown config key 'model.widht'"),
    (["train", "--config.steps=many"], "expected a value of type int"),
    (["train", "--config.policy=mixed_bf61"], "config.policy"),
    (["train", "--config.batch_size=0"], "config.batch_size=0"),
    (["train", "--config.model.d_model=100"], "config.model"),
    (["train", "--config.data.name=imagenet"], "config.data"),
    (["compare", "digits_mlp", "--policies", "fp32,fp33"], "--policies"),
    (["train", "--num_processes", "2", "--process_id", "0"], "jax.distributed.initialize failed"),
    (["train", "--config.autocast_rules=*attn*"], "is not a dict literal"),
    (["train", "--config.autocast_rules={'tanh': 'fp31'}"], "config.autocast_rules"),
    (["train", "--config.health_every=-1"], "config.health_every"),
    (["diagnose", "digits_mlp", "--step", "-1"], "--step=-1"),
    (["train", "--config.mesh.fsdp=3"], "config.mesh.fsdp=3 does not divide the 1 devices"),
    (["train", "--config.mesh.data=2"], "holds 2 devices, but this run uses 1"),
    (["train", "--config.mesh.fsdp=0"], "config.mesh.fsdp=0 must be an integer >= 1"),
    (["train", "--config.mesh.tensor=2"], "unknown mesh axis 'tensor'"),
    (["doctor", "digits_mlp", "--mesh", "fsdp=8"], "--mesh needs --target"),
    (["doctor", "digits_mlp", "--target", "h100", "--mesh", "tensor=2"], "unknown mesh axis"),
    (["doctor", "digits_mlp", "--target", "h100", "--mesh", "fsdp=7"], "not divisible by the 7"),
  ],
)
def test_bad_input_is_one_line_and_exit_status_2(argv, message, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("mpjax: error: ") and "\n" not in err, err
  assert message in err


def test_without_the_experiments_extra_the_cli_says_what_to_install_before_any_work():
  blocked = ["ml_collections", "orbax.checkpoint", "sklearn", "matplotlib", "tqdm"]
  code = (
    "import sys\n"
    f"for name in {blocked!r}:\n"
    "  sys.modules[name] = None  # as if not installed\n"
    "import mpjax  # the library needs none of them\n"
    "from mpjax import cli\n"
    "codes = [cli.main(['train']), cli.main(['compare', 'digits_mlp', '--policies', 'fp32'])]\n"
    "print(codes)\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "MPJAX_POLICY"}
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().splitlines()[-1] == "[1, 1]"
  lines = [line for line in proc.stderr.splitlines() if line.startswith("mpjax: error: ")]
  assert [line.split(" needs ")[0] for line in lines] == [
    "mpjax: error: mpjax train",
    "mpjax: error: mpjax compare",
  ], proc.stderr[-3000:]
  for line in lines:
    assert "experiments extra (ml_collections, orbax-checkpoint, scikit-learn, matplotlib" in line
    assert 'pip install "mpjax[experiments]"' in line and 'pip install -e ".[experiments]"' in line
  assert "Traceback" not in proc.stderr


def test_unwritable_run_dir_is_one_line_and_exit_status_2(tmp_path, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert cli.main(["train", "digits_mlp", "--run_dir", str(blocker / "run")]) == 2
  err = capsys.readouterr().err.strip()
  assert "is not writable" in err and "\n" not in err


def test_a_mesh_must_use_every_device_and_name_only_data_and_fsdp(tmp_path):
  def sizes(devices, **mesh):
    config = ex.load_config("default")
    config.mesh.update(mesh)
    return mesh_shape(config, devices)

  assert sizes(8) == {"data": 8, "fsdp": 1}  # the default: data parallel over every device
  assert sizes(8, fsdp=8) == {"data": 1, "fsdp": 8}
  assert sizes(8, data=2, fsdp=4) == {"data": 2, "fsdp": 4}
  with pytest.raises(
    ex.ConfigError, match=r"data=4 x fsdp=4 holds 16 devices, but this run uses 8"
  ):
    sizes(8, data=4, fsdp=4)
  with pytest.raises(ex.ConfigError, match=r"or set config.num_devices=4\."):
    sizes(8, data=2, fsdp=2)  # fewer devices than the run has: num_devices says how many
  with pytest.raises(ex.ConfigError, match="config.mesh.fsdp=3 does not divide the 8 devices"):
    sizes(8, fsdp=3)
  # An axis in the config file itself (not an override) is refused at load, with the fix.
  config_file = tmp_path / "tensor_parallel.py"
  config_file.write_text(
    "from configs import default\n\n\n"
    "def get_config():\n"
    "  config = default.get_config()\n"
    "  config.mesh.tensor = 2\n"
    "  return config\n"
  )
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "default.py").write_text((ROOT / "configs" / "default.py").read_text())
  moved = tmp_path / "configs" / "tensor_parallel.py"
  config_file.rename(moved)
  with pytest.raises(ex.ConfigError, match=r"config.mesh: unknown mesh axis 'tensor'.*remove it"):
    ex.load_config(str(moved))


def test_fsdp_shards_each_param_on_its_largest_dimension_the_axis_divides():
  assert fsdp_spec((64, 256), 8) == P(None, "fsdp")
  assert fsdp_spec((256, 256), 8) == P("fsdp")  # a tie: the first
  assert fsdp_spec((12, 24, 8), 4) == P(None, "fsdp")
  assert fsdp_spec((10, 3), 4) == P()  # none divides: replicated
  assert fsdp_spec((64, 256), 1) == P()
  params = {"dense": {"kernel": jnp.ones((64, 256)), "bias": jnp.ones(256)}, "head": jnp.ones(10)}
  assert param_specs(params, {"data": 2, "fsdp": 4}) == {
    "dense": {"kernel": P(None, "fsdp"), "bias": P("fsdp")},
    "head": P(),
  }


class _Annotated(nn.Module):
  """A model that says where its params go (MaxText's style), over axes a mesh may not have."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "fsdp")))(x)
    x = nn.Dense(64, kernel_init=nn.with_partitioning(init, ("fsdp", "tensor")))(x)
    return nn.Dense(16, kernel_init=nn.with_partitioning(init, (("data", "fsdp"), None)))(x)


def test_partitioning_metadata_decides_where_params_go():
  boxed = jax.eval_shape(_Annotated().init, jax.random.key(0), jnp.ones((2, 32)))["params"]
  specs = param_specs(boxed, {"data": 2, "fsdp": 4})
  assert specs["Dense_0"] == {"kernel": P(None, "fsdp"), "bias": P()}  # unannotated: replicated
  assert specs["Dense_1"]["kernel"] == P("fsdp")  # "tensor" is not a mesh axis: whole
  assert specs["Dense_2"]["kernel"] == P(("data", "fsdp"))
  # An axis of size 1 shards nothing; a dimension its axes do not divide is refused.
  assert param_specs(boxed, {"data": 1, "fsdp": 4})["Dense_2"]["kernel"] == P("fsdp")
  with pytest.raises(ValueError, match=r"\['Dense_2'\]\['kernel'\].*not divisible by data x fsdp"):
    param_specs(boxed, {"data": 3, "fsdp": 4})


def test_resuming_with_a_different_config_is_refused(tmp_path):
  ex.train(ex.load_config("digits_mlp", ["steps=4", "log_every=2"]), run_dir=tmp_path)
  with pytest.raises(ex.ConfigError, match="learning_rate"):
    ex.train(ex.load_config("digits_mlp", ["steps=8", "learning_rate=0.1"]), run_dir=tmp_path)


def test_a_checkpoint_of_another_model_version_is_one_clear_error(tmp_path, monkeypatch):
  ex.train(ex.load_config("digits_mlp", ["steps=4", "log_every=2"]), run_dir=tmp_path)
  # the same config, but the model code changed its parameter shapes since the run was saved
  monkeypatch.setitem(ex.MODELS, "mlp", lambda **kw: models.MLP(**{**kw, "features": (32,)}))
  with pytest.raises(ex.ConfigError, match="does not fit this config's model.*new --run_dir"):
    ex.train(ex.load_config("digits_mlp", ["steps=8", "log_every=2"]), run_dir=tmp_path)


def test_env_policy_overrides_the_config_but_not_compare(tmp_path, monkeypatch):
  monkeypatch.setenv("MPJAX_POLICY", "mixed_fp16")
  summary = ex.train(ex.load_config("digits_mlp", ["steps=3", "log_every=3"]), run_dir=tmp_path)
  assert summary["policy"] == "mixed_fp16" and "compute_dtype=float16" in summary["dtypes"]
  with pytest.raises(ex.ConfigError, match="MPJAX_POLICY is set"):
    ex.compare(ex.load_config("digits_mlp"), ["fp32"], run_dir=tmp_path / "c")


# ------------------------------------------------------------------ train, resume, signals


def test_interrupted_run_resumes_bit_identically(tmp_path):
  """SIGINT mid-run writes a checkpoint; rerunning ends exactly where an unbroken run ends."""
  overrides = ["steps=300", "log_every=5", "policy=mixed_fp16"]
  config = ex.load_config("digits_cnn", overrides)  # BatchNorm statistics and a dynamic scale
  full = ex.train(config, run_dir=tmp_path / "full")

  metrics = tmp_path / "broken" / "metrics.jsonl"

  def interrupt_once_logging():
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
      time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)

  thread = threading.Thread(target=interrupt_once_logging, daemon=True)
  thread.start()
  first = ex.train(config, run_dir=tmp_path / "broken")
  thread.join()
  assert first["interrupted"] == "SIGINT" and first["steps"] < 300, first
  resumed = ex.train(config, run_dir=tmp_path / "broken")
  assert resumed["interrupted"] is None and resumed["steps"] == 300

  exp = ex.Experiment(config)
  a, b = _restore(tmp_path / "full", exp), _restore(tmp_path / "broken", exp)
  chex.assert_trees_all_equal(a.params, b.params)
  chex.assert_trees_all_equal(a.opt_state, b.opt_state)
  chex.assert_trees_all_equal(a.model_state, b.model_state)
  chex.assert_trees_all_equal(a.loss_scale, b.loss_scale)
  assert (full["test_loss"], full["loss"]) == (resumed["test_loss"], resumed["loss"])
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  logged = [r["step"] for r in rows if "loss" in r]
  assert logged == sorted(set(logged)), "metrics past the checkpoint were not dropped"


def test_cli_sigterm_writes_a_checkpoint_and_the_same_command_resumes(tmp_path):
  run_dir = tmp_path / "run"
  argv = [sys.executable, "-m", "mpjax.cli", "train", "digits_mlp", "--run_dir", str(run_dir)]
  argv += ["--no_progress", "--config.steps=20000", "--config.log_every=10"]
  env = {k: v for k, v in os.environ.items() if k != "MPJAX_POLICY"}
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  deadline = time.time() + 120
  metrics = run_dir / "metrics.jsonl"
  while not (metrics.exists() and metrics.read_text()) and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert "stopped by SIGTERM" in err and "Traceback" not in err
  with ocp.CheckpointManager(run_dir / "checkpoints") as manager:
    stopped_at = manager.latest_step()
  assert 0 < stopped_at < 20000
  logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  assert max(logged) == stopped_at  # no finished, logged step is lost


def test_train_cli_prints_a_summary_and_writes_the_run_directory(tmp_path, capsys):
  run_dir = tmp_path / "run"
  argv = ["train", "digits_mlp", "--run_dir", str(run_dir), "--config.steps=30"]
  assert cli.main(argv + ["--config.log_every=10"]) == 0
  out = capsys.readouterr().out
  assert "30 steps" in out and "skipped steps" in out and "step memory" in out
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["steps"] == 30 and summary["test_accuracy"] > 0.5
  assert {"step", "loss", "loss_scale", "skipped_steps", "step_time_s"} <= set(
    json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
  )
  assert (run_dir / "config.json").exists()


# ------------------------------------------------------------------ evidence


@pytest.mark.parametrize("name", ["digits_mlp", "digits_cnn"])
def test_digits_mixed_precision_accuracy_within_half_a_point_of_fp32(name, tmp_path):
  config = ex.load_config(name)
  results = ex.compare(config, ["fp32", "mixed_bf16", "mixed_fp16"], run_dir=tmp_path)
  base = results["fp32"]["test_accuracy"]
  assert base > 0.9
  for policy in ("mixed_bf16", "mixed_fp16"):
    assert abs(results[policy]["test_accuracy"] - base) <= 0.005, results
  table = (tmp_path / "results.md").read_text()
  assert "speedup vs fp32" in table and "mixed_fp16" in table
  assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "loss_scale.png").exists()


def test_char_lm_mixed_precision_loss_within_two_percent_of_fp32(tmp_path):
  config = ex.load_config("default", ["steps=150", "log_every=50", "eval_every=0"])
  results = ex.compare(config, ["fp32", "mixed_bf16", "mixed_fp16"], run_dir=tmp_path)
  base = results["fp32"]["test_loss"]
  assert base < 3.0  # learned something: uniform over ~100 characters is 4.6
  for policy in ("mixed_bf16", "mixed_fp16"):
    assert abs(results[policy]["test_loss"] / base - 1) < 0.02, results


def test_underflow_demo_compare_shows_fp16_needs_loss_scaling(tmp_path):
  config = ex.load_config("underflow_demo")
  results = ex.compare(config, ["fp32", "mixed_fp16", "mixed_fp16:none"], run_dir=tmp_path)
  base = results["fp32"]["test_accuracy"]
  assert base > 0.9
  assert results["mixed_fp16:none"]["loss_scale"] == "none"
  assert results["mixed_fp16:none"]["test_accuracy"] < base - 0.2, results
  assert abs(results["mixed_fp16"]["test_accuracy"] - base) <= 0.02, results
  table = (tmp_path / "results.md").read_text()
  assert "| mixed_fp16:none | " in table and (tmp_path / "mixed_fp16-none").is_dir()
  assert "spread" in table and "±" in table.split("| fp32 | ")[1].split("|")[0]
  with pytest.raises(ex.ConfigError, match="loss scale 'sometimes' is not one of"):
    ex.compare(config, ["mixed_fp16:sometimes"], run_dir=tmp_path / "bad")


# ------------------------------------------------------------------ when training goes wrong

# fp16 with a learning rate that blows the weights up: after a few steps a GEMM's fp16 output
# overflows on every step, while f32 still computes it.
DIVERGING = [
  "--config.policy=mixed_fp16",
  "--config.learning_rate=300.0",
  "--config.steps=300",
  "--config.log_every=5",
]


def test_divergence_guard_stops_with_a_checkpoint_the_cause_and_exit_status_3(tmp_path, capsys):
  run = tmp_path / "guarded"
  argv = ["train", "digits_mlp", "--run_dir", str(run), "--no_progress", *DIVERGING]
  assert cli.main([*argv, "--config.stop_after_skips=20"]) == ex.DIVERGED_EXIT_STATUS
  err = capsys.readouterr().err
  summary = json.loads((run / "summary.json").read_text())
  stopped = summary["steps"]
  assert stopped < 100 and summary["skipped_steps"] >= 20
  assert f"mpjax: stopped at step {stopped}" in err and "skipped" in err
  assert "in module `MLP/dense_" in err and "--config.autocast_rules=" in err
  assert summary["diverged"] in err
  with ocp.CheckpointManager(run / "checkpoints") as manager:
    assert manager.latest_step() == stopped
  # The premise: unguarded, the same run skips step after step to the end.
  off = ["--config.stop_after_skips=0", "--config.stop_at_min_scale=0"]
  assert cli.main([*argv[:3], str(tmp_path / "unguarded"), *argv[4:], *off]) == 0
  unguarded = json.loads((tmp_path / "unguarded" / "summary.json").read_text())
  assert unguarded["steps"] == 300 and unguarded["skipped_steps"] > 250
  # mpjax diagnose replays the stopped run with its own config (fp16, the learning rate).
  capsys.readouterr()
  assert cli.main(["diagnose", "digits_mlp", "--step", str(stopped), "--run_dir", str(run)]) == 0
  out = capsys.readouterr().out
  assert f"from the checkpoint of step {stopped}" in out and "[mixed_fp16]" in out
  assert "in module `MLP/dense_" in out and "Suggested rules" in out and "'fp32'" in out


def test_diagnose_a_healthy_config_finds_nothing(capsys):
  assert cli.main(["diagnose", "digits_mlp", "--config.policy=mixed_fp16"]) == 0
  out = capsys.readouterr().out
  assert "from the initial state" in out
  assert "No operation overflows" in out and "none needed" in out


def test_gradient_health_shows_the_underflow_that_loss_scaling_removes(tmp_path):
  config = ex.load_config("underflow_demo", ["steps=60", "health_every=20", "log_every=20"])
  results = ex.compare(config, ["mixed_fp16:none", "mixed_fp16"], run_dir=tmp_path)
  assert set(results) == {"mixed_fp16:none", "mixed_fp16"}

  def last_health(run):
    rows = read_health(tmp_path / run)
    assert [r["step"] for r in rows] == [20, 40, 60]
    return rows[-1]

  unscaled, scaled = last_health("mixed_fp16-none"), last_health("mixed_fp16")
  # Without scaling nearly every first-layer gradient entry is below fp16's smallest
  # subnormal; at the dynamic scale none is.
  assert unscaled["health/params/dense_0/underflow"] > 0.9
  assert scaled["health/params/dense_0/underflow"] < 0.01
  assert (tmp_path / "underflow.png").is_file()
  assert "underflow.png" in (tmp_path / "results.md").read_text()
  # Nothing is measured when not asked for.
  config = ex.load_config("underflow_demo", ["steps=20", "log_every=10"])
  ex.train(config, run_dir=tmp_path / "plain")
  assert not read_health(tmp_path / "plain")


def test_autoprecision_picks_rules_before_training_and_saves_them(tmp_path, capsys):
  config = ex.load_config(
    "digits_mlp", ["policy=mixed_fp16", "autoprecision=true", "steps=10", "log_every=5"]
  )
  summary = ex.train(config, run_dir=tmp_path)
  err = capsys.readouterr().err
  assert "mpjax: autoprecision: config.autocast_rules = {}" in err  # a healthy model: none
  assert summary["autocast_rules"] == {} and summary["skipped_steps"] == 0
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["autoprecision"] is True and saved["autocast_rules"] == "{}"
  # Rules given in the config are used by the step, the evaluation and the summary.
  rules = "{'*MLP/dense_0*': 'fp32'}"
  config = ex.load_config("digits_mlp", ["policy=mixed_fp16", f"autocast_rules={rules}"])
  exp = ex.Experiment(config)
  assert exp.rules == {"*MLP/dense_0*": "fp32"}
  state = exp.init_state()
  batch = exp.put_batch(exp.dataset.batch(0, config.batch_size, 0))
  jaxpr = str(jax.make_jaxpr(exp.make_step())(state, batch))
  plain = str(
    jax.make_jaxpr(ex.Experiment(ex.load_config("digits_mlp", ["policy=mixed_fp16"])).make_step())(
      state, batch
    )
  )
  # The first layer's GEMMs run in f32 under the rule: fewer fp16 GEMMs than without it.
  assert jaxpr.count("f16[") < plain.count("f16[")


def _host_devices_env(count):
  """The environment of a subprocess on ``count`` CPU devices, with no policy override."""
  env = {k: v for k, v in os.environ.items() if k != "MPJAX_POLICY"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={count}")
  return env


def _on_host_devices(count, code, *args, timeout=600):
  """Runs Python ``code`` with ``args`` on ``count`` CPU devices: its last line's JSON, stderr."""
  proc = subprocess.run(
    [sys.executable, "-c", code, *map(str, args)],
    env=_host_devices_env(count),
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _cli_on_host_devices(count, args, run_dir):
  """``mpjax <args> --run_dir <run_dir>`` as one process of ``count`` CPU devices."""
  command = [sys.executable, "-m", "mpjax.cli", *args, "--run_dir", str(run_dir)]
  env = _host_devices_env(count)
  proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]


def test_data_parallel_over_eight_host_devices(tmp_path):
  code = (
    "import json, sys, mpjax.experiment as ex\n"
    "config = ex.load_config('digits_cnn', ['steps=20', 'log_every=10'])\n"
    "print(json.dumps(ex.train(config, run_dir=sys.argv[1])))\n"
  )
  eight, _ = _on_host_devices(8, code, tmp_path / "eight", timeout=300)
  one = ex.train(
    ex.load_config("digits_cnn", ["steps=20", "log_every=10", "num_devices=1"]),
    run_dir=tmp_path / "one",
  )
  assert eight["devices"] == 8 and one["devices"] == 1
  # The same global batches and the same math, summed in another order.
  assert abs(eight["test_loss"] - one["test_loss"]) < 2e-2 * one["test_loss"]


def _free_port():
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(args, run_dir, devices_each=2):
  """``mpjax <args>`` as two processes of one run (gloo on CPU), each with ``devices_each``."""
  env = _host_devices_env(devices_each)
  command = [sys.executable, "-m", "mpjax.cli", *args, "--run_dir", str(run_dir)]
  address = f"127.0.0.1:{_free_port()}"
  return [
    subprocess.Popen(
      [*command, "--coordinator_address", address, "--num_processes=2", f"--process_id={i}"],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=ROOT,
    )
    for i in range(2)
  ]


def _finish(procs):
  outs = [p.communicate(timeout=300) for p in procs]
  return [p.returncode for p in procs], "\n".join(err[-3000:] for _, err in outs)


def test_two_processes_train_as_one_run_of_their_devices(tmp_path):
  """`mpjax train --coordinator_address ...` on 2 processes x 2 devices = 1 process x 4."""
  args = ["train", "digits_mlp", "--config.steps=12", "--config.log_every=6", "--no_progress"]
  codes, err = _finish(_two_processes(args, tmp_path / "two"))
  assert codes == [0, 0], err
  _cli_on_host_devices(4, args, tmp_path / "four")
  two, four = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("two", "four"))
  assert two["devices"] == four["devices"] == 4
  # process 0 alone wrote the metrics: one line per log step and one evaluation
  assert len((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == 3
  for key in ("loss", "test_loss", "test_accuracy"):
    assert two[key] == pytest.approx(four[key], rel=1e-5), key


# ------------------------------------------------------------------ sharded (FSDP) runs

# The default config (the char-level LM, mixed_bf16) on less of its corpus, checkpointed at 3.
_SHARDED = ["eval_every=0", "log_every=3", "checkpoint_every=3", "data.max_chars=200000"]

# On 8 host devices: FSDP over all 8, and data parallel over all 8, for 6 steps each.
_FSDP_ON_EIGHT = """
import json, sys, jax, numpy as np, orbax.checkpoint as ocp, flax.linen as nn
import mpjax.experiment as ex

run_dir, overrides = sys.argv[1], json.loads(sys.argv[2])
out = {}
try:  # 12 examples do not split over 8 devices
  ex.load_config("default", [*overrides, "mesh.fsdp=8", "batch_size=12"])
except ex.ConfigError as e:
  out["batch_error"] = str(e)
for name, mesh in (("fsdp", ["mesh.fsdp=8"]), ("data", ["mesh.data=8"])):
  config = ex.load_config("default", [*overrides, "steps=6", *mesh])
  out[name] = ex.train(config, run_dir=f"{run_dir}/{name}")

def where(tree):
  return {jax.tree_util.keystr(p): list(x.sharding.spec) for p, x in
          jax.tree_util.tree_leaves_with_path(tree)}

# The FSDP run's checkpoint of step 6, restored onto its mesh.
exp = ex.Experiment(ex.load_config("default", [*overrides, "steps=6", "mesh.fsdp=8"]))
target = jax.tree.map(ocp.utils.to_shape_dtype_struct, exp.init_state())
with ocp.CheckpointManager(f"{run_dir}/fsdp/checkpoints") as manager:
  state = manager.restore(6, args=ocp.args.StandardRestore(target))
kernel = state.params["params"]["block_0"]["mlp_in"]["kernel"]
out["params"], out["opt_state"] = where(state.params), where(state.opt_state)
out["kernel_shard"] = kernel.addressable_shards[0].data.shape
out["sums"] = {k: float(np.sum(np.asarray(x, np.float64))) for k, x in
               zip(out["params"], jax.tree.leaves(state.params))}
print(json.dumps(out))
"""

# On 4 host devices: the FSDP run's checkpoint onto a mesh of 4, then `mpjax train` resumes it.
_RESUME_ON_FOUR = """
import json, sys, jax, numpy as np, orbax.checkpoint as ocp
import mpjax.experiment as ex
from mpjax import cli

run_dir, overrides = sys.argv[1], json.loads(sys.argv[2])
exp = ex.Experiment(ex.load_config("default", [*overrides, "steps=9", "mesh.fsdp=4"]))
target = jax.tree.map(ocp.utils.to_shape_dtype_struct, exp.init_state())
with ocp.CheckpointManager(f"{run_dir}/fsdp/checkpoints") as manager:
  state = manager.restore(6, args=ocp.args.StandardRestore(target))
kernel = state.params["params"]["block_0"]["mlp_in"]["kernel"]
sums = {jax.tree_util.keystr(p): float(np.sum(np.asarray(x, np.float64))) for p, x in
        jax.tree_util.tree_leaves_with_path(state.params)}
argv = ["train", "default", "--run_dir", f"{run_dir}/fsdp", "--no_progress"]
argv += [f"--config.{o}" for o in [*overrides, "steps=9", "mesh.fsdp=4"]]
code = cli.main(argv)
print(json.dumps({"code": code, "devices": len(jax.devices()), "sums": sums,
                  "kernel": list(kernel.sharding.spec),
                  "kernel_shard": kernel.addressable_shards[0].data.shape}))
"""


def test_fsdp_over_eight_devices_trains_as_data_parallel_and_resumes_on_four(tmp_path):
  """`config.mesh.fsdp=8` shards params and Adam's moments; the run resumes with fsdp=4."""
  eight, _ = _on_host_devices(8, _FSDP_ON_EIGHT, tmp_path, json.dumps(_SHARDED))
  assert "config.batch_size=12 is not divisible by the 8 devices" in eight["batch_error"]
  fsdp, data = eight["fsdp"], eight["data"]
  assert fsdp["mesh"] == {"data": 1, "fsdp": 8} and data["mesh"] == {"data": 8, "fsdp": 1}
  assert fsdp["steps"] == data["steps"] == 6
  # Each param on its largest dimension that 8 divides: (d_model, d_ff) on d_ff, a LayerNorm
  # scale on its only one; the moments like their params.
  params = eight["params"]
  assert params["['params']['block_0']['mlp_in']['kernel']"] == [None, "fsdp"]
  assert params["['params']['block_0']['mlp_out']['kernel']"] == ["fsdp"]
  assert params["['params']['ln_f']['scale']"] == ["fsdp"]
  assert eight["kernel_shard"] == [128, 512 // 8]
  moments = {k: v for k, v in eight["opt_state"].items() if ".mu[" in k or ".nu[" in k}
  assert len(moments) == 2 * len(params)
  assert all(v == params[k[k.index("['params']") :]] for k, v in moments.items()), moments
  # The same global batches and the same math as data parallelism: only the sums run in
  # another order (bf16 GEMMs, partial sums over other devices), so the figures agree to
  # float reassociation, not bit for bit (measured: 1e-4 relative on the loss).
  for key in ("loss", "test_loss", "test_accuracy"):
    assert math.isfinite(fsdp[key]) and fsdp[key] == pytest.approx(data[key], rel=2e-3), key

  four, err = _on_host_devices(4, _RESUME_ON_FOUR, tmp_path, json.dumps(_SHARDED))
  # The checkpoint of 8 shards comes back whole onto 4, each param on the same dimension.
  assert four["sums"] == eight["sums"]
  assert four["kernel"] == [None, "fsdp"] and four["kernel_shard"] == [128, 128]
  assert four["code"] == 0 and four["devices"] == 4, err[-3000:]
  run = tmp_path / "fsdp"
  assert f"mpjax: resuming {run} from step 6 of 9 (checkpoint of step 6)." in err
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps"] == 9 and summary["mesh"] == {"data": 1, "fsdp": 4}
  assert summary["skipped_steps"] == 0 and math.isfinite(summary["loss"])
  logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert logged == [3, 6, 6, 9, 9]  # train logs, then evaluations, of both runs
  with ocp.CheckpointManager(run / "checkpoints") as manager:
    assert manager.latest_step() == 9


def test_two_processes_shard_as_one_process_of_their_devices(tmp_path):
  """FSDP over 2 processes x 4 devices = over 1 process x 8; each process writes its shards."""
  args = ["train", "digits_mlp", "--config.steps=12", "--config.log_every=6", "--no_progress"]
  args += ["--config.checkpoint_every=6", "--config.mesh.fsdp=8"]
  codes, err = _finish(_two_processes(args, tmp_path / "two", devices_each=4))
  assert codes == [0, 0], err
  _cli_on_host_devices(8, args, tmp_path / "one")
  two, one = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("two", "one"))
  assert two["mesh"] == one["mesh"] == {"data": 1, "fsdp": 8}
  for key in ("loss", "test_loss", "test_accuracy"):
    assert two[key] == pytest.approx(one[key], rel=1e-5), key
  # orbax wrote each process's shards apart (its OCDBT store per process).
  written = {p.name for p in (tmp_path / "two" / "checkpoints" / "12").rglob("*process_*")}
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= written, written


@pytest.mark.usefixtures("gpu_compiler")
def test_doctor_compiles_the_fsdp_step_for_h100_and_reports_its_collectives(capsys):
  argv = ["doctor", "digits_mlp", "--target", "h100", "--mesh", "data=2,fsdp=4"]
  assert cli.main([*argv, "--compare", "mixed_bf16"]) == 0
  out = capsys.readouterr().out
  header = "**Collectives per train step on 8 x h100, mesh data=2 x fsdp=4**"
  # After the audit of the one-GPU step, before the kernel report.
  assert out.index("**Kernels per train step") > out.index(header) > out.index("Train step of")
  table = out.split(header)[1].split("**Kernels")[0].strip().splitlines()[1:]  # past the header
  table = [line for line in table if line.strip()]
  assert table[0].split()[:4] == ["kind", "dtype", "MB", "group"]
  rows = [line.split() for line in table[1:]]
  groups = {(row[0], int(row[3])) for row in rows if row[0] in mpjax.collectives.KINDS}
  # The params gathered and their gradients reduce-scattered within each fsdp group of 4;
  # gradients summed over the data axis, in groups of 2.
  assert {("all-gather", 4), ("reduce-scatter", 4), ("all-reduce", 2)} <= groups, table


def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpoint(tmp_path):
  run_dir, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
  args = ["train", "digits_mlp", "--no_progress", "--config.log_every=10"]
  procs = _two_processes([*args, "--config.steps=100000"], run_dir)
  deadline = time.time() + 120
  while not (metrics.exists() and metrics.read_text()) and time.time() < deadline:
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)  # one process only, as Ctrl-C on one host
  codes, err = _finish(procs)
  assert codes == [128 + signal.SIGTERM] * 2, err
  with ocp.CheckpointManager(run_dir / "checkpoints") as manager:
    stopped_at = manager.latest_step()
  assert 0 < stopped_at < 100000 and stopped_at % 10 == 0  # the processes agree at log steps
  codes, err = _finish(_two_processes([*args, f"--config.steps={stopped_at + 10}"], run_dir))
  assert codes == [0, 0], err
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["steps"] == stopped_at + 10
  logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  assert logged[-3:] == [stopped_at, stopped_at + 10, stopped_at + 10]  # train log, then eval


def test_a_rerun_says_it_resumes_and_a_complete_run_says_so_without_training(tmp_path, capsys):
  run = ["train", "digits_mlp", "--run_dir", str(tmp_path), "--config.log_every=5"]
  assert cli.main([*run, "--config.steps=10"]) == 0
  first = capsys.readouterr()
  assert "resuming" not in first.err
  assert "step 10/10: loss " in first.err  # stderr is not a terminal: a line per log step
  written = (tmp_path / "metrics.jsonl").read_text()

  assert cli.main([*run, "--config.steps=10"]) == 0
  again = capsys.readouterr()
  assert again.err.splitlines()[0].startswith(f"mpjax: {tmp_path} is already complete (10 of 10")
  assert "step " not in again.err and (tmp_path / "metrics.jsonl").read_text() == written
  assert "digits_mlp [mixed_bf16] on 1 device(s): 10 steps" in again.out

  assert cli.main([*run, "--config.steps=20"]) == 0
  more = capsys.readouterr()
  assert more.err.splitlines()[0] == (
    f"mpjax: resuming {tmp_path} from step 10 of 20 (checkpoint of step 10)."
  )
  assert "step 15/20" in more.err and "step 20/20" in more.err and "step 5/20" not in more.err


def test_health_and_the_guard_add_no_work_to_the_steps_between_theirs(tmp_path, monkeypatch):
  """What a run does after each step, seen from the host: the step program it runs (compiled
  once, the same executable), every program call, device-to-host read and guard check."""
  from mpjax.experiment import loop

  run_steps, device_get, check = loop._run_steps, jax.device_get, loop._DivergenceGuard.check

  def traced(name, fn):
    def call(*args, **kwargs):
      events.append(name)
      return fn(*args, **kwargs)

    return call

  def spied_run_steps(exp, compiled, *rest):
    # The optimized HLO without its source locations (the callers' lines differ).
    hlo = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    programs.append(
      re.sub(r"(?m)^(\d+ .*|FileNames|FunctionNames|FileLocations|StackFrames)$", "", hlo)
    )
    exp.health_fn = traced("health", exp.health_fn)
    return run_steps(exp, traced("step", compiled), *rest)

  monkeypatch.setattr(loop, "_run_steps", spied_run_steps)
  monkeypatch.setattr(jax, "device_get", traced("device_get", device_get))
  monkeypatch.setattr(loop._DivergenceGuard, "check", traced("guard", check))

  def after_each_step(overrides):
    events.clear()
    config = ex.load_config("digits_mlp", ["steps=6", "log_every=3", *overrides])
    ex.train(config, run_dir=tmp_path / str(len(programs)))
    steps = "|".join(events).split("step")[1:]  # what follows each step, up to the next
    return [[e for e in s.split("|") if e] for s in steps]

  events, programs = [], []
  plain = after_each_step(["health_every=0", "stop_after_skips=0", "stop_at_min_scale=0"])
  watched = after_each_step(["health_every=2", "stop_after_skips=7", "stop_at_min_scale=9"])
  assert programs[0] == programs[1]  # the same compiled step program
  assert len(plain) == len(watched) == 6  # one step program call per step, no other
  assert plain[0] == [] and plain[2][:2] == ["device_get", "guard"]  # log steps: 3, 6
  for it, (before, after) in enumerate(zip(plain, watched, strict=True), start=1):
    if it % 2:  # between health steps: exactly what the plain run does
      assert after == before, it
    else:  # a health step: one health program and one read of its figures more
      assert (
        after.count("health") == 1 and after.count("device_get") == before.count("device_get") + 1
      ), it
      extra = ["health", "device_get"]
      i = after.index("health")
      assert after[:i] + after[i + 2 :] == before and after[i : i + 2] == extra, it
