"""Storing params and optimizer state in bf16 without losing small updates.

An update smaller than half of bf16's spacing (2**-8 relative) is lost when the
new value is rounded to nearest, so a bf16 train state stalls where f32 masters
keep moving. Two writes keep it:

- **stochastic rounding**: round up with probability equal to the remainder,
  so the stored value is right in expectation. For f32 -> bf16 that is: add 16
  uniform random bits to the low half of the f32 bit pattern, then drop it.
- **Kahan-compensated summation**: keep what the rounding lost in a bf16
  compensation buffer and add it back on the next update.

The optimizer itself runs in f32 on the stored values widened, inside the same
jitted step, so XLA fuses the widening, the optax update and the rounded write
into the optimizer's own kernels: no extra pass over the params.

The random bits are a pure function of the train state: a key and an update
count kept in the optimizer state (:class:`RoundingState`), hashed with each
leaf's index and each element's (:func:`random_bits`). So
two runs from one state are bit-identical, a resumed run continues as an
uninterrupted one, a skipped step (which keeps the optimizer state) changes
nothing, and data-parallel replicas, which hold the same key, round alike.

An optimizer that casts its own state, such as ``optax.adam(lr,
mu_dtype=jnp.bfloat16)``, rounds that state to nearest inside ``tx.update``,
before the rounded write sees it: stochastic rounding then keeps nothing for
those leaves. Leave the optimizer's dtypes alone and set the policy's
``opt_state_dtype`` instead (:func:`init_opt_state` warns).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from mpjax._dtypes import is_floating, to_f32

# ROUNDINGS, uses_rounded_storage, random_bits, bits_seeded_by and round_stochastically are the
# library's own (policy.py, train_step.py and block_scaled.py use them), not exported.
__all__ = [
  "RoundingState",
  "stochastic_round",
  "kahan_add",
  "init_opt_state",
  "rounded_update",
  "state_bytes",
]

ROUNDINGS = ("nearest", "stochastic", "kahan")
"""How a value is written to its stored dtype (:attr:`mpjax.Policy.rounding`)."""

_BF16, _F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
# Leaves of the optimizer state are folded in after the params' (a leaf index per stream).
_OPT_STREAM = 1 << 20


class RoundingState(NamedTuple):
  """The optimizer state of a policy with rounded storage (see :func:`init_opt_state`).

  Attributes:
    inner: the optax optimizer's own state; its floating leaves of rank >= 1
      in the policy's ``opt_state_dtype``.
    key: the key's data (``jax.random.key_data`` of the PRNG key the
      rounding draws from: ``uint32[2]`` under the default threefry PRNG,
      ``uint32[4]`` under rbg, of which the first two words are used), a
      plain array, so checkpoints keep it.
    count: the updates applied (int32), hashed with the key into each
      update's seed: each update draws new bits; a skipped step, which keeps
      this state, draws none.
    compensation: with ``rounding="kahan"``, what rounding each param lost,
      params-shaped, in the param dtype; ``None`` otherwise.

  Example:
    >>> import jax.numpy as jnp, optax, mpjax
    >>> params = {"w": jnp.zeros(3, jnp.bfloat16)}
    >>> state = mpjax.init_opt_state(optax.sgd(1e-3), mpjax.get_policy("bf16_kahan"), params, 7)
    >>> isinstance(state, mpjax.RoundingState), int(state.count), state.compensation["w"].dtype
    (True, 0, dtype(bfloat16))
  """

  inner: optax.OptState
  key: jax.Array
  count: jax.Array
  compensation: Any


def uses_rounded_storage(policy: Any) -> bool:
  """Whether ``policy`` stores optimizer state in its own dtype or rounds the writes.

  Such a policy's train state keeps a :class:`RoundingState` as its optimizer
  state, and its step runs the optimizer in f32 on the widened stored values.

  Args:
    policy: the :class:`mpjax.Policy`.

  Returns:
    Whether its ``opt_state_dtype`` is set or its ``rounding`` is not ``"nearest"``.

  Example:
    >>> import mpjax
    >>> from mpjax.rounding import uses_rounded_storage
    >>> [uses_rounded_storage(mpjax.get_policy(p)) for p in ("bf16_sr", "fp32")]
    [True, False]
  """
  return policy.opt_state_dtype is not None or policy.rounding != "nearest"


def stochastic_round(x: jax.Array, bits: jax.Array, dtype: Any = jnp.bfloat16) -> jax.Array:
  """``x`` rounded to bf16 stochastically: up with probability equal to the remainder.

  Adds the low 16 of ``bits`` to the low half of ``x``'s f32 bit pattern and
  drops that half, so ``E[stochastic_round(x)] == x`` over uniform ``bits``.
  Infinities stay; NaN stays NaN; a finite value within one bf16 spacing of
  bf16's largest may round up to infinity, with the probability its remainder
  gives.

  Args:
    x: the values (any float dtype; computed in f32).
    bits: uniform ``uint32`` random bits, ``x``'s shape.
    dtype: the target dtype; only ``bfloat16`` is rounded stochastically (an
      f32 target is ``x`` in f32).

  Returns:
    ``x`` in ``dtype``.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> x = jnp.full((100_000,), 1.0 + 2.0**-10)  # a quarter of bf16's spacing above 1
    >>> bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint32)
    >>> y = mpjax.stochastic_round(x, bits)
    >>> y.dtype, sorted(set(y.tolist()))
    (dtype(bfloat16), [1.0, 1.0078125])
    >>> abs(float(jnp.mean(y.astype(jnp.float32))) - (1.0 + 2.0**-10)) < 1e-4
    True
  """
  dtype = np.dtype(dtype)
  x = x.astype(jnp.float32)
  if dtype == _F32:
    return x
  if dtype != _BF16:
    raise ValueError(
      f"stochastic_round: rounds f32 to bfloat16 only, not {dtype.name}; store bf16, or "
      "use rounding='nearest'."
    )
  pattern = lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (pattern + (bits.astype(jnp.uint32) & 0xFFFF)) & jnp.uint32(0xFFFF0000)
  # The truncation is exact: the low half of ``rounded`` is zero.
  y = lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
  # A NaN's pattern could carry into the sign; infinities have a zero low half.
  return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), y)


def kahan_add(
  value: jax.Array, update: jax.Array, compensation: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """``value + update`` stored in ``value``'s dtype, with what rounding lost kept apart.

  The sum ``value + update + compensation`` is taken in f32, rounded to
  nearest in ``value``'s dtype, and the rest (what the rounding dropped) is the
  new compensation, added back next time: an update far below the dtype's
  spacing accumulates there until it moves the value.

  Args:
    value: the stored value (bf16).
    update: the update (f32).
    compensation: the previous compensation (``value``'s dtype).

  Returns:
    ``(new_value, new_compensation)``, both in ``value``'s dtype.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> v, c = jnp.ones(1, jnp.bfloat16), jnp.zeros(1, jnp.bfloat16)
    >>> for _ in range(8):  # 8 updates of 2**-10, each a quarter of bf16's spacing at 1
    ...   v, c = mpjax.kahan_add(v, jnp.full(1, 2.0**-10), c)
    >>> float(v[0]), float(c[0])  # round to nearest alone would stay at 1.0
    (1.0078125, 0.0)
  """
  total = value.astype(jnp.float32) + update.astype(jnp.float32) + compensation.astype(jnp.float32)
  new_value = total.astype(value.dtype)
  new_compensation = (total - new_value.astype(jnp.float32)).astype(compensation.dtype)
  # Where the sum is not finite, no compensation is kept (inf - inf would be NaN).
  new_compensation = jnp.where(jnp.isfinite(total), new_compensation, 0).astype(compensation.dtype)
  return new_value, new_compensation


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a bijection of uint32 in which every input bit
  flips each output bit with probability about 1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def random_bits(key: jax.Array, count: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
  """Uniform ``uint32`` bits of ``shape``, a pure function of ``(key, count, stream, index)``.

  A counter-based hash: the key data and the update count make a seed per
  step, the stream (one per leaf written) a seed per leaf, and each element's
  flat index is hashed with them. It is integer arithmetic on an iota, so XLA
  fuses it into the kernel that writes the rounded values: no random-number
  kernel, no extra pass, and no per-leaf key derivation kernels
  (``jax.random.fold_in`` per leaf costs a small kernel each on a GPU). The
  index is the element's index in ``shape``: for a replicated leaf, or one
  sharded by ``jax.jit`` (GSPMD partitions the iota), that is its global
  index, so a sharded leaf draws the same bits as an unsharded one. Inside
  ``shard_map`` ``shape`` is the local shard's, so every shard of a leaf
  would draw the same pattern.

  Args:
    key: the key's data (:attr:`RoundingState.key`; its first two words are used).
    count: the update count (int32).
    stream: which value is written (a leaf's index).
    shape: the shape of the bits.

  Returns:
    ``uint32`` bits of ``shape``.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> key = jax.random.key_data(jax.random.key(0))
    >>> bits = mpjax.rounding.random_bits(key, jnp.int32(0), 0, (100_000,))
    >>> 0.49 < float(jnp.mean((bits >> 31).astype(jnp.float32))) < 0.51
    True
  """
  seed0, seed1 = _seeds(key, count, np.asarray([stream]))
  return _bits(seed0[0], seed1[0], shape)


def _seeds(key: jax.Array, count: jax.Array, streams: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """The two per-value seeds of :func:`random_bits` for each of ``streams``, as ``uint32[n]``
  vectors: one small computation for every value a step writes, not a scalar chain each."""
  u32 = jnp.uint32
  key = key.astype(u32)
  step = _fmix32(key[1] + count.astype(u32) * u32(0x9E3779B9))
  leaf = jnp.asarray((streams.astype(np.uint64) * 0x7F4A7C15 + 0x632BE5AB) & 0xFFFFFFFF, u32)
  seed0 = _fmix32(step ^ key[0] ^ leaf)
  seed1 = _fmix32(seed0 + leaf + u32(0x2545F491))
  return seed0, seed1


def bits_seeded_by(values: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
  """Random ``uint32`` bits of ``shape`` (:func:`random_bits`), seeded by a hash of ``values``
  (f32, each bit pattern hashed with its index) and ``stream``: a pure function of them, so new
  values (a new step's gradients) draw new bits and the same values the same ones."""
  u32 = jnp.uint32
  words = lax.bitcast_convert_type(values.astype(jnp.float32), u32).reshape(-1)
  index = lax.iota(u32, words.size)
  seed = jnp.sum(_fmix32(words ^ (index * u32(0x9E3779B9))), dtype=u32)
  return random_bits(jnp.stack([seed, _fmix32(seed + u32(1))]), jnp.int32(0), stream, shape)


def round_stochastically(v: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """``v`` (f32, within ``dtype``'s finite range) rounded to one of the two ``dtype`` values
  around it: the upper with probability ``(|v| - lower) / (upper - lower)``, from the top 24
  of ``bits``; returned in f32, exactly a ``dtype`` value. Exact: the spacing is a power of
  two, read from ``v``'s exponent (``dtype``'s subnormal spacing below its normal range)."""
  info = jnp.finfo(dtype)
  a = jnp.abs(v)
  exponent = (lax.bitcast_convert_type(a, jnp.uint32) >> 23).astype(jnp.int32) - 127
  exponent = jnp.maximum(exponent, info.minexp)
  spacing = lax.bitcast_convert_type((exponent - info.nmant + 127) << 23, jnp.float32)
  steps = a / spacing
  lower = jnp.floor(steps)
  uniform = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
  rounded = (lower + (uniform < steps - lower)) * spacing
  return jnp.where(jnp.isnan(v), v, jnp.copysign(rounded, v))


def _bits(seed0: jax.Array, seed1: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Each element's bits of ``shape``: its flat index hashed with the value's two seeds."""
  u32 = jnp.uint32
  index = jnp.zeros(shape, u32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(u32, shape, axis) * u32(stride & 0xFFFFFFFF)
    stride *= shape[axis]
  return _fmix32(_fmix32(index ^ seed0) + seed1)


def _stored(x: Any, dtype: Any) -> Any:
  """A floating leaf of rank >= 1 in ``dtype``; scalars (counts, hyperparameters) and
  non-floating leaves as they are."""
  if dtype is None or not is_floating(x) or jnp.ndim(x) == 0:
    return x
  return x.astype(dtype)


def _key_data(key: jax.Array | int | None) -> jax.Array:
  """The data of the rounding's key: from a typed key, an integer seed (a Python or numpy
  integer, or a 0-d integer array) or key data."""
  if key is None:
    key = 0
  if not hasattr(key, "dtype"):
    key = np.asarray(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  elif jnp.ndim(key) == 0 and jnp.issubdtype(key.dtype, jnp.integer):
    key = jax.random.key_data(jax.random.key(key))
  expected = jax.random.key_data(jax.random.key(0)).shape
  if jnp.shape(key) != expected:
    raise ValueError(
      f"rounding key: expected jax.random.key(seed), an integer seed or uint32{list(expected)} "
      f"key data, got {jnp.result_type(key).name}{list(jnp.shape(key))}."
    )
  return jnp.asarray(key, jnp.uint32)


def init_opt_state(
  tx: optax.GradientTransformation,
  policy: Any,
  params: Any,
  key: jax.Array | int | None = None,
) -> Any:
  """The optimizer state a policy stores: ``tx.init(params)``, or a :class:`RoundingState`.

  For a policy without rounded storage (:func:`uses_rounded_storage` false)
  this is ``tx.init(params)``. Otherwise the optimizer's state is initialised
  on the params in f32 and its floating leaves of rank >= 1 (Adam's moments, a
  momentum, whatever the optimizer keeps per parameter) are stored in the
  policy's ``opt_state_dtype`` (``None``: its ``param_dtype``); scalars such
  as Adam's ``count`` or injected hyperparameters (``b2=0.999`` is 1.0 in
  bf16) and integer leaves stay as the optimizer made them.

  Args:
    tx: any optax optimizer.
    policy: the :class:`mpjax.Policy`.
    params: the params, already in the policy's ``param_dtype``.
    key: the rounding's PRNG key (``jax.random.key``), an integer seed (also
      ``np.int64`` or a 0-d integer array), or ``None`` for seed 0.

  Returns:
    The optimizer state.

  Example:
    >>> import jax.numpy as jnp, optax, mpjax
    >>> policy = mpjax.get_policy("bf16_sr")
    >>> params = {"w": jnp.zeros((2, 3), jnp.bfloat16)}
    >>> state = mpjax.init_opt_state(optax.adamw(1e-3), policy, params)
    >>> state.inner[0].mu["w"].dtype, state.inner[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
  """
  if not uses_rounded_storage(policy):
    return tx.init(params)
  dtype = policy.param_dtype if policy.opt_state_dtype is None else policy.opt_state_dtype
  inner32 = tx.init(jax.tree.map(to_f32, params))
  _warn_if_optimizer_casts(inner32, policy)
  inner = jax.tree.map(lambda x: _stored(x, dtype), inner32)
  compensation = None
  if policy.rounding == "kahan":
    compensation = jax.tree.map(lambda p: jnp.zeros_like(p) if is_floating(p) else None, params)
  return RoundingState(inner, _key_data(key), jnp.zeros((), jnp.int32), compensation)


def _warn_if_optimizer_casts(inner32: Any, policy: Any) -> None:
  """Warns where the optimizer, initialised on f32 params, keeps per-parameter state in a
  narrower dtype: it rounds that state to nearest itself, before a rounded write."""
  narrow = {
    np.dtype(x.dtype).name
    for x in jax.tree.leaves(inner32)
    if is_floating(x) and jnp.ndim(x) > 0 and jnp.finfo(x.dtype).bits < 32
  }
  if narrow and policy.rounding != "nearest":
    warnings.warn(
      f"init_opt_state: the optimizer keeps per-parameter state in {', '.join(sorted(narrow))} "
      f"(e.g. optax.adam(..., mu_dtype=jnp.bfloat16)) and rounds it to nearest in tx.update, "
      f"so policy {policy}'s rounding={policy.rounding!r} keeps nothing for it; leave the "
      "optimizer's dtypes alone and set the policy's opt_state_dtype instead.",
      stacklevel=3,
    )


def _write(new: Any, old: Any, rounding: str, seeds: tuple[jax.Array, jax.Array] | None) -> Any:
  """``new`` (f32) written to ``old``'s dtype: stochastically for bf16 unless nearest, with the
  random bits of the value's two seeds (:func:`_seeds`)."""
  if not is_floating(old) or new is None:
    return new
  if rounding == "nearest" or np.dtype(old.dtype) != _BF16:
    return new.astype(old.dtype)
  return stochastic_round(new, _bits(*seeds, jnp.shape(new)), old.dtype)


def rounded_update(
  tx: optax.GradientTransformation,
  policy: Any,
  grads: Any,
  opt_state: RoundingState,
  params: Any,
) -> tuple[Any, RoundingState]:
  """One optimizer update of rounded storage: the new params and :class:`RoundingState`.

  Widens the stored params and optimizer state to f32, runs ``tx.update`` and
  the addition in f32, and writes each result back to its stored dtype: bf16
  stochastically (``"stochastic"``, and the optimizer state under
  ``"kahan"``), the params of ``"kahan"`` compensated, anything else to
  nearest. All of it is elementwise, so under ``jax.jit`` XLA fuses it into the
  optimizer's kernels. A leaf the optimizer casts itself (``optax.adam(...,
  mu_dtype=jnp.bfloat16)``) arrives rounded to nearest, and stays so.

  Args:
    tx: the optax optimizer.
    policy: the :class:`mpjax.Policy`.
    grads: the f32 gradients.
    opt_state: the state from :func:`init_opt_state`.
    params: the stored params.

  Returns:
    ``(new_params, new_opt_state)``, in the dtypes they had.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpjax
    >>> policy = mpjax.get_policy("bf16_sr")
    >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
    >>> tx = optax.sgd(1e-3)
    >>> opt_state = mpjax.init_opt_state(tx, policy, params)
    >>> update = jax.jit(lambda g, s, p: mpjax.rounded_update(tx, policy, g, s, p))
    >>> params, opt_state = update({"w": jnp.ones(4)}, opt_state, params)
    >>> params["w"].dtype, int(opt_state.count)
    (dtype(bfloat16), 1)
  """
  if not isinstance(opt_state, RoundingState):
    raise TypeError(
      f"rounded_update: the optimizer state of policy {policy} must be an "
      f"mpjax.RoundingState (from TrainState.create / mpjax.init_opt_state), got "
      f"{type(opt_state).__name__}."
    )
  params32 = jax.tree.map(to_f32, params)
  inner32 = jax.tree.map(to_f32, opt_state.inner)
  updates, new_inner = tx.update(jax.tree.map(to_f32, grads), inner32, params32)
  opt_rounding = "nearest" if policy.rounding == "nearest" else "stochastic"
  leaves, treedef = jax.tree.flatten(opt_state.inner)
  p_leaves, p_treedef = jax.tree.flatten(params)
  # Every value's seeds in one vector, one small kernel, rather than a chain of scalar kernels
  # per step; the same-shaped updates that share that vector fuse into one kernel (bits as
  # random_bits draws them: leaf i of the params is stream i, of the optimizer state
  # _OPT_STREAM + i). Round to nearest needs none.
  count, seeds = opt_state.count, [None] * (len(p_leaves) + len(leaves))
  if policy.rounding != "nearest":
    streams = np.concatenate([np.arange(len(p_leaves)), _OPT_STREAM + np.arange(len(leaves))])
    seed0, seed1 = _seeds(opt_state.key, count, streams)
    # The count's increment after the seeds: it then overwrites the donated count in place,
    # not a copy of it (XLA copies an input that an unordered reader still needs).
    (seed0, seed1), count = lax.optimization_barrier(((seed0, seed1), count))
    seeds = [(seed0[i], seed1[i]) for i in range(len(streams))]
  new_leaves = treedef.flatten_up_to(new_inner)
  new_inner = treedef.unflatten(
    _write(n, o, opt_rounding, seeds[len(p_leaves) + i])
    for i, (n, o) in enumerate(zip(new_leaves, leaves, strict=True))
  )
  u_leaves = p_treedef.flatten_up_to(updates)
  compensation = opt_state.compensation
  if policy.rounding == "kahan":
    c_leaves = p_treedef.flatten_up_to(compensation)
    pairs = [
      (p, c) if c is None else kahan_add(p, u, c)
      for p, u, c in zip(p_leaves, u_leaves, c_leaves, strict=True)
    ]
    new_params = p_treedef.unflatten(p for p, _ in pairs)
    compensation = p_treedef.unflatten(c for _, c in pairs)
  else:
    new_params = p_treedef.unflatten(
      _write(to_f32(p) + u, p, policy.rounding, seeds[i]) if is_floating(p) else p
      for i, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True))
    )
  return new_params, RoundingState(new_inner, opt_state.key, count + 1, compensation)


def state_bytes(params: Any, opt_state: Any) -> int:
  """The bytes of a train state's params and optimizer state (what each step reads and writes).

  Args:
    params: the params (arrays, or ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``).
    opt_state: the optimizer state (``state.opt_state``), the same.

  Returns:
    The bytes of their leaves that have a dtype, summed.

  Example:
    >>> import jax.numpy as jnp, optax, mpjax
    >>> params = {"w": jnp.zeros(1000)}
    >>> mpjax.state_bytes(params, optax.adam(1e-3).init(params))  # 4 + 4 + 4 bytes a param
    12004
  """
  return sum(
    int(np.prod(jnp.shape(x))) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves((params, opt_state))
    if hasattr(x, "dtype")
  )
