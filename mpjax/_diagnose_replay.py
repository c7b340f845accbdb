"""The eager replay behind :mod:`mpjax.diagnose`: a program run operation by operation.

:func:`replay_program` traces the program :func:`mpjax.autocast` makes of a
function (or its scaled gradient, as :func:`mpjax.make_train_step` runs it)
and :class:`Replay` runs that jaxpr eagerly, one operation at a time, entering
calls, ``remat``, ``custom_jvp`` and ``custom_vjp`` functions, the branch a
``cond`` takes and each iteration of a ``scan`` or ``while`` loop, recording
each operation's result (and, where asked, the same operation in f32 on the
same inputs: its shadow). What it runs without seeing its operations, it lists.
Internal: its names are not mpjax's API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from mpjax.autocast import autocast, is_array, with_arrays
from mpjax.jax_compat import scan_layout

__all__ = ["MAX_REPLAYED", "Replay", "ReplayedOp", "replay_program"]


@dataclasses.dataclass(frozen=True)
class ReplayedOp:
  """One operation of a replay: where, what, and how its result compares with f32."""

  index: int
  path: str
  primitive: str
  source: str | None  # the primitive that made its first input
  dtype: str
  inputs_finite: bool
  finite: bool
  shadow: tuple[np.ndarray, ...] | None  # the result in f32 from the same inputs
  values: tuple[np.ndarray, ...]  # the result (kept only when every shadow is computed)
  iteration: tuple[int, ...] = ()  # the iteration of each enclosing loop, outermost first
  why: str = ""  # when asked for and None: why the shadow could not be computed


# Operations that only move or lay out a value: its maker is what made their input.
_MOVES = frozenset(
  "optimization_barrier reshape transpose copy copy_p squeeze expand_dims broadcast_in_dim".split()
)
# Higher-order primitives whose body the replay runs in their place, and the parameter holding it.
_CALLS = {
  "jit": "jaxpr",
  "pjit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "eval_jaxpr": "call_jaxpr",  # jax >= 0.11's closed_call
  "remat2": "jaxpr",
  "checkpoint": "jaxpr",
  "custom_jvp_call": "call_jaxpr",
  "custom_vjp_call": "call_jaxpr",
  "custom_vjp_call_jaxpr": "fun_jaxpr",
}
# Primitives whose jaxpr parameter only combines two scalars (scatter-add's add, a reducer).
_COMBINING = ("scatter", "reduce", "select_and_", "argmin", "argmax")
# Operations replayed one by one at most (each counts once, a loop's condition included); a
# loop's iterations reached after that many run compiled, unchecked.
MAX_REPLAYED = 200_000


def _floating(x: Any) -> bool:
  """A concrete floating array (a JAX array, or a literal's numpy value)."""
  return (
    isinstance(x, jax.Array | np.ndarray | np.generic)
    and not isinstance(x, jax.core.Tracer)
    and jnp.issubdtype(x.dtype, jnp.floating)
  )


def _f32_params(params: Mapping[str, Any]) -> dict[str, Any]:
  """An equation's params with every half-precision result dtype made f32."""
  out = dict(params)
  for key in ("new_dtype", "preferred_element_type"):
    dtype = out.get(key)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4:
      out[key] = np.dtype(np.float32)
  return out


def _has_body(eqn: Any) -> bool:
  """Whether the equation runs a program of its own (a call, loop, branch, shard_map...)."""
  if eqn.primitive.name.startswith(_COMBINING):
    return False
  for value in eqn.params.values():
    for v in value if isinstance(value, tuple | list) else (value,):
      if isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr):
        return True
  return False


def _parts(sub: Any) -> tuple[Any, Sequence[Any]]:
  """An open jaxpr and its consts, from a closed or an open one."""
  return (sub.jaxpr, sub.consts) if isinstance(sub, jcore.ClosedJaxpr) else (sub, ())


def _bind(eqn: Any, invals: Sequence[Any], params: Mapping[str, Any] | None = None) -> list[Any]:
  params = eqn.primitive.get_bind_params(dict(eqn.params if params is None else params))
  outs = eqn.primitive.bind(*invals, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _in_f32(eqn: Any, invals: list[Any]) -> tuple[np.ndarray, ...] | str:
  """The equation's floating results computed in f32 from its inputs, or why they cannot be."""
  if _has_body(eqn):
    return "its body is typed for the dtypes it was traced with"
  ins = [x.astype(jnp.float32) if _floating(x) else x for x in invals]
  try:
    outs = _bind(eqn, ins, _f32_params(eqn.params))
  except Exception as e:  # noqa: BLE001 - whatever the reason, f32 cannot compute it
    return f"it refuses f32 operands ({type(e).__name__})"
  floats = [o for o in outs if _floating(o)]
  half = next((o.dtype for o in floats if np.dtype(o.dtype).itemsize < 4), None)
  if half is not None:  # a callback's declared result, for instance
    return f"its result stays {np.dtype(half).name} whatever its operands"
  return tuple(np.asarray(o, np.float32) for o in floats)


class _FirstFound(Exception):
  """Ends a replay at its first non-finite operation: nothing after it is needed."""


class Replay:
  """Runs a jaxpr eagerly, operation by operation, entering calls, branches and loops.

  Each operation with a floating result is recorded in ``ops`` (with its f32
  shadow for the first non-finite one, or for all with ``shadow_all``); what
  runs without its operations being seen (a body it does not enter, a loop's
  iterations beyond ``max_replayed`` operations) goes in ``unchecked``, as
  ``(path, primitive, iteration, why)``.
  """

  def __init__(self, shadow_all: bool, stop_at_first: bool, max_replayed: int) -> None:
    self.shadow_all = shadow_all
    self.max_replayed = max_replayed
    self.stop_at_first = stop_at_first
    self.ops: list[ReplayedOp] = []
    self.unchecked: list[tuple[str, str, tuple[int, ...], str]] = []
    self.made_by: dict[Any, str | None] = {}  # what made a value, seen through moves and calls
    self.iteration: list[int] = []  # the iteration of each loop being replayed
    self.replayed = 0
    self.first_found = False

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: str) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
      if isinstance(v, jcore.Literal):
        return np.asarray(v.val, v.aval.dtype) if hasattr(v.aval, "dtype") else v.val
      return env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      path = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
      outs = self.equation(eqn, invals, path)
      for v, x in zip(eqn.outvars, outs, strict=True):
        if not isinstance(v, jcore.DropVar):
          env[v] = x
    return [read(v) for v in jaxpr.outvars]

  def equation(self, eqn: Any, invals: list[Any], path: str) -> list[Any]:
    """One equation: its body run in its place (each operation recorded), or the operation."""
    name, p = eqn.primitive.name, eqn.params
    if name in _CALLS and p.get(_CALLS[name]) is not None:
      return self.call(eqn, p[_CALLS[name]], invals, eqn.invars, path)
    if name == "cond":
      branch = p["branches"][int(invals[0])]
      return self.call(eqn, branch, invals[1:], eqn.invars[1:], path)
    if name == "while":
      return self.while_loop(eqn, invals, path)
    if name == "scan" and p["length"] > 0:
      return self.scan(eqn, invals, path)
    self.replayed += 1
    outs = _bind(eqn, invals)
    # A shard_map, a custom linear solve...: its operations are not seen (a scan of length 0
    # runs none).
    if _has_body(eqn) and not (name == "scan" and p["length"] == 0):
      self.unchecked.append((path, name, tuple(self.iteration), "its body was not replayed"))
    self.probe(eqn, path, invals, outs)
    return outs

  def call(
    self, eqn: Any, sub: Any, invals: list[Any], outer: Sequence[Any], path: str
  ) -> list[Any]:
    """A body run in place of its equation; what made its values carries in and out."""
    jaxpr, consts = _parts(sub)
    self.carry_sources(jaxpr.invars, outer)
    outs = self.run(jaxpr, consts, invals, path)
    self.carry_sources(eqn.outvars, jaxpr.outvars)
    return outs

  def carry_sources(self, to: Sequence[Any], frm: Sequence[Any]) -> None:
    for t, f in zip(to, frm, strict=True):
      if not isinstance(f, jcore.Literal):
        self.made_by[t] = self.made_by.get(f)

  def compiled(self, eqn: Any, path: str, where: str) -> None:
    """Notes that a loop's remaining iterations run compiled: their operations are not seen."""
    why = (
      f"its iterations from {where} on ran compiled (after {self.replayed} operations replayed "
      f"one by one, max_replayed={self.max_replayed})"
    )
    self.unchecked.append((path, eqn.primitive.name, tuple(self.iteration[:-1]), why))

  def while_loop(self, eqn: Any, invals: list[Any], path: str) -> list[Any]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    (cond, cc), (body, bc) = _parts(p["cond_jaxpr"]), _parts(p["body_jaxpr"])
    self.carry_sources(body.invars, eqn.invars[cn:])
    self.iteration.append(0)
    try:
      while True:
        if not bool(self.run(cond, cc, [*cconsts, *carry], path)[0]):
          return carry
        if self.replayed >= self.max_replayed:  # the rest runs compiled (the condition again)
          break
        carry = self.run(body, bc, [*bconsts, *carry], path)
        self.iteration[-1] += 1
      self.compiled(eqn, path, f"iteration {self.iteration[-1]}")
    finally:
      self.iteration.pop()
    outs = _bind(eqn, [*cconsts, *bconsts, *carry])
    self.probe(eqn, path, invals, outs)
    return outs

  def scan(self, eqn: Any, invals: list[Any], path: str) -> list[Any]:
    p = eqn.params
    (nc, ncarry), length = scan_layout(p), p["length"]
    body, body_consts = _parts(p["jaxpr"])
    consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    self.carry_sources(body.invars, eqn.invars)
    compiled = None
    ys: list[Any] = [None] * length
    self.iteration.append(0)
    try:
      for t in range(length):
        i = length - 1 - t if p["reverse"] else t
        self.iteration[-1] = i  # the index into the scanned axis (a layer, in a layer stack)
        args = [*consts, *carry, *(x[i] for x in xs)]
        if compiled is None and self.replayed >= self.max_replayed:
          compiled = jax.jit(jcore.jaxpr_as_fun(p["jaxpr"]))
          self.compiled(eqn, path, f"index {i}")
        out = self.run(body, body_consts, args, path) if compiled is None else compiled(*args)
        carry, ys[i] = list(out[:ncarry]), list(out[ncarry:])
    finally:
      self.iteration.pop()
    outs = [*carry, *(jnp.stack([y[k] for y in ys]) for k in range(len(ys[0])))]
    if compiled is not None:
      self.probe(eqn, path, invals, outs)
    return outs

  def probe(self, eqn: Any, path: str, invals: list[Any], outs: list[Any]) -> None:
    """Records the operation's result and, for the first non-finite one (or all), its shadow."""
    name = eqn.primitive.name
    source = next(
      (self.made_by.get(v) for v in eqn.invars if not isinstance(v, jcore.Literal)), None
    )
    # What made a value, seen through the ops that only move it.
    self.made_by.update({v: source if name in _MOVES and source else name for v in eqn.outvars})
    values = tuple(np.asarray(o, np.float32) for o in outs if _floating(o))
    if not values:
      return
    floats = [np.asarray(x, np.float32) for x in invals if _floating(x)]
    inputs_finite = all(np.isfinite(x).all() for x in floats)
    finite = all(np.isfinite(v).all() for v in values)
    first = inputs_finite and not finite and not self.first_found
    self.first_found = self.first_found or first
    shadow = _in_f32(eqn, invals) if (self.shadow_all or first) else None
    why = shadow if isinstance(shadow, str) else ""
    shadow = None if isinstance(shadow, str) else shadow
    dtype = next(str(o.dtype) for o in outs if _floating(o))
    kept = values if self.shadow_all else ()
    op = ReplayedOp(len(self.ops), path, name, source, dtype, inputs_finite, finite, shadow, kept)
    self.ops.append(dataclasses.replace(op, iteration=tuple(self.iteration), why=why))
    if first and self.stop_at_first:
      raise _FirstFound


def replay_program(
  fn: Callable[..., Any],
  args: tuple,
  kwargs: dict,
  policy: Any,
  rules: Any,
  loss_scale: float | None,
  shadow_all: bool,
  *,
  stop_at_first: bool = False,
  max_replayed: int = MAX_REPLAYED,
) -> tuple[Replay, Any]:
  """Every operation of the program ``fn`` makes under ``policy``, run eagerly in order.

  The program is ``autocast(fn)`` as :func:`mpjax.make_train_step` makes it
  on this backend (on a CPU under remat, with JAX's default softmax; on a GPU
  or TPU without, with the custom-JVP one), or with ``loss_scale`` the
  gradient of its loss times the scale, as the step differentiates it. Each
  operation's result is checked; its f32 shadow (the same operation on the
  same inputs in f32) is computed for the first non-finite one, and for all
  with ``shadow_all``. With ``stop_at_first`` the replay ends there (the
  outputs are then ``None``).

  Args:
    fn: the function (a loss, with ``loss_scale``).
    args: its positional arguments (concrete: it runs).
    kwargs: its keyword arguments.
    policy: the policy :func:`mpjax.autocast` runs it under.
    rules: autocast rules, or ``None``.
    loss_scale: replay the gradient of the loss times this scale; ``None``:
      ``fn`` itself.
    shadow_all: compute every operation's f32 shadow (and keep its result),
      not only the first non-finite one's.
    stop_at_first: end the replay at the first non-finite operation.
    max_replayed: how many operations to replay one by one; a loop's
      iterations reached after that many run compiled, and are listed in
      ``Replay.unchecked``.

  Returns:
    The :class:`Replay` (its ``ops`` and ``unchecked``) and the program's
    outputs (``None`` when it stopped at the first non-finite operation).
  """
  program = autocast(fn, policy, rules=rules)
  if loss_scale is not None:
    scaled = program
    program = jax.value_and_grad(lambda *a, **k: scaled(*a, **k) * loss_scale)
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
  arrays = [jnp.asarray(leaves[i]) for i in dynamic]
  closed = jax.make_jaxpr(with_arrays(program, leaves, treedef, dynamic))(*arrays)
  replay = Replay(shadow_all, stop_at_first, max_replayed)
  try:
    outs = replay.run(closed.jaxpr, closed.consts, arrays, "")
  except _FirstFound:
    outs = None
  return replay, outs
