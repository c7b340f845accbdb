"""When mixed precision goes wrong: the operation that overflows, gradient health, and the rules.

:func:`find_nonfinite` replays a function operation by operation twice, once
as :func:`mpjax.autocast` runs it under a policy and once in f32 (the *shadow*),
and names the first operation whose result is inf or NaN in the policy's
precision while its f32 shadow is finite: the module, the primitive, the pass,
and the autocast rule that moves that module to f32. :func:`suggest_rules`
adds such rules until the function's outputs (a loss and its gradients) are
finite and within a tolerance of f32. :func:`grad_health` measures, per
module, how much of a gradient is zero, would underflow or overflow a half
dtype, and how large it gets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util
from jax.extend import core as jcore

from mpjax.autocast import autocast, is_array, with_arrays
from mpjax.autocast_interpreter import INPUT, EvalContext, eval_closed
from mpjax.op_classes import module_of, parse_rules
from mpjax.policy import PRESETS, Policy

__all__ = ["NonFiniteReport", "find_nonfinite", "suggest_rules", "grad_health", "module_of"]

_F32_POLICY = PRESETS["fp32"]


def rule_for(module: str, primitive: str) -> dict[str, str]:
  """The autocast rules that run ``module`` and what is inside it (or, at the top level,
  every ``primitive``) in f32."""
  if not module:
    return {primitive: "fp32"}
  return {f"*{module}": "fp32", f"*{module}/*": "fp32"}


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
  """The first operation whose result is not finite in the policy's precision but is in f32.

  Attributes:
    module: the module path (the name stack without transformation wrappers,
      as autocast ``rules`` match it), e.g. ``"Model/attn"``; empty at the top
      level.
    path: the full name-stack path, e.g. ``"transpose(jvp(Model))/attn"``.
    primitive: the JAX primitive, e.g. ``"dot_general"``.
    dtype: the dtype of its result under the policy, e.g. ``"float16"``.
    phase: ``"forward"`` or ``"backward"`` (an operation of the gradient).
    shadow_max: the largest magnitude of the same operation's result computed
      in f32 from the same inputs.
    dtype_max: the largest finite value of ``dtype``.
    rule: autocast ``rules`` that run the module in f32, e.g.
      ``{"*Model/attn": "fp32", "*Model/attn/*": "fp32"}`` (pass them as
      ``make_train_step(..., autocast_rules=...)`` or
      ``config.autocast_rules``).
    index: the operation's position in the replay (program order).
    policy: the policy it was replayed under.
  """

  module: str
  path: str
  primitive: str
  dtype: str
  phase: str
  shadow_max: float
  dtype_max: float
  rule: Mapping[str, str]
  index: int
  policy: str

  def __str__(self) -> str:
    where = f"module `{self.module}`" if self.module else "the top level"
    if self.module:
      effect = (
        "runs that module in f32 (mapping it to 'mixed_bf16' instead keeps it in half "
        "precision with f32's range)"
      )
    else:
      effect = (
        f"runs every `{next(iter(self.rule))}` in f32 (the operation is in no module: a "
        "jax.named_scope around it lets a rule name it alone)"
      )
    return (
      f"The first value that is not finite under {self.policy} comes from `{self.primitive}` "
      f"in {where} ({self.phase} pass, operation {self.index}): its {self.dtype} result "
      f"overflows (largest finite {self.dtype_max:.6g}) where f32 computes it finite, up to "
      f"{self.shadow_max:.4g}.\nFix: autocast_rules={dict(self.rule)!r} {effect}."
    )


@dataclasses.dataclass(frozen=True)
class _Op:
  """One operation of a replay: where, what, and how its result compares with f32."""

  index: int
  path: str
  primitive: str
  source: str | None  # the primitive that made its first input
  dtype: str
  inputs_finite: bool
  finite: bool
  shadow: tuple[np.ndarray, ...] | None  # the result in f32 from the same inputs
  values: tuple[np.ndarray, ...]


# Operations that only move or lay out a value: its maker is what made their input.
_MOVES = frozenset(
  "optimization_barrier reshape transpose copy copy_p squeeze expand_dims broadcast_in_dim".split()
)


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


def _in_f32(eqn: Any, invals: list[Any]) -> tuple[np.ndarray, ...] | None:
  """The equation's floating results computed in f32 from its inputs (None: not recomputable)."""
  if any(isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr) for v in eqn.params.values()):
    return None  # a call, loop or branch: its body is typed for the dtypes it was traced with
  ins = [x.astype(jnp.float32) if _floating(x) else x for x in invals]
  try:
    params = eqn.primitive.get_bind_params(_f32_params(eqn.params))
    outs = eqn.primitive.bind(*ins, **params)
  except (TypeError, ValueError):
    return None
  outs = outs if eqn.primitive.multiple_results else [outs]
  return tuple(np.asarray(o, np.float32) for o in outs if _floating(o))


def _replay(
  fn: Callable[..., Any],
  args: tuple,
  kwargs: dict,
  policy: Any,
  rules: Any,
  loss_scale: float | None,
  shadow_all: bool,
) -> tuple[list[_Op], Any]:
  """Every operation of the program ``fn`` makes under ``policy``, run eagerly in order.

  The program is ``autocast(fn)`` (without remat, so that each operation
  runs here), or with ``loss_scale`` the gradient of its loss times the scale,
  as :func:`mpjax.make_train_step` runs it. Each operation's result is checked;
  its f32 shadow (the same operation on the same inputs in f32) is computed
  for the first non-finite one, and for all with ``shadow_all``.
  """
  program = autocast(fn, policy, rules=rules, remat=False)
  if loss_scale is not None:
    scaled = program
    program = jax.value_and_grad(lambda *a, **k: scaled(*a, **k) * loss_scale)
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
  arrays = [jnp.asarray(leaves[i]) for i in dynamic]
  closed = jax.make_jaxpr(with_arrays(program, leaves, treedef, dynamic))(*arrays)
  ops: list[_Op] = []
  first_found = False
  made_by: dict[Any, str] = {}

  def probe(eqn: Any, path: str, invals: list[Any], outs: list[Any]) -> None:
    nonlocal first_found
    name = eqn.primitive.name
    source = next((made_by.get(v) for v in eqn.invars if not isinstance(v, jcore.Literal)), None)
    # What made a value, seen through the ops that only move it.
    made_by.update({v: source if name in _MOVES and source else name for v in eqn.outvars})
    values = tuple(np.asarray(o, np.float32) for o in outs if _floating(o))
    if not values:
      return
    floats = [np.asarray(x, np.float32) for x in invals if _floating(x)]
    inputs_finite = all(np.isfinite(x).all() for x in floats)
    finite = all(np.isfinite(v).all() for v in values)
    first = inputs_finite and not finite and not first_found
    first_found = first_found or first
    shadow = _in_f32(eqn, invals) if (shadow_all or first) else None
    dtype = next(str(o.dtype) for o in outs if _floating(o))
    ops.append(_Op(len(ops), path, name, source, dtype, inputs_finite, finite, shadow, values))

  # The program runs as traced (an f32 policy changes no dtype), each operation on its own.
  ctx = EvalContext(_F32_POLICY, parse_rules(None), "full", remat=False, probe=probe)
  outs = eval_closed(ctx, closed, arrays, [INPUT] * len(arrays), "")
  return ops, outs


def _policy_name(policy: Any) -> str:
  """A preset's name where the policy is one, else its repr."""
  if isinstance(policy, str):
    return policy
  return next((name for name, preset in PRESETS.items() if preset == policy), str(policy))


def _report(op: _Op, policy: Any) -> NonFiniteReport | None:
  """The report of a first non-finite operation, if f32 computes it finite."""
  if op.shadow is None or not all(np.isfinite(v).all() for v in op.shadow):
    return None  # f32 overflows too, or the operation cannot be recomputed: not precision
  module = module_of(op.path)
  dtype = np.dtype(op.dtype)
  # Outside any module a rule can only name a primitive; a cast that overflows is fixed
  # by the one that made its input (a GEMM accumulated in f32, then cast down).
  culprit = op.source if op.primitive == "convert_element_type" and op.source else op.primitive
  return NonFiniteReport(
    module=module,
    path=op.path,
    primitive=op.primitive,
    dtype=dtype.name,
    phase="backward" if "transpose(" in op.path else "forward",
    shadow_max=max(float(np.abs(v).max()) if v.size else 0.0 for v in op.shadow),
    dtype_max=float(jnp.finfo(dtype).max),
    rule=rule_for(module, culprit),
    index=op.index,
    policy=_policy_name(policy),
  )


def _first_report(ops: list[_Op], policy: Any) -> NonFiniteReport | None:
  first = next((op for op in ops if op.inputs_finite and not op.finite), None)
  return None if first is None else _report(first, policy)


def find_nonfinite(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str = "mixed_fp16",
  rules: Mapping[str, str] | None = None,
  loss_scale: float | None = None,
  **kwargs: Any,
) -> NonFiniteReport | None:
  """The first operation of ``fn`` that overflows under ``policy`` but not in f32, or ``None``.

  The program :func:`mpjax.autocast` makes of ``fn`` (with ``rules``) runs
  eagerly, operation by operation, and each result is checked; the first that
  is inf or NaN while its inputs are finite is computed again in f32 from the
  same inputs (its *shadow*), and reported if that is finite. With
  ``loss_scale``, ``fn`` is a loss and the program is its gradient with
  respect to the first argument, of the loss times ``loss_scale``, exactly as
  :func:`mpjax.make_train_step` differentiates it: the backward pass runs in
  the dtypes it has there. Without, ``fn`` runs as given (pass
  ``jax.value_and_grad`` of a loss to check an f32 program's gradient under
  autocast). An overflow inside a ``scan``, ``while`` or ``cond`` body is not
  pinpointed.

  Args:
    fn: the function: a loss (with ``loss_scale``), or any function.
    *args: its arguments (concrete arrays: it runs).
    policy: the mixed policy to check.
    rules: autocast rules already in use.
    loss_scale: check the train step's gradient at this loss scale.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`NonFiniteReport` (``print`` it), or ``None`` when nothing
    overflows that f32 computes finite.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> def loss(w, x):
    ...   with jax.named_scope("blowup"):
    ...     h = (x @ w) * 1000.0
    ...   return jnp.mean(h * 1e-3)
    >>> w, x = jnp.full((4, 4), 30.0), jnp.full((2, 4), 1.0)
    >>> report = mpjax.find_nonfinite(loss, w, x, policy="mixed_fp16", loss_scale=2.0**15)
    >>> report.module, report.primitive, report.phase, report.rule["*blowup"]
    ('blowup', 'mul', 'forward', 'fp32')
  """
  ops, _ = _replay(fn, args, kwargs, policy, rules, loss_scale, shadow_all=False)
  return _first_report(ops, policy)


def _relative_error(low: Any, ref: Any) -> float:
  """The largest relative (Frobenius) error over the floating leaves, inf where not finite."""
  worst = 0.0
  for a, b in zip(jax.tree.leaves(low), jax.tree.leaves(ref), strict=True):
    if not jnp.issubdtype(jnp.asarray(b).dtype, jnp.floating):
      continue
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not a.size:
      continue
    if not np.isfinite(a).all():
      return math.inf
    norm = np.linalg.norm(b)
    worst = max(worst, float(np.linalg.norm(a - b) / norm) if norm else float(np.abs(a).max()))
  return worst


def _module_errors(ops: list[_Op]) -> dict[str, float]:
  """Per module, the largest error its operations add: their result against their f32 shadow."""
  errors: dict[str, float] = {}
  for op in ops:
    module = module_of(op.path)
    if not module or op.shadow is None or len(op.shadow) != len(op.values):
      continue
    error = _relative_error(op.values, op.shadow)
    errors[module] = max(errors.get(module, 0.0), error)
  return errors


def suggest_rules(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str = "mixed_fp16",
  tolerance: float = 1e-2,
  loss_scale: float | None = None,
  max_rules: int = 8,
  **kwargs: Any,
) -> dict[str, str]:
  """The autocast rules that make ``fn`` finite and within ``tolerance`` of f32 under ``policy``.

  Starting from no rules, it replays the program (see :func:`find_nonfinite`):
  while an operation overflows, it adds the rules that run that operation's
  module in f32; once every output is finite, while the outputs' largest
  relative error against the f32 program exceeds ``tolerance``, it adds the
  module whose operations add the largest error (each operation's result
  against the same operation in f32 on the same inputs). Deterministic for the
  same inputs; a greedy search, so "smallest" means: no rule is added that was
  not needed at the time. An overflow that a module's rule does not remove
  leaves ``{"*": "fp32"}``: the whole function in f32.

  Args:
    fn: as for :func:`find_nonfinite`: a loss with ``loss_scale`` (its value
      and gradients are held to ``tolerance``), or any function.
    *args: its arguments.
    policy: the mixed policy.
    tolerance: the largest relative error (Frobenius norm, per output leaf)
      accepted against f32.
    loss_scale: check the train step's gradient at this loss scale.
    max_rules: stop after this many modules.
    **kwargs: its keyword arguments.

  Returns:
    A rules dict for :func:`mpjax.autocast` / ``make_train_step(...,
    autocast_rules=...)``; empty when ``fn`` is fine as it is.

  Raises:
    ValueError: if ``tolerance`` is not positive.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> def loss(w, x):
    ...   with jax.named_scope("blowup"):
    ...     h = (x @ w) * 1000.0
    ...   return jnp.mean(h * 1e-3)
    >>> w, x = jnp.full((4, 4), 30.0), jnp.full((2, 4), 1.0)
    >>> mpjax.suggest_rules(loss, w, x, loss_scale=2.0**15)
    {'*blowup': 'fp32', '*blowup/*': 'fp32'}
  """
  if not tolerance > 0:
    raise ValueError(f"suggest_rules: tolerance={tolerance!r} must be positive, e.g. 1e-2.")
  _, reference = _replay(fn, args, kwargs, _F32_POLICY, None, loss_scale, shadow_all=False)
  rules: dict[str, str] = {}
  modules = 0
  while modules < max_rules:
    ops, outs = _replay(fn, args, kwargs, policy, rules, loss_scale, shadow_all=False)
    report = _first_report(ops, policy)
    if report is not None:
      new = dict(report.rule)
    elif _relative_error(outs, reference) > tolerance:
      ops, _ = _replay(fn, args, kwargs, policy, rules, loss_scale, shadow_all=True)
      errors = {m: e for m, e in _module_errors(ops).items() if f"*{m}" not in rules}
      if not errors:
        break
      new = rule_for(max(sorted(errors), key=lambda m: errors[m]), "")
    else:
      break
    if set(new) <= set(rules):  # its rule did not help: only f32 everywhere is left
      rules = {"*": "fp32"}
      break
    rules.update(new)
    modules += 1
  return rules


def _module_path(key_path: tuple) -> str:
  """``("params", "Dense_0", "kernel")`` -> ``"params/Dense_0"``: a leaf's module."""
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path]
  return "/".join(names[:-1]) or (names[0] if names else "")


def grad_health(
  grads: Any, dtype: Any = jnp.float16, loss_scale: float | jax.Array = 1.0
) -> dict[str, dict[str, jax.Array]]:
  """Per module, how a gradient would fare in a half dtype: zeros, underflow, overflow, size.

  The values measured are ``grads * loss_scale``, what a backward pass in
  ``dtype`` holds under that scale. Jittable and cheap (one pass over the
  gradients): run it every N steps (``mpjax train --config.health_every=N``).

  Args:
    grads: a gradient pytree (f32, e.g. of a Flax model's params).
    dtype: the half dtype to measure against (``jnp.float16``, ``jnp.bfloat16``).
    loss_scale: the loss scale the backward pass runs under.

  Returns:
    ``{module path: figures}``, the path being the leaves' key path without
    the last key (``"params/Dense_0"``); figures (scalars): ``zero`` (share of
    entries exactly 0), ``underflow`` (share of non-zero entries that ``dtype``
    casts to 0), ``subnormal`` (share of non-zero entries below its smallest
    normal, where precision is lost), ``overflow`` (share of finite entries
    that ``dtype`` casts to inf), ``max`` (the largest finite magnitude),
    ``nonfinite`` (count of inf/NaN entries). Shares are of all the module's
    entries.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> grads = {"params": {"Dense_0": {"kernel": jnp.array([0.0, 1e-9, 1e-6, 1.0])}}}
    >>> health = mpjax.grad_health(grads, jnp.float16)["params/Dense_0"]
    >>> float(health["zero"]), float(health["underflow"]), float(health["subnormal"])
    (0.25, 0.25, 0.5)
  """
  normal = float(jnp.finfo(dtype).smallest_normal)
  groups: dict[str, list[jax.Array]] = {}
  for key_path, leaf in tree_util.tree_flatten_with_path(grads)[0]:
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
      groups.setdefault(_module_path(key_path), []).append(
        jnp.ravel(leaf).astype(jnp.float32) * loss_scale
      )
  health = {}
  for module, leaves in sorted(groups.items()):
    g = jnp.concatenate(leaves) if len(leaves) > 1 else leaves[0]
    a = jnp.abs(g)
    n = max(g.size, 1)
    finite = jnp.isfinite(g)
    nonzero = (a > 0) & finite
    cast = g.astype(dtype)  # what the dtype makes of each entry
    health[module] = {
      "zero": jnp.sum(a == 0) / n,
      "underflow": jnp.sum(nonzero & (cast == 0)) / n,
      "subnormal": jnp.sum(nonzero & (a < normal)) / n,
      "overflow": jnp.sum(finite & jnp.isinf(cast)) / n,
      "max": jnp.max(jnp.where(finite, a, 0.0)),
      "nonfinite": jnp.sum(~finite),
    }
  return health
