"""Precision policies for Flax modules: keyword arguments for linen, an in-place pass for NNX.

Flax modules take their precision as constructor arguments: ``dtype`` (the
compute dtype their inputs and weights are cast to), ``param_dtype`` (the
dtype parameters are created and stored in) and, for GEMM layers, the
``dot_general`` (or ``conv_general_dilated``) function they call. A plain
``dtype=bfloat16`` gives bf16 x bf16 -> bf16 GEMMs, which XLA:CPU runs slower
than f32; the functions installed here accumulate in f32 forward and backward
(:func:`mpjax.gemm.mixed_dot_general`).

What Flax 0.12.8 accepts, read from its source:

- linen ``Dense`` and ``DenseGeneral`` take ``dot_general``; ``Conv`` and
  ``ConvLocal`` take ``conv_general_dilated``; ``Einsum``, ``ConvTranspose``
  and attention's score/value products take neither (run those under
  :func:`mpjax.autocast`).
- ``LayerNorm``, ``BatchNorm``, ``RMSNorm`` and ``GroupNorm`` take ``dtype`` and
  ``param_dtype`` only. ``dtype`` is the dtype of their *output*: their
  statistics are computed in at least f32 (``force_float32_reductions=True``,
  the default) and ``BatchNorm``'s running statistics are created and kept f32
  whatever ``param_dtype`` is.
- NNX ``Linear`` and ``LinearGeneral`` have a ``dot_general`` attribute,
  ``Einsum`` an ``einsum_op``, ``Conv`` a ``conv_general_dilated``; NNX
  ``BatchNorm`` casts its running statistics to ``dtype`` before normalizing
  with them, which :func:`nnx_apply_policy` turns off.

The weights stay in ``param_dtype`` (f32 masters for a mixed policy); each
layer casts them to ``dtype`` where it uses them, so a weight's gradient is
accumulated in f32 and rounded once to the compute dtype before it reaches the
f32 master (as in ``torch.autocast``). :func:`mpjax.autocast` on the plain f32
model keeps those gradients f32 throughout.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from mpjax._dtypes import is_castable_dtype
from mpjax.gemm import mixed_conv, mixed_dot_general, same_as_operands
from mpjax.policy import Policy, get_policy

__all__ = ["linen_kwargs", "nnx_apply_policy", "LAYER_KINDS"]

LAYER_KINDS = ("dense", "conv", "norm")
"""The ``layer`` values :func:`linen_kwargs` accepts."""

_BUILT: list[Callable[..., Any]] = []
"""Every function the factories below have built (one per kind and compute dtype)."""


@functools.cache
def _dot_general(compute_dtype: np.dtype) -> Callable[..., jax.Array]:
  """:func:`mixed_dot_general` for ``compute_dtype``, cached.

  One policy gives one function object: modules built twice with the same
  policy compare equal and share compiled code.
  """
  dot_general = mixed_dot_general(compute_dtype)
  _BUILT.append(dot_general)
  return dot_general


def _conv_params(lhs: jax.Array, rhs: jax.Array, compute_dtype: np.dtype, kw: dict) -> tuple:
  """The ``conv_general_dilated`` primitive's parameters, as ``lax`` canonicalizes them."""
  closed = jax.make_jaxpr(functools.partial(lax.conv_general_dilated, **kw))(
    jax.ShapeDtypeStruct(lhs.shape, compute_dtype), jax.ShapeDtypeStruct(rhs.shape, compute_dtype)
  )
  (eqn,) = (e for e in closed.jaxpr.eqns if e.primitive.name == "conv_general_dilated")
  skip = ("precision", "preferred_element_type")
  return tuple(sorted((k, v) for k, v in eqn.params.items() if k not in skip))


@functools.cache
def _conv_general_dilated(compute_dtype: np.dtype) -> Callable[..., jax.Array]:
  """A drop-in ``lax.conv_general_dilated`` accumulating in f32 forward and backward."""

  def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
  ) -> jax.Array:
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    kw = dict(
      window_strides=window_strides,
      padding=padding,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count,
      batch_group_count=batch_group_count,
      out_sharding=out_sharding,
    )
    if same_as_operands(lhs, rhs, preferred_element_type):
      preferred_element_type = None
    if precision is not None or preferred_element_type is not None:
      return lax.conv_general_dilated(
        lhs, rhs, precision=precision, preferred_element_type=preferred_element_type, **kw
      )
    return mixed_conv(lhs, rhs, _conv_params(lhs, rhs, compute_dtype, kw), compute_dtype)

  name = f"mixed_conv_general_dilated_{compute_dtype.name}"
  conv_general_dilated.__name__ = conv_general_dilated.__qualname__ = name
  _BUILT.append(conv_general_dilated)
  return conv_general_dilated


@functools.cache
def _einsum_op(compute_dtype: np.dtype) -> Callable[..., jax.Array]:
  """``jnp.einsum`` whose contractions go through the f32-accumulating ``dot_general``."""
  einsum_op = functools.partial(jnp.einsum, _dot_general=_dot_general(compute_dtype))
  _BUILT.append(einsum_op)
  return einsum_op


def _keep_stats_promote(args: tuple, /, *, dtype: Any = None, inexact: bool = True) -> tuple:
  """NNX ``BatchNorm``'s ``promote_dtype``, leaving the running mean and variance as they are.

  Flax's default casts them to ``dtype`` too, so a bf16 ``BatchNorm`` in eval
  mode would normalize with bf16-rounded statistics.
  """
  x, mean, var, scale, bias = args
  x, scale, bias = nnx_dtypes.promote_dtype((x, scale, bias), dtype=dtype, inexact=inexact)
  return x, mean, var, scale, bias


_FLAX_DEFAULTS = {
  "dot_general": (None, lax.dot_general),
  "conv_general_dilated": (None, lax.conv_general_dilated),
  "einsum_op": (jnp.einsum,),
}
"""For each swappable attribute, the values Flax gives it by default (the last one is restored)."""


def _layers(layer: str | Iterable[str]) -> tuple[str, ...]:
  kinds = (layer,) if isinstance(layer, str) else tuple(layer)
  for kind in kinds:
    if kind not in LAYER_KINDS:
      raise ValueError(
        f"linen_kwargs: layer={kind!r} is not one of {LAYER_KINDS}; pass 'dense' for "
        "Dense/DenseGeneral and mpjax.models, 'conv' for Conv, 'norm' for norm layers and Embed."
      )
  if not kinds:
    raise ValueError("linen_kwargs: layer=() names no layer kind; pass 'dense', 'conv' or 'norm'.")
  return kinds


def linen_kwargs(
  policy: Policy | str | Any = "mixed_bf16", *, layer: str | Sequence[str] = "dense"
) -> dict[str, Any]:
  """The keyword arguments that give Flax linen modules a precision policy's fast path.

  ``dtype`` is the policy's compute dtype and ``param_dtype`` its param dtype.
  For a mixed policy (f32 params, f16/bf16 compute) GEMM layers also get a
  function that takes compute-dtype operands and accumulates in f32, forward
  and backward: ``dot_general`` (:func:`mpjax.gemm.mixed_dot_general`) for
  ``layer="dense"``, ``conv_general_dilated`` for ``layer="conv"``. Other
  policies (``fp32``, ``pure_bf16``) keep Flax's own ``lax`` functions.

  Which layer takes which (Flax 0.12.8):

  - ``"dense"``: ``nn.Dense``, ``nn.DenseGeneral`` and the models of
    :mod:`mpjax.models` (``dtype``, ``param_dtype``, ``dot_general``).
  - ``"conv"``: ``nn.Conv``, ``nn.ConvLocal`` (``dtype``, ``param_dtype``,
    ``conv_general_dilated``).
  - ``"norm"``: ``nn.LayerNorm``, ``nn.BatchNorm``, ``nn.RMSNorm``,
    ``nn.GroupNorm``, and also ``nn.Embed`` (``dtype``, ``param_dtype``). A
    norm's ``dtype`` is its output dtype; its statistics stay f32, and
    ``BatchNorm``'s running statistics are f32 whatever ``param_dtype`` is.
  - a sequence such as ``("dense", "conv")`` gives the union, for modules that
    take both (:class:`mpjax.models.CNN`).

  The model's own output is in the compute dtype: compute the loss from
  ``logits.astype(jnp.float32)``.

  Args:
    policy: anything :func:`mpjax.get_policy` reads.
    layer: ``"dense"``, ``"conv"``, ``"norm"``, or a sequence of them.

  Returns:
    A dict to splat into the module's constructor. The same policy gives the
    same functions, so modules built twice compare equal.

  Raises:
    ValueError: if the policy cannot be read or ``layer`` is not one of the kinds.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from mpjax.flax_policy import linen_kwargs
    >>> sorted(linen_kwargs("mixed_bf16"))
    ['dot_general', 'dtype', 'param_dtype']
    >>> layer = nn.Dense(8, **linen_kwargs("mixed_bf16"))
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> layer.apply(variables, jnp.ones((2, 4))).dtype, variables["params"]["kernel"].dtype
    (dtype(bfloat16), dtype('float32'))
    >>> linen_kwargs("fp32", layer="norm")
    {'dtype': dtype('float32'), 'param_dtype': dtype('float32')}
  """
  policy = get_policy(policy)
  kinds = _layers(layer)
  kwargs: dict[str, Any] = {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}
  if policy.is_mixed:
    compute = np.dtype(policy.compute_dtype)
    if "dense" in kinds:
      kwargs["dot_general"] = _dot_general(compute)
    if "conv" in kinds:
      kwargs["conv_general_dilated"] = _conv_general_dilated(compute)
  return kwargs


def _path(parts: tuple) -> str:
  return "/".join(str(p) for p in parts)


def _check_exclude(exclude: Any) -> tuple[tuple[type, ...], tuple[str, ...]]:
  entries = (exclude,) if isinstance(exclude, (str, type)) else exclude
  try:
    entries = tuple(entries)
  except TypeError:
    raise TypeError(
      f"nnx_apply_policy: exclude must be a module type, a path glob, or a sequence of them, "
      f"got {type(exclude).__name__}."
    ) from None
  types, globs = [], []
  for entry in entries:
    if isinstance(entry, str):
      globs.append(entry)
    elif isinstance(entry, type) and issubclass(entry, nnx.Module):
      types.append(entry)
    else:
      what = entry.__name__ if isinstance(entry, type) else f"{type(entry).__name__} {entry!r}"
      raise TypeError(
        f"nnx_apply_policy: exclude entry {what} is neither an nnx.Module subclass (e.g. "
        "nnx.LayerNorm) nor a path glob (e.g. 'head' or '*/norm*')."
      )
  return tuple(types), tuple(globs)


def _swap(module: Any, attr: str, new: Callable[..., Any] | None) -> None:
  """Sets ``module.<attr>`` to ``new``, or back to Flax's default for ``None``.

  Only a Flax default or a function built here is replaced: a user's own
  choice (an fp8 ``dot_general``, a ``dot_general_cls``) stays.
  """
  if attr == "dot_general" and getattr(module, "dot_general_cls", None) is not None:
    return
  current = getattr(module, attr)
  if any(current is f for f in (*_FLAX_DEFAULTS[attr], *_BUILT)):
    setattr(module, attr, new if new is not None else _FLAX_DEFAULTS[attr][-1])


def nnx_apply_policy(
  module: nnx.Module,
  policy: Policy | str | Any = "mixed_bf16",
  *,
  exclude: type | str | Sequence[type | str] = (),
) -> nnx.Module:
  """Applies a precision policy to an NNX module and its submodules, in place.

  Every submodule that has a ``dtype`` gets the compute dtype (for norm layers
  that is their output dtype; their statistics stay f32), every ``nnx.Param``
  is cast to the param dtype, and ``nnx.BatchStat`` running statistics are
  left as they are (f32). For a mixed policy (f32 params, f16/bf16 compute),
  GEMM layers get f32 accumulation forward and backward: ``nnx.Linear`` and
  ``nnx.LinearGeneral`` a ``dot_general``, ``nnx.Einsum`` an ``einsum_op``,
  ``nnx.Conv`` a ``conv_general_dilated``. With any f16/bf16 compute,
  ``nnx.BatchNorm`` normalizes with its f32 running statistics instead of
  compute-dtype copies (as linen's does). Functions the
  user set (an fp8 ``dot_general``, a ``dot_general_cls``) are kept. Applying
  another policy later replaces what this one set (``"fp32"`` restores Flax's
  ``lax`` functions).

  The module's output is in the compute dtype unless its last layer is
  excluded: compute the loss from ``logits.astype(jnp.float32)``.

  Args:
    module: the NNX module; changed in place.
    policy: anything :func:`mpjax.get_policy` reads.
    exclude: submodules that stay as they are, with everything under them:
      module types (``nnx.LayerNorm``, matched with ``isinstance``) and/or
      globs matched with ``fnmatch`` against the ``/``-joined attribute path
      (``"head"``, ``"blocks/*/norm*"``; the root's path is ``""``).

  Returns:
    ``module`` itself.

  Raises:
    TypeError: if ``module`` is not an ``nnx.Module`` or an ``exclude`` entry is
      neither an ``nnx.Module`` subclass nor a string.
    ValueError: if the policy cannot be read or a glob matches no submodule path.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mpjax.flax_policy import nnx_apply_policy
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.body = nnx.Linear(4, 8, rngs=rngs)
    ...     self.head = nnx.Linear(8, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.head(nnx.relu(self.body(x)))
    >>> net = nnx_apply_policy(Net(nnx.Rngs(0)), "mixed_bf16", exclude="head")
    >>> net.body.dtype, net.body.kernel.dtype, net.head.dtype
    (dtype(bfloat16), dtype('float32'), None)
    >>> net(jnp.ones((1, 4))).dtype  # the f32 head promotes its bf16 input
    dtype('float32')
  """
  if not isinstance(module, nnx.Module):
    raise TypeError(
      f"nnx_apply_policy: module must be an nnx.Module, got {type(module).__name__}; for "
      "linen modules pass mpjax.flax_policy.linen_kwargs(policy) to their constructors."
    )
  policy = get_policy(policy)
  types, globs = _check_exclude(exclude)
  modules = {path: m for path, m in nnx.iter_modules(module)}
  names = [_path(p) for p in modules]
  for glob in globs:
    if not any(fnmatch.fnmatchcase(name, glob) for name in names):
      shown = ", ".join(repr(n) for n in sorted(names)[:12])
      nearest = difflib.get_close_matches(glob, names, n=1, cutoff=0.0)
      raise ValueError(
        f"nnx_apply_policy: exclude glob {glob!r} matches no submodule path of "
        f"{type(module).__name__} (did you mean {nearest[0]!r}?); its paths are {shown}."
      )
  excluded = {
    p
    for p, m in modules.items()
    if isinstance(m, types) or any(fnmatch.fnmatchcase(_path(p), g) for g in globs)
  }

  def kept(path: tuple) -> bool:  # the path is an excluded module or lies under one
    return any(path[:i] in excluded for i in range(len(path) + 1))

  compute, param = np.dtype(policy.compute_dtype), np.dtype(policy.param_dtype)
  mixed = policy.is_mixed
  half = jnp.finfo(compute).bits < 32
  for path, m in modules.items():
    if kept(path):
      continue
    attrs = vars(m)
    if "dtype" in attrs:
      m.dtype = compute
    if "param_dtype" in attrs:
      m.param_dtype = param
    if "dot_general" in attrs:
      _swap(m, "dot_general", _dot_general(compute) if mixed else None)
    if "conv_general_dilated" in attrs:
      _swap(m, "conv_general_dilated", _conv_general_dilated(compute) if mixed else None)
    if "einsum_op" in attrs:
      _swap(m, "einsum_op", _einsum_op(compute) if mixed else None)
    if isinstance(m, nnx.BatchNorm):
      if half and m.promote_dtype is nnx_dtypes.promote_dtype:
        m.promote_dtype = _keep_stats_promote
      elif not half and m.promote_dtype is _keep_stats_promote:
        m.promote_dtype = nnx_dtypes.promote_dtype

  for path, node in nnx.iter_graph(module):
    if not isinstance(node, nnx.Param):
      continue
    owner = max((p for p in modules if path[: len(p)] == p), key=len)
    if kept(owner):
      continue
    value = node.get_value()
    if is_castable_dtype(getattr(value, "dtype", None)) and value.dtype != param:
      node.set_value(value.astype(param))
  return module
