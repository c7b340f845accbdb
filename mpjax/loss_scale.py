"""Loss scaling: no-op, static and dynamic loss-scale states, and the finite check.

Every state is a ``flax.struct.PyTreeNode``: the evolving values are pytree
leaves, the hyperparameters are static fields, and nothing is flattened by hand
(jmp's hand-written flatten drops ``min_loss_scale`` under ``jit``). The scale is
always float32, whatever dtype it was given (jmp#47); a ``DynamicLossScale``
given a scale or floor that is not floating warns as jmp does, then uses it as
float32.

The method names are jmp's (``loss_scale``, ``scale``, ``unscale``, ``adjust``),
so code written against jmp switches by changing the import.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from mpjax._dtypes import is_floating, to_f32

__all__ = [
  "LossScale",
  "NoOpLossScale",
  "StaticLossScale",
  "DynamicLossScale",
  "all_finite",
  "select_tree",
]

T = TypeVar("T")
AxisName = Hashable | Sequence[Hashable]

_F32_MAX = float(np.finfo(np.float32).max)


def _as_array(value: Any, dtype: Any) -> Any:
  """``value`` as an array of ``dtype``, leaving abstract placeholders alone.

  ``__post_init__`` also runs when JAX unflattens a state with placeholders
  (avals, sentinels, ``None``), which must pass through untouched.
  """
  if isinstance(value, (bool, int, float, np.ndarray, np.generic, jax.Array)):
    if getattr(value, "dtype", None) != dtype:
      return jnp.asarray(value, dtype)
  return value


def _warn_if_not_floating(value: Any, name: str) -> None:
  """jmp's warning for a ``DynamicLossScale`` scale or floor that is not floating.

  Placeholders JAX unflattens with (``object()``, ``None``, avals) pass in
  silence, as in jmp.
  """
  if not isinstance(value, (bool, int, float, np.ndarray, np.generic, jax.Array)):
    return
  dtype = jnp.result_type(value)  # as JAX stores it: np.int64 is int32 without x64
  if not jnp.issubdtype(dtype, jnp.floating):
    # stacklevel 4: the caller of DynamicLossScale(...), past __post_init__ and __init__.
    warnings.warn(
      f"Expected floating type for {name}, got {dtype}; mpjax uses it as float32.",
      UserWarning,
      stacklevel=4,
    )


def _scale_tree(tree: T, factor: jax.Array) -> T:
  def scale(x):
    if not is_floating(x):
      return x
    x = to_f32(x)
    return x * factor.astype(x.dtype)

  return jax.tree.map(scale, tree)


class NoOpLossScale(struct.PyTreeNode):
  """A loss scale that does nothing: the default for fp32 and bf16 compute.

  Example:
    >>> import jax.numpy as jnp
    >>> import mpjax
    >>> ls = mpjax.NoOpLossScale()
    >>> grads = jnp.ones(2, jnp.bfloat16)
    >>> float(ls.loss_scale), ls.unscale(grads) is grads
    (1.0, True)
  """

  @property
  def loss_scale(self) -> jax.Array:
    """The scale, ``1.0`` as a float32 scalar."""
    return jnp.ones((), jnp.float32)

  def scale(self, tree: T) -> T:
    """Returns ``tree`` itself, as jmp's ``NoOpLossScale`` does."""
    return tree

  def unscale(self, tree: T) -> T:
    """Returns ``tree`` itself, as jmp's ``NoOpLossScale`` does."""
    return tree

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> NoOpLossScale:
    """Returns this state unchanged."""
    del grads_finite
    return self


class StaticLossScale(struct.PyTreeNode):
  """A fixed loss scale.

  Attributes:
    loss_scale: the scale, a float32 scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> import mpjax
    >>> ls = mpjax.StaticLossScale(1024)
    >>> float(ls.scale(jnp.float32(2.0))), float(ls.unscale(jnp.float32(2048.0)))
    (2048.0, 2.0)
  """

  loss_scale: jax.Array

  def __post_init__(self):
    scale = self.loss_scale
    if isinstance(scale, (int, float)) and not (0 < scale < math.inf):
      raise ValueError(f"StaticLossScale({scale}) must be positive and finite, e.g. 2.0**15.")
    object.__setattr__(self, "loss_scale", _as_array(scale, jnp.float32))

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of ``tree`` by the scale; they come back in f32."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of ``tree`` by the scale; they come back in f32."""
    return _scale_tree(tree, 1.0 / self.loss_scale)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> StaticLossScale:
    """Returns this state unchanged: a static scale never moves."""
    del grads_finite
    return self


class DynamicLossScale(struct.PyTreeNode):
  """A loss scale that grows while gradients stay finite and shrinks when they do not.

  A finite step counts. After ``period`` consecutive finite steps the scale is
  multiplied by ``factor`` (never past ``max_loss_scale``) and the count
  restarts. A non-finite step resets the count; once ``hysteresis`` consecutive
  steps have been non-finite, that step and every further non-finite step of
  the run divide the scale by ``factor`` (never below ``min_loss_scale``).

  The defaults follow TF/Keras and DeepSpeed: start at ``2**15`` (below the
  fp16 maximum 65504, unlike Flax's 65536 whose first step overflows), double
  every 2000 finite steps.

  Attributes:
    loss_scale: the current scale, a float32 scalar.
    counter: consecutive finite steps since the last growth or overflow (int32).
    overflow_counter: consecutive non-finite steps (int32).
    period: finite steps between growths.
    factor: growth and backoff factor, > 1.
    min_loss_scale: the floor of the scale, a Python float (a scalar array is
      taken, as jmp takes one).
    max_loss_scale: the ceiling of the scale (finite).
    hysteresis: consecutive non-finite steps before the scale shrinks.

  Example:
    >>> import mpjax
    >>> ls = mpjax.DynamicLossScale(2.0**15, period=2)
    >>> ls = ls.adjust(True).adjust(True)
    >>> float(ls.loss_scale)
    65536.0
    >>> float(ls.adjust(False).loss_scale)
    32768.0
  """

  # jmp's positional order first: DynamicLossScale(loss_scale, counter, period, factor,
  # min_loss_scale); the rest keyword-only.
  loss_scale: jax.Array = 2.0**15
  counter: jax.Array = 0
  period: int = struct.field(pytree_node=False, default=2000)
  factor: float = struct.field(pytree_node=False, default=2)
  min_loss_scale: float = struct.field(pytree_node=False, default=1.0)
  overflow_counter: jax.Array = struct.field(default=0, kw_only=True)
  max_loss_scale: float = struct.field(pytree_node=False, default=2.0**24, kw_only=True)
  hysteresis: int = struct.field(pytree_node=False, default=1, kw_only=True)

  def __post_init__(self):
    period = self.period
    if isinstance(period, (float, np.floating)) and float(period).is_integer():
      object.__setattr__(self, "period", int(period))  # jmp accepts period=2000.0
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    if isinstance(self.min_loss_scale, (bool, int, np.ndarray, np.generic, jax.Array)):
      # A static field is hashed under jit: a Python float (jmp takes an array here).
      object.__setattr__(self, "min_loss_scale", float(self.min_loss_scale))
    self._check_hyperparameters()
    object.__setattr__(self, "loss_scale", _as_array(self.loss_scale, jnp.float32))
    object.__setattr__(self, "counter", _as_array(self.counter, jnp.int32))
    object.__setattr__(self, "overflow_counter", _as_array(self.overflow_counter, jnp.int32))

  def _check_hyperparameters(self) -> None:
    def fail(problem: str, fix: str):
      raise ValueError(f"DynamicLossScale: {problem}; {fix}.")

    if not isinstance(self.period, (int, np.integer)) or self.period < 1:
      fail(f"period={self.period!r} must be an integer >= 1", "the default is period=2000")
    if not isinstance(self.hysteresis, (int, np.integer)) or self.hysteresis < 1:
      fail(f"hysteresis={self.hysteresis!r} must be an integer >= 1", "use hysteresis=1 for none")
    if not self.factor > 1:
      fail(f"factor={self.factor!r} must be > 1", "the default is factor=2")
    if not 0 < self.min_loss_scale < math.inf:
      fail(f"min_loss_scale={self.min_loss_scale!r} must be positive and finite", "e.g. 1.0")
    if not self.max_loss_scale <= _F32_MAX:
      fail(f"max_loss_scale={self.max_loss_scale!r} must be finite in float32", "e.g. 2.0**24")
    if self.min_loss_scale > self.max_loss_scale:
      fail(
        f"min_loss_scale={self.min_loss_scale!r} > max_loss_scale={self.max_loss_scale!r}",
        "make min_loss_scale <= max_loss_scale",
      )
    scale = self.loss_scale
    if isinstance(scale, (int, float)) and not (
      self.min_loss_scale <= scale <= self.max_loss_scale
    ):
      fail(
        f"loss_scale={scale!r} is outside [min_loss_scale, max_loss_scale] = "
        f"[{self.min_loss_scale}, {self.max_loss_scale}]",
        "start inside the bounds (the default start is 2.0**15)",
      )

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of ``tree`` by the scale; they come back in f32."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of ``tree`` by the scale; they come back in f32."""
    return _scale_tree(tree, 1.0 / self.loss_scale)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
    """Returns the state after a step whose gradients were (or were not) all finite.

    Args:
      grads_finite: a scalar bool, e.g. from :func:`all_finite`.

    Returns:
      The new state.
    """
    finite = jnp.asarray(grads_finite, jnp.bool_)
    counter = jnp.where(finite, self.counter + 1, 0)
    overflow_counter = jnp.where(finite, 0, self.overflow_counter + 1)
    grow = finite & (counter >= self.period)
    shrink = ~finite & (overflow_counter >= self.hysteresis)
    factor = jnp.float32(self.factor)
    grown = jnp.minimum(self.loss_scale * factor, jnp.float32(self.max_loss_scale))
    shrunk = jnp.maximum(self.loss_scale / factor, jnp.float32(self.min_loss_scale))
    loss_scale = jnp.where(grow, grown, jnp.where(shrink, shrunk, self.loss_scale))
    return self.replace(
      loss_scale=loss_scale,
      counter=jnp.where(grow, 0, counter).astype(jnp.int32),
      overflow_counter=overflow_counter.astype(jnp.int32),
    )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of mpjax's loss-scale states."""


def all_finite(tree: Any, *, axis_name: AxisName | None = None) -> jax.Array:
  """Whether every floating leaf of ``tree`` is finite, as a scalar bool.

  Args:
    tree: a pytree; non-floating leaves are ignored.
    axis_name: under ``shard_map`` or ``pmap``, the mapped axis name (or names)
      to agree over: every device gets the same answer, False if any device
      saw a non-finite value. Under ``jit`` with shardings the answer is global
      already and no axis name is needed.

  Returns:
    A scalar ``bool`` array.

  Example:
    >>> import jax.numpy as jnp
    >>> import mpjax
    >>> bool(mpjax.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = [x for x in jax.tree.leaves(tree) if is_floating(x)]
  finite = jnp.array(True)
  for x in leaves:
    finite = finite & jnp.isfinite(x).all()
  if axis_name is not None:
    finite = lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite


def select_tree(pred: jax.typing.ArrayLike, on_true: T, on_false: T) -> T:
  """Picks ``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

  Args:
    pred: a scalar bool.
    on_true: a pytree.
    on_false: a pytree of the same structure, shapes and dtypes.

  Returns:
    A pytree of that structure.

  Example:
    >>> import jax.numpy as jnp
    >>> import mpjax
    >>> mpjax.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
    Array([0., 0.], dtype=float32)
  """
  pred = jnp.asarray(pred)
  if pred.shape != () or pred.dtype != jnp.bool_:
    raise ValueError(
      f"select_tree: pred must be a scalar bool, got {pred.dtype}{list(pred.shape)}."
    )
  true_leaves, true_def = jax.tree.flatten(on_true)
  false_leaves, false_def = jax.tree.flatten(on_false)
  if true_def != false_def:
    raise ValueError(
      f"select_tree: on_true and on_false differ in structure:\n{true_def}\nvs\n{false_def}"
    )
  return jax.tree.unflatten(
    true_def, [lax.select(pred, a, b) for a, b in zip(true_leaves, false_leaves, strict=True)]
  )
