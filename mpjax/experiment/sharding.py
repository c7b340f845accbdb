"""Where an experiment's arrays go on its mesh: batches over every device, params over ``fsdp``.

An experiment's mesh has two axes, ``("data", "fsdp")`` (``config.mesh``). A batch is split over
both together, so each device trains on ``batch_size / devices`` examples. The parameters are
split over ``fsdp`` (fully sharded data parallelism, as nanodo and MaxText shard them): each on
its largest dimension that the ``fsdp`` size divides (the first such dimension on a tie),
replicated when none does. A model whose parameters carry Flax partitioning metadata
(``nn.with_partitioning``, ``nn.Partitioned``) is placed as its names say instead: a name of a
mesh axis shards that dimension over it, any other name (or an axis of size 1) leaves it whole,
and a parameter without metadata is replicated, as ``flax.linen.get_partition_spec`` reads it.
:class:`mpjax.TrainState` then places the rest of the state on the same mesh (Adam's moments
like their params) and every train step keeps that layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax.layout import fsdp_spec, like_params, normalized_sharding
from mpjax.train_state import TrainState

__all__ = [
  "BATCH_SPEC",
  "MESH_AXES",
  "abstract_state",
  "param_specs",
  "put_on_mesh",
]

# The axes of an experiment's mesh, outer to inner (fsdp's gathers stay within a host or node).
MESH_AXES = ("data", "fsdp")
# A batch's leading dimension, over every device of the mesh.
BATCH_SPEC = P(MESH_AXES)


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.Partitioned)


def _named_spec(box: nn.Partitioned, axis_sizes: Mapping[str, int], where: str) -> P:
  """A box's names as a spec over a mesh of ``axis_sizes``: other names (and size-1 axes) None."""
  shape = np.shape(box.value)
  spec = []
  for dim, names in enumerate(box.names):
    names = names if isinstance(names, tuple) else (names,)
    kept = tuple(n for n in names if n is not None and axis_sizes.get(n, 1) > 1)
    size = int(np.prod([axis_sizes[n] for n in kept]))
    if shape[dim] % size:
      raise ValueError(
        f"parameter {where} of shape {shape} is partitioned as {tuple(box.names)}, but its "
        f"dimension {dim} ({shape[dim]}) is not divisible by {' x '.join(kept)} = {size} "
        "devices; change the mesh sizes or the model's partitioning names."
      )
    spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def param_specs(params: Any, axis_sizes: Mapping[str, int]) -> Any:
  """Where each parameter goes on a mesh of ``axis_sizes``: by its metadata, else by FSDP.

  Args:
    params: the parameters (arrays or ``jax.ShapeDtypeStruct`` s, e.g. from
      ``jax.eval_shape(model.init, ...)``), Flax ``nn.Partitioned`` boxes
      allowed.
    axis_sizes: mesh axis name -> size, e.g. ``{"data": 1, "fsdp": 8}``.

  Returns:
    A tree of ``PartitionSpec`` s of the unboxed params' structure (trailing
    ``None`` s left out). With any box in ``params``, boxes follow their names
    and the other leaves are replicated; without, each leaf is sharded by
    :func:`mpjax.layout.fsdp_spec`.

  Raises:
    ValueError: for a partitioned dimension that its mesh axes do not divide.

  Example:
    >>> import jax.numpy as jnp
    >>> from mpjax.experiment.sharding import param_specs
    >>> specs = param_specs({"w": jnp.ones((16, 64)), "b": jnp.ones(5)}, {"data": 1, "fsdp": 8})
    >>> tuple(specs["w"]), tuple(specs["b"])
    ((None, 'fsdp'), ())
  """
  boxed = any(_is_box(x) for x in jax.tree.leaves(params, is_leaf=_is_box))
  fsdp = axis_sizes.get("fsdp", 1)

  def spec(path: tuple, x: Any) -> P:
    if _is_box(x):
      return _named_spec(x, axis_sizes, jax.tree_util.keystr(path))
    return P() if boxed else fsdp_spec(np.shape(x), fsdp)

  return jax.tree_util.tree_map_with_path(spec, params, is_leaf=_is_box)


def put_on_mesh(tree: Any, mesh: Mesh, specs: Any = None) -> Any:
  """Host values (the same in every process) as arrays placed on ``mesh``.

  Each process makes the shards of its own devices (``jax.make_array_from_callback``), so this
  works the same in one process and in each process of a multi-process run.

  Args:
    tree: arrays or NumPy values, every process holding the same.
    mesh: the mesh to place them on.
    specs: a tree of ``PartitionSpec`` s of ``tree``'s structure; ``None`` replicates.

  Returns:
    ``tree`` as ``jax.Array`` s with normalized ``NamedSharding`` s (see
    :func:`mpjax.layout.normalized_sharding`).
  """
  if specs is None:
    specs = jax.tree.map(lambda _: P(), tree)

  def put(x: Any, spec: P) -> jax.Array:
    x = np.asarray(x)  # a device value read to the host (no jax.device_get: a batch is host data)
    sharding = normalized_sharding(NamedSharding(mesh, spec))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(put, tree, specs)


def abstract_state(state: TrainState, mesh: Mesh, specs: Any) -> TrainState:
  """``state`` as ``jax.ShapeDtypeStruct`` s on ``mesh``, placed as a run places it, layout kept.

  The params go as ``specs`` says; as :meth:`mpjax.TrainState.create` places a state, a leaf of
  a param's path and shape (Adam's ``mu`` and ``nu``) goes like that param, and every other
  leaf is replicated. For compiling a run's sharded step for a mesh this machine does not have
  (:func:`mpjax.compile_for` over :func:`mpjax.target_mesh`).

  Args:
    state: a train state (its values are not read).
    mesh: the mesh, e.g. a :func:`mpjax.target_mesh`.
    specs: a tree of ``PartitionSpec`` s of ``state.params``' structure.

  Returns:
    The abstract state, with :meth:`~mpjax.TrainState.keep_layout` applied so a step compiled
    on it keeps each leaf where it is.
  """
  param_shardings = jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda s: isinstance(s, P)
  )
  shardings = like_params(state, state.params, param_shardings, mesh)

  def one(x: Any, sharding: Any) -> Any:
    return jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False)
    )

  return jax.tree.map(one, state, shardings).keep_layout()
