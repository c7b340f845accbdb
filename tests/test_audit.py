"""The GEMM audit: every GEMM found, counted, flagged; the compiled-HLO reader on GPU-style text."""

import functools
import json
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import mpjax
from mpjax.audit import audit, audit_jaxpr, parse_compiled_gemms
from mpjax.hlo import short_dtype
from mpjax.kernels import report_from_hlo


def _mlp():
  model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(16)])
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = model.init(jax.random.key(1), x)

  def loss(params, x):
    return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

  return model, params, x, loss


def test_f32_mlp_every_gemm_flagged_and_share_zero():
  _, params, x, loss = _mlp()
  report = audit(jax.jit(jax.grad(loss)), params, x)
  # 3 forward GEMMs; backward: 3 weight gradients and 2 input gradients (x is
  # not differentiated), all inside the jit.
  assert len(report.rows) == 8
  assert sum("transpose" not in r.path for r in report.rows) == 3
  assert all(r.dtypes == "f32 x f32 -> f32" for r in report.rows)
  assert all("f32-operands" in [f.code for f in r.flags] for r in report.rows)
  assert report.flagged == report.rows
  assert report.fast_path_share == 0.0
  assert report.rows[0].path == "jvp(Sequential)/layers_0"


def test_autocast_mlp_grad_sees_forward_and_backward_gemms():
  _, params, x, loss = _mlp()
  report = audit(jax.jit(jax.grad(mpjax.autocast(loss, "mixed_bf16"))), params, x)
  forward = [r for r in report.rows if "transpose" not in r.path]
  backward = [r for r in report.rows if "transpose" in r.path]
  assert len(forward) == 3 and len(backward) in (5, 6)
  assert all(r.dtypes == "bf16 x bf16 -> f32" for r in report.rows)
  assert not report.flagged
  assert report.fast_path_share == 1.0


def test_train_step_audit_takes_a_donated_train_state():
  model, params, x, loss = _mlp()
  state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.adam(1e-3), policy="mixed_bf16"
  )
  step = jax.jit(mpjax.make_train_step(loss), donate_argnums=0)
  fresh = audit(step, state, x)
  step(state, x)  # donates (deletes) the state's buffers
  again = audit(step, state, x)
  assert again.rows == fresh.rows and again.fast_path_share == 1.0
  f32_state = mpjax.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.adam(1e-3), policy="fp32"
  )
  assert audit(step, f32_state, x).fast_path_share == 0.0


def test_half_result_dot_flagged_on_cpu_only():
  x = jnp.ones((16, 32), jnp.bfloat16)
  w = jnp.ones((32, 64), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jnp.dot)(x, w)
  (cpu,) = audit_jaxpr(jaxpr, platform="cpu").rows
  assert cpu.dtypes == "bf16 x bf16 -> bf16"
  assert [f.code for f in cpu.flags] == ["half-result-on-cpu"] and not cpu.fast
  # For a GPU with no compiled program, nothing says how a bf16 result is accumulated:
  # not flagged, not assumed f32 either.
  gpu_report = audit_jaxpr(jaxpr, platform="gpu")
  (gpu,) = gpu_report.rows
  assert not gpu.flags and not gpu.fast and gpu_report.accumulation_unknown == (gpu,)
  assert "0 flagged, 1 of unknown accumulation." in str(gpu_report)
  assert audit(jnp.dot, x, w).fast_path_share == (0.0 if jax.default_backend() == "cpu" else 1.0)


@pytest.mark.parametrize(
  "dtype, size, flagged",
  [
    (jnp.bfloat16, 100, True),
    (jnp.bfloat16, 104, False),
    (jnp.float16, 24, False),
    (jnp.float8_e4m3fn, 24, True),  # fp8 wants multiples of 16
    (jnp.float8_e4m3fn, 32, False),
  ],
)
def test_misaligned_dimension_flagged(dtype, size, flagged):
  x = jnp.ones((64, size), dtype)
  w = jnp.ones((size, 128), dtype)
  report = audit(lambda x, w: lax.dot(x, w, preferred_element_type=jnp.float32), x, w)
  (row,) = report.rows
  assert row.alignment == (16 if dtype == jnp.float8_e4m3fn else 8)
  assert (row.misaligned == (f"K={size}",)) == flagged
  assert ("misaligned" in [f.code for f in row.flags]) == flagged
  assert report.fast_path_share == (0.0 if flagged else 1.0)


def test_flops_exact_for_batched_dot_and_dims():
  a = jnp.ones((3, 40, 24), jnp.bfloat16)  # batch 3, M 40, K 24
  b = jnp.ones((3, 24, 56), jnp.bfloat16)  # N 56
  (row,) = audit(
    lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32), a, b
  ).rows
  assert dict(row.dims) == {"batch": 3, "M": 40, "N": 56, "K": 24}
  assert row.flops == 2 * 3 * 40 * 56 * 24
  assert row.shape == "3x40x24 @ 3x24x56 -> 3x40x56"


def test_scan_trip_count_multiplies_flops():
  w = jnp.ones((32, 32), jnp.bfloat16)

  def f(x, w):
    def body(h, _):
      return lax.dot(h, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), None

    return lax.scan(body, x, None, length=5)[0]

  (row,) = audit(f, jnp.ones((8, 32), jnp.bfloat16), w).rows
  assert row.count == 5 and row.flops == 5 * 2 * 8 * 32 * 32


def test_nested_jaxprs_are_entered():
  w = jnp.ones((16, 16))

  def f(x):
    x = jax.checkpoint(lambda x: x @ w)(x)
    x = lax.cond(x.sum() > 0, lambda x: x @ w, lambda x: x, x)
    x = lax.while_loop(lambda x: x.sum() < 0, lambda x: x @ w, x)
    return jax.jit(lambda x: x @ w)(x)

  report = audit(f, jnp.ones((8, 16)))
  assert len(report.rows) == 4
  notes = [r.note for r in report.rows]
  assert "cond branch: counted as if taken" in notes
  assert "while body: counted once" in notes
  assert "while body: counted once" in str(report)


def test_convolution_counted_with_flops_and_channel_alignment():
  images = jnp.ones((2, 3, 16, 16), jnp.bfloat16)  # NCHW, 3 input channels
  kernel = jnp.ones((8, 3, 3, 3), jnp.bfloat16)  # OIHW

  def conv(images, kernel):
    return lax.conv_general_dilated(
      images, kernel, (1, 1), "SAME", preferred_element_type=jnp.float32
    )

  (row,) = audit(conv, images, kernel).rows
  assert row.op == "conv_general_dilated"
  assert row.flops == 2 * (2 * 16 * 16) * 8 * (3 * 3 * 3)
  assert dict(row.dims)["C_in"] == 3 and row.misaligned == ("C_in=3",)
  assert row.dtypes == "bf16 x bf16 -> f32"


def test_precision_from_the_default_matmul_precision_context():
  x = jnp.ones((8, 8))
  with jax.default_matmul_precision("highest"):
    jaxpr = jax.make_jaxpr(jnp.dot)(x, x)
  (row,) = audit_jaxpr(jaxpr, platform="gpu").rows
  assert row.precision == "HIGHEST"
  assert [f.code for f in row.flags] == ["f32-operands", "f32-highest"]
  (row,) = audit_jaxpr(jax.make_jaxpr(jnp.dot)(x, x), platform="gpu").rows
  assert [f.code for f in row.flags] == ["f32-operands", "tf32"]


# Modelled on XLA:GPU's optimized HLO (``compile().as_text()`` and the HLO of
# XLA's gemm_rewriter and Triton tests), with long instructions broken over
# lines as those tests write them: a cuBLASLt call whose operands are printed
# without types, an fp8 cuBLASLt call with scales, batched legacy cuBLAS, an
# autotuned Triton GEMM fusion, a cuDNN convolution, a dot left in a loop
# fusion, and a cuBLASLt call in a while body with a quoted, escaped config.
GPU_HLO = r"""HloModule jit_step, is_scheduled=true,
  entry_computation_layout={(bf16[256,512]{1,0}, bf16[512,1024]{1,0})->f32[256,1024]{1,0}}

%triton_gemm_dot.3_computation (p_0: f32[256,1024], p_1: bf16[1024,1000]) -> f32[256,1000] {
  %parameter_0 = f32[256,1024]{1,0} parameter(0)
  %convert.4 = bf16[256,1024]{1,0} convert(%parameter_0)
  %parameter_1 = bf16[1024,1000]{1,0} parameter(1)
  ROOT %dot.3 = f32[256,1000]{1,0} dot(%convert.4, %parameter_1), lhs_contracting_dims={1},
    rhs_contracting_dims={0},
    metadata={op_name="jit(step)/jvp(Model)/head/dot_general" source_file="m.py" source_line=41}
}

%fused_computation.1 (param_0.1: f32[64,100], param_1.2: f32[100,64]) -> f32[64,64] {
  %param_0.1 = f32[64,100]{1,0} parameter(0)
  %param_1.2 = f32[100,64]{1,0} parameter(1)
  %dot.7 = f32[64,64]{1,0} dot(f32[64,100]{1,0} %param_0.1, f32[100,64]{1,0} %param_1.2),
    lhs_contracting_dims={1}, rhs_contracting_dims={0},
    metadata={op_name="jit(step)/small/dot_general"}
  ROOT %tanh.2 = f32[64,64]{1,0} tanh(%dot.7)
}

%body.5 (carry: (s32[], bf16[128,128])) -> (s32[], bf16[128,128]) {
  %carry = (s32[], bf16[128,128]{1,0}) parameter(0)
  %get-tuple-element.1 = s32[] get-tuple-element(%carry), index=0
  %get-tuple-element.2 = bf16[128,128]{1,0} get-tuple-element(%carry), index=1
  %custom-call.9 = (bf16[128,128]{1,0}, s8[4194304]{0}) custom-call(%get-tuple-element.2,
    %get-tuple-element.2), custom_call_target="__cublas$lt$matmul",
    backend_config="{\"gemm_backend_config\":{\"alpha_real\":1,\"beta\":0,
      \"dot_dimension_numbers\":{\"lhs_contracting_dimensions\":[\"1\"],
      \"rhs_contracting_dimensions\":[\"0\"],\"lhs_batch_dimensions\":[],
      \"rhs_batch_dimensions\":[]},\"epilogue\":\"DEFAULT\"}}"
  %get-tuple-element.3 = bf16[128,128]{1,0} get-tuple-element(%custom-call.9), index=0
  ROOT %tuple.2 = (s32[], bf16[128,128]{1,0}) tuple(%get-tuple-element.1, %get-tuple-element.3)
}

ENTRY %main.42 (p0: bf16[256,512], p1: bf16[512,1024]) -> f32[256,1024] {
  %p0 = bf16[256,512]{1,0} parameter(0), metadata={op_name="x"}
  %p1 = bf16[512,1024]{1,0} parameter(1), metadata={op_name="w"}
  %p2 = bf16[1024,1000]{1,0} parameter(2)
  %custom-call.1 = (f32[256,1024]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1),
    custom_call_target="__cublas$lt$matmul",
    metadata={op_name="jit(step)/jvp(Model)/Dense_0/dot_general" source_file="m.py" source_line=12},
    backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],
      "gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{
        "lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],
        "lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"alpha_imag":0,
      "precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"},
      "epilogue":"BIAS","lhs_stride":"131072","rhs_stride":"524288","grad_x":false,
      "grad_y":false,"damax_output":false},"force_earliest_schedule":false}
  %get-tuple-element.4 = f32[256,1024]{1,0} get-tuple-element(%custom-call.1), index=0
  %triton_gemm_dot.3 = f32[256,1000]{1,0} fusion(%get-tuple-element.4, %p2), kind=kCustom,
    calls=%triton_gemm_dot.3_computation,
    metadata={op_name="jit(step)/jvp(Model)/head/dot_general"},
    backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],
      "fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64",
        "block_n":"128","block_k":"32","split_k":"1","num_stages":"4","num_warps":"4",
        "num_ctas":"1"}},"force_earliest_schedule":false}
  %p3 = f8e4m3fn[128,512]{1,0} parameter(3)
  %p4 = f8e4m3fn[256,512]{1,0} parameter(4)
  %c1 = f32[] constant(1)
  %cublas-lt-matmul.2 = (bf16[128,256]{1,0}, s8[33554432]{0}) custom-call(
    f8e4m3fn[128,512]{1,0} %p3, f8e4m3fn[256,512]{1,0} %p4, f32[] %c1, f32[] %c1, f32[] %c1,
    f32[] %c1), custom_call_target="__cublas$lt$matmul$f8",
    backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{
      "lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],
      "lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT",
      "damax_output":false}}
  %p5 = f32[16,128,64]{2,1,0} parameter(5)
  %custom-call.3 = (f32[16,128,128]{2,1,0}, s8[1048576]{0}) custom-call(
    f32[16,128,64]{2,1,0} %p5, f32[16,128,64]{2,1,0} %p5), custom_call_target="__cublas$gemm",
    backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{
      "lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["2"],
      "lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},
      "precision_config":{"operand_precision":["HIGHEST","HIGHEST"]},"epilogue":"DEFAULT"}}
  %p6 = bf16[8,32,32,32]{3,2,1,0} parameter(6)
  %p7 = bf16[64,3,3,32]{3,2,1,0} parameter(7)
  %cudnn-conv.1 = (bf16[8,32,32,64]{3,2,1,0}, u8[0]{0}) custom-call(
    bf16[8,32,32,32]{3,2,1,0} %p6, bf16[64,3,3,32]{3,2,1,0} %p7),
    window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f,
    custom_call_target="__cudnn$convForward",
    metadata={op_name="jit(step)/Conv_0/conv_general_dilated"},
    backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],
      "cudnn_conv_backend_config":{"activation_mode":"kNone","conv_result_scale":1,
      "side_input_scale":0,"leakyrelu_alpha":0},"force_earliest_schedule":false}
  %p8 = f32[64,100]{1,0} parameter(8)
  %p9 = f32[100,64]{1,0} parameter(9)
  %loop_tanh_fusion = f32[64,64]{1,0} fusion(%p8, %p9), kind=kLoop,
    calls=%fused_computation.1, metadata={op_name="jit(step)/small/tanh"}
  %init = (s32[], bf16[128,128]{1,0}) parameter(10)
  %while.1 = (s32[], bf16[128,128]{1,0}) while(%init), condition=%cond.5, body=%body.5
  ROOT %get-tuple-element.5 = f32[256,1024]{1,0} get-tuple-element(%custom-call.1), index=0
}
"""


def test_parse_compiled_gemms_reads_gpu_hlo():
  gemms = {g.name: g for g in parse_compiled_gemms(GPU_HLO)}
  assert set(gemms) == {
    "custom-call.1",
    "triton_gemm_dot.3",
    "cublas-lt-matmul.2",
    "custom-call.3",
    "cudnn-conv.1",
    "loop_tanh_fusion",
    "custom-call.9",
  }
  lt = gemms["custom-call.1"]
  assert (lt.kind, lt.call, lt.op) == ("cublas_lt", "__cublas$lt$matmul", "dot")
  assert (lt.lhs_shape, lt.rhs_shape, lt.out_shape) == ((256, 512), (512, 1024), (256, 1024))
  assert (lt.lhs_dtype, lt.out_dtype, lt.epilogue) == ("bfloat16", "float32", "BIAS")
  assert dict(lt.dims) == {"batch": 1, "M": 256, "N": 1024, "K": 512}
  assert lt.op_name == "jit(step)/jvp(Model)/Dense_0/dot_general" and lt.tensor_core
  triton = gemms["triton_gemm_dot.3"]
  assert (triton.kind, triton.call) == ("triton_gemm", "__triton_gemm")
  assert triton.lhs_dtype == "bfloat16"  # the dot inside, after the fused convert
  assert dict(triton.dims) == {"batch": 1, "M": 256, "N": 1000, "K": 1024}
  f8 = gemms["cublas-lt-matmul.2"]
  assert (f8.kind, f8.lhs_dtype, f8.out_dtype) == ("cublas_lt_f8", "float8_e4m3fn", "bfloat16")
  assert dict(f8.dims) == {"batch": 1, "M": 128, "N": 256, "K": 512}
  legacy = gemms["custom-call.3"]
  assert legacy.kind == "cublas" and dict(legacy.dims) == {"batch": 16, "M": 128, "N": 128, "K": 64}
  conv = gemms["cudnn-conv.1"]
  assert (conv.kind, conv.op, conv.out_shape) == ("cudnn", "conv", (8, 32, 32, 64))
  loop = gemms["loop_tanh_fusion"]
  assert (loop.kind, loop.call) == ("loop", "dot in kLoop fusion") and not loop.tensor_core
  assert loop.op_name == "jit(step)/small/dot_general"
  in_while = gemms["custom-call.9"]  # escaped backend_config, inside a while body
  assert in_while.kind == "cublas_lt" and dict(in_while.dims)["K"] == 128
  json.dumps([g.to_dict() for g in gemms.values()])


def test_each_compiled_gemm_says_its_accumulation_where_the_hlo_says_it():
  acc = {g.name: g.accumulation for g in parse_compiled_gemms(GPU_HLO)}
  assert acc == {
    "custom-call.1": "f32",  # writes f32
    "triton_gemm_dot.3": "f32",
    "cublas-lt-matmul.2": "f32",  # cuBLASLt's FP8 GEMMs compute in f32 only
    "custom-call.3": "f32",
    "cudnn-conv.1": "unknown",  # a bf16 convolution: cuDNN's choice, not in the HLO
    "loop_tanh_fusion": "f32",
    "custom-call.9": "f32",  # bf16 x bf16 -> bf16, no algorithm: XLA's cuBLASLt compute type
  }


# A Q/DQ GEMM as XLA's default mode compiles it for an H100 (jax 0.10.2, abridged): the
# fusion reads the f8 values and widens them to bf16 before the dot; and a bf16 dot with an
# f16-accumulating algorithm.
QDQ_HLO = r"""HloModule jit_f, is_scheduled=true

%gemm_fusion_dot_computation {
  %parameter_0 = f8e4m3fn[256,512]{1,0} parameter(0)
  %convert.6 = bf16[256,512]{1,0} convert(%parameter_0)
  %parameter_1 = f8e4m3fn[512,1024]{1,0} parameter(1)
  %convert.7 = bf16[512,1024]{1,0} convert(%parameter_1)
  ROOT %dot.1 = f32[256,1024]{1,0} dot(%convert.6, %convert.7), lhs_contracting_dims={1},
    rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
}

%half_dot_computation (p0: f16[64,128], p1: f16[128,64]) -> f16[64,64] {
  %p0 = f16[64,128]{1,0} parameter(0)
  %p1 = f16[128,64]{1,0} parameter(1)
  ROOT %dot.2 = f16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1},
    rhs_contracting_dims={0}, algorithm=dot_f16_f16_f16
}

ENTRY %main.3 {
  %x = f8e4m3fn[256,512]{1,0} parameter(0)
  %w = f8e4m3fn[512,1024]{1,0} parameter(1)
  %gemm_fusion_dot = f32[256,1024]{1,0} fusion(%x, %w), kind=kCustom,
    calls=%gemm_fusion_dot_computation,
    backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %a = f16[64,128]{1,0} parameter(2)
  %b = f16[128,64]{1,0} parameter(3)
  %half = f16[64,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%half_dot_computation,
    backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %t = (f32[256,1024]{1,0}, f16[64,64]{1,0}) tuple(%gemm_fusion_dot, %half)
}
"""


def test_a_gemm_planned_in_fp8_that_compiles_to_a_wider_one_is_flagged_fp8_lost():
  def f(x, w, a, b):
    dq = [q.astype(jnp.bfloat16) * jnp.bfloat16(2.0) for q in (x, w)]  # dequantize
    return jnp.dot(*dq, preferred_element_type=jnp.float32), jnp.dot(a, b)

  args = (
    jnp.ones((256, 512), jnp.float8_e4m3fn),
    jnp.ones((512, 1024), jnp.float8_e4m3fn),
    jnp.ones((64, 128), jnp.float16),
    jnp.ones((128, 64), jnp.float16),
  )
  report = audit_jaxpr(jax.make_jaxpr(f)(*args), platform="gpu", hlo_text=QDQ_HLO)
  fp8, half = report.rows
  assert fp8.dtypes == "f8_e4m3fn x f8_e4m3fn -> f32"  # planned: FP8 operands, dequantized
  assert (fp8.call_kind, fp8.compiled_dtypes) == ("triton_gemm", "bf16 x bf16 -> f32")
  assert [f.code for f in fp8.flags] == ["fp8-lost"] and not fp8.fast
  assert "multiplies bf16 x bf16: the FP8 was lost" in fp8.flags[0].reason
  # Read from the program, a half accumulation is flagged too.
  assert half.accumulation == "f16" and not half.fast
  assert [f.code for f in half.flags] == ["low-precision-accumulation"]
  assert report.fast_path_share == 0.0
  text = str(report)
  assert "| compiled dtypes | accumulation |" in text and "`fp8-lost`" in text
  assert "1 GEMMs planned with FP8 operands; compiled, 0 multiply FP8 x FP8" in text
  data = json.loads(json.dumps(report.to_dict()))
  assert data["rows"][0]["compiled_dtypes"] == "bf16 x bf16 -> f32"
  assert data["rows"][1]["accumulation"] == "f16"
  # The same rows with no compiled program: nothing to say FP8 was lost.
  assert not audit_jaxpr(jax.make_jaxpr(f)(*args), platform="gpu").rows[0].flags


def test_parse_compiled_gemms_on_cpu_compiled_text():
  x = jnp.ones((16, 32))
  text = jax.jit(lambda x: x @ x.T).lower(x).compile().as_text()
  (gemm,) = parse_compiled_gemms(text)
  assert gemm.op == "dot" and dict(gemm.dims) == {"batch": 1, "M": 16, "N": 16, "K": 32}


def test_half_gemms_that_xla_cpu_widens_are_not_flagged_half_lost_on_cpu():
  """XLA:CPU widens some half GEMMs as documented; on a CPU the audit judges the planned dtypes."""
  a, b = jnp.ones((64, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
  images, kernel = jnp.ones((8, 8, 8, 32), jnp.bfloat16), jnp.ones((3, 3, 32, 64), jnp.bfloat16)

  def f(a, b, images, kernel):
    dims = ("NHWC", "HWIO", "NHWC")
    conv = lax.conv_general_dilated(
      images, kernel, (1, 1), "SAME", dimension_numbers=dims, preferred_element_type=jnp.float32
    )
    c, d = a[:32, :128].astype(jnp.float16), b[:128, :64].astype(jnp.float16)
    return a @ b, conv, lax.dot(c, d, preferred_element_type=jnp.float32)

  args = (a, b, images, kernel)
  hlo = jax.jit(f).lower(*args).compile().as_text()  # the CPU's compiled program
  report = audit_jaxpr(jax.make_jaxpr(f)(*args), platform="cpu", hlo_text=hlo)
  conv, half_result, f16 = report.rows
  # The premise: XLA:CPU multiplies the bf16 convolution and the f16 GEMM in f32 (and the
  # half-result GEMM too, up to jax 0.10: its flag's reason).
  assert conv.compiled_dtypes == f16.compiled_dtypes == "f32 x f32 -> f32"
  codes = [[x.code for x in r.flags if x.code != "not-tensor-core"] for r in report.rows]
  # A half result: flagged as before (its widening is that flag's reason), and only so.
  assert codes == [[], ["half-result-on-cpu"], []]
  assert report.half_lost == () and report.to_dict()["half_lost"] == 0
  assert "Half precision lost" not in str(report)
  # audit on a CPU reads no compiled program: the same flags, the call's aside.
  assert [[x.code for x in r.flags] for r in audit(f, *args).rows] == codes


def test_audit_with_gpu_hlo_matches_calls_and_flags():
  x = jnp.ones((256, 512), jnp.bfloat16)
  w = jnp.ones((512, 1024), jnp.bfloat16)
  h = jnp.ones((64, 100))
  v = jnp.ones((100, 64))

  def f(x, w, h, v):
    return lax.dot(x, w, preferred_element_type=jnp.float32), jnp.tanh(h @ v)

  report = audit_jaxpr(jax.make_jaxpr(f)(x, w, h, v), platform="gpu", hlo_text=GPU_HLO)
  fast, slow = report.rows
  assert (fast.call, fast.call_kind, fast.fast, fast.flags) == (
    "__cublas$lt$matmul",
    "cublas_lt",
    True,
    (),
  )
  assert slow.call == "dot in kLoop fusion"
  assert [f.code for f in slow.flags] == ["f32-operands", "tf32", "not-tensor-core"]
  assert report.fast_path_share == pytest.approx(fast.flops / (fast.flops + slow.flops))
  assert len(report.compiled_only) == 5  # the program has 2 GEMMs, the HLO 7
  text = str(report)
  assert "| `__cublas$lt$matmul` |" in text and "not-tensor-core" in text
  assert json.loads(json.dumps(report.to_dict()))["rows"][1]["call"] == "dot in kLoop fusion"


def test_report_markdown_and_json():
  _, params, x, loss = _mlp()
  report = audit(jax.grad(loss), params, x)
  text = str(report)
  assert text.startswith("| # | path | shape | dtypes | precision | GFLOP | flags |")
  assert "Fast path: 0.0%" in text and "not read: the backend is" in text
  data = json.loads(json.dumps(report.to_dict()))
  assert data["fast_path_share"] == 0.0 and len(data["rows"]) == 8
  assert data["rows"][0]["flags"][0]["code"] == "f32-operands"


def test_bad_input_raises_early():
  with pytest.raises(TypeError, match="fn must be the function"):
    audit("not a function")
  with pytest.raises(TypeError, match="must be a jaxpr"):
    audit_jaxpr(lambda x: x)
  with pytest.raises(TypeError, match="must be HLO module text"):
    parse_compiled_gemms(b"HloModule m")


def test_audit_takes_a_typed_prng_key_leaf():
  """An NNX model holding ``nnx.Rngs`` (for Dropout) has ``jax.random.key`` leaves."""

  def step(params, key, x):
    noise = jax.random.normal(key, x.shape)
    return jnp.dot((x + noise).astype(jnp.bfloat16), params, preferred_element_type=jnp.float32)

  params, x = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((8, 16))
  report = mpjax.audit(step, params, jax.random.key(0), x)
  assert len(report.rows) == 1 and report.fast_path_share == 1.0


def test_a_strided_convolution_and_both_its_gradients_count_the_same_flops():
  conv = nn.Conv(16, (3, 3), strides=(2, 2), padding="SAME", use_bias=False)
  x = jnp.ones((4, 16, 16, 8))
  params = conv.init(jax.random.key(0), x)

  def loss(p, x):
    return jnp.sum(conv.apply(p, x) ** 2)

  report = mpjax.audit(jax.grad(mpjax.autocast(loss, "mixed_bf16"), argnums=(0, 1)), params, x)
  convs = [r for r in report.rows if r.op == "conv_general_dilated"]
  assert len(convs) == 3  # forward, input gradient (lhs-dilated by the stride), kernel gradient
  forward = 2.0 * 4 * 8 * 8 * 16 * (3 * 3 * 8)  # output elements x (kernel taps x in-channels)
  assert [r.flops for r in convs] == [forward] * 3


def test_the_hlo_reader_reads_a_train_step_that_an_h200_compiled_and_autotuned():
  """Real GPU output, not hand-made HLO: the mixed_bf16 char-LM step (4 layers, d512) of
  gpu_check at commit 5efd7ca, compiled and autotuned on a lent NVIDIA H200.

  Its provenance and its 75 GEMM calls are in ``tests/data/h200_mixed_bf16_step.json``: it
  is NOT the program behind ``results/gpu/gpu_check_h200.json`` (20 cuBLASLt / 55 Triton).
  """
  import gzip
  import hashlib
  import pathlib

  data = pathlib.Path(__file__).parent / "data"
  path = data / "h200_mixed_bf16_step.hlo.gz"
  record = json.loads((data / "h200_mixed_bf16_step.json").read_text())
  assert hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256_gz"]
  hlo = gzip.open(path, "rt").read()
  calls = [
    {
      "name": g.name,
      "kind": g.kind,
      "dtypes": f"{short_dtype(g.lhs_dtype)} x {short_dtype(g.rhs_dtype)} -> "
      f"{short_dtype(g.out_dtype)}",
      "accumulation": g.accumulation,
      "shapes": [list(g.lhs_shape), list(g.rhs_shape), list(g.out_shape)],
      "op_name": g.op_name.removeprefix("jit(step)/"),
    }
    for g in parse_compiled_gemms(hlo)
  ]
  assert calls == record["calls"]  # call by call, in program order
  # What the table holds, counted here from the calls themselves.
  assert len(calls) == 75  # 25 in the forward pass, 50 in the backward
  kinds = Counter((c["kind"], c["dtypes"]) for c in calls)
  # The 17 f32 results are weight gradients split over K (f32 partials, summed after).
  assert kinds == {
    ("triton_gemm", "bf16 x bf16 -> bf16"): 58,
    ("triton_gemm", "bf16 x bf16 -> f32"): 9,
    ("cublas_lt", "bf16 x bf16 -> f32"): 8,
  }
  assert {c["accumulation"] for c in calls} == {"f32"}
  assert sum("transpose(jvp(CharLM))" in c["op_name"] for c in calls) == 50
  # Not the JSON's program: its mixed_bf16 step had 20 cuBLASLt calls and 55 Triton fusions.
  run = json.loads((data.parent.parent / "results" / "gpu" / "gpu_check_h200.json").read_text())
  assert run["variants"]["mixed_bf16 (autocast)"]["calls"] == "cublas_lt 20, triton_gemm 55"
  assert (record["counts"]["cublas_lt"], record["counts"]["triton_gemm"]) == (8, 67)
  report = report_from_hlo(hlo, "h200")
  assert report.by_kind["gemm"] == 75 and report.by_kind["conditional"] == 0
  assert report.calls == {"triton_gemm": 67, "cublas_lt": 8}
  assert report.accumulation == {"f32": 75}
  # The same model FLOPs as the saved run's audit (split-K changes the shapes, not the FLOPs).
  assert report.flops == record["counts"]["gemm_flops"] == run["audit"]["total_flops"]
  assert {k.peak_dtype for k in report.kernels if k.kind == "gemm"} == {"bfloat16"}


def test_gemms_inside_a_pallas_kernel_are_not_audited_and_the_report_says_so():
  import pallas_matmul

  from mpjax.jaxpr_gemms import sub_jaxprs

  # A projection, then a matmul in a Pallas kernel, forward and backward (interpreted: a CPU).
  w, x = jnp.ones((32, 32), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  loss = functools.partial(pallas_matmul.loss, interpret=True)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))

  # The premise: the kernels' own programs hold dots (one grid block's), which are no GEMM of
  # the program XLA compiles.
  def eqns(jaxpr):
    for e in jaxpr.eqns:
      yield e
      for _, sub in sub_jaxprs(e):
        yield from eqns(sub)

  kernels = [e for e in eqns(jax.make_jaxpr(grad)(x, w).jaxpr) if e.primitive.name == "pallas_call"]
  assert len(kernels) >= 2  # forward and backward
  inner = [e for k in kernels for _, sub in sub_jaxprs(k) for e in eqns(sub)]
  assert any(e.primitive.name == "dot_general" for e in inner)
  report = audit(grad, x, w)
  assert [r.path for r in report.rows if "pallas" in r.path] == []
  # The projection's GEMMs: forward, and the gradients of x and w.
  assert len(report.rows) == 3
  assert report.total_flops == 3 * (2 * 64 * 32 * 32)
  assert len(report.custom_kernels) == len(kernels)
  assert report.to_dict()["custom_kernels"] == list(report.custom_kernels)
  text = report.to_markdown()
  assert f"Not audited: {len(kernels)} custom kernels (Pallas `pallas_call`)" in text
