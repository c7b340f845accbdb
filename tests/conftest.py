"""Shared test setup: no policy override leaks in from the environment; the slow tests marked.

The default ``pytest -n 2`` deselects the tests marked ``slow`` (pyproject's ``addopts``) and
runs in under five minutes on two cores; ``pytest -n 2 -m slow`` runs the rest, and CI runs both.
A test is slow when it trains for many steps, starts other processes (8 host devices, two
processes), runs a whole benchmark script, or compiles whole train steps for a GPU target.
"""

import functools
import os
import re

import pytest

# XLA:CPU spends most of this suite's time compiling, and most of that in LLVM's optimizer. The
# tests check numerics and compiled HLO, not how fast the CPU's machine code runs, and LLVM's
# level changes no HLO pass: level 0 compiles about 3x faster. Set before jax starts a backend.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"

import mpjax  # noqa: E402
import mpjax.gpu  # noqa: E402

# Node-id prefixes of the slow tests, each with why it is slow.
SLOW = {
  "tests/test_multidevice.py": "a subprocess with 8 host devices runs every case",
  "tests/test_experiment.py::test_interrupted_run_resumes_bit_identically": "trains twice",
  "tests/test_experiment.py::test_health_and_the_guard_add_no_work_to_the_steps_between_theirs": (
    "trains twice"
  ),
  "tests/test_experiment.py::test_cli_sigterm_writes_a_checkpoint": "a CLI process, trains twice",
  "tests/test_experiment.py::test_digits_mixed_precision_accuracy": "trains to accuracy",
  "tests/test_experiment.py::test_char_lm_mixed_precision_loss": "trains an LM per policy",
  "tests/test_experiment.py::test_underflow_demo_compare": "trains one run per policy",
  "tests/test_experiment.py::test_data_parallel_over_eight_host_devices": "8 host devices",
  "tests/test_experiment.py::test_two_processes_train": "two processes",
  "tests/test_experiment.py::test_fsdp_over_eight_devices": "8, then 4 host devices, trains 3x",
  "tests/test_experiment.py::test_two_processes_shard": "two processes, then one of 8 devices",
  "tests/test_experiment.py::test_doctor_compiles_the_fsdp_step": "whole-step GPU compiles",
  "tests/test_experiment.py::test_sigterm_to_one_of_two_processes": "two processes",
  "tests/test_experiment.py::test_autoprecision_picks_rules": "diagnoses, then trains",
  "tests/test_experiment.py::test_gradient_health_shows_the_underflow": "trains one run per policy",
  "tests/test_examples.py::test_bench_script": "a whole benchmark run",
  "tests/test_examples.py::test_gpu_check_script_runs_small": "compiles and times every variant",
  "tests/test_examples.py::test_gpu_check_times_gpt2_with_fused_attention": "every variant",
  "tests/test_diagnose.py::test_forward_overflow_is_found_and_its_rule_fixes_training": "trains",
  "tests/test_diagnose.py::test_attention_scores_beyond_fp16": "replays a transformer",
  "tests/test_diagnose.py::test_every_fault_of_a_model_gets_a_rule": "replays many faults",
  "tests/test_diagnose.py::test_suggest_rules_is_deterministic": "suggests rules twice",
  "tests/test_gpu.py::test_mixed_bf16_step_moves_fewer_bytes": "8 whole-step GPU compiles",
  "tests/test_gpu.py::test_a_checked_step_costs_no_conditional": "8 whole-step GPU compiles",
  "tests/test_gpu.py::test_every_shipped_config_audits_on_h100": "whole-step GPU compiles",
  "tests/test_gpu.py::test_doctor_for_h100": "whole-step GPU compiles",
  "tests/test_gpu.py::test_bench_target": "whole-step GPU compiles",
  "tests/test_gpu.py::test_every_fp8_gemm_of_an_lm_step": "a whole-step GPU compile",
  "tests/test_gpu.py::test_fp8_gemms_on_a_gpu_without_fp8": "whole-step GPU compiles",
  "tests/test_autocast.py::test_fp16_autocast_training_matches_f32_training": "trains twice",
  "tests/test_doctor.py::test_every_shipped_config_has_no_misaligned_gemm": "every config's step",
  "tests/test_doctor.py::test_doctor_command_prints_the_audit_table": "a CLI process",
  "tests/test_diagnose.py::test_backward_only_overflow_is_found": "replays a training step",
  "tests/test_experiment.py::test_divergence_guard_stops": "trains until it diverges",
  "tests/test_experiment.py::test_diagnose_a_healthy_config_finds_nothing": "trains, then replays",
  "tests/test_experiment.py::test_a_rerun_says_it_resumes": "trains a config twice",
  "tests/test_experiment.py::test_a_checkpoint_of_another_model_version": "trains, then resumes",
  "tests/test_experiment.py::test_resuming_with_a_different_config_is_refused": "trains, resumes",
  "tests/test_experiment.py::test_without_the_experiments_extra": "a CLI process",
  "tests/test_diagnose.py::test_backward_overflow_behind_an_f32_loss_is_found": "replays a step",
  "tests/test_doctor.py::test_padding_stays_zero_and_logits_keep_num_classes": "trains the CNN",
  "tests/test_examples.py::test_readme_numerics_test_file_passes": "three numerics tests of a CNN",
  "tests/test_gpu.py::test_bf16_weight_gradient_gemms_write": "whole-step GPU compiles",
  "tests/test_gpu.py::test_doctor_in_the_cublaslt_mode_says_so": "a whole-step GPU compile",
  "tests/test_gpu.py::test_importing_mpjax_with_the_compiler_plugin": "a Python process",
  "tests/test_xla.py::test_configure_xla_before_the_backend_starts": "a Python process",
  "mpjax/experiment/comparison.py::mpjax.experiment.comparison.compare": "a training doctest",
  "mpjax/experiment/loop.py::mpjax.experiment.loop.train": "a training doctest",
  "tests/test_rounding.py::test_a_checkpoint_keeps_the_key": "orbax save and restore, trains twice",
  "tests/test_rounding.py::test_experiment_resumed_from_a_checkpoint": "trains a config twice",
  "tests/test_rounding.py::test_data_parallel_replicas_round": "8 host devices, two steps x2",
  "tests/test_rounding.py::test_h100_step_of_bf16_sr": "three whole-step GPU compiles",
  "tests/test_sharded_numerics.py::test_bf16_gradient_reductions": "eight GPU compiles",
  "tests/test_sharded_numerics.py::test_a_sharded_bf16_sr_leaf": "8 host devices, three trainings",
  "tests/test_sharded_numerics.py::test_fp8_amax_of_a_sharded": "8 host devices, two trainings",
  "tests/test_examples.py::test_bench_script_compiles_every_policy_for_a_mesh": (
    "eight whole-step GPU compiles"
  ),
  # The default set's slowest tests (8 s or more on this project's 2-core machine), so that it
  # stays under five minutes; the slow set runs them in CI.
  "tests/test_rounding.py::test_bf16_storage_runs_a_declared_f32_models_gemms_in_bf16_compiled": (
    "three whole-step GPU compiles"
  ),
  "tests/test_gpu.py::test_the_h200_run_that_lost_fp8": "whole-step GPU compiles of an LM",
  "tests/test_models.py::test_bad_inputs_raise": "an LM and a CNN traced for each bad input",
  "tests/test_fp8.py::test_gemm_under_another_fp8_recipe": "train steps under three rule sets",
  "tests/test_gpu.py::test_nvfp4_runs_its_forward_gemms": "whole-step GPU compiles",
  "tests/test_gpu.py::test_block_scaled_dot_under_jax_grad": "GPU compiles for two targets",
  "tests/test_gpu.py::test_the_fp8_share_of_a_mixed_fp8_step_compiled_for_h100_in_the_default_"
  "mode[lm": "a whole-step GPU compile of an LM (the MLPs' in the default set)",
  "tests/test_block_scaled.py::test_mixed_mxfp8_and_nvfp4_train": "trains three policies",
  "tests/test_models.py::test_transformer_shapes_dtypes_and_masked_padding": "many LM compiles",
  "tests/test_models.py::test_transformer_policy_and_autocast_match_f32": "three LM compiles",
  "mpjax/models.py::mpjax.models.TransformerLM": "an LM doctest",
  "tests/test_autocast.py::test_fp16_block_with_large_activations": "forward and backward in fp16",
  "tests/test_autocast.py::test_every_gemm_keeps_its_module_path": "traces and compiles a block",
  "tests/test_diagnose.py::test_a_clean_model_has_no_report_and_needs_no_rules": "replays a step",
  "tests/test_flax_policy.py::test_linen_kwargs_give_bf16_outputs": "compiles a CNN and an LM",
  "tests/test_fp8.py::test_checkpoint_round_trip_of_a_trained_fp8_state": "trains twice",
  "tests/test_fp8.py::test_first_steps_fill_the_history_and_scales": "steps an FP8 model",
  "tests/test_fp8.py::test_init_fp8_state_matches_what_the_first_step_makes": "two FP8 steps",
  "tests/test_fp8.py::test_amax_compute_algo_max_and_most_recent": "steps two FP8 models",
  "tests/test_fp8.py::test_a_step_that_makes_the_fp8_state_says_how": "compiles a step twice",
  "tests/test_fp8.py::test_keep_bf16_chooses_the_fp8_gemms": "compiles several recipes",
  "tests/test_train_step.py::test_step_runs_eagerly_and_keeps_callers_params": "eager steps",
  "tests/test_testing.py::test_matches_f32_passes_in_bf16_and_names_the_leaf": "three trainings",
  "tests/test_examples.py::test_every_readme_code_block_runs": "every README code block",
  "tests/test_sharded.py::test_a_sharded_step_keeps_every_leafs_layout_and_compiles_once": (
    "8 host devices, five policies"
  ),
  # Then those of 5 s or more under `pytest -n 2` on 2 cores (results/tests/default_set.txt),
  # but for the B200 MLP compile of mixed_mxfp8, which CI's newest-jax leg must run.
  "tests/test_rounding.py::test_bf16_storage_runs_a_declared_f32_models_gemms_in_bf16_with": (
    "four compiles of an LM step"
  ),
  "tests/test_flax_policy.py::test_linen_batchnorm_running_statistics_stay_f32": "CNN steps",
  "tests/test_experiment.py::test_env_policy_overrides_the_config_but_not_compare": "trains",
  "tests/test_fp8.py::test_fp8_training_tracks_bf16": "trains twice",
  "tests/test_fp8.py::test_delayed_scale_from_history_saturates_a_jump_in_amax": "FP8 steps",
  "tests/test_models.py::test_transformer_is_causal": "LM compiles",
  "tests/test_train_step.py::test_fp16_underflow_needs_loss_scaling": "trains twice",
  "tests/test_train_step.py::test_a_state_created_with_its_step_compiles_the_fp8_step_once": (
    "FP8 steps"
  ),
  "tests/test_data.py::test_underflow_task_needs_loss_scaling_in_fp16": "trains twice",
  "tests/test_examples.py::test_readme_flax_linen_loop_trains": "trains",
  "tests/test_train_step.py::test_gradient_accumulation_with_optax_multisteps": "steps x k",
  "tests/test_block_scaled.py::test_nvfp4_quantization_has_two_levels": "many quantizations",
  "tests/test_autocast.py::test_outputs_and_gradients_match_f32_within_bf16_tolerance[block": (
    "a block's steps"
  ),
  "tests/test_testing.py::test_a_step_that_trains_on_a_bad_batch_is_caught": "trains",
  "tests/test_models.py::test_cnn_shapes_dtypes_and_eval_mode": "CNN compiles",
  "tests/test_fp8.py::test_gemm_in_scan_runs_fp8_without_delayed_state": "compiles a scan",
  "tests/test_models.py::test_mlp_shapes_and_dtypes": "MLP compiles",
  "tests/test_train_step.py::test_mixed_policies_autocast_by_default": "a step per policy",
  "tests/test_block_scaled.py::test_residuals_are_saved_quantized": "two steps' residuals",
  "tests/test_models.py::test_models_under_autocast_match_f32[transformer": "LM compiles",
  "tests/test_fp8.py::test_skipped_step_keeps_fp8_state_bit_identical": "FP8 steps",
  "tests/test_flax_policy.py::test_nnx_batchnorm_statistics_stay_f32_in_train_mode": "NNX steps",
  "tests/test_flax_policy.py::test_nnx_apply_policy_matches_f32_with_excluded": "NNX steps",
  "tests/test_experiment.py::test_train_cli_prints_a_summary": "a CLI process, trains",
}


def _compiles_for_a_gpu(item) -> bool:
  """Whether a doctest compiles for a GPU target (``compile_for``, ``target="h100"``...)."""
  examples = getattr(getattr(item, "dtest", None), "examples", ())
  return any(re.search(r"compile_for\(|target=\"", e.source) for e in examples)


@functools.cache
def _missing_plugin() -> str | None:
  """Why GPU compiles cannot run here (no compiler plugin at jaxlib's version), or None."""
  try:
    mpjax.gpu._check_compiler()
  except RuntimeError as e:
    return str(e)
  return None


def pytest_collection_modifyitems(config, items):
  missing = _missing_plugin()
  for item in items:
    if any(item.nodeid.startswith(prefix) for prefix in SLOW):
      item.add_marker(pytest.mark.slow)
    # The GPU tests skip, saying why, without the plugin (the tests do the same through
    # ``gpu_compiler``); CI installs it, and checks it did, so they run there.
    if missing and _compiles_for_a_gpu(item):
      item.add_marker(pytest.mark.skip(reason=missing))


@pytest.fixture(scope="session")
def gpu_compiler():
  """Skips the test, saying why, where XLA's CUDA compiler plugin at jaxlib's version is missing.

  The tests that compile for a GPU target ask for it: ``@pytest.mark.usefixtures("gpu_compiler")``,
  or a whole module's ``pytestmark``. The reason names the plugin and the command installing it.
  Session-scoped, so it skips before any module-scoped fixture compiles for a GPU.
  """
  if missing := _missing_plugin():
    pytest.skip(missing)


@pytest.fixture(autouse=True)
def _no_policy_override(monkeypatch):
  monkeypatch.delenv(mpjax.POLICY_ENV_VAR, raising=False)
