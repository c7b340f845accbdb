"""The code of README.md and docs/ runs as a user would run it, and so do the benchmark scripts."""

import importlib.util
import pathlib
import re
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mpjax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _doc_code(doc: str, heading: str) -> str:
  """The first python block after a heading line (e.g. "## Quickstart") of README.md or docs/."""
  text = (ROOT / doc).read_text().split(f"{heading}\n", 1)[1]
  return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _run_section(doc: str, heading: str, namespace: dict) -> dict:
  exec(compile(_doc_code(doc, heading), f"{doc} {heading}", "exec"), namespace)
  return namespace


def test_readme_quickstart_and_checkpoint_run(capsys):
  namespace = _run_section("README.md", "## Quickstart", {})
  state, metrics = namespace["state"], namespace["metrics"]
  assert int(state.step) == 1 and bool(metrics["grads_finite"])
  assert float(metrics["loss_scale"]) == 2.0**15
  assert capsys.readouterr().out.strip()
  _run_section("docs/train_step.md", "## Checkpoints", namespace)
  chex.assert_trees_all_equal(namespace["restored"].params, state.params)
  assert float(namespace["restored"].loss_scale.loss_scale) == 2.0**15
  _run_section("docs/autocast.md", "# Autocast: every operation in the right precision", namespace)
  assert namespace["logits"].dtype == "float32"
  report = namespace["report"]
  assert 0 < report.lowered_share < 1  # the rule kept the last layer in f32
  assert "layers_2" in str(report)


def test_every_readme_code_block_runs_after_the_quickstart():
  text = (ROOT / "README.md").read_text()
  namespace: dict = {}
  for block in re.findall(r"```python\n(.*?)```", text, re.S):
    exec(compile(block, "README.md", "exec"), namespace)
  x = jnp.ones((2, 64))
  params = namespace["Classifier"]().init(jax.random.key(0), x)
  assert namespace["Classifier"]().apply(params, x).dtype == jnp.bfloat16
  assert namespace["net"].body.dtype == jnp.bfloat16 and namespace["net"].head.dtype is None


def test_fp8_doc_example_makes_the_state_with_the_step_and_compiles_it_once():
  model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(4)])
  batch = jax.random.normal(jax.random.key(0), (16, 8))

  def loss_fn(params, x):
    return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

  params = model.init(jax.random.key(1), batch)
  ns = dict(jax=jax, mpjax=mpjax, model=model, params=params, tx=optax.adam(1e-3))
  ns.update(loss_fn=loss_fn, batch=batch)
  _run_section("docs/fp8.md", "# FP8 training", ns)
  assert ns["state"].fp8.gemms == 1 and int(ns["state"].step) == 1
  ns["step"](ns["state"], batch)
  assert ns["step"]._cache_size() == 1


def test_readme_numerics_test_file_passes():
  ns = _run_section("docs/testing.md", "# Test your model's numerics", {})
  tests = [f for name, f in ns.items() if name.startswith("test_")]
  assert len(tests) == 3
  for test in tests:
    test()


def test_readme_flax_linen_loop_trains_with_f32_masters_on_the_fast_path(capsys):
  ns = _run_section("docs/flax.md", "## Flax linen", {})
  assert float(ns["metrics"]["loss"]) < 0.3  # digits: chance is ln(10) = 2.3
  assert {x.dtype for x in jax.tree.leaves(ns["state"].params)} == {jnp.dtype("float32")}
  assert ns["report"].fast_path_share == 1.0 and not ns["report"].flagged  # backward too
  assert "fast-path share of GEMM FLOPs 100%" in capsys.readouterr().out


def test_readme_flax_nnx_loop_and_the_audit_of_its_step(capsys):
  ns = _run_section("docs/flax.md", "## Flax NNX", {})
  net = ns["net"]
  assert float(ns["metrics"]["loss"]) < 0.3
  assert net.body.dtype == jnp.bfloat16 and net.head.dtype is None  # the head was excluded
  assert {x.dtype for x in jax.tree.leaves(ns["state"].params)} == {jnp.dtype("float32")}
  chex.assert_trees_all_equal(nnx.state(net, nnx.Param), ns["state"].params)
  _run_section("docs/audit_and_gpu.md", "## The audit", ns)
  assert {row.dtypes for row in ns["report"].flagged} == {"f32 x f32 -> f32"}
  assert "Fast path: 72.7%" in capsys.readouterr().out


def _script(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Flax modules are dataclasses: their module must be importable
  spec.loader.exec_module(module)
  return module


def test_bench_fused_attention_needs_a_gpu_target(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _script("bench").main(["--small", "--models", "gpt2_fused"])
  assert exit_info.value.code == 2
  assert "--models gpt2_fused needs --target (e.g. --target h100)" in capsys.readouterr().err


def test_bench_script_runs_every_variant(capsys):
  results = _script("bench").main(["--small", "--rounds", "2", "--compiles", "2"])
  assert set(results) == {"mlp", "transformer"}
  for table in results.values():
    assert set(table) == {
      "plain fp32",
      "mpjax fp32",
      "mpjax fp32 skip_nonfinite",
      "mpjax mixed_bf16 autocast",
      "mpjax mixed_bf16 cast",
      "mpjax mixed_fp16 autocast",
      "flax dtype=bf16",
      "jmp cast",
    }
    assert table["plain fp32"]["step_ratio"] == 1.0
    assert all(r["compile_s"] > 0 for r in table.values())
    # autocast saves bf16 activations and no bf16 weight copies: less than fp32
    assert table["mpjax mixed_bf16 autocast"]["residual_ratio"] < 0.9
  assert "| mpjax mixed_bf16 autocast |" in capsys.readouterr().out


def test_bench_script_keras_peer_ceiling_and_json(tmp_path, capsys, monkeypatch):
  import json

  monkeypatch.setenv("KERAS_BACKEND", "jax")  # what the script sets before importing keras
  path = tmp_path / "bench.json"
  args = ["--small", "--rounds", "1", "--compiles", "1", "--models", "mlp", "--keras", "yes"]
  args += ["--json", str(path)]
  results = _script("bench").main(args)
  mlp = results["mlp"]
  assert "keras mixed_bfloat16" in mlp
  assert mlp["mpjax mixed_bf16 autocast"]["fast_path_share"] == 1.0
  assert mlp["flax dtype=bf16"]["fast_path_share"] == 0.0  # bf16 x bf16 -> bf16 dots on CPU
  record = json.loads(path.read_text())
  assert record["results"] == json.loads(json.dumps(results))
  assert len(record["ceiling"]) == 2 and all(r["bf16_ms"] > 0 for r in record["ceiling"].values())
  out = capsys.readouterr().out
  assert "| keras mixed_bfloat16 |" in record["markdown"] and record["markdown"] in out


def test_gpu_check_reads_a_gpu_programs_kernels_as_the_deviceless_report_does():
  import importlib.metadata

  import mpjax.gpu

  try:
    importlib.metadata.version(mpjax.gpu.PLUGIN)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"needs XLA's CUDA compiler plugin ({mpjax.gpu.PLUGIN})")
  gpu_check = _script("gpu_check")
  a = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
  compiled = mpjax.compile_for(lambda a, b: a @ b, a, b, target="h200")
  read = gpu_check.program_report(
    compiled.as_text(), compiled.memory_analysis(), "NVIDIA H200", "default"
  )
  expected = mpjax.kernel_report(lambda a, b: a @ b, a, b, target="h200").to_dict()
  assert read == expected and read["target"] == "h200" and read["split_k_gemms"] == 1
  assert gpu_check.program_report(compiled.as_text(), None, "Tesla T4", "default") == {
    "note": "not read: no mpjax target for 'Tesla T4'"
  }
  broken = gpu_check.program_report("HloModule m", None, "NVIDIA H100 80GB HBM3", "default")
  assert broken["note"].startswith("not read: ValueError")


def test_gpu_check_script_runs_small(tmp_path, capsys):
  import json

  gpu_check = _script("gpu_check")
  out = tmp_path / "gpu_check.json"
  corpus = tmp_path / "corpus.txt.gz"  # written from this Python's standard library
  argv = ["--small", "--models", "gpt2", "--rounds", "2", "--peak-tflops", "1", "--json", str(out)]
  argv += ["--corpus", str(corpus)]
  figures = gpu_check.main([*argv, "--reference", str(tmp_path / "none.json")])
  assert json.loads(out.read_text())["markdown"] == figures["markdown"]
  assert "errors" not in figures
  env = figures["environment"]
  assert env["jax"] == jax.__version__ and env["jaxlib"] and env["device_kind"]
  assert {"cuda_runtime", "cudnn", "platform_version", "nvidia_smi_cuda", "packages"} <= set(
    env["cuda"]
  )
  assert "xla_flags" in env and "default_matmul_precision" in env
  variants = figures["models"]["gpt2"]["variants"]
  assert set(variants) == set(gpu_check.VARIANTS)
  fp32 = variants["fp32 (default precision: TF32)"]
  assert fp32["step_ratio"] == 1.0 and figures["models"]["gpt2"]["model_flops"] > 0
  for v in variants.values():
    assert v["step_ms"] > 0 and v["step_ratio"] > 0 and v["compile_s"] >= 0
    assert v["mfu"] == pytest.approx(fp32["mfu"] / v["step_ratio"])  # the same model FLOPs
  off, default = variants["mixed_fp8 (Triton GEMMs off)"], variants["mixed_fp8 (XLA default)"]
  # On a CPU the Triton option is not passed (said so); --small compiles at XLA:CPU's -O0.
  assert default["compile_options"] == off["compile_options"] == gpu_check.SMALL_CPU_OPTIONS
  assert off["trace_reused"] and "applies to XLA:GPU only" in off["compile_note"]
  assert figures["variants_compiled"]["mixed_fp8 (Triton GEMMs off)"] == {
    "xla_gpu_enable_triton_gemm": False
  }
  for v in variants.values():  # the program's kernel report is read on a GPU only, and said so
    assert v["program"] == {"note": "not read: a cpu program, not a GPU's"}
  head = variants["mixed_fp8, FP8 head (XLA default)"]
  for fp8 in (off["fp8"], default["fp8"], head["fp8"]):  # XLA:CPU widens FP8: none compiled
    assert fp8["planned"] > 0 and fp8["compiled_f8"] == 0 and fp8["compiled_gemms"] > 0
    assert fp8["lost"] == fp8["planned"] and fp8["all_planned_in_fp8"] is False
  assert head["fp8"]["planned"] > default["fp8"]["planned"]  # the LM head's GEMMs too
  assert variants["mixed_bf16 (mpjax autocast)"]["fast_path_share"] == 1.0
  training = figures["training"]
  assert training["policy"] == "mixed_bf16" and training["steps"] == 20
  assert len(training["losses"]) == 4 and training["final_loss"] < training["losses"]["5"]
  assert training["comparison"] == {"compared": False, "note": "no CPU reference found"}
  # Trained on the corpus file, which holds the standard library's stream: the same tokens.
  assert corpus.is_file() and training["corpus"]["text_file"] == "corpus.txt.gz"
  without = gpu_check.train_charlm(small=True)
  assert without["corpus"]["sha256"] == training["corpus"]["sha256"]
  assert without["losses"] == training["losses"]
  # Against itself, saved as a reference: compared, no difference.
  same = gpu_check.compare_losses(training, gpu_check.reference_record(training, argv))
  assert same["compared"] and same["max_rel_diff"] == 0.0 and same["corpus_match"]
  assert "| gpt2 | mixed_fp8 (XLA default) |" in capsys.readouterr().out
  # The CPU reference the GPU run compares with: the script's config, 200 steps, loss every 20.
  reference = json.loads(gpu_check.REFERENCE.read_text())
  assert reference["overrides"] == gpu_check.TRAIN and reference["seed"] == 0
  assert sorted(map(int, reference["losses"])) == list(range(20, 201, 20))
  assert reference["jax"] and reference["date"] and "--write-reference" in reference["command"]
  assert gpu_check.compare_losses(reference, reference)["max_rel_diff"] == 0.0


def test_gpu_check_times_gpt2_with_fused_attention_interpreted_on_a_cpu(capsys):
  # gpt2_fused's Pallas kernel is a GPU kernel; on a CPU the script runs it interpreted.
  gpu_check = _script("gpu_check")
  argv = ["--small", "--models", "gpt2_fused", "--rounds", "2", "--peak-tflops", "1", "--no-train"]
  figures = gpu_check.main(argv)
  assert "errors" not in figures
  model = figures["models"]["gpt2_fused"]
  assert model["fused_attention_interpreted"] is True
  variants = model["variants"]
  assert set(variants) == set(gpu_check.VARIANTS)
  layers = model["sizes"]["layers"]
  for v in variants.values():
    assert v["step_ms"] > 0 and v["custom_kernels"] >= 2 * layers  # a forward and a backward
  # The audit reads no GEMM inside the kernels: their FLOPs (per layer 9 GEMMs of 2 * batch *
  # heads * seq^2 * head_dim, half computed: causal; batch 2, 2 heads, seq 16, head_dim 16) are
  # added from the shapes, so MFU counts the attention too.
  attention = layers * 9 * (2 * 2 * 2 * 16 * 16 * 16) / 2
  fp32 = variants["fp32 (default precision: TF32)"]
  assert model["fused_attention_flops"] == attention
  assert model["model_flops"] == fp32["gemm_flops"] + attention
  assert fp32["mfu"] == pytest.approx(model["model_flops"] / (fp32["step_ms"] * 1e-3) / 1e12)
  assert variants["mixed_fp8 (XLA default)"]["fp8"]["planned"] > 0
  assert "| gpt2_fused | mixed_fp8 (XLA default) |" in capsys.readouterr().out


def test_bench_script_compiles_every_policy_for_a_mesh_of_gpus_and_reads_its_collectives(
  tmp_path, capsys
):
  import json

  import mpjax.gpu

  try:
    importlib.metadata.version(mpjax.gpu.PLUGIN)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"needs XLA's CUDA compiler plugin ({mpjax.gpu.PLUGIN})")
  out = tmp_path / "sharded.json"
  argv = ["--target", "h100", "--mesh", "fsdp=8", "--models", "mlp", "--small", "--json", str(out)]
  results = _script("bench").main(argv)["mlp"]
  record = json.loads(out.read_text())
  assert record["mesh"] == {"fsdp": 8} and record["command"].endswith("--json " + str(out))
  assert record["jax"] == jax.__version__ and "| mpjax mixed_bf16 |" in record["markdown"]
  assert set(results) == {"plain fp32", "flax dtype=bf16", *_script("bench").SHARDED_POLICIES}
  bf16, f32 = results["mpjax mixed_bf16"], results["mpjax fp32"]
  # The premise: fp32 gathers and reduces f32 across the 8 devices.
  assert f32["all_gather_bytes"] > 0 and f32["reduce_bytes"] > 0
  assert set(f32["bytes_by_dtype"]) == {"float32"}
  # mixed_bf16 gathers the weights in bf16 (half the bytes) and reduces in bf16; reduce=f32
  # reduces in f32; bf16_sr stores half fp32's state per device.
  assert bf16["all_gather_bytes_vs_fp32"] <= 0.52 and bf16["reduce_bytes_vs_fp32"] <= 0.55
  reduce_f32 = results["mpjax mixed_bf16 reduce=f32"]
  assert reduce_f32["all_gather_bytes_vs_fp32"] <= 0.6  # XLA's placement: mostly bf16
  assert reduce_f32["reduce_bytes"] > bf16["reduce_bytes"]
  # reduce=f32 sums the weights' gradients in f32, which mixed_bf16 sums in bf16 (a bias's
  # gradient, a sum over the batch, is f32 in both). At these tiny shapes the head's 32 x 8
  # kernel is sharded on its contracting dimension, and XLA still sums one activation gradient
  # in bf16 under reduce=f32 (tests/test_sharded.py holds every reduction of a weight to f32).
  f32_sums, bf16_sums = reduce_f32["reduce_bytes_by_dtype"], bf16["reduce_bytes_by_dtype"]
  assert f32_sums["float32"] > bf16_sums["float32"]
  assert f32_sums.get("bfloat16", 0) < bf16_sums["bfloat16"]
  assert results["mpjax bf16_sr"]["state_bytes_per_device_vs_fp32"] <= 0.7  # scalars aside, 0.5
  assert all(r["flagged"] == 0 for label, r in results.items() if "mixed_bf16" in label)
  assert "| mpjax bf16_sr |" in capsys.readouterr().out
