"""`mpjax doctor`: the audit of every shipped config's train step; the command as users run it."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from mpjax import cli
from mpjax import experiment as ex
from mpjax.policy import POLICY_ENV_VAR, get_policy

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "example")


@pytest.fixture(autouse=True)
def _no_policy_env(monkeypatch):
  monkeypatch.delenv(POLICY_ENV_VAR, raising=False)


def _doctor(*args):
  """``mpjax doctor ARGS`` as a user runs it: a fresh Python process, from the repository root."""
  env = {k: v for k, v in os.environ.items() if k != POLICY_ENV_VAR}
  return subprocess.run(
    [sys.executable, "-m", "mpjax.cli", "doctor", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_configs_are_found():
  assert {"default", "digits_mlp", "digits_cnn", "charlm_fp16", "underflow_demo"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_has_no_misaligned_gemm(name):
  config = ex.load_config(name)
  report = cli.doctor_report(config)
  # Forward and backward GEMMs of at least a two-layer model: 2 forward, 2 weight gradients and
  # the input gradient of the second layer (the first one's is not computed: nothing needs it).
  assert len(report.rows) >= 5
  misaligned = [(r.path, r.shape, r.misaligned) for r in report.rows if r.misaligned]
  assert not misaligned, misaligned
  if get_policy(config.policy).is_mixed:
    # Half-precision operands, f32 accumulation, aligned: nothing flagged on CPU.
    assert not report.flagged, [(r.path, [f.code for f in r.flags]) for r in report.flagged]
    assert report.fast_path_share == 1.0


def test_doctor_flags_a_misaligned_batch(capsys):
  assert cli.main(["doctor", "digits_mlp", "--config.batch_size=12"]) == 0
  out = capsys.readouterr().out
  assert "Train step of digits_mlp [mixed_bf16], batch 12" in out
  assert "`misaligned`" in out and "M=12 not a multiple of 8" in out


def test_padding_stays_zero_and_logits_keep_num_classes():
  """The CNN's padded input channels and classes start at zero and stay zero through training."""
  exp = ex.Experiment(ex.load_config("digits_cnn", ["batch_size=16"]))
  state = exp.init_state()
  params = state.params["params"]
  assert params["conv_0"]["kernel"].shape == (3, 3, 8, 32)  # 1 input channel, padded to 8
  assert params["head"]["kernel"].shape == (128, 16)  # 10 classes, padded to 16
  step = exp.make_step()
  for i in range(3):
    state, metrics = step(state, exp.put_batch(exp.dataset.batch(i, 16, 0)))
  assert bool(metrics["grads_finite"])
  params = jax.device_get(state.params["params"])
  np.testing.assert_array_equal(params["conv_0"]["kernel"][:, :, 1:], 0.0)
  np.testing.assert_array_equal(params["head"]["kernel"][:, 10:], 0.0)
  np.testing.assert_array_equal(params["head"]["bias"][10:], 0.0)
  assert np.abs(params["head"]["kernel"][:, :10]).min() > 0
  x = exp.dataset.batch(0, 4, 0)["x"]
  logits = exp.model.apply({**state.params, **state.model_state}, x, train=False)
  assert logits.shape == (4, 10)


def test_doctor_command_prints_the_audit_table():
  result = _doctor("digits_mlp")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert out.startswith("Train step of digits_mlp [mixed_bf16], batch 64, on cpu")
  assert "| # | path | shape | dtypes | precision | GFLOP | flags |" in out
  assert "bf16 x bf16 -> f32" in out and "MLP/head" in out
  assert "Fast path: 100.0% of" in out and "0 flagged." in out


def test_doctor_unknown_config_is_one_line_and_exit_status_2():
  result = _doctor("nonexistent")
  assert result.returncode == 2
  assert result.stdout == ""
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("mpjax: error: unknown config 'nonexistent'")
  assert "digits_mlp" in lines[0]
