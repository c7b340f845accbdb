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

from mpjax._diagnose_replay import MAX_REPLAYED, Replay, ReplayedOp, replay_program
from mpjax.op_classes import module_of
from mpjax.policy import PRESETS, Policy

__all__ = [
  "NonFiniteReport",
  "UncheckedOp",
  "UncheckedReport",
  "find_nonfinite",
  "suggest_rules",
  "grad_health",
  "module_of",
]

_F32_POLICY = PRESETS["fp32"]


# The scope jax.checkpoint gives the forward operations it computes again in the backward pass
# (the train step's program on a CPU, under remat); autocast's rules never see it.
_REMAT_SCOPE = "rematted_computation"


def _module(path: str) -> str:
  """The module of a replayed operation, as autocast rules match it (see module_of)."""
  return "/".join(p for p in module_of(path).split("/") if p != _REMAT_SCOPE)


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
    iteration: the iteration of each loop around the operation, outermost
      first (for a ``scan``, the index into the scanned axis: the layer of a
      scanned layer stack; for a ``while``, the iterations run before);
      empty outside loops.
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
  iteration: tuple[int, ...] = ()

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
      f"in {where} ({self.phase} pass, operation {self.index}{_loop(self.iteration)}): its "
      f"{self.dtype} result "
      f"overflows (largest finite {self.dtype_max:.6g}) where f32 computes it finite, up to "
      f"{self.shadow_max:.4g}.\nFix: autocast_rules={dict(self.rule)!r} {effect}."
    )


def _loop(iteration: tuple[int, ...]) -> str:
  """``", loop iteration 2"`` (``", loop iterations (0, 2)"`` in nested loops), or nothing."""
  if not iteration:
    return ""
  return (
    f", loop iteration {iteration[0]}" if len(iteration) == 1 else f", loop iterations {iteration}"
  )


def _phase(path: str) -> str:
  return "backward" if "transpose(" in path else "forward"


@dataclasses.dataclass(frozen=True)
class UncheckedOp:
  """An operation (or a body of operations) :func:`find_nonfinite` could not check.

  Attributes:
    module: its module path (as in :class:`NonFiniteReport`); empty at the top level.
    path: its full name-stack path.
    primitive: the JAX primitive, e.g. ``"pure_callback"``, ``"shard_map"``, ``"while"``.
    phase: ``"forward"`` or ``"backward"``.
    iteration: the iteration of each loop around it, outermost first.
    reason: what was not checked and why, e.g. ``"its body was not replayed"``.
    nonfinite: whether its result is inf or NaN under the policy while its
      inputs are finite (the first such operation of the replay, whose f32
      result could not be computed: whether f32 overflows too is unknown).
    rule: for a ``nonfinite`` one, the autocast ``rules`` that run its module
      in f32 (worth a try); empty otherwise.

  Example:
    >>> import mpjax
    >>> op = mpjax.UncheckedOp(
    ...   "Model/mlp", "Model/mlp", "shard_map", "forward", (), "its body was not replayed"
    ... )
    >>> print(op)
    `shard_map` in module `Model/mlp` (forward pass): its body was not replayed
  """

  module: str
  path: str
  primitive: str
  phase: str
  iteration: tuple[int, ...]
  reason: str
  nonfinite: bool = False
  rule: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __str__(self) -> str:
    where = f"module `{self.module}`" if self.module else "the top level"
    what = f"`{self.primitive}` in {where} ({self.phase} pass{_loop(self.iteration)})"
    if self.nonfinite:
      return (
        f"{what}: its result is not finite, and f32 cannot compute it from the same inputs "
        f"({self.reason}); autocast_rules={dict(self.rule)!r} may help"
      )
    return f"{what}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class UncheckedReport:
  """:func:`find_nonfinite`'s answer when it could not check every operation.

  No operation it checked overflows where f32 stays finite, but these it could
  not check, so it cannot say that the program diverges in f32 too.

  Attributes:
    unchecked: what was not checked, in program order; a ``nonfinite`` one
      (last) is the first operation whose result is inf or NaN.
    policy: the policy it was replayed under.

  Example:
    A clean function whose loop ran compiled past ``max_replayed`` operations:

    >>> import jax, jax.numpy as jnp, mpjax
    >>> def fn(x, n):
    ...   return jax.lax.fori_loop(0, n, lambda i, h: h * 1.01, x)
    >>> report = mpjax.find_nonfinite(fn, jnp.ones(4), jnp.int32(40), max_replayed=30)
    >>> [(u.primitive, u.nonfinite) for u in report.unchecked]
    [('while', False)]
    >>> report.unchecked[0].reason.split(" (")[0]
    'its iterations from iteration 10 on ran compiled'
  """

  unchecked: tuple[UncheckedOp, ...]
  policy: str

  def __str__(self) -> str:
    nonfinite = any(u.nonfinite for u in self.unchecked)
    found = (
      "The first value that is not finite comes from an operation it could not check in f32"
      if nonfinite
      else "No operation that was checked overflows where f32 stays finite"
    )
    items = "\n".join(f"- {u}" for u in self.unchecked)
    return (
      f"Could not check every operation under {self.policy} against f32, so whether the run "
      f"diverges in f32 too is unknown. {found}. Could not check:\n{items}"
    )


def _policy_name(policy: Any) -> str:
  """A preset's name where the policy is one, else its repr."""
  if isinstance(policy, str):
    return policy
  return next((name for name, preset in PRESETS.items() if preset == policy), str(policy))


def _culprit(op: ReplayedOp) -> str:
  """What a rule must name: a cast that overflows is fixed by the op that made its input."""
  return op.source if op.primitive == "convert_element_type" and op.source else op.primitive


def _report(op: ReplayedOp, policy: Any) -> NonFiniteReport | None:
  """The report of a first non-finite operation, if f32 computes it finite."""
  if op.shadow is None or not all(np.isfinite(v).all() for v in op.shadow):
    return None  # f32 overflows too, or the operation cannot be recomputed: not precision
  module = _module(op.path)
  dtype = np.dtype(op.dtype)
  # Outside any module a rule can only name a primitive; a cast that overflows is fixed
  # by the one that made its input (a GEMM accumulated in f32, then cast down).
  return NonFiniteReport(
    module=module,
    path=op.path,
    primitive=op.primitive,
    dtype=dtype.name,
    phase=_phase(op.path),
    shadow_max=max(float(np.abs(v).max()) if v.size else 0.0 for v in op.shadow),
    dtype_max=float(jnp.finfo(dtype).max),
    rule=rule_for(module, _culprit(op)),
    index=op.index,
    policy=_policy_name(policy),
    iteration=op.iteration,
  )


def _first_nonfinite(ops: list[ReplayedOp]) -> ReplayedOp | None:
  return next((op for op in ops if op.inputs_finite and not op.finite), None)


def _answer(replay: Replay, policy: Any) -> NonFiniteReport | UncheckedReport | None:
  """The report of the first overflow, else what was not checked, else None."""
  first = _first_nonfinite(replay.ops)
  report = None if first is None else _report(first, policy)
  if report is not None:
    return report
  unchecked = [
    UncheckedOp(_module(path), path, primitive, _phase(path), iteration, why)
    for path, primitive, iteration, why in replay.unchecked
  ]
  if first is not None and first.shadow is None:  # not finite, and f32 cannot say
    module, why = _module(first.path), first.why
    # A shard_map (or a loop run compiled) that is itself the first: one entry, both reasons.
    key = (first.path, first.primitive, first.iteration)
    if unchecked and (unchecked[-1].path, unchecked[-1].primitive, unchecked[-1].iteration) == key:
      why = f"{unchecked.pop().reason}; {why}"
    unchecked.append(
      UncheckedOp(
        module,
        first.path,
        first.primitive,
        _phase(first.path),
        first.iteration,
        why,
        nonfinite=True,
        rule=rule_for(module, _culprit(first)),
      )
    )
  return UncheckedReport(tuple(unchecked), _policy_name(policy)) if unchecked else None


def find_nonfinite(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str = "mixed_fp16",
  rules: Mapping[str, str] | None = None,
  loss_scale: float | None = None,
  max_replayed: int = MAX_REPLAYED,
  **kwargs: Any,
) -> NonFiniteReport | UncheckedReport | None:
  """The first operation of ``fn`` that overflows under ``policy`` but not in f32.

  The program :func:`mpjax.autocast` makes of ``fn`` (with ``rules``) runs
  eagerly, operation by operation, and each result is checked; the first that
  is inf or NaN while its inputs are finite is computed again in f32 from the
  same inputs (its *shadow*), and reported if that is finite. Calls
  (``jit``, ``remat``, ``custom_jvp``, ``custom_vjp``), the branch a ``cond``
  takes, and each iteration of a ``scan`` or ``while`` loop run operation by
  operation too, so an overflow in a scanned layer stack is found in the layer
  it happens in (``report.iteration``); once ``max_replayed`` operations were
  replayed, a loop's remaining iterations run compiled, unchecked.

  With ``loss_scale``, ``fn`` is a loss and the program is its gradient with
  respect to the first argument, of the loss times ``loss_scale``, as
  :func:`mpjax.make_train_step` differentiates it on this backend: on a CPU
  under remat (the forward pass rematerialised in the backward one) and with
  JAX's default softmax, on a GPU without remat and with the custom-JVP
  softmax (see :func:`mpjax.autocast`'s ``remat``). What differs from the
  compiled step: each operation runs on its own, so an XLA fusion that keeps
  an intermediate in f32 (``xla_allow_excess_precision``) is not reproduced,
  and an FP8 policy's GEMMs run with current scaling (the step's delayed
  scales are not passed in). Without ``loss_scale``, ``fn`` runs as given
  (pass ``jax.value_and_grad`` of a loss to check an f32 program's gradient
  under autocast).

  Args:
    fn: the function: a loss (with ``loss_scale``), or any function.
    *args: its arguments (concrete arrays: it runs).
    policy: the mixed policy to check.
    rules: autocast rules already in use.
    loss_scale: check the train step's gradient at this loss scale.
    max_replayed: how many operations to replay one by one (each takes about
      as long as a small eager JAX call); the iterations of a loop reached
      after that run compiled, and are reported as not checked.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`NonFiniteReport` (``print`` it) for the first operation that
    overflows where f32 stays finite; otherwise an :class:`UncheckedReport`
    if it could not check something: a body it does not enter (a
    ``shard_map``), a loop's iterations beyond the limit, or a first
    non-finite operation that f32 cannot compute (a callback declared to
    return float16); ``None`` only when every operation was checked and none
    overflows where f32 stays finite.

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

    In a scanned layer stack, the layer that overflows:

    >>> def stack(ws, x):
    ...   def layer(h, w):
    ...     with jax.named_scope("layer"):
    ...       return (h @ w) * 100.0, None
    ...   return jnp.mean(jax.lax.scan(layer, x, ws)[0] * 1e-6)
    >>> ws, x = jnp.stack([jnp.eye(4)] * 3), jnp.full((2, 4), 10.0)
    >>> report = mpjax.find_nonfinite(stack, ws, x)
    >>> report.module, report.primitive, report.iteration
    ('layer', 'mul', (1,))

    What it could not check is named, never taken for "f32 diverges too":

    >>> import numpy as np
    >>> def host(x):  # a host function that returns float16 inf: f32 cannot recompute it
    ...   out = jax.ShapeDtypeStruct(x.shape, jnp.float16)
    ...   return jax.pure_callback(lambda a: np.full(a.shape, np.inf, np.float16), out, x)
    >>> report = mpjax.find_nonfinite(host, jnp.ones(2))
    >>> type(report).__name__, report.unchecked[0].primitive, report.unchecked[0].nonfinite
    ('UncheckedReport', 'pure_callback', True)
  """
  replay, _ = replay_program(
    fn,
    args,
    kwargs,
    policy,
    rules,
    loss_scale,
    shadow_all=False,
    stop_at_first=True,
    max_replayed=max_replayed,
  )
  return _answer(replay, policy)


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


def _module_errors(ops: list[ReplayedOp]) -> dict[str, float]:
  """Per module, the largest error its operations add: their result against their f32 shadow."""
  errors: dict[str, float] = {}
  for op in ops:
    module = _module(op.path)
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
  _, reference = replay_program(fn, args, kwargs, _F32_POLICY, None, loss_scale, shadow_all=False)
  rules: dict[str, str] = {}
  modules = 0
  while modules < max_rules:
    replay, outs = replay_program(fn, args, kwargs, policy, rules, loss_scale, shadow_all=False)
    report = _answer(replay, policy)
    if isinstance(report, NonFiniteReport):
      new = dict(report.rule)
    elif _relative_error(outs, reference) > tolerance:
      replay, _ = replay_program(fn, args, kwargs, policy, rules, loss_scale, shadow_all=True)
      errors = {m: e for m, e in _module_errors(replay.ops).items() if f"*{m}" not in rules}
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
