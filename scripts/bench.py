"""Step time, saved activations and compile time of mixed precision against fp32 and the peers.

Runs, in one process and interleaved after warm-up, one Adam training step
(f32 master params, state donated) of two unchanged f32 Flax models:

- ``mlp``: an MLP 1024-4096-4096-1024, batch 256;
- ``transformer``: a 4-layer causal transformer LM (d_model 512, 8 heads, MLP
  2048, seq 256, batch 4, vocabulary 512).

Variants, each against ``plain fp32`` (``jax.value_and_grad`` + optax):

- ``mpjax fp32``: :func:`mpjax.make_train_step` with the fp32 policy (its
  bookkeeping: the loss-scale state, the policy, the step counters);
- ``mpjax fp32 skip_nonfinite``: the same with the finite check and skip that
  the fp16 policies get by default (``skip_nonfinite=True``);
- ``mpjax mixed_bf16 autocast``: the default for mixed policies;
- ``mpjax mixed_bf16 cast``: the same with ``autocast=False`` (params and batch
  cast to bf16 up front, jmp-style policy casting);
- ``mpjax mixed_fp16 autocast``: fp16 with dynamic loss scaling;
- ``flax dtype=bf16``: the peer a Flax user reaches for, every module built
  with ``dtype=jnp.bfloat16``, in a plain step;
- ``jmp cast``: jmp's recipe by hand: ``jmp.get_policy("params=float32,
  compute=bfloat16,output=float32")``, params and inputs cast to bf16, a plain
  step;
- ``keras mixed_bfloat16``: the same models in Keras 3 on the JAX backend
  (``Dense``, ``LayerNormalization``, ``MultiHeadAttention`` with a causal
  mask) under ``keras.mixed_precision.set_global_policy("mixed_bfloat16")``,
  trained the stateless way (``model.stateless_call`` and
  ``optimizer.stateless_apply`` with Keras's Adam inside ``jax.jit``). Needs
  ``pip install -e ".[bench]"``; skipped with a note when Keras is missing, and
  by default with ``--small``.

Per variant: the median step time and its ratio to ``plain fp32``; the
activations saved for the backward pass (residuals that are not arguments,
``jax.ad_checkpoint``) and their ratio to fp32; tracing plus compiling time
(the fastest of ``--compiles`` fresh compiles, interleaved over the variants
after ``jax.clear_caches()``, so no variant pays the process's first-compile
costs) and its ratio to fp32; the share of GEMM FLOPs on the fast path from
:func:`mpjax.audit.audit_jaxpr` of the traced step. Then the ceiling: a bare GEMM (the
MLP's 4096x4096 layer at batch 256, and 2048^3) in f32 against bf16 x bf16 ->
f32. Prints markdown tables; ``--json`` also writes every figure and the tables.

    python scripts/bench.py [--models mlp,transformer] [--rounds 15] [--compiles 3] [--json F]
    python scripts/bench.py --target h100 [--models mlp,transformer,gpt2,gpt2_fused]  # no GPU
    python scripts/bench.py --target h100 --gemm_backend cublaslt   # Triton GEMMs off

With ``--target``, nothing is timed: every variant's step (but Keras's) is
compiled for that GPU on this machine and its kernel report printed
(:func:`mpjax.kernel_report`: kernels by kind, standalone converts, bytes
moved, copies, temp memory and a roofline estimate), as ratios to plain fp32.
It compiles in XLA's default mode, the one users run (Triton GEMM fusions on,
with placeholder tiles: nothing autotunes without a GPU), unless
``--gemm_backend cublaslt`` turns Triton GEMMs off; ``--json`` records the
mode, the XLA options, ``XLA_FLAGS`` and the jax, jaxlib and compiler plugin
versions. ``gpt2`` is GPT-2 small (12 layers, d768, seq 1024, batch 8) with
the transformer's attention, which writes its scores to memory; ``gpt2_fused``
the same with a fused flash attention (jax's Pallas kernel, in bf16 in every
variant, as flash kernels run), as GPT-2 trains on a GPU: its kernels are
custom calls whose FLOPs the report cannot read, so the bench counts them
from the shapes and says what the estimate leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax.audit import audit_jaxpr
from mpjax.experiment.comparison import device_description
from mpjax.jax_compat import saved_residuals


class MLP(nn.Module):
  features: tuple[int, ...]
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.features):
      x = nn.Dense(width, dtype=self.dtype)(x)
      if i < len(self.features) - 1:
        x = nn.relu(x)
    return x


def fused_attention_kernel() -> str:
  """Which fused attention ``gpt2_fused`` runs on this jax: its name in records.

  ``"pallas_triton_mha"``: jax's Pallas flash attention (Triton), in jax up to
  0.12.0.1. jax 0.12.1 removed it, leaving only Mosaic GPU kernels, which do
  not compile without a GPU; there ``"xla_dot_product_attention"``:
  ``jax.nn.dot_product_attention(implementation="xla")``, whose GEMMs are XLA's
  own (audited and counted like any), with the scores in memory as XLA writes
  them: a stand-in with the model's shapes, not a flash kernel.
  """
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "jax.experimental.pallas.ops.gpu.attention is deprecated")
      from jax.experimental.pallas.ops.gpu import attention  # noqa: F401
  except ImportError:
    return "xla_dot_product_attention"
  return "pallas_triton_mha"


def _fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool) -> jax.Array:
  """Causal attention in one kernel forward and one backward where jax has one (see
  :func:`fused_attention_kernel`).

  The scores never reach memory, as with cuDNN's fused attention (which jax
  traces only with a GPU). A Triton kernel: it compiles for NVIDIA GPU
  targets only (``interpret`` runs it on the CPU, for ``init``). jax 0.12
  deprecates Pallas's Triton backend in favour of Mosaic GPU kernels and
  tokamax (hence the warnings silenced); Mosaic GPU kernels do not compile
  without a GPU, and this kernel compiles on jax 0.10.2 to 0.12.0.1.
  """
  scale = 1 / np.sqrt(q.shape[-1])
  if fused_attention_kernel() == "xla_dot_product_attention":
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    warnings.filterwarnings("ignore", "jax.experimental.pallas.ops.gpu.attention is deprecated")
    from jax.experimental.pallas.ops.gpu.attention import mha

    return mha(q, k, v, segment_ids=None, sm_scale=scale, causal=True, interpret=interpret)


def fused_attention_flops(sizes: dict[str, int], batch_size: int) -> float:
  """The GEMM FLOPs of a step's :func:`_fused_attention`, which the kernel report cannot read.

  Per layer, GEMMs of ``batch * heads * seq^2 * head_dim`` multiply-adds: 2
  forward (scores, values) and 7 backward (the dK/dV kernel recomputes the
  scores and the probabilities' gradient, then dV and dK; the dQ kernel
  recomputes those two again, then dQ), each half computed (causal: the
  kernels skip the blocks above the diagonal).
  """
  if fused_attention_kernel() != "pallas_triton_mha":  # XLA's GEMMs: the report reads them
    return 0.0
  seq, heads, d_model = sizes["seq"], sizes["heads"], sizes["d_model"]
  per_gemm = 2.0 * batch_size * heads * seq * seq * (d_model // heads) / 2
  return sizes["layers"] * (2 + 7) * per_gemm


class Block(nn.Module):
  d_model: int
  heads: int
  mlp: int
  dtype: Any = None
  attention: str = "materialized"  # or "fused": jax's Pallas flash attention (GPU targets)
  interpret: bool = False  # the fused attention's kernel interpreted: to run it on a CPU

  @nn.compact
  def __call__(self, x):
    b, s, _ = x.shape
    h = nn.LayerNorm(dtype=self.dtype)(x)
    qkv = nn.Dense(3 * self.d_model, dtype=self.dtype)(h).reshape(b, s, 3, self.heads, -1)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.attention == "fused":  # in bf16 whatever the model's dtype, as flash kernels run
      half = [t.astype(jnp.bfloat16) for t in (q, k, v)]
      interpret = self.interpret or self.is_initializing()
      attn = _fused_attention(*half, interpret=interpret).astype(q.dtype)
    else:
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
      mask = jnp.tril(jnp.ones((s, s), bool))
      scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
      probs = jax.nn.softmax(scores.astype(jnp.float32)).astype(v.dtype)
      attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    attn = attn.reshape(b, s, self.d_model)
    x = x + nn.Dense(self.d_model, dtype=self.dtype)(attn)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(self.mlp, dtype=self.dtype)(h)
    return x + nn.Dense(self.d_model, dtype=self.dtype)(nn.gelu(h))


class TransformerLM(nn.Module):
  vocab: int = 512
  d_model: int = 512
  heads: int = 8
  mlp: int = 2048
  layers: int = 4
  dtype: Any = None
  attention: str = "materialized"
  interpret: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d_model))
    for _ in range(self.layers):
      x = Block(self.d_model, self.heads, self.mlp, self.dtype, self.attention, self.interpret)(x)
    return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def _workload(
  name: str, small: bool, interpret: bool = False
) -> tuple[Callable[[Any], nn.Module], Any, Callable, dict]:
  """(model factory by dtype, batch, loss(logits, batch), model sizes) for one workload.

  ``interpret`` runs ``gpt2_fused``'s attention kernel interpreted, as a CPU can.
  """
  key = jax.random.key(0)
  if name == "mlp":
    sizes = (16, 32, 32, 8) if small else (1024, 4096, 4096, 1024)
    batch_size = 8 if small else 256
    batch = {
      "x": jax.random.normal(key, (batch_size, sizes[0])),
      "y": jax.random.normal(jax.random.key(1), (batch_size, sizes[-1])),
    }
    return (
      lambda dtype: MLP(sizes[1:], dtype),
      batch,
      lambda out, batch: jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2),
      dict(features=sizes),
    )
  dims = (
    dict(vocab=64, d_model=32, heads=4, mlp=64, layers=2)
    if small
    else dict(vocab=512, d_model=512, heads=8, mlp=2048, layers=4)
  )
  seq, batch_size = (16, 2) if small else (256, 4)
  if name in ("gpt2", "gpt2_fused") and not small:  # GPT-2 small; its vocabulary padded to 64
    dims, seq, batch_size = dict(vocab=50304, d_model=768, heads=12, mlp=3072, layers=12), 1024, 8
  if name == "1b" and not small:  # a 1B-parameter LM (16 layers, d2048), FSDP's scale
    dims, seq, batch_size = dict(vocab=50304, d_model=2048, heads=16, mlp=8192, layers=16), 1024, 16
  if name == "gpt2_fused":  # its attention fused (GPU targets, or interpreted)
    dims = dict(dims, attention="fused", heads=2 if small else 12)  # Triton: head_dim >= 16
  tokens = jax.random.randint(key, (batch_size, seq + 1), 0, dims["vocab"])
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  return (
    lambda dtype: TransformerLM(**dims, dtype=dtype, interpret=interpret),
    batch,
    lambda out, batch: optax.softmax_cross_entropy_with_integer_labels(
      out.astype(jnp.float32), batch["y"]
    ).mean(),
    dict(dims, seq=seq),
  )


def _keras_models(keras: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """Keras builders of the same two models: (mlp(features), transformer(**dims))."""
  layers = keras.layers

  def mlp(features):
    widths = features[1:]
    return keras.Sequential(
      [keras.Input((features[0],))]
      + [
        layers.Dense(width, activation="relu" if i < len(widths) - 1 else None)
        for i, width in enumerate(widths)
      ]
    )

  class KerasBlock(layers.Layer):
    def __init__(self, d_model, heads, mlp, **kwargs):
      super().__init__(**kwargs)
      self.norm1 = layers.LayerNormalization()
      self.attention = layers.MultiHeadAttention(heads, d_model // heads)
      self.norm2 = layers.LayerNormalization()
      self.up = layers.Dense(mlp, activation="gelu")
      self.down = layers.Dense(d_model)

    def call(self, x):
      h = self.norm1(x)
      x = x + self.attention(h, h, use_causal_mask=True)
      return x + self.down(self.up(self.norm2(x)))

  class KerasLM(keras.Model):
    def __init__(self, vocab, d_model, heads, mlp, layers, seq, **kwargs):
      super().__init__(**kwargs)
      self.embed = keras.layers.Embedding(vocab, d_model)
      self.pos = keras.layers.Embedding(seq, d_model)
      self.blocks = [KerasBlock(d_model, heads, mlp) for _ in range(layers)]
      self.norm = keras.layers.LayerNormalization()
      self.head = keras.layers.Dense(vocab)

    def call(self, tokens):
      x = self.embed(tokens) + self.pos(keras.ops.arange(tokens.shape[1]))
      for block in self.blocks:
        x = block(x)
      return self.head(self.norm(x))

  return mlp, KerasLM


def _keras_variant(name: str, sizes: dict, batch: Any, loss: Callable) -> tuple | None:
  """The Keras 3 ``mixed_bfloat16`` peer, trained statelessly in ``jax.jit``; None without Keras."""
  os.environ["KERAS_BACKEND"] = "jax"  # read when keras is first imported
  try:
    import keras
  except ImportError as e:
    print(f"note: keras mixed_bfloat16 skipped: {e} (pip install -e '.[bench]')", flush=True)
    return None
  if keras.backend.backend() != "jax":
    print(f"note: keras skipped: it was imported with the {keras.backend.backend()} backend.")
    return None
  mlp, lm = _keras_models(keras)
  previous = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:  # layers take the policy when built; put the global one back after
    keras.utils.set_random_seed(2)
    model = mlp(sizes["features"]) if name == "mlp" else lm(**sizes)
    model(batch["x"])
  finally:
    keras.mixed_precision.set_global_policy(previous)
  optimizer = keras.optimizers.Adam(1e-4)
  optimizer.build(model.trainable_variables)
  non_trainable = [v.value for v in model.non_trainable_variables]

  def loss_of(trainable, batch):
    out, _ = model.stateless_call(trainable, non_trainable, batch["x"])
    return loss(out, batch)

  def step(carry, batch):
    trainable, opt_vars = carry
    value, grads = jax.value_and_grad(loss_of)(trainable, batch)
    trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
    return (trainable, opt_vars), {"loss": value}

  trainable = [jnp.copy(v.value) for v in model.trainable_variables]

  def init():
    # The step donates what it is given: copies, so the model keeps its own.
    return [jnp.copy(v) for v in trainable], [jnp.copy(v.value) for v in optimizer.variables]

  return jax.jit(step, donate_argnums=0), init, loss_of, trainable


def _variants(
  name: str, small: bool, keras: bool, fp8: bool = False, interpret: bool = False
) -> tuple[dict[str, tuple], Any]:
  """(label -> (step, init_state, loss_of_params for residuals, its params), batch).

  ``fp8`` adds ``mpjax mixed_fp8 autocast`` (for GPU targets: XLA:CPU emulates FP8),
  the same with the last FP8-eligible GEMM (the output head) in FP8 too
  (:data:`FP8_HEAD`), which the default recipe keeps in bf16, and the
  block-scaled presets (:data:`BLOCK_SCALED`). ``interpret``: see
  :func:`_workload`.
  """
  make_model, batch, loss, sizes = _workload(name, small, interpret)
  # A fused attention is a Pallas kernel, which autocast runs as traced (in bf16, see Block).
  rules = {"pallas_call": "keep"} if sizes.get("attention") == "fused" else None
  tx = optax.adam(1e-4)
  f32_model = make_model(None)
  params = f32_model.init(jax.random.key(2), batch["x"])

  def plain(model, cast: Callable[[Any], Any] = lambda t: t):
    def loss_of(params, batch):
      return loss(model.apply(cast(params), cast(batch["x"])), batch)

    def step(carry, batch):
      params, opt_state = carry
      value, grads = jax.value_and_grad(loss_of)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    def init():
      own = jax.tree.map(jnp.copy, params)  # the step donates it
      return own, tx.init(own)

    return jax.jit(step, donate_argnums=0), init, loss_of, params

  def with_mpjax(
    policy: str | mpjax.Policy, autocast: bool = True, skip_nonfinite: bool | None = None
  ):
    def loss_of(params, batch):
      return loss(f32_model.apply(params, batch["x"]), batch)

    step = mpjax.make_train_step(
      loss_of, autocast=autocast, autocast_rules=rules, skip_nonfinite=skip_nonfinite
    )

    def init():
      return mpjax.TrainState.create(apply_fn=f32_model.apply, params=params, tx=tx, policy=policy)

    p = mpjax.get_policy(policy)
    run = (
      mpjax.autocast(loss_of, p, rules=rules)
      if autocast
      else lambda params, batch: loss_of(p.cast_to_compute(params), p.cast_to_compute(batch))
    )
    return jax.jit(step, donate_argnums=0), init, run, params

  jmp_policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
  variants = {
    "plain fp32": plain(f32_model),
    "mpjax fp32": with_mpjax("fp32"),
    "mpjax fp32 skip_nonfinite": with_mpjax("fp32", skip_nonfinite=True),
    "mpjax mixed_bf16 autocast": with_mpjax("mixed_bf16"),
    "mpjax mixed_bf16 cast": with_mpjax("mixed_bf16", autocast=False),
    "mpjax mixed_fp16 autocast": with_mpjax("mixed_fp16"),
    "flax dtype=bf16": plain(make_model(jnp.bfloat16)),
    "jmp cast": plain(f32_model, jmp_policy.cast_to_compute),
  }
  if fp8:
    variants["mpjax mixed_fp8 autocast"] = with_mpjax("mixed_fp8")
    variants[FP8_HEAD_LABEL] = with_mpjax(FP8_HEAD)
    for preset in BLOCK_SCALED:
      variants[f"mpjax {preset} autocast"] = with_mpjax(preset)
    variants[MXFP8_HEAD_LABEL] = with_mpjax(MXFP8_HEAD)
  if keras:
    peer = _keras_variant(name, sizes, batch, loss)
    if peer is not None:
      variants["keras mixed_bfloat16"] = peer
  return variants, batch


# mixed_fp8 with only the first FP8-eligible GEMM kept in bf16: the output head
# (GPT-2's LM head, the MLP's last layer) multiplies in FP8 too.
FP8_HEAD = mpjax.Policy(
  jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.Fp8Recipe(keep_bf16=("first",))
)
FP8_HEAD_LABEL = "mpjax mixed_fp8 autocast, FP8 head"
# The block-scaled presets (MXFP8, NVFP4): Blackwell's Tensor Cores, emulated elsewhere.
BLOCK_SCALED = ("mixed_mxfp8", "mixed_nvfp4")
# mixed_mxfp8 with the output head block-scaled too (only the first GEMM kept in bf16).
MXFP8_HEAD = mpjax.Policy(
  jnp.float32, jnp.bfloat16, jnp.float32, fp8=mpjax.BlockScaledRecipe(keep_bf16=("first",))
)
MXFP8_HEAD_LABEL = "mpjax mixed_mxfp8 autocast, MXFP8 head"


def _residual_bytes(loss_of: Callable, params: Any, batch: Any) -> int:
  """Bytes of the activations saved for the backward pass (not the arguments)."""
  total = 0
  for aval, where in saved_residuals(loss_of, params, batch):
    if "from the argument" not in where:
      total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
  return total


def _compile_seconds(step: Callable, state: Any, batch: Any) -> tuple[float, Any, Any]:
  """Seconds to trace and compile ``step`` afresh, its traced form and the executable."""
  jax.clear_caches()
  start = time.perf_counter()
  traced = step.trace(state, batch)
  compiled = traced.lower().compile()
  return time.perf_counter() - start, traced, compiled


def bench(
  name: str, rounds: int, small: bool = False, keras: bool = True, compiles: int = 3
) -> dict[str, dict[str, float]]:
  variants, batch = _variants(name, small, keras)
  results: dict[str, dict[str, float]] = {}
  states = {}
  compile_times: dict[str, list[float]] = {label: [] for label in variants}
  for _ in range(compiles):
    for label, (step, init, _, _) in variants.items():
      seconds, traced, compiled = _compile_seconds(step, init(), batch)
      compile_times[label].append(seconds)
  for label, (step, init, loss_of, params) in variants.items():
    state = init()
    _, traced, compiled = _compile_seconds(step, state, batch)
    # The audit reads the program just traced (on a GPU also the compiled HLO).
    on_gpu = jax.default_backend() == "gpu"
    report = audit_jaxpr(
      traced.jaxpr, platform=jax.default_backend(), hlo_text=compiled.as_text() if on_gpu else None
    )
    for _ in range(3):  # warm up
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    states[label] = (compiled, state)
    results[label] = {
      "compile_s": min(compile_times[label]),
      "residual_mib": _residual_bytes(loss_of, params, batch) / 2**20,
      "fast_path_share": report.fast_path_share,
    }
  times: dict[str, list[float]] = {label: [] for label in variants}
  for _ in range(rounds):
    for label in variants:
      compiled, state = states[label]
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready((state, metrics))
      times[label].append(time.perf_counter() - start)
      states[label] = (compiled, state)
  base = results["plain fp32"]
  base_time = statistics.median(times["plain fp32"])
  for label, r in results.items():
    r["step_ms"] = statistics.median(times[label]) * 1e3
    r["step_ratio"] = r["step_ms"] / (base_time * 1e3)
    r["residual_ratio"] = r["residual_mib"] / base["residual_mib"]
    r["compile_ratio"] = r["compile_s"] / base["compile_s"]
  return results


def gpu_compile(
  name: str, target: str, small: bool = False, gemm_backend: str = "default"
) -> dict[str, Any]:
  """Each variant's train step compiled for a GPU target here (no GPU): its kernel report.

  With the GPU variants: ``mpjax mixed_fp8 autocast`` (its FP8 state made
  first, as a training run makes it). ``gemm_backend``: ``"default"`` (XLA's
  default mode, Triton GEMMs on) or ``"cublaslt"`` (Triton GEMMs off).
  """
  variants, batch = _variants(name, small, keras=False, fp8=True)
  reports = {}
  for label, (step, init, _, _) in variants.items():
    state = jax.eval_shape(init)
    if isinstance(state, mpjax.TrainState):
      state = mpjax.init_fp8_state(step, state, batch)
    reports[label] = mpjax.kernel_report(
      step, state, batch, target=target, gemm_backend=gemm_backend
    )
  return reports


def saved_activations(name: str, small: bool = False) -> dict[str, int]:
  """Bytes each mpjax variant of ``gpu_compile`` saves for its backward pass (traced here)."""
  variants, batch = _variants(name, small, keras=False, fp8=True, interpret=True)
  return {
    label: _residual_bytes(loss_of, params, batch)
    for label, (_, _, loss_of, params) in variants.items()
    if label.startswith("mpjax") and "autocast" in label
  }


def block_scaled_against_bf16(reports: dict[str, Any], saved: dict[str, int]) -> str:
  """The block-scaled steps against the bf16 one on the target: GEMM calls, estimated time,
  saved activations."""
  bf16 = reports["mpjax mixed_bf16 autocast"]
  parts = []
  for preset in BLOCK_SCALED:
    label = f"mpjax {preset} autocast"
    r = reports[label]
    native = r.calls.get("cudnn_block_scaled", 0)
    how = (
      f"{native} of {sum(r.calls.values())} GEMMs are cuDNN block-scaled calls"
      if native
      else f"no GEMM fits the recipe's blocks on {r.target.name}"
      if r.target.fp4_tflops
      else f"no native block-scaled GEMM on {r.target.name}: XLA emulates them at the bf16 rate"
    )
    parts.append(
      f"{preset} / mixed_bf16 on {r.target.name}: estimated step time "
      f"{r.estimated_seconds / bf16.estimated_seconds:.3f}x, GEMM kernels "
      f"{r.estimated_gemm_seconds / bf16.estimated_gemm_seconds:.3f}x, kernels "
      f"{r.count / bf16.count:.2f}x, bytes moved {r.bytes_moved / bf16.bytes_moved:.2f}x, saved "
      f"activations {saved[label] / saved['mpjax mixed_bf16 autocast']:.3f}x ({how}); "
      f"{fp8_bound(r, bf16)}"
    )
  head = reports[MXFP8_HEAD_LABEL]
  parts.append(
    f"With the output head in MXFP8 too (keep_bf16=('first',)): estimated step time "
    f"{head.estimated_seconds / bf16.estimated_seconds:.3f}x; {fp8_bound(head, bf16)}"
  )
  return " ".join(parts)


# The policies a sharded run compares (label -> policy), beside plain fp32 and Flax's bf16 peer.
SHARDED_POLICIES = {
  "mpjax fp32": "fp32",
  "mpjax mixed_bf16": "mixed_bf16",
  "mpjax mixed_bf16 reduce=f32": "p=f32,c=bf16,o=f32,reduce=f32",
  "mpjax mixed_fp16": "mixed_fp16",
  "mpjax mixed_fp8": "mixed_fp8",
  "mpjax bf16_sr": "bf16_sr",
}


def parse_mesh(text: str) -> dict[str, int]:
  """``"data=2,fsdp=8"`` as ``{"data": 2, "fsdp": 8}``."""
  axes = {}
  for part in text.split(","):
    name, sep, size = part.partition("=")
    if not sep or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(f"--mesh {text!r}: each axis is name=size, e.g. --mesh data=2,fsdp=8")
    axes[name.strip()] = int(size)
  return axes


def sharded_compile(
  name: str, target: str, axes: dict[str, int], nodes: int = 1, small: bool = False
) -> dict[str, dict[str, Any]]:
  """Each variant's step compiled for a mesh of GPUs here: its collectives and state bytes.

  Every leaf of the state is sharded over ``fsdp`` on its largest dimension the axis divides
  (:func:`mpjax.layout.fsdp_spec`), the batch over every axis; mpjax's states record that
  layout (``keep_layout``), so the step keeps it and casts shards before gathering them.
  """
  from mpjax.collectives import collective_report
  from mpjax.layout import fsdp_spec

  make_model, batch, loss, _ = _workload(name, small)
  mesh = mpjax.target_mesh(target, axes, nodes=nodes)
  n = mesh.size
  batch = {  # the batch rounded up to a multiple of the devices
    k: jnp.tile(v, (-(-v.shape[0] // n * n) // v.shape[0],) + (1,) * (v.ndim - 1))[
      : max(n, -(-v.shape[0] // n) * n)
    ]
    for k, v in batch.items()
  }

  def placed(x: Any, spec: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  fsdp = axes.get("fsdp", 1)
  on_mesh = {k: placed(v, P(tuple(axes))) for k, v in batch.items()}
  peers, _ = _variants(name, small, keras=False)
  steps = {label: peers[label] for label in ("plain fp32", "flax dtype=bf16")}
  f32_model = make_model(None)
  params = jax.eval_shape(f32_model.init, jax.random.key(2), batch["x"])

  def loss_of(params, batch):
    return loss(f32_model.apply(params, batch["x"]), batch)

  for label, policy in SHARDED_POLICIES.items():
    step = jax.jit(mpjax.make_train_step(loss_of), donate_argnums=0)

    def init(policy=policy, step=step):
      state = mpjax.TrainState.create(
        apply_fn=f32_model.apply, params=params, tx=optax.adam(1e-4), policy=policy
      )
      return mpjax.init_fp8_state(step, state, batch)

    steps[label] = (step, init)
  results = {}
  for label, (step, init, *_) in steps.items():
    state = jax.tree.map(lambda x: placed(x, fsdp_spec(x.shape, fsdp)), jax.eval_shape(init))
    if isinstance(state, mpjax.TrainState):
      state = state.keep_layout()
    compiled = mpjax.compile_for(step, state, on_mesh, target=target)
    report = collective_report(compiled, target=target)
    by_kind = report.bytes_by_kind
    state_bytes = sum(
      np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state)
    )
    results[label] = {
      "all_gather_bytes": by_kind.get("all-gather", 0),
      "reduce_bytes": by_kind.get("reduce-scatter", 0) + by_kind.get("all-reduce", 0),
      "collective_bytes": report.total_bytes,
      "collective_seconds": report.seconds,
      "bytes_by_dtype": dict(report.bytes_by_dtype),
      "reduce_bytes_by_dtype": _reduce_bytes_by_dtype(report),
      "flagged": len(report.flagged),
      "state_bytes_per_device": int(state_bytes),
    }
  base, peer = results["mpjax fp32"], results["flax dtype=bf16"]
  for r in results.values():
    for key in ("all_gather_bytes", "reduce_bytes", "collective_bytes", "state_bytes_per_device"):
      r[f"{key}_vs_fp32"] = r[key] / base[key] if base[key] else None
      r[f"{key}_vs_flax_bf16"] = r[key] / peer[key] if peer[key] else None
  return results


def _reduce_bytes_by_dtype(report: Any) -> dict[str, int]:
  """Bytes of the reduce-scatters and all-reduces (the gradients' sums), by dtype."""
  found: dict[str, int] = {}
  for c in report.collectives:
    if c.kind in ("reduce-scatter", "all-reduce"):
      for dtype, nbytes in c.dtypes.items():
        found[dtype] = found.get(dtype, 0) + nbytes * c.count
  return found


def sharded_table(name: str, where: str, results: dict[str, dict[str, Any]]) -> str:
  """One markdown table of :func:`sharded_compile`'s figures, ratios to mpjax fp32's."""

  def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"

  lines = [
    f"**{name} on {where}**",
    "",
    "| variant | all-gather MB | vs fp32 | reduce MB | vs fp32 | all collectives MB | vs fp32 "
    "| vs Flax bf16 | est. comm ms | state MB/device | vs fp32 | flagged |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for label, r in results.items():
    lines.append(
      f"| {label} | {r['all_gather_bytes'] / 1e6:.1f} | {ratio(r['all_gather_bytes_vs_fp32'])} "
      f"| {r['reduce_bytes'] / 1e6:.1f} | {ratio(r['reduce_bytes_vs_fp32'])} "
      f"| {r['collective_bytes'] / 1e6:.1f} | {ratio(r['collective_bytes_vs_fp32'])} "
      f"| {ratio(r['collective_bytes_vs_flax_bf16'])} | {1e3 * r['collective_seconds']:.2f} "
      f"| {r['state_bytes_per_device'] / 1e6:.1f} | {ratio(r['state_bytes_per_device_vs_fp32'])} "
      f"| {r['flagged']} |"
    )
  return "\n".join(lines)


def fp8_against_bf16(reports: dict[str, Any]) -> str:
  """How the FP8 step compares with the bf16 one on the target: kernels, bytes, estimated time."""
  fp8, bf16 = reports["mpjax mixed_fp8 autocast"], reports["mpjax mixed_bf16 autocast"]
  head = reports[FP8_HEAD_LABEL]
  head_time = head.estimated_seconds / bf16.estimated_seconds
  f8_calls = fp8.calls.get("cublas_lt_f8", 0)
  return (
    f"mixed_fp8 / mixed_bf16 on {fp8.target.name}: kernels {fp8.count / bf16.count:.2f}x, bytes "
    f"moved {fp8.bytes_moved / bf16.bytes_moved:.2f}x, estimated step time "
    f"{fp8.estimated_seconds / bf16.estimated_seconds:.3f}x (FP8 GEMMs at "
    f"{fp8.target.fp8_tflops:g} TFLOP/s, bf16 at {fp8.target.bf16_tflops:g}); {fp8.fp8_gemms} of "
    f"{sum(fp8.calls.values())} GEMMs multiply FP8 operands ({f8_calls} FP8 cuBLASLt calls, "
    f"{fp8.fp8_gemms - f8_calls} f8 dots in Triton fusions). {fp8_bound(fp8, bf16)} With the "
    f"output head in FP8 too (keep_bf16=('first',)): estimated step time {head_time:.3f}x, "
    f"{head.fp8_gemms} GEMMs with FP8 operands."
  )


def fp8_bound(fp8: Any, bf16: Any) -> str:
  """Where the FP8 step's estimated time goes against the bf16 step's, and its bound.

  The bound is the FP8 step whose other kernels (amax, quantize, scales,
  everything that is not a GEMM) took what the bf16 step's take: the bf16 step
  less what the GEMM kernels save. Making the FP8 work outside the GEMMs cheaper
  approaches it; only more GEMMs in FP8 (the recipe keeps some in bf16) or a
  cheaper step around them (e.g. fused attention) goes below it.
  """
  gemm_b, gemm_f = bf16.estimated_gemm_seconds, fp8.estimated_gemm_seconds
  rest_b = bf16.estimated_seconds - gemm_b
  rest_f = fp8.estimated_seconds - gemm_f
  bound = (bf16.estimated_seconds - (gemm_b - gemm_f)) / bf16.estimated_seconds
  return (
    f"GEMM kernels {1e3 * gemm_b:.2f} -> {1e3 * gemm_f:.2f} ms, the other kernels "
    f"{1e3 * rest_b:.2f} -> {1e3 * rest_f:.2f} ms: were the other kernels as fast as the bf16 "
    f"step's, the step would be {bound:.3f}x."
  )


def fused_attention_line(reports: dict[str, Any], name: str, small: bool) -> str:
  """What the estimate leaves out of a fused attention (custom kernels): its GEMM FLOPs."""
  if fused_attention_kernel() != "pallas_triton_mha":
    return (
      f"The attention ({fused_attention_kernel()}): jax {jax.__version__} has no Pallas Triton "
      "flash attention, so XLA's own attention stands in, scores in memory; the estimates "
      "count its GEMMs like any other."
    )
  _, batch, _, sizes = _workload(name, small)
  report = reports["mpjax mixed_bf16 autocast"]
  kernels = [k for k in report.kernels if k.kind == "custom"]
  bytes_seconds = sum(report.kernel_seconds(k) for k in kernels)
  flops = fused_attention_flops(sizes, batch["x"].shape[0])
  flops_seconds = flops / (report.target.peak_tflops("bfloat16") * 1e12)
  verdict = (
    "so their bytes bound them and the estimates stand"
    if flops_seconds <= bytes_seconds
    else f"so each estimate is {1e3 * (flops_seconds - bytes_seconds):.2f} ms short"
  )
  return (
    f"The fused attention (bf16 in every variant): {len(kernels)} Pallas kernels a step, which "
    f"the estimates count by their bytes ({1e3 * bytes_seconds:.2f} ms at the bandwidth in "
    f"mixed_bf16); their GEMMs, {flops:.4g} FLOP counted from the shapes, take "
    f"{1e3 * flops_seconds:.2f} ms at the bf16 peak, {verdict}."
  )


def compile_record(target: str, gemm_backend: str) -> dict[str, Any]:
  """How ``--target`` compiled: the GEMM mode, the XLA options and flags, the versions."""
  import jaxlib

  from mpjax.gpu import describe_gemm_backend, gemm_backend_options, installed_plugins

  return {
    "target": target,
    "gemm_backend": gemm_backend,
    "gemm_mode": describe_gemm_backend(gemm_backend),
    "xla_options": gemm_backend_options(gemm_backend),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "compiler_plugins": installed_plugins(),
    "fused_attention_kernel": fused_attention_kernel(),  # what gpt2_fused runs on this jax
  }


def ceiling(rounds: int, small: bool = False) -> dict[str, dict[str, float]]:
  """A bare GEMM in f32 against bf16 x bf16 -> f32: what mixed precision can gain at most."""
  shapes = {  # label: (M, K, N)
    "mlp layer 256x4096 @ 4096x4096": (256, 4096, 4096),
    "square 2048^3": (2048, 2048, 2048),
  }
  if small:
    shapes = {"mlp layer 8x32 @ 32x32": (8, 32, 32), "square 64^3": (64, 64, 64)}
  f32_dot = jax.jit(jnp.dot)
  mixed_dot = jax.jit(lambda a, b: lax.dot(a, b, preferred_element_type=jnp.float32))
  results = {}
  for label, (m, k, n) in shapes.items():
    a = jax.random.normal(jax.random.key(0), (m, k))
    b = jax.random.normal(jax.random.key(1), (k, n))
    runs = {
      "f32": (f32_dot, (a, b)),
      "bf16": (mixed_dot, (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))),
    }
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for fn, operands in runs.values():
      jax.block_until_ready(fn(*operands))  # compile and warm up
      jax.block_until_ready(fn(*operands))
    for _ in range(rounds):
      for kind, (fn, operands) in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*operands))
        times[kind].append(time.perf_counter() - start)
    flops = 2.0 * m * k * n
    r = {f"{kind}_ms": statistics.median(t) * 1e3 for kind, t in times.items()}
    r["ratio"] = r["bf16_ms"] / r["f32_ms"]
    r.update({f"{kind}_tflops": flops / (r[f"{kind}_ms"] * 1e-3) / 1e12 for kind in runs})
    results[label] = r
  return results


def _table(name: str, results: dict[str, dict[str, float]]) -> str:
  lines = [
    f"**{name}**",
    "",
    "| variant | step ms | vs fp32 | saved activations MiB | vs fp32 | compile s | vs fp32 "
    "| fast path |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for label, r in results.items():
    lines.append(
      f"| {label} | {r['step_ms']:.1f} | {r['step_ratio']:.3f}x | {r['residual_mib']:.1f} | "
      f"{r['residual_ratio']:.3f}x | {r['compile_s']:.2f} | {r['compile_ratio']:.2f}x | "
      f"{100 * r['fast_path_share']:.0f}% |"
    )
  return "\n".join(lines)


def _ceiling_table(results: dict[str, dict[str, float]]) -> str:
  lines = [
    "**ceiling: a bare GEMM**",
    "",
    "| GEMM | f32 ms | bf16 x bf16 -> f32 ms | vs f32 | f32 TFLOP/s | bf16 TFLOP/s |",
    "|---|---|---|---|---|---|",
  ]
  for label, r in results.items():
    lines.append(
      f"| {label} | {r['f32_ms']:.2f} | {r['bf16_ms']:.2f} | {r['ratio']:.3f}x | "
      f"{r['f32_tflops']:.3f} | {r['bf16_tflops']:.3f} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="mlp,transformer", help="comma-separated workloads")
  parser.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds")
  parser.add_argument(
    "--compiles", type=int, default=3, help="fresh compiles per variant (the fastest counts)"
  )
  parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test)")
  parser.add_argument(
    "--keras",
    choices=("auto", "yes", "no"),
    default="auto",
    help="run the Keras 3 peer (auto: yes, except with --small)",
  )
  parser.add_argument(
    "--target",
    help="instead of timing here: compile every variant for this GPU (h100, a100, ...; needs "
    "XLA's CUDA compiler plugin, see the README) and print its kernels, bytes, temp memory and "
    "a roofline estimate; "
    "--models may then include gpt2 (GPT-2 small: 12 layers, d768, seq 1024, batch 8) and "
    "gpt2_fused (the same with fused flash attention)",
  )
  parser.add_argument(
    "--gemm_backend",
    choices=("default", "cublaslt", "triton"),
    default="default",
    help="with --target: 'default' compiles in XLA's default mode, the one users run (Triton "
    "GEMM fusions on); 'cublaslt' turns Triton GEMMs off; 'triton' is 'default' (default: "
    "%(default)s)",
  )
  parser.add_argument(
    "--mesh",
    help="with --target: compile each variant for a mesh of GPUs, e.g. fsdp=8 or data=2,fsdp=8 "
    "(FSDP over 'fsdp'), and print its collective bytes, time and state bytes per device",
  )
  parser.add_argument("--nodes", type=int, default=1, help="with --mesh: nodes (GPUs per node: 8)")
  parser.add_argument("--json", help="write every figure and the markdown tables to this file")
  args = parser.parse_args(argv)
  command = " ".join(["python scripts/bench.py", *(sys.argv[1:] if argv is None else argv)])
  if "gpt2_fused" in args.models.split(",") and not args.target:
    parser.error(
      "--models gpt2_fused needs --target (e.g. --target h100): its attention is a Pallas "
      "Triton kernel, which runs on NVIDIA GPUs, not here"
    )
  if args.mesh and not args.target:
    parser.error("--mesh needs --target (e.g. --target h100 --mesh fsdp=8)")
  if args.mesh:
    axes, record, tables = parse_mesh(args.mesh), {}, []
    where = f"{args.nodes} node(s) of {args.target}, mesh {args.mesh}"
    for name in args.models.split(","):
      record[name] = sharded_compile(name, args.target, axes, args.nodes, args.small)
      tables.append(sharded_table(name, where, record[name]))
      print(tables[-1], end="\n\n", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        compiled = compile_record(args.target, args.gemm_backend)
        saved = {"command": command, **compiled, "mesh": axes, "nodes": args.nodes}
        json.dump({**saved, "results": record, "markdown": "\n\n".join(tables)}, f, indent=2)
    return record
  if args.target:
    from mpjax.gpu import describe_gemm_backend
    from mpjax.kernels import kernel_table

    record, tables = {}, []
    mode = describe_gemm_backend(args.gemm_backend)
    for name in args.models.split(","):
      reports = gpu_compile(name, args.target, args.small, args.gemm_backend)
      record[name] = {label: r.to_dict() for label, r in reports.items()}
      fp8_line = fp8_against_bf16(reports) if mpjax.get_target(args.target).fp8_tflops else ""
      fp8_line += "\n\n" + block_scaled_against_bf16(reports, saved_activations(name, args.small))
      if any(r.custom_kernels for r in reports.values()):
        fp8_line += "\n\n" + fused_attention_line(reports, name, args.small)
      tables.append(f"**{name} on {args.target}, {mode}**\n\n{kernel_table(reports)}\n\n{fp8_line}")
      print(tables[-1], end="\n\n", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        compiled = compile_record(args.target, args.gemm_backend)
        saved = {"command": command, **compiled, "results": record}
        json.dump({**saved, "markdown": "\n\n".join(tables)}, f, indent=2)
    return record
  keras = args.keras == "yes" or (args.keras == "auto" and not args.small)
  if args.keras == "auto" and args.small:
    print("note: keras mixed_bfloat16 skipped with --small (--keras yes runs it)\n")
  all_results = {}
  tables = []
  for name in args.models.split(","):
    all_results[name] = bench(name, args.rounds, args.small, keras, args.compiles)
    tables.append(_table(name, all_results[name]))
    print(tables[-1], end="\n\n", flush=True)
  gemm_ceiling = ceiling(args.rounds, args.small)
  tables.append(_ceiling_table(gemm_ceiling))
  print(tables[-1], end="\n\n", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      record = {
        "device": device_description(),
        "jax": jax.__version__,
        "command": command,
        "backend": jax.default_backend(),
        "results": all_results,
        "ceiling": gemm_ceiling,
        "markdown": "\n\n".join(tables),
      }
      json.dump(record, f, indent=2)
  return all_results


if __name__ == "__main__":
  main()
