"""Where a sharded train state lives: its layout, kept by every step, and shards cast in place.

Under ``jax.jit`` with ``NamedSharding`` s (FSDP, tensor parallel, meshes of
several axes) XLA's sharding propagation decides where a step's outputs go,
and a replicated LayerNorm scale can come back sharded over the batch axis:
the next call then compiles again. The step cannot see its inputs' shardings
while it traces (in ``Auto`` mesh axes, the default), so the state records them
(:attr:`mpjax.TrainState.layout`) and the step puts each new leaf back
(:func:`constrain_to_layout`). The same record lets the step cast each sharded
parameter to the policy's gather dtype on its own shard, before anything
gathers it (:func:`cast_shards`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from mpjax._backend import lowering_platform, platform_kind
from mpjax._dtypes import is_floating

__all__ = [
  "cast_shards",
  "constrain_to_layout",
  "fsdp_spec",
  "like_params",
  "layout_of",
  "mesh_in_context",
  "mesh_of",
  "normalized_sharding",
  "splits_a_leaf",
]


def normalized_sharding(sharding: Any) -> Any:
  """A ``NamedSharding`` as a jitted step returns it: its spec without trailing ``None`` s.

  ``P("fsdp", None)`` and ``P("fsdp")`` place an array alike but are not equal, and ``jit``
  compiles anew for an argument whose sharding is not equal to the last call's.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> from mpjax.layout import normalized_sharding
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    >>> tuple(normalized_sharding(NamedSharding(mesh, P("fsdp", None))).spec)
    ('fsdp',)
  """
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def mesh_of(tree: Any) -> jax.sharding.Mesh | None:
  """The one mesh of more than one device that ``tree``'s leaves are placed on, if there is one."""
  meshes = {
    x.sharding.mesh
    for x in jax.tree.leaves(tree)
    if isinstance(getattr(x, "sharding", None), NamedSharding)
  }
  if len(meshes) != 1:
    return None
  mesh = meshes.pop()
  return mesh if mesh.size > 1 else None


def mesh_in_context(layout: tuple[Any, ...] | None) -> contextlib.AbstractContextManager[Any]:
  """The context to trace a sharded state's model in: its mesh's abstract mesh.

  Code that asks JAX for the mesh (``jax.sharding.get_abstract_mesh()``,
  ``with_sharding_constraint`` with a bare ``PartitionSpec``) finds the one
  the state is on, as it would under ``jax.set_mesh``. Nothing is entered for
  a layout on one device, or where a mesh is in context already.

  Example:
    >>> from mpjax.layout import mesh_in_context
    >>> with mesh_in_context(None):  # a state on one device: nothing is entered
    ...   jax.sharding.get_abstract_mesh().empty
    True
  """
  meshes = {s.mesh for s in layout or () if isinstance(s, NamedSharding) and s.mesh.size > 1}
  if len(meshes) != 1 or not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(meshes.pop().abstract_mesh)


def layout_of(tree: Any) -> tuple[jax.sharding.Sharding, ...] | None:
  """The (normalized) sharding of every leaf of ``tree``, or ``None`` if all are on one device.

  Arrays and ``jax.ShapeDtypeStruct`` s placed with a sharding both have one; a leaf without
  any (a host value) makes the layout ``None``.
  """
  leaves = jax.tree.leaves(tree)
  shardings = tuple(normalized_sharding(getattr(x, "sharding", None)) for x in leaves)
  if any(s is None for s in shardings) or all(len(s.device_set) == 1 for s in shardings):
    return None
  return shardings


def _applies(layout: tuple[Any, ...] | None, leaves: list[Any]) -> bool:
  """Whether ``layout`` is of these leaves and of the devices XLA is lowering for.

  A CPU state's layout does not apply when :func:`mpjax.compile_for` lowers its step for a GPU
  target, nor a layout of another tree (the FP8 state made by the first step).
  """
  if layout is None or len(layout) != len(leaves):
    return False
  platforms = {platform_kind(d.platform) for s in layout for d in s.device_set}
  if platforms != {lowering_platform(leaves)}:
    return False
  # Where the traced leaves say their mesh (lowered from placed abstract values), it must be
  # the layout's: a state recorded over 8 devices, lowered for one, keeps XLA's placement.
  for x, sharding in zip(leaves, layout, strict=True):
    traced = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    names = getattr(traced, "axis_names", ())
    if names and isinstance(sharding, NamedSharding):
      if dict(zip(names, traced.axis_sizes, strict=True)) != dict(sharding.mesh.shape):
        return False
  return True


def splits_a_leaf(tree: Any, layout: tuple[Any, ...] | None) -> bool:
  """Whether ``layout`` applies to ``tree`` (traced) and splits some leaf of it over devices.

  A step whose gradients are split so must not reduce them through one whole array (a
  concatenation of every gradient): XLA would gather each whole onto every device.
  """
  leaves = jax.tree.leaves(tree)
  return _applies(layout, leaves) and any(
    any(axis is not None for axis in getattr(s, "spec", ())) for s in layout
  )


def constrain_to_layout(tree: Any, layout: tuple[Any, ...] | None) -> Any:
  """``tree`` (traced) with each leaf placed as ``layout`` says, where the layout applies."""
  leaves, treedef = jax.tree.flatten(tree)
  if not _applies(layout, leaves):
    return tree
  return treedef.unflatten(
    [lax.with_sharding_constraint(x, s) for x, s in zip(leaves, layout, strict=True)]
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_on_shard(x: jax.Array, sharding: Any, dtype: Any) -> jax.Array:
  return lax.with_sharding_constraint(x.astype(dtype), sharding)


def _cast_on_shard_fwd(x, sharding, dtype):
  return _cast_on_shard(x, sharding, dtype), jnp.zeros((0,), x.dtype)


def _cast_on_shard_bwd(sharding, dtype, like, g):
  # The gradient summed onto the shard in the gathered dtype, as the GEMMs wrote it; the barrier
  # keeps XLA from widening it before the reduce-scatter (it would, to give the f32 master its
  # gradient: twice the bytes).
  g = lax.with_sharding_constraint(g.astype(dtype), sharding)
  return (lax.optimization_barrier(g).astype(like.dtype),)


_cast_on_shard.defvjp(_cast_on_shard_fwd, _cast_on_shard_bwd)


def cast_shards(params: Any, layout: tuple[Any, ...] | None, dtype: Any) -> Any:
  """Each sharded floating leaf of ``params`` cast to ``dtype`` on its own shard.

  The cast is pinned to the leaf's sharding, so whatever gathers the parameter (XLA's
  all-gather for a GEMM over another axis) moves ``dtype``: XLA may otherwise gather the f32
  shard and convert after (jax#23543). Its gradient is summed onto the shard in ``dtype``, then
  widened to the leaf's own dtype. Replicated leaves and a layout that does not apply (see
  :func:`constrain_to_layout`) stay as they are.
  """
  leaves, treedef = jax.tree.flatten(params)
  if not _applies(layout, leaves):
    return params

  def cast(x: Any, sharding: Any) -> Any:
    replicated = all(axis is None for axis in getattr(sharding, "spec", ()))
    if replicated or not is_floating(x) or x.dtype == dtype:
      return x
    return _cast_on_shard(x, sharding, dtype)

  return treedef.unflatten([cast(x, s) for x, s in zip(leaves, layout, strict=True)])


def fsdp_spec(shape: tuple[int, ...], size: int, axis: str = "fsdp") -> PartitionSpec:
  """The FSDP sharding of an array: its largest dimension that ``size`` divides, over ``axis``.

  The rule nanodo and MaxText use for params without annotations; the first of equal
  dimensions wins, and an array no dimension of which ``size`` divides (a scalar, a bias of
  odd width) is replicated.

  Example:
    >>> from mpjax.layout import fsdp_spec
    >>> [tuple(fsdp_spec(s, n)) for s, n in [((768, 3072), 8), ((50304, 768), 16), ((3,), 8)]]
    [(None, 'fsdp'), ('fsdp',), ()]
  """
  dims = [d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size]
  if size <= 1 or not dims:
    return PartitionSpec()
  best = max(dims, key=lambda d: (shape[d], -d))
  return PartitionSpec(*([None] * best), axis)


def like_params(tree: Any, params: Any, param_shardings: Any, mesh: jax.sharding.Mesh) -> Any:
  """A sharding for every leaf of ``tree`` (a train state): where its params go, the rest with them.

  A leaf whose path ends with a param's path and has its shape (the param itself, Adam's ``mu``
  and ``nu``, a Kahan buffer) is sharded like that param; every other leaf (scalars, keys, FP8
  histories) is replicated on ``mesh``. All normalized (see :func:`normalized_sharding`).

  Args:
    tree: the tree to place, e.g. a :class:`mpjax.TrainState` (values not read).
    params: the params inside it (``tree.params``).
    param_shardings: a sharding per leaf of ``params``, of its structure.
    mesh: the mesh the rest is replicated on.
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  by_path = {
    jax.tree_util.keystr(path): (tuple(np.shape(x)), sharding)
    for (path, x), sharding in zip(leaves, jax.tree.leaves(param_shardings), strict=True)
  }
  replicated = NamedSharding(mesh, PartitionSpec())

  def where(path: tuple, x: Any) -> Any:
    key = jax.tree_util.keystr(path)
    for suffix, (shape, sharding) in by_path.items():
      if key.endswith(suffix) and shape == tuple(np.shape(x)):
        return normalized_sharding(sharding)
    return replicated

  return jax.tree_util.tree_map_with_path(where, tree)
