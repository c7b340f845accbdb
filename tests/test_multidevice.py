"""Data-parallel behaviour of mpjax on 8 (forced host) devices.

The device count of the CPU backend is fixed when JAX initialises, so the
checks run once, in a subprocess (tests/multidevice_script.py) started with
``--xla_force_host_platform_device_count=8``; it prints its results as one JSON
dict, and the tests below assert on it. Device 3's shard of the batch (rows
24..31) holds the one non-finite input of the "poisoned" batch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("multidevice_script.py")
N_DEVICES = 8
BAD_DEVICE = 3


@pytest.fixture(scope="module")
def results():
  env = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "JAX_PLATFORMS": "cpu",
  }
  env.pop("MPJAX_POLICY", None)  # the script asks for mixed_fp16 and must get it
  proc = subprocess.run(
    [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, (
    f"{SCRIPT.name} exited with {proc.returncode}\n--- stderr ---\n{proc.stderr[-8000:]}"
  )
  lines = proc.stdout.strip().splitlines()
  assert lines, f"{SCRIPT.name} printed nothing\n--- stderr ---\n{proc.stderr[-8000:]}"
  return json.loads(lines[-1])


def _assert_trees_close(actual, expected, *, rtol, atol, what):
  assert len(actual) == len(expected), what
  for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
    np.testing.assert_allclose(
      np.asarray(a, np.float64),
      np.asarray(e, np.float64),
      rtol=rtol,
      atol=atol,
      err_msg=f"{what}: leaf {i}",
    )


def test_script_sees_eight_devices(results):
  assert results["device_count"] == N_DEVICES


# ---- a. plain jit with NamedSharding: the computation is global, no axis_name ----


def test_jit_poisoned_input_lives_on_device_3_only(results):
  r = results["jit"]
  assert r["n_batch_shards"] == N_DEVICES
  assert r["bad_shard_row_starts"] == [BAD_DEVICE * 8]
  assert r["bad_shard_device_ids"] == [BAD_DEVICE]


def test_jit_clean_step_trains(results):
  r = results["jit"]
  assert r["loss_scale_type"] == "DynamicLossScale"
  assert r["initial_loss_scale"] == 2.0**15
  assert r["clean_grads_finite"] is True
  assert np.isfinite(r["clean_loss"]) and np.isfinite(r["clean_grad_norm"])
  assert r["clean_step"] == 1
  assert r["clean_skipped"] == 0
  assert r["clean_params_changed"] is True
  assert r["params_sharding_replicated"] is True
  # A finite step counts towards growth but does not grow before `period`.
  assert r["clean_loss_scale"] == 2.0**15
  assert r["clean_counter"] == 1


def test_jit_skip_keeps_params_and_opt_state_bit_identical(results):
  r = results["jit"]
  assert r["donated_input_deleted"] is True, "the state was not donated; the test is moot"
  assert r["bad_grads_finite"] is False
  assert r["bad_params_identical"] is True
  assert r["bad_params_shard_identical"] is True, "some device's copy of params moved"
  assert r["bad_opt_state_identical"] is True
  assert r["bad_step"] == r["step_before"] == 1
  assert r["bad_skipped"] == 1


def test_jit_skip_halves_loss_scale_on_every_shard(results):
  r = results["jit"]
  assert r["bad_metric_loss_scale"] == r["loss_scale_before"] == 2.0**15
  assert r["bad_loss_scale"] == 2.0**14
  assert r["bad_counter"] == 0
  assert r["bad_overflow_counter"] == 1
  assert r["bad_loss_scale_shard_devices"] == list(range(N_DEVICES))
  assert r["bad_loss_scale_shard_values"] == [2.0**14] * N_DEVICES


def test_jit_trains_again_after_a_skip(results):
  r = results["jit"]
  assert r["recover_grads_finite"] is True
  assert r["recover_metric_loss_scale"] == 2.0**14
  assert r["recover_step"] == 2
  assert r["recover_skipped"] == 1


# ---- b. shard_map and pmap with axis_name="data" ----------------------------------

CHECK_VMA = [True, False]


@pytest.mark.parametrize("check_vma", CHECK_VMA)
def test_shard_map_skip_is_unanimous(results, check_vma):
  r = results[f"shard_map_check_vma_{check_vma}"]
  assert r["loss_scale_before"] == 2.0**10
  assert r["bad_grads_finite"] is False
  assert r["bad_per_device_grads_finite"] == [False] * N_DEVICES
  assert r["bad_per_device_loss_scale"] == [2.0**9] * N_DEVICES
  assert r["bad_per_device_step"] == [0] * N_DEVICES
  assert r["bad_per_device_params_identical"] is True
  assert r["bad_per_device_opt_state_identical"] is True
  assert r["bad_params_identical"] is True
  assert r["bad_opt_state_identical"] is True
  assert (r["bad_step"], r["bad_skipped"], r["bad_loss_scale"]) == (0, 1, 2.0**9)


@pytest.mark.parametrize("check_vma", CHECK_VMA)
def test_shard_map_devices_agree_when_one_device_overflows(results, check_vma):
  r = results[f"shard_map_check_vma_{check_vma}"]
  # The premise: on its own, only the poisoned device sees a non-finite gradient.
  expected_local = [d != BAD_DEVICE for d in range(N_DEVICES)]
  assert r["bad_local_grads_finite"] == expected_local
  # The step: every device takes the poisoned device's verdict and skips, with one state.
  assert r["bad_per_device_grads_finite"] == [False] * N_DEVICES
  assert len(set(r["bad_per_device_loss_scale"])) == 1
  assert r["bad_per_device_step"] == [0] * N_DEVICES
  assert r["bad_per_device_params_identical"] is True


def _assert_clean_step_matches_jit(r, ref):
  assert ref["grads_finite"] is True and ref["step"] == 1
  assert r["clean_per_device_grads_finite"] == [True] * N_DEVICES
  assert r["clean_per_device_state_agrees"] is True
  # The loss and the gradient norm are averages over the full batch in both.
  np.testing.assert_allclose(r["clean_loss"], ref["loss"], rtol=1e-5)
  np.testing.assert_allclose(r["clean_grad_norm"], ref["grad_norm"], rtol=1e-3)
  # Adam's first moments (0.1 * g) and second moments (0.001 * g**2) see the
  # gradient's scale; its first update (about lr * sign(g)) barely does.
  _assert_trees_close(
    r["clean_opt_state"], ref["opt_state"], rtol=1e-2, atol=1e-6, what="opt_state"
  )
  _assert_trees_close(r["clean_params"], ref["params"], rtol=0, atol=1e-5, what="params")
  moved = max(
    float(np.max(np.abs(np.asarray(p) - np.asarray(p0))))
    for p, p0 in zip(ref["params"], ref["initial_params"], strict=True)
  )
  assert moved > 5e-3, "the reference step did not move the params; the comparison is moot"


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_clean_step_matches_plain_jit(results, check_vma):
  """Gradients are the mean over devices, also where shard_map tracks varying axes (jax.grad
  of replicated params would otherwise sum them before the step's pmean)."""
  r = results[f"shard_map_check_vma_{check_vma}"]
  assert r["clean_grads_finite"] is True and r["clean_step"] == 1
  _assert_clean_step_matches_jit(r, results["jit_ref"])


def test_pmap_clean_step_matches_plain_jit(results):
  r = results["pmap_step"]
  assert r["clean_per_device_step"] == [1] * N_DEVICES
  _assert_clean_step_matches_jit(r, results["jit_ref"])


def test_pmap_skip_is_unanimous(results):
  r = results["pmap_step"]
  assert r["bad_per_device_grads_finite"] == [False] * N_DEVICES
  assert r["bad_per_device_loss_scale"] == [2.0**9] * N_DEVICES
  assert r["bad_per_device_step"] == [0] * N_DEVICES
  assert r["bad_params_identical"] is True


# ---- c. all_finite under shard_map --------------------------------------------------


def test_all_finite_with_axis_name_is_shared(results):
  r = results["all_finite"]
  assert r["clean_with_axis"] == [True] * N_DEVICES
  assert r["inf_with_axis"] == [False] * N_DEVICES
  assert r["nan_with_axis"] == [False] * N_DEVICES


def test_all_finite_without_axis_name_is_local(results):
  r = results["all_finite"]
  only_bad_device = [d != BAD_DEVICE for d in range(N_DEVICES)]
  assert r["clean_local"] == [True] * N_DEVICES
  assert r["inf_local"] == only_bad_device
  assert r["nan_local"] == only_bad_device


# ---- d. pmap of DynamicLossScale.adjust ---------------------------------------------


def test_pmap_adjust_per_device(results):
  # Start: scale 1024, counter 1, period 2, factor 2, min_loss_scale 512.
  r = results["pmap"]
  flags = r["flags"]
  assert r["type"] == "DynamicLossScale"
  assert r["dtypes"] == ["float32", "int32", "int32"]
  # Finite: the second finite step of the period grows the scale; not finite: halves it.
  assert r["loss_scale"] == [2048.0 if f else 512.0 for f in flags]
  assert r["counter"] == [0] * N_DEVICES
  assert r["overflow_counter"] == [0 if f else 1 for f in flags]
  # Again: finite counts 1 (no growth yet); not finite would halve to 256 but
  # stops at min_loss_scale=512, which must survive pmap's flatten/unflatten.
  assert r["twice_loss_scale"] == [2048.0 if f else 512.0 for f in flags]
  assert r["twice_counter"] == [1 if f else 0 for f in flags]
  assert r["twice_overflow_counter"] == [0 if f else 2 for f in flags]


def test_pmap_adjust_keeps_static_fields(results):
  assert results["pmap"]["static"] == {
    "period": 2,
    "factor": 2,
    "min_loss_scale": 512.0,
    "max_loss_scale": 2.0**20,
    "hysteresis": 1,
  }


def test_fp8_amaxes_under_shard_map_are_those_of_the_global_batch(results):
  """Each device sees its shard; the recorded amaxes are the max over every device's."""
  r = results["fp8"]
  # The premise: the devices' shards have different amaxes.
  assert min(r["local_x_amax"]) < r["global_x_amax"] == max(r["local_x_amax"])
  sm = np.asarray(r["shard_map_history_row0"][0])
  jit = np.asarray(r["jit_history_row0"][0])
  assert sm.shape == jit.shape == (3, 3)  # three FP8 GEMMs: lhs, rhs, grad
  assert sm[0, 0] == r["global_x_amax"]  # the first Dense's input is the batch itself
  np.testing.assert_allclose(sm[:, :2], jit[:, :2], rtol=1e-6)  # activations and weights
  # Under shard_map each device's loss is the mean of its 8 rows, not of 64: its output
  # gradients are 8x those of the global step.
  np.testing.assert_allclose(sm[:, 2], 8 * jit[:, 2], rtol=1e-2)
  assert np.all(np.asarray(r["shard_map_scale"][0]) == 1.0)  # the first step's scales
