"""Block-scaled FP8 and FP4 GEMMs (MXFP8, NVFP4): one scale per small block of the contraction.

Per-tensor FP8 (:mod:`mpjax.fp8`) gives a whole tensor one scale, so one
outlier shrinks every other value toward the format's subnormals. Block
scaling gives each run of ``block_size`` consecutive values along the
contraction its own scale, which Blackwell's Tensor Cores (sm_100) apply inside
the GEMM:

- **MXFP8** (the OCP Microscaling spec): E4M3 values, one E8M0 scale (a power of
  two) per 32. NVIDIA's recipe (arXiv 2506.08027; Transformer Engine's
  ``MXFP8BlockScaling``) uses E4M3 for gradients too and rounds each scale up,
  so no value of a block saturates.
- **NVFP4**: E2M1 values (6 at most), one E4M3 scale per 16, and an f32 scale
  per tensor that brings the block scales into E4M3's range.

A block-scaled GEMM multiplies quantized operands whose blocks run along its
contraction, so each of a layer's three GEMMs needs its operands blocked along
another dimension: the forward ``y = x @ w`` blocks ``x`` and ``w`` along K;
the input gradient ``dx = g @ w.T`` blocks ``g`` and ``w`` along N; the weight
gradient ``dw = x.T @ g`` blocks ``x`` and ``g`` along M. The forward pass
saves ``x`` and ``w`` quantized along M and N (Transformer Engine's
"columnwise" copies, one byte a value), which is all the backward GEMMs read:
the saved activations are half of a bf16 GEMM's.

On a GPU each GEMM is :func:`jax.nn.scaled_matmul`, which XLA compiles for a
Blackwell GPU to one cuDNN call, ``__cudnn$blockScaledDot``. For a GPU without
block-scaled Tensor Cores (H100, A100) XLA dequantizes the operands and runs a
bf16 GEMM: the numerics of the recipe, at no more than the bf16 rate; the audit
flags each such GEMM ``block-scaled-emulated``. On a CPU (and a TPU) the
operands are dequantized into bf16, exactly (an E4M3 or E2M1 value times its
block scale is a bf16 value, within bf16's range), and multiplied by the bf16 x bf16 -> f32 kernel:
the same products, summed in f32. Quantization is the same code everywhere, so
its numerics can be unit-tested on a CPU bit for bit.

f32 inputs below f32's normal range (subnormals, under 2**-126) count as zero,
as XLA's f32 arithmetic flushes them on the CPU; so do values that a block's
scale brings below the element format's smallest subnormal.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mpjax._backend import lowering_platform
from mpjax.fp8 import check_choice, keep_bf16_globs
from mpjax.gemm import SAVED, forward_gemm
from mpjax.rounding import bits_seeded_by, round_stochastically

__all__ = [
  "BlockScaledRecipe",
  "BlockQuantized",
  "MXFP8",
  "NVFP4",
  "NVFP4_FP4_GRADIENTS",
  "block_scaled_dot",
  "dequantize_blocks",
  "quantize_blocks",
]

ELEMENT_FORMATS: dict[str, Any] = {
  "e4m3": jnp.float8_e4m3fn,
  "e5m2": jnp.float8_e5m2,
  "e2m1": jnp.float4_e2m1fn,
}
"""The element formats a recipe names, and their dtypes."""

SCALE_FORMATS: dict[str, Any] = {"e8m0": jnp.float8_e8m0fnu, "e4m3": jnp.float8_e4m3fn}
"""The block-scale formats a recipe names, and their dtypes."""

SCALE_ROUNDINGS = ("up", "floor", "nearest")
BACKWARDS = ("same", "mxfp8", "bf16")
GRADIENT_ROUNDINGS = ("nearest", "stochastic")

# (B, M, K) x (B, N, K) -> (B, M, N): the form every block-scaled GEMM takes.
_BMK = (((2,), (2,)), ((0,), (0,)))


@dataclasses.dataclass(frozen=True)
class BlockScaledRecipe:
  """How a policy's block-scaled GEMMs quantize, and which GEMMs stay in the compute dtype.

  The GEMMs it runs are those :class:`mpjax.Fp8Recipe` would run in FP8 (a
  ``dot_general`` of which an operand is a weight or the model's input), whose
  M, N and K are multiples of ``block_size`` (each is the contraction of one
  of the three GEMMs); the others stay in the compute dtype. The defaults are
  NVIDIA's MXFP8 recipe (:data:`MXFP8`); :data:`NVFP4` is NVIDIA's NVFP4 one.

  Attributes:
    element_format: the values' format: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"`` (FP4).
    scale_format: the block scales' format: ``"e8m0"`` (a power of two, MX)
      or ``"e4m3"`` (NVFP4).
    block_size: how many consecutive values along the contraction share a
      scale (32 for MX, 16 for NVFP4).
    scale_rounding: how an E8M0 scale is chosen from a block's largest
      magnitude ``amax``: ``"up"`` (NVIDIA's recipe: the smallest power of two
      ``s`` with ``amax / s`` within the format, so nothing saturates) or
      ``"floor"`` (the OCP MX spec's ``2**(floor(log2 amax) - emax)``, where
      the largest values of a block may saturate). An E4M3 scale is
      ``amax / max`` rounded to nearest: ``"nearest"``.
    tensor_scale: whether an f32 scale per tensor brings the block scales
      into the scale format's range (NVFP4's second level), taken from the
      tensor's amax when it is quantized.
    backward: the backward GEMMs' recipe: ``"same"`` as the forward,
      ``"mxfp8"`` (:data:`MXFP8`), or ``"bf16"`` (the compute dtype).
    gradient_rounding: how the output gradient, the operand both backward
      GEMMs share, is rounded to the element format: ``"nearest"`` (even) or
      ``"stochastic"`` (to one of the two values around it, the upper one with
      probability its distance from the lower one over their spacing, so
      it is right in expectation: NVFP4's gradients). The random bits hash
      each element's index with the tensor's block amaxes: a pure function of
      the step's values, new each step as the gradients change.
    square_weight_blocks: whether a weight (an operand passed as is, see
      :func:`block_scaled_dot`) shares one scale per ``block_size`` x
      ``block_size`` tile rather than per row of a tile, so its copies blocked
      along K (forward) and along N (input gradient) are the same values
      (NVFP4's 16 x 16 weight blocks).
    hadamard_wgrad: whether the weight-gradient GEMM (``dw = x.T @ g``,
      contracting the rows of ``x`` and ``g``) multiplies both operands, in
      blocks of ``block_size`` rows (the backward recipe's), by ``H S /
      sqrt(block_size)`` first: ``H`` Sylvester's Hadamard matrix and ``S`` a
      fixed diagonal of random signs. It is orthogonal, so the product is
      unchanged, and it spreads an outlier over its block before the block is
      quantized (NVFP4's random Hadamard transform). ``block_size`` must then
      be a power of two.
    keep_bf16: GEMMs that stay in the compute dtype, as
      :attr:`mpjax.Fp8Recipe.keep_bf16`: ``"first"``, ``"last"`` and
      name-stack globs.

  Raises:
    ValueError: for a value not among the accepted ones (the message lists
      them), a block size that is not a positive integer, a rounding the
      scale format does not have, or gradient options with no block-scaled
      backward GEMM to apply to.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> recipe = mpjax.BlockScaledRecipe(keep_bf16=("last",))
    >>> policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=recipe)
    >>> mpjax.get_policy("mixed_mxfp8").fp8.name, mpjax.get_policy("mixed_nvfp4").fp8.name
    ('mxfp8', 'nvfp4')
  """

  element_format: str = "e4m3"
  scale_format: str = "e8m0"
  block_size: int = 32
  scale_rounding: str = "up"
  tensor_scale: bool = False
  backward: str = "same"
  gradient_rounding: str = "nearest"
  square_weight_blocks: bool = False
  hadamard_wgrad: bool = False
  keep_bf16: tuple[str, ...] = ("first", "last")

  def __post_init__(self):
    check_choice("BlockScaledRecipe", "element_format", self.element_format, tuple(ELEMENT_FORMATS))
    check_choice("BlockScaledRecipe", "scale_format", self.scale_format, tuple(SCALE_FORMATS))
    check_choice("BlockScaledRecipe", "scale_rounding", self.scale_rounding, SCALE_ROUNDINGS)
    check_choice("BlockScaledRecipe", "backward", self.backward, BACKWARDS)
    check_choice(
      "BlockScaledRecipe", "gradient_rounding", self.gradient_rounding, GRADIENT_ROUNDINGS
    )
    if (
      isinstance(self.block_size, bool)
      or not isinstance(self.block_size, int | np.integer)
      or self.block_size < 1
    ):
      raise ValueError(
        f"BlockScaledRecipe: block_size={self.block_size!r} must be a positive integer "
        "(32 for MXFP8, 16 for NVFP4)."
      )
    e8m0 = self.scale_format == "e8m0"
    if e8m0 == (self.scale_rounding == "nearest"):
      accepted = "'up' or 'floor'" if e8m0 else "'nearest'"
      raise ValueError(
        f"BlockScaledRecipe: scale_rounding={self.scale_rounding!r} with "
        f"scale_format={self.scale_format!r}: an {self.scale_format} scale rounds {accepted}."
      )
    object.__setattr__(self, "keep_bf16", keep_bf16_globs("BlockScaledRecipe", self.keep_bf16))
    object.__setattr__(self, "block_size", int(self.block_size))
    for flag in ("tensor_scale", "square_weight_blocks", "hadamard_wgrad"):
      object.__setattr__(self, flag, bool(getattr(self, flag)))
    if self.backward == "bf16" and (self.hadamard_wgrad or self.gradient_rounding != "nearest"):
      raise ValueError(
        "BlockScaledRecipe: hadamard_wgrad and gradient_rounding='stochastic' change how the "
        "backward GEMMs quantize, and backward='bf16' quantizes none; set backward='same' or "
        "'mxfp8', or leave them at their defaults."
      )
    size = self.backward_recipe.block_size if self.backward_recipe else self.block_size
    if self.hadamard_wgrad and size & (size - 1):
      raise ValueError(
        f"BlockScaledRecipe: hadamard_wgrad=True transforms blocks of {size} rows with a "
        f"{size} x {size} Hadamard matrix, which exists here for a power of two only; use a "
        "block_size of 16 or 32, or hadamard_wgrad=False."
      )

  @property
  def name(self) -> str:
    """``"mxfp8"``, ``"nvfp4"``, or the formats spelled out for another recipe."""
    if self.same_numerics(MXFP8):
      return "mxfp8"
    if self.same_numerics(NVFP4):
      return "nvfp4"
    return f"{self.element_format}/{self.scale_format}x{self.block_size}"

  def same_numerics(self, other: BlockScaledRecipe) -> bool:
    """Whether ``other`` quantizes the forward GEMMs as this recipe does."""
    fields = ("element_format", "scale_format", "block_size", "scale_rounding", "tensor_scale")
    return all(getattr(self, f) == getattr(other, f) for f in fields)

  @property
  def element_dtype(self) -> np.dtype:
    """The dtype of the quantized values."""
    return np.dtype(ELEMENT_FORMATS[self.element_format])

  @property
  def scale_dtype(self) -> np.dtype:
    """The dtype of the block scales."""
    return np.dtype(SCALE_FORMATS[self.scale_format])

  @property
  def backward_recipe(self) -> BlockScaledRecipe | None:
    """The recipe of the backward GEMMs; ``None`` where they run in the compute dtype."""
    if self.backward == "same":
      return self
    return MXFP8 if self.backward == "mxfp8" else None

  def fits(self, m: int, n: int, k: int) -> bool:
    """Whether a GEMM of these sizes can run block-scaled, forward and backward.

    M, N and K are each the contraction of one of the three GEMMs, so each
    must be a multiple of the block size (the backward recipe's too).
    """
    sizes = [self.block_size]
    if self.backward_recipe is not None:
      sizes.append(self.backward_recipe.block_size)
    return all(d % b == 0 for d in (m, n, k) for b in sizes)


MXFP8 = BlockScaledRecipe()
"""NVIDIA's MXFP8 recipe: E4M3 values forward and backward, an E8M0 scale per 32 rounded up."""

NVFP4 = BlockScaledRecipe(
  element_format="e2m1",
  scale_format="e4m3",
  block_size=16,
  scale_rounding="nearest",
  tensor_scale=True,
  backward="mxfp8",
)
"""NVIDIA's NVFP4 recipe for the forward GEMMs (E2M1, an E4M3 scale per 16, an f32 scale per
tensor), the gradient GEMMs in MXFP8, the first and last GEMM in bf16 (``mixed_nvfp4``); in XLA
it estimates faster on B200, and trained closer to bf16, than :data:`NVFP4_FP4_GRADIENTS`."""

NVFP4_FP4_GRADIENTS = dataclasses.replace(
  NVFP4,
  backward="same",
  gradient_rounding="stochastic",
  square_weight_blocks=True,
  hadamard_wgrad=True,
)
"""NVIDIA's whole NVFP4 recipe (arXiv 2509.25149; Transformer Engine's ``NVFP4BlockScaling``):
E2M1 values, an E4M3 scale per 16 and an f32 scale per tensor in all three GEMMs; weights in
16 x 16 blocks, gradients rounded stochastically, the weight gradient's operands through a
random Hadamard transform; the first and last GEMM in bf16."""


class BlockQuantized(NamedTuple):
  """A tensor quantized in blocks along its last dimension.

  Attributes:
    values: the quantized values, in the element dtype, the tensor's shape.
    scales: one per block: shape ``(..., K // block_size)``, in the scale dtype.
    tensor_scale: an f32 scalar multiplying every value (NVFP4), or ``None``.
  """

  values: jax.Array
  scales: jax.Array
  tensor_scale: jax.Array | None


def _format_max(dtype: Any) -> float:
  return float(jnp.finfo(dtype).max)


def _e8m0_scales(amax: jax.Array, element: np.dtype, rounding: str) -> jax.Array:
  """The E8M0 codes (uint8) of the blocks' scales, from their f32 amaxes, exactly.

  With ``amax = m * 2**E`` (``1 <= m < 2``) and the format's largest value
  ``fmax = mmax * 2**emax``, ``floor`` gives ``2**(E - emax)``, ``up`` one
  power more where ``m > mmax``: read from amax's bits, no rounding anywhere;
  at least ``2**-126`` (the OCP spec allows ``2**-127``, an f32 subnormal that XLA
  flushes on the CPU). A zero amax gets the code of ``2**-127``; an inf or NaN one NaN.
  """
  fmax = _format_max(element)
  emax = math.floor(math.log2(fmax))
  mmax_bits = int(round((fmax / 2**emax - 1) * 2**23))
  bits = jax.lax.bitcast_convert_type(amax, jnp.uint32).astype(jnp.int32)
  biased, mantissa = bits >> 23, bits & 0x7FFFFF
  exponent = biased - 127 - emax
  if rounding == "up":
    exponent = exponent + (mantissa > mmax_bits).astype(jnp.int32)
  # 2**-127, an f32 subnormal, would be flushed where the scale is applied in f32 or bf16
  # (XLA:CPU): the smallest scale a nonzero block gets is 2**-126.
  code = jnp.clip(exponent, -126, 127) + 127
  code = jnp.where(biased == 0, 0, code)  # zero (subnormals are flushed)
  return jnp.where(biased == 255, 255, code).astype(jnp.uint8)


def quantize_blocks(x: jax.Array, recipe: BlockScaledRecipe, axis: int = -1) -> BlockQuantized:
  """``x`` quantized in blocks of ``recipe.block_size`` consecutive values along ``axis``.

  Each block's scale comes from its largest magnitude (amax); each value is
  divided by its scale (and the tensor scale) in f32 and cast to the element
  format, saturating: beyond the format's range becomes its largest value. A
  block holding an inf or NaN gets a NaN scale, so all of it stands for NaN (an
  overflow is never hidden); with a tensor scale (NVFP4) the whole tensor
  does. MX scales are exact powers of two, at least ``2**-126`` (see
  :class:`BlockScaledRecipe` for the rounding); an E4M3 scale is ``amax / max``
  rounded to nearest.

  ``axis`` other than the last gives what ``quantize_blocks(jnp.moveaxis(x,
  axis, -1), recipe)`` gives, bit for bit (Transformer Engine's "columnwise"
  copy of a ``(M, K)`` activation is ``axis=0``), computed without moving
  ``x``: XLA then reads ``x`` where it lies and writes only the quantized
  values moved.

  Args:
    x: a float array whose ``axis`` is a multiple of the block size.
    recipe: the formats and block size.
    axis: the dimension the blocks run along.

  Returns:
    The :class:`BlockQuantized` tensor, blocked along its last dimension
    (``axis`` moved last).

  Raises:
    ValueError: where ``axis`` is not a multiple of the block size.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> x = jnp.array([[1.0] * 31 + [500.0]])
    >>> q = mpjax.quantize_blocks(x, mpjax.MXFP8)
    >>> q.scales.astype(jnp.float32).tolist(), q.values[0, -1].astype(jnp.float32).item()
    ([[2.0]], 256.0)
    >>> mpjax.quantize_blocks(x.T, mpjax.MXFP8, axis=0).values.shape
    (1, 32)
  """
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(
      f"quantize_blocks: axis {axis} is out of range for a {x.shape} array; give one of its "
      f"dimensions, {-x.ndim} to {x.ndim - 1}."
    )
  if x.shape[axis] % recipe.block_size:
    raise ValueError(
      f"quantize_blocks: dimension {axis} of a {x.shape} array is not a multiple of the "
      f"block size {recipe.block_size}; pad it, or leave this GEMM in the compute dtype."
    )
  return _quantize(x, recipe, axis % x.ndim)


def _whole_blocks_on_each_device(x: jax.Array, axis: int, block: int) -> jax.Array:
  """``x``, kept whole along ``axis`` on each device where splitting it could cut a block.

  Under a mesh in context (``jax.set_mesh``, or the one a sharded
  :class:`mpjax.TrainState` is on, which its train step enters), an
  axis whose blocks a split over every device would not share out evenly
  (``128 / 32 = 4`` blocks over 8 devices) is gathered before it is
  quantized. Otherwise XLA's partitioner may split a block's scales unevenly:
  the cuDNN GEMM's partitioning then fails to compile, or gathers E8M0 scales
  with an all-reduce, which NCCL cannot run. An axis of whole blocks on every
  device is left to the partitioner.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
    return x
  if (x.shape[axis] // block) % mesh.size == 0:
    return x
  spec = [P.UNCONSTRAINED] * x.ndim
  spec[axis] = None
  return jax.lax.with_sharding_constraint(x, P(*spec))


def _quantize(
  x: jax.Array,
  recipe: BlockScaledRecipe,
  axis: int,
  *,
  square: bool = False,
  hadamard: bool = False,
  stochastic: bool = False,
) -> BlockQuantized:
  """``x`` quantized in blocks along ``axis``, returned with that axis last (values and scales).

  The blocks' amaxes are reduced and the values scaled in ``x``'s own layout; only the
  quantized values (one byte each, or half) move to put ``axis`` last, which XLA writes in
  the same kernel that quantizes. Transposing ``x`` first would have XLA write it
  transposed in f32 and read it twice more.

  ``square``: one amax per ``block x block`` tile of the last two dimensions; ``hadamard``:
  :func:`_hadamard` along ``axis`` first; ``stochastic``: stochastic rounding (:func:`_options`).
  """
  block = recipe.block_size
  element = recipe.element_dtype
  fmax = _format_max(element)
  x = _whole_blocks_on_each_device(x, axis, block)
  if hadamard:
    x = _hadamard(x.astype(jnp.float32), axis, block)
  shape = x.shape
  blocks = x.reshape(*shape[:axis], shape[axis] // block, block, *shape[axis + 1 :])
  # The largest magnitude is exact in x's own dtype: XLA reads (or keeps) x, never an f32 copy.
  if square:  # one amax per tile of the last two dimensions, repeated along the other one
    other = x.ndim - 1 if axis == x.ndim - 2 else x.ndim - 2
    tiles = x.reshape(*shape[:-2], shape[-2] // block, block, shape[-1] // block, block)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
    amax = jnp.repeat(amax, block, axis=other)
  elif axis == x.ndim - 1:
    amax = jnp.max(jnp.abs(blocks), axis=axis + 1)
  else:  # as elementwise maxima of the blocks' rows: XLA would transpose x for a reduce
    rows = (jax.lax.index_in_dim(blocks, j, axis + 1, keepdims=False) for j in range(block))
    amax = functools.reduce(jnp.maximum, map(jnp.abs, rows))
  amax = amax.astype(jnp.float32)
  blocks = blocks.astype(jnp.float32)
  tensor_scale = None
  if recipe.scale_format == "e8m0":
    codes = _e8m0_scales(amax, element, recipe.scale_rounding)
    scales = jax.lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu)
    # 1 / scale from the code's bits: 2**(127 - code) is an f32 normal for codes 0..253.
    inverse_bits = (254 - jnp.minimum(codes.astype(jnp.int32), 253)) << 23
    inverse = jax.lax.bitcast_convert_type(inverse_bits, jnp.float32)
    inverse = jnp.where(codes == 255, jnp.nan, inverse)
  else:
    smax = _format_max(recipe.scale_dtype)
    if recipe.tensor_scale:
      whole = jnp.max(amax)
      tiny = jnp.finfo(jnp.float32).tiny  # a smaller (subnormal) tensor scale would flush to 0
      tensor_scale = jnp.where(whole > 0, jnp.maximum(whole / jnp.float32(fmax * smax), tiny), 1.0)
      tensor_scale = jnp.where(jnp.isfinite(whole), tensor_scale, jnp.nan).astype(jnp.float32)
      amax = amax / tensor_scale
    scales = jnp.clip(amax / jnp.float32(fmax), -smax, smax)
    scales = jnp.where(jnp.isfinite(amax), scales, jnp.nan).astype(recipe.scale_dtype)
    divisor = scales.astype(jnp.float32)
    if tensor_scale is not None:
      divisor = divisor * tensor_scale
    inverse = jnp.where(divisor == 0, 0.0, 1.0 / divisor)
    inverse = jnp.where(jnp.isnan(divisor), jnp.nan, inverse)
  scaled = jnp.clip(blocks * jnp.expand_dims(inverse, axis + 1), -fmax, fmax)
  if stochastic:
    scaled = round_stochastically(scaled, element, bits_seeded_by(amax, axis, scaled.shape))
  values = scaled.astype(element).reshape(shape)
  last = x.ndim - 1
  return BlockQuantized(
    jnp.moveaxis(values, axis, last), jnp.moveaxis(scales, axis, last), tensor_scale
  )


@functools.cache
def _hadamard_matrix(size: int) -> np.ndarray:
  """``H S / sqrt(size)``, the orthogonal matrix :func:`_hadamard` multiplies blocks by: ``H``
  Sylvester's Hadamard matrix of ``size`` (a power of two), ``S`` a diagonal of random signs
  drawn once with a fixed seed (as Transformer Engine fixes its own)."""
  h = np.ones((1, 1))
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  return h * np.random.default_rng(size).choice([-1.0, 1.0], size) / math.sqrt(size)


def _hadamard(x: jax.Array, axis: int, size: int) -> jax.Array:
  """``x`` (f32) with each block of ``size`` along ``axis`` multiplied by
  :func:`_hadamard_matrix`: each value of a block the sum of the block's values times a
  column of the matrix, as elementwise products of its rows, which XLA fuses into the
  quantization that reads them (a matmul would be a GEMM kernel of its own; the fast
  transform's butterflies are concatenations, which XLA writes out in f32 at each step)."""
  shape = x.shape
  blocks = x.reshape(*shape[:axis], shape[axis] // size, size, *shape[axis + 1 :])
  matrix = _hadamard_matrix(size).astype(np.float32)
  column = (size,) + (1,) * (x.ndim - axis - 1)  # a row of the matrix, along the block
  terms = (
    jax.lax.index_in_dim(blocks, i, axis + 1) * matrix[i].reshape(column) for i in range(size)
  )
  return functools.reduce(jnp.add, terms).reshape(shape)


def dequantize_blocks(q: BlockQuantized, dtype: Any = jnp.float32) -> jax.Array:
  """The values a :class:`BlockQuantized` tensor stands for, in ``dtype``.

  In bf16 (and f32) the block's product is exact within bf16's exponent
  range: an E4M3 or E2M1 value times an E8M0 or E4M3 scale has at most 8
  significant bits. The tensor scale (NVFP4) multiplies it after, in ``dtype``.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> x = jnp.arange(-16.0, 16.0).reshape(1, 32)  # each value times 16 is an E4M3 value
    >>> bool((mpjax.dequantize_blocks(mpjax.quantize_blocks(x, mpjax.MXFP8)) == x).all())
    True
  """
  values, scales, tensor_scale = q
  blocks = scales.shape[-1]
  shaped = values.astype(dtype).reshape(*values.shape[:-1], blocks, values.shape[-1] // blocks)
  out = (shaped * scales.astype(dtype)[..., None]).reshape(values.shape)
  return out if tensor_scale is None else out * tensor_scale.astype(dtype)


def _matmul(a: BlockQuantized, b: BlockQuantized, dtype: Any, platform: str) -> jax.Array:
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` of block-quantized operands, in ``dtype``.

  On a GPU :func:`jax.nn.scaled_matmul` (cuDNN's block-scaled GEMM on
  Blackwell); elsewhere the operands dequantized into bf16 (exactly) and the
  bf16 x bf16 -> f32 GEMM. The tensor scales multiply the f32 result.
  """
  scaled = a.tensor_scale is not None or b.tensor_scale is not None
  written = jnp.float32 if scaled or platform != "gpu" else dtype
  if platform == "gpu":
    out = jax.nn.scaled_matmul(a.values, b.values, a.scales, b.scales, written)
  else:
    a_bf16 = dequantize_blocks(BlockQuantized(a.values, a.scales, None), jnp.bfloat16)
    b_bf16 = dequantize_blocks(BlockQuantized(b.values, b.scales, None), jnp.bfloat16)
    out = forward_gemm(a_bf16, b_bf16, _BMK, jnp.float32, None, platform)
  for t in (a.tensor_scale, b.tensor_scale):
    if t is not None:
      out = out * t
  return out.astype(dtype)


def _plain_matmul(a: jax.Array, b: jax.Array, dtype: Any, platform: str) -> jax.Array:
  return forward_gemm(a, b, _BMK, dtype, None, platform)


def _to_bmk(x: jax.Array, contract: tuple[int, ...], batch: tuple[int, ...]) -> jax.Array:
  """``x`` as ``(batch, free, contract)``, each group flattened, in dot_general's order."""
  free = [d for d in range(x.ndim) if d not in contract and d not in batch]
  shape = lambda dims: math.prod(x.shape[d] for d in dims)  # noqa: E731
  moved = jnp.transpose(x, (*batch, *free, *contract))
  return moved.reshape(shape(batch), shape(free), shape(contract))


def _from_bmk(
  y: jax.Array, shape: tuple[int, ...], contract: tuple[int, ...], batch: tuple[int, ...]
) -> jax.Array:
  """The inverse of :func:`_to_bmk`: a ``(B, M, K)`` array as an array of ``shape``."""
  free = [d for d in range(len(shape)) if d not in contract and d not in batch]
  order = (*batch, *free, *contract)
  moved = y.reshape(tuple(shape[d] for d in order))
  return jnp.transpose(moved, np.argsort(order))


def _swap(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def block_scaled_dot(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  recipe: BlockScaledRecipe,
  compute_dtype: Any,
  saved_as_is: tuple[bool, bool] = (False, False),
) -> jax.Array:
  """``lax.dot_general`` with block-scaled operands, forward and backward.

  The forward GEMM multiplies ``lhs`` and ``rhs`` quantized along their
  contraction; the backward GEMMs the output gradient and the saved
  operands, quantized along the dimensions they contract (the recipe's
  ``backward``). What is saved for the backward pass is the operands'
  quantized copies (one byte a value for MXFP8), not the operands; except
  those ``saved_as_is`` names, which the backward pass quantizes from
  themselves: a weight, whose f32 master the caller keeps anyway, costs no
  memory saved as is (autocast passes its inputs so). The result is in
  ``compute_dtype``, the gradients in each operand's dtype.

  Args:
    lhs: the left operand (f32 or the compute dtype).
    rhs: the right operand.
    dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
    recipe: the :class:`BlockScaledRecipe`; M, N and K must fit it
      (:meth:`BlockScaledRecipe.fits`).
    compute_dtype: the result's dtype (bf16).
    saved_as_is: for ``(lhs, rhs)``, whether the backward pass keeps the
      operand itself rather than a quantized copy.

  Returns:
    The product, shaped as ``lax.dot_general``'s.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> x, w = jnp.ones((64, 32)), jnp.ones((32, 64))
    >>> y = jax.jit(mpjax.block_scaled_dot, static_argnums=(2, 3, 4))(
    ...     x, w, (((1,), (0,)), ((), ())), mpjax.MXFP8, jnp.bfloat16)
    >>> y.dtype, float(y[0, 0])
    (dtype(bfloat16), 32.0)
  """
  return _forward(lhs, rhs, dimension_numbers, recipe, compute_dtype, saved_as_is)[0]


def _blocked(
  x3: jax.Array, axis: int, recipe: BlockScaledRecipe | None, compute_dtype: Any, **options: bool
) -> Any:
  """``x3`` blocked along ``axis`` (1 or 2), that axis moved last: quantized (with
  :func:`_options`), or cast where ``recipe`` is ``None`` (a bf16 backward pass)."""
  if recipe is None:
    return (x3 if axis == 2 else _swap(x3)).astype(compute_dtype)
  return _quantize(x3, recipe, axis, **options)


def _options(
  recipe: BlockScaledRecipe, weight: bool = False, wgrad: bool = False, gradient: bool = False
) -> dict[str, bool]:
  """The options of ``recipe`` an operand takes: a ``weight`` (passed as is) square blocks, a
  weight gradient's operand (``wgrad``) the Hadamard transform, the output ``gradient`` SR."""
  return {
    "square": weight and recipe.square_weight_blocks,
    "hadamard": wgrad and recipe.hadamard_wgrad,
    "stochastic": gradient and recipe.gradient_rounding == "stochastic",
  }


def _kept(residual: jax.Array) -> jax.Array:
  return checkpoint_name(residual, SAVED)


def _forward(lhs, rhs, dimension_numbers, recipe, compute_dtype, saved_as_is):
  (lc, rc), (lb, rb) = dimension_numbers
  lhs3, rhs3 = _to_bmk(lhs, lc, lb), _to_bmk(rhs, rc, rb)
  platform = lowering_platform(lhs, rhs)
  lhs_weight, rhs_weight = saved_as_is
  # rhs3 is (B, N, K): quantized along K as (B, K, N), a (K, N) weight's own layout.
  out3 = _matmul(
    _quantize(lhs3, recipe, 2, **_options(recipe, lhs_weight)),
    _quantize(_swap(rhs3), recipe, 1, **_options(recipe, rhs_weight)),
    compute_dtype,
    platform,
  )
  batch = [lhs.shape[d] for d in lb]
  free = lambda x, c, b: [x.shape[d] for d in range(x.ndim) if d not in c and d not in b]  # noqa: E731
  out = out3.reshape(*batch, *free(lhs, lc, lb), *free(rhs, rc, rb))
  # What the backward GEMMs contract: lhs along M (the weight gradient's K),
  # rhs along N (the input gradient's K): the columnwise copies, quantized now
  # (or in the backward pass, from an operand saved as is).
  backward = recipe.backward_recipe
  # Under autocast's remat the quantized copies are what the backward pass keeps.
  # Each is quantized in the layout it has as an (M, K) activation and a (K, N) weight:
  # lhs3 along M (an operand of the weight gradient), rhs3 (B, N, K) as (B, K, N) along N.
  saved = (
    lhs
    if lhs_weight
    else jax.tree.map(
      _kept, _blocked(lhs3, 1, backward, compute_dtype, **_options(recipe, wgrad=True))
    ),
    rhs if rhs_weight else jax.tree.map(_kept, _blocked(_swap(rhs3), 2, backward, compute_dtype)),
  )
  # Zero-size arrays carry the operands' shapes and dtypes to the backward pass.
  shapes = (jnp.zeros((0, *lhs.shape), lhs.dtype), jnp.zeros((0, *rhs.shape), rhs.dtype))
  return out, (*saved, *shapes)


def _backward(dimension_numbers, recipe, compute_dtype, saved_as_is, residuals, g):
  lhs_cols, rhs_cols, lhs_like, rhs_like = residuals
  lhs_shape, rhs_shape = lhs_like.shape[1:], rhs_like.shape[1:]
  (lc, rc), (lb, rb) = dimension_numbers
  backward = recipe.backward_recipe
  if saved_as_is[0]:
    options = _options(recipe, weight=True, wgrad=True)
    lhs_cols = _blocked(_to_bmk(lhs_cols, lc, lb), 1, backward, compute_dtype, **options)
  if saved_as_is[1]:
    options = _options(recipe, weight=True)
    rhs_cols = _blocked(_swap(_to_bmk(rhs_cols, rc, rb)), 2, backward, compute_dtype, **options)
  platform = lowering_platform(g, residuals)
  b = math.prod(lhs_shape[d] for d in lb)
  m = math.prod(lhs_shape[d] for d in range(len(lhs_shape)) if d not in lc and d not in lb)
  g3 = g.reshape(b, m, -1)
  if backward is None:
    g3 = g3.astype(compute_dtype)
    d_lhs3 = _plain_matmul(g3, rhs_cols, compute_dtype, platform)
    d_rhs3 = _plain_matmul(lhs_cols, _swap(g3), compute_dtype, platform)
  else:
    rows = _quantize(g3, backward, 2, **_options(recipe, gradient=True))
    cols = _quantize(g3, backward, 1, **_options(recipe, wgrad=True, gradient=True))
    d_lhs3 = _matmul(rows, rhs_cols, compute_dtype, platform)
    d_rhs3 = _matmul(lhs_cols, cols, compute_dtype, platform)
  # The weight gradient is written (B, K, N), a weight's own layout (x @ w's w is (K, N)):
  # XLA then transposes nothing.
  d_lhs = _from_bmk(d_lhs3, lhs_shape, lc, lb).astype(lhs_like.dtype)
  d_rhs = _from_bmk(_swap(d_rhs3), rhs_shape, rc, rb).astype(rhs_like.dtype)
  return d_lhs, d_rhs


block_scaled_dot.defvjp(_forward, _backward)
