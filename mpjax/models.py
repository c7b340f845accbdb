"""Reference models: an MLP, a small CNN and a decoder-only transformer, as plain Flax linen.

Each model takes the precision fields Flax layers use, and forwards them to
its ``Dense``/``Conv`` layers:

- ``dtype``: the compute dtype (``None``: whatever the inputs and params give,
  i.e. plain f32);
- ``param_dtype``: the dtype parameters are created in (f32 by default);
- ``dot_general``: the GEMM function (``None``: ``lax.dot_general``).

So each runs three ways: as a plain f32 model, under :func:`mpjax.autocast`
(``autocast(model.apply, "mixed_bf16")``, which :func:`mpjax.make_train_step`
does for mixed policies), or built for a policy with
``Model(..., **linen_kwargs(policy))`` (:func:`mpjax.flax_policy.linen_kwargs`).
Norm statistics and the attention softmax run in f32 in every case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mpjax.xla import pad_to_multiple

__all__ = ["MLP", "CNN", "TransformerLM"]

_ALIGN = 8  # f16/bf16 GEMM dimensions that Tensor Cores and XLA:CPU's fast kernel take as they are
_LECUN = nn.initializers.lecun_normal()  # the default kernel init of nn.Dense and nn.Conv


def _check_positive(model: str, **fields: Any) -> None:
  for name, value in fields.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{model}: {name}={value!r} must be an integer >= 1.")


def _zero_padded(
  init: Callable[..., jax.Array], sizes: Mapping[int, int]
) -> Callable[..., jax.Array]:
  """``init`` drawn for the true ``sizes`` (``{axis: size}``), zero-padded to the shape asked for.

  A layer widened for GEMM alignment starts with the values (and the init
  scale) of the unpadded layer. Its padding only meets zero inputs (padded
  features or channels) or feeds sliced-off outputs (padded logits), so its
  gradient is zero, it stays zero, and the layer computes what the unpadded
  one would.
  """

  def padded_init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    true_shape, widths = list(shape), [(0, 0)] * len(shape)
    for axis, size in sizes.items():
      true_shape[axis] = size
      widths[axis] = (0, shape[axis] - size)
    return jnp.pad(init(key, tuple(true_shape), dtype), widths)

  return padded_init


def _pad_last(x: jax.Array) -> jax.Array:
  """``x`` with its last axis zero-padded to a multiple of 8."""
  pad = pad_to_multiple(x.shape[-1], _ALIGN) - x.shape[-1]
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _aligned_head(
  num_classes: int, name: str, sizes: Mapping[int, int], **kw: Any
) -> Callable[[jax.Array], jax.Array]:
  """A ``Dense`` head with ``num_classes`` padded to a multiple of 8, its logits sliced back.

  The kernel and bias have the padded width (the padding starts at zero and
  stays there, see :func:`_zero_padded`; ``sizes`` pads the kernel's input
  axis too), so the head's GEMMs, forward and backward, are aligned; the
  logits are ``(..., num_classes)``.
  """
  padded = pad_to_multiple(num_classes, _ALIGN)
  init = _zero_padded(_LECUN, {**sizes, -1: num_classes})
  dense = nn.Dense(padded, kernel_init=init, name=name, **kw)
  return lambda x: dense(x)[..., :num_classes]


def _nearest_multiple(value: int, multiple: int = _ALIGN) -> int:
  """The multiple of ``multiple`` nearest to ``value`` (upwards on a tie, never 0)."""
  up = pad_to_multiple(value, multiple)
  down = up - multiple
  return down if down >= multiple and value - down < up - value else up


class MLP(nn.Module):
  """A multi-layer perceptron classifier: ``Dense`` + activation layers, then a ``Dense`` head.

  GEMM alignment: the flattened input features and ``num_classes`` are padded
  to multiples of 8 (zero input features, zero kernel rows; a head of
  ``pad_to_multiple(num_classes)`` outputs whose extra logits are sliced off).
  The padding starts at zero and gets zero gradients, so the model computes
  and learns what the unpadded one would; the logits are
  ``(batch, num_classes)``.

  Attributes:
    features: the width of each hidden layer (empty: a linear classifier).
    num_classes: the number of logits.
    activation: the hidden layers' activation (``nn.gelu``; ``nn.relu`` also works).
    dtype: compute dtype of the ``Dense`` layers; ``None`` follows inputs and params.
    param_dtype: dtype of the parameters.
    dot_general: the ``Dense`` layers' GEMM; ``None`` is ``lax.dot_general``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpjax.models import MLP
    >>> model = MLP(features=(32, 32), num_classes=10)
    >>> x = jnp.ones((4, 8, 8, 1))  # trailing dims are flattened
    >>> variables = model.init(jax.random.key(0), x)
    >>> model.apply(variables, x).shape
    (4, 10)
  """

  features: Sequence[int]
  num_classes: int
  activation: Callable[[jax.Array], jax.Array] = nn.gelu
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dot_general: Any = None

  def __post_init__(self):
    object.__setattr__(self, "features", tuple(self.features))
    _check_positive("MLP", num_classes=self.num_classes)
    for i, width in enumerate(self.features):
      _check_positive("MLP", **{f"features[{i}]": width})
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Logits ``(batch, num_classes)`` for inputs ``(batch, ...)``."""
    if x.ndim < 2:
      raise ValueError(f"MLP: input of shape {x.shape} has no batch dimension; pass (batch, ...).")
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, dot_general=self.dot_general)
    x = x.reshape(x.shape[0], -1)
    # Input features zero-padded to a multiple of 8, and the first kernel with zero rows.
    first = {0: x.shape[-1]}
    x = _pad_last(x)
    for i, width in enumerate(self.features):
      init = _zero_padded(_LECUN, first if i == 0 else {})
      x = self.activation(nn.Dense(width, kernel_init=init, name=f"dense_{i}", **kw)(x))
    return _aligned_head(self.num_classes, "head", {} if self.features else first, **kw)(x)


class CNN(nn.Module):
  """A small image classifier: (conv 3x3 -> BatchNorm -> ReLU -> 2x2 max pool) blocks, dense head.

  Inputs are NHWC images, e.g. ``(batch, 8, 8, 1)`` digits. BatchNorm keeps
  its running statistics in the ``batch_stats`` collection (in f32 for every
  ``dtype``): train with
  ``model.apply(variables, x, train=True, mutable=["batch_stats"])`` and
  evaluate with ``model.apply(variables, x, train=False)``. The convolutions
  have no bias (the BatchNorm after each has one).

  GEMM alignment: the input channels (1 for digits) and ``num_classes`` are
  padded to multiples of 8 as in :class:`MLP` (zero channels and kernel
  slices; extra logits sliced off), so every convolution and GEMM, forward and
  backward, has aligned channels and dimensions; the logits are
  ``(batch, num_classes)``.

  Attributes:
    num_classes: the number of logits.
    features: the output channels of each conv block.
    dense: the width of the hidden dense layer.
    momentum: BatchNorm's running-average momentum.
    dtype: compute dtype of every layer; ``None`` follows inputs and params.
    param_dtype: dtype of the parameters.
    dot_general: the ``Dense`` layers' GEMM; ``None`` is ``lax.dot_general``.
    conv_general_dilated: the ``Conv`` layers' convolution; ``None`` is
      ``lax.conv_general_dilated``. ``linen_kwargs(policy, layer=("dense",
      "conv"))`` sets both.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpjax.models import CNN
    >>> model = CNN(num_classes=10, features=(8, 16), dense=32)
    >>> x = jnp.ones((4, 8, 8, 1))
    >>> variables = model.init(jax.random.key(0), x, train=False)
    >>> logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    >>> logits.shape, updates["batch_stats"]["bn_0"]["mean"].dtype
    ((4, 10), dtype('float32'))
  """

  num_classes: int
  features: Sequence[int] = (32, 64)
  dense: int = 128
  momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dot_general: Any = None
  conv_general_dilated: Any = None

  def __post_init__(self):
    object.__setattr__(self, "features", tuple(self.features))
    _check_positive("CNN", num_classes=self.num_classes, dense=self.dense)
    for i, width in enumerate(self.features):
      _check_positive("CNN", **{f"features[{i}]": width})
    if not 0.0 <= self.momentum < 1.0:
      raise ValueError(f"CNN: momentum={self.momentum!r} must be in [0, 1), e.g. 0.9.")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    """Logits ``(batch, num_classes)`` for NHWC images ``(batch, height, width, channels)``."""
    if x.ndim != 4:
      raise ValueError(
        f"CNN: input of shape {x.shape} is not NHWC (batch, height, width, channels); for "
        "digits use mpjax.data.load_digits(image=True)."
      )
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    # Input channels (1 for digits) zero-padded to a multiple of 8, the first kernel likewise.
    first = {-2: x.shape[-1]}
    x = _pad_last(x)
    for i, width in enumerate(self.features):
      x = nn.Conv(
        width,
        (3, 3),
        use_bias=False,
        kernel_init=_zero_padded(_LECUN, first if i == 0 else {}),
        conv_general_dilated=self.conv_general_dilated,
        name=f"conv_{i}",
        **kw,
      )(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum, name=f"bn_{i}", **kw)(
        x
      )
      x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2), padding="SAME")
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.dense, dot_general=self.dot_general, name="dense", **kw)(x))
    return _aligned_head(self.num_classes, "head", {}, dot_general=self.dot_general, **kw)(x)


class _CausalSelfAttention(nn.Module):
  n_heads: int
  dtype: Any
  param_dtype: Any
  dot_general: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, d_model = x.shape
    head_dim = d_model // self.n_heads
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, dot_general=self.dot_general)
    dot = self.dot_general or lax.dot_general
    qkv = nn.Dense(3 * d_model, name="qkv", **kw)(x)
    q, k, v = (t.reshape(batch, length, self.n_heads, head_dim) for t in jnp.split(qkv, 3, axis=-1))
    # (batch, heads, query, key); batch dims (batch, heads), contracting head_dim.
    scores = dot(q, k, (((3,), (3,)), ((0, 2), (0, 2))))
    # Mask and softmax in f32, with f32's own most negative finite value (never -inf).
    scores = scores.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # (batch, heads, query, head_dim): contract keys with v's length axis.
    out = dot(probs, v, (((3,), (1,)), ((0, 1), (0, 2))))
    out = out.transpose(0, 2, 1, 3).reshape(batch, length, d_model)
    return nn.Dense(d_model, name="out", **kw)(out)


class _Block(nn.Module):
  n_heads: int
  d_ff: int
  dtype: Any
  param_dtype: Any
  dot_general: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    attention = _CausalSelfAttention(self.n_heads, dot_general=self.dot_general, name="attn", **kw)
    x = x + attention(nn.LayerNorm(name="ln_attn", **kw)(x))
    h = nn.LayerNorm(name="ln_mlp", **kw)(x)
    h = nn.gelu(nn.Dense(self.d_ff, dot_general=self.dot_general, name="mlp_in", **kw)(h))
    return x + nn.Dense(x.shape[-1], dot_general=self.dot_general, name="mlp_out", **kw)(h)


class TransformerLM(nn.Module):
  """A decoder-only transformer language model (GPT-style, pre-LayerNorm).

  Token and learned position embeddings; ``n_layers`` blocks of causal
  self-attention and a GELU MLP, each behind a LayerNorm and a residual
  connection; a final LayerNorm and an untied output head. The attention
  scores are masked and softmaxed in f32 whatever ``dtype`` is.

  The head has :attr:`vocab_padded` outputs (``vocab_size`` padded to a
  multiple of 8 with :func:`mpjax.pad_to_multiple`, so its GEMM is aligned).
  The logits of the padding ids are masked to the logits dtype's most negative
  finite value: they get zero probability, softmax and cross-entropy over
  all ``vocab_padded`` logits equal those over the first ``vocab_size``, and
  argmax never picks them.

  Construction checks the shapes the fast path needs: ``d_model``, ``d_ff``
  and the head dimension ``d_model // n_heads`` multiples of 8.

  Attributes:
    vocab_size: the number of token ids (the true vocabulary).
    d_model: the width of the residual stream.
    n_heads: attention heads; must divide ``d_model``.
    n_layers: transformer blocks.
    d_ff: the hidden width of each block's MLP.
    max_len: the longest sequence (positions with an embedding).
    dtype: compute dtype of every layer; ``None`` follows inputs and params.
    param_dtype: dtype of the parameters.
    dot_general: the GEMM of the ``Dense`` layers and of the attention
      products; ``None`` is ``lax.dot_general``.

  Raises:
    ValueError: at construction, naming the field and the nearest valid value,
      if a size is not a positive integer, ``n_heads`` does not divide
      ``d_model``, or ``d_model``, ``d_ff`` or the head dimension is not a
      multiple of 8.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpjax.models import TransformerLM
    >>> model = TransformerLM(vocab_size=98, d_model=32, n_heads=4, d_ff=64, max_len=16)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape, model.vocab_padded
    ((2, 16, 104), 104)
    >>> TransformerLM(vocab_size=98, d_model=100)
    Traceback (most recent call last):
    ...
    ValueError: TransformerLM: d_model=100 is not a multiple of 8 (GEMM alignment); use d_model=104.
  """

  vocab_size: int
  d_model: int = 128
  n_heads: int = 4
  n_layers: int = 2
  d_ff: int = 512
  max_len: int = 128
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dot_general: Any = None

  def __post_init__(self):
    _check_positive(
      "TransformerLM",
      vocab_size=self.vocab_size,
      d_model=self.d_model,
      n_heads=self.n_heads,
      n_layers=self.n_layers,
      d_ff=self.d_ff,
      max_len=self.max_len,
    )
    for name in ("d_model", "d_ff"):
      value = getattr(self, name)
      if value % _ALIGN:
        raise ValueError(
          f"TransformerLM: {name}={value} is not a multiple of {_ALIGN} (GEMM alignment); "
          f"use {name}={_nearest_multiple(value)}."
        )
    d = self.d_model
    valid = [h for h in range(1, d + 1) if d % h == 0 and (d // h) % _ALIGN == 0]
    nearest = min(valid, key=lambda h: (abs(h - self.n_heads), -h))
    if self.d_model % self.n_heads:
      raise ValueError(
        f"TransformerLM: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
        f"use n_heads={nearest}."
      )
    if (self.d_model // self.n_heads) % _ALIGN:
      raise ValueError(
        f"TransformerLM: n_heads={self.n_heads} gives a head dimension of "
        f"{self.d_model // self.n_heads} (d_model={self.d_model} / n_heads), not a multiple of "
        f"{_ALIGN}; use n_heads={nearest}."
      )
    super().__post_init__()

  @property
  def vocab_padded(self) -> int:
    """The number of logits: ``vocab_size`` padded to a multiple of 8."""
    return pad_to_multiple(self.vocab_size, _ALIGN)

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits ``(batch, length, vocab_padded)`` for token ids ``(batch, length)``."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
        f"TransformerLM: tokens must be integer ids of shape (batch, length), got "
        f"{tokens.dtype} of shape {tokens.shape}."
      )
    length = tokens.shape[1]
    if length > self.max_len:
      raise ValueError(
        f"TransformerLM: sequence length {length} exceeds max_len={self.max_len}; build the "
        f"model with max_len >= {length} or pass shorter sequences."
      )
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    embed_init = nn.initializers.normal(stddev=0.02)
    x = nn.Embed(self.vocab_size, self.d_model, embedding_init=embed_init, name="embed", **kw)(
      tokens
    )
    positions = nn.Embed(
      self.max_len, self.d_model, embedding_init=embed_init, name="pos_embed", **kw
    )(jnp.arange(length))
    x = x + positions[None].astype(x.dtype)
    for i in range(self.n_layers):
      x = _Block(self.n_heads, self.d_ff, dot_general=self.dot_general, name=f"block_{i}", **kw)(x)
    x = nn.LayerNorm(name="ln_f", **kw)(x)
    logits = nn.Dense(self.vocab_padded, dot_general=self.dot_general, name="head", **kw)(x)
    if self.vocab_padded == self.vocab_size:
      return logits
    real = jnp.arange(self.vocab_padded) < self.vocab_size
    return jnp.where(real, logits, jnp.finfo(logits.dtype).min)
