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
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from mpjax.autocast import _INPUT, _check, _Ctx, _eval_closed, _is_array, _with_arrays
from mpjax.policy import PRESETS, Policy

__all__ = ["NonFiniteReport", "find_nonfinite", "suggest_rules", "grad_health"]

_F32_POLICY = PRESETS["fp32"]


def module_of(path: str) -> str:
  """A name-stack path without JAX's transformation wrappers: what autocast rules match.

  ``"transpose(jvp(MLP))/Dense_1"`` -> ``"MLP/Dense_1"``.
  """
  return re.sub(r"[A-Za-z_]\w*\(|\)", "", path).strip("/")


def rule_for(module: str, primitive: str) -> dict[str, str]:
  """The autocast rule that runs ``module`` (or, at the top level, ``primitive``) in f32."""
  return {f"*{module}*": "fp32"} if module else {primitive: "fp32"}


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
    shadow_max: the largest magnitude of the same result computed in f32.
    dtype_max: the largest finite value of ``dtype``.
    rule: an autocast ``rules`` dict that runs the module in f32, e.g.
      ``{"*Model/attn*": "fp32"}`` (pass it as ``make_train_step(...,
      autocast_rules=...)`` or ``config.autocast_rules``).
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
    return (
      f"The first value that is not finite under {self.policy} comes from `{self.primitive}` "
      f"in {where} ({self.phase} pass, operation {self.index}): its {self.dtype} result "
      f"overflows (largest finite {self.dtype_max:.6g}) where f32 computes it finite, up to "
      f"{self.shadow_max:.4g}.\n"
      f"Fix: autocast_rules={dict(self.rule)!r} runs that module in f32 (mapping it to "
      "'mixed_bf16' instead keeps it in half precision with f32's range)."
    )


@dataclasses.dataclass(frozen=True)
class _Op:
  path: str
  primitive: str
  dtype: str
  finite: bool
  max_abs: float
  values: tuple[np.ndarray, ...]


def _replay(
  fn: Callable[..., Any], args: tuple, kwargs: dict, policy: Any, rules: Any, keep: bool
) -> tuple[list[_Op], list[Any]]:
  """Every operation of ``fn`` as autocast runs it under ``policy``, eagerly, in order."""
  policy, parsed = _check(fn, policy, rules, "full")
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

  arrays = [jnp.asarray(leaves[i]) for i in dynamic]
  closed = jax.make_jaxpr(_with_arrays(fn, leaves, treedef, dynamic))(*arrays)
  ops: list[_Op] = []

  def probe(eqn: Any, path: str, outs: list[Any]) -> None:
    floats = [
      o
      for o in outs
      if isinstance(o, jax.Array)
      and not isinstance(o, jax.core.Tracer)
      and jnp.issubdtype(o.dtype, jnp.floating)
    ]
    if not floats:
      return
    finite = all(bool(jnp.isfinite(o).all()) for o in floats)
    max_abs = max(
      float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(o), o, 0).astype(jnp.float32))))
      if o.size
      else 0.0
      for o in floats
    )
    values = tuple(np.asarray(o, np.float32) for o in floats) if keep else ()
    ops.append(_Op(path, eqn.primitive.name, str(floats[0].dtype), finite, max_abs, values))

  ctx = _Ctx(policy, parsed, "full", remat=False, probe=probe)
  outs = _eval_closed(ctx, closed, arrays, [_INPUT] * len(arrays), "")
  return ops, outs


def _policy_name(policy: Any) -> str:
  """A preset's name where the policy is one, else its repr."""
  if isinstance(policy, str):
    return policy
  return next((name for name, preset in PRESETS.items() if preset == policy), str(policy))


def find_nonfinite(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str = "mixed_fp16",
  rules: Mapping[str, str] | None = None,
  **kwargs: Any,
) -> NonFiniteReport | None:
  """The first operation of ``fn`` that overflows under ``policy`` but not in f32, or ``None``.

  ``fn`` is replayed eagerly, operation by operation, as :func:`mpjax.autocast`
  runs it (with ``rules``), and again in f32; the first operation whose result
  is inf or NaN in the policy's precision while its f32 shadow is finite is
  reported. Pass a loss function to check the forward pass, and
  ``jax.value_and_grad`` of it (of the loss times the loss scale, as a train
  step differentiates it) to check the backward pass too. Operations inside
  ``scan``, ``while`` and ``cond`` bodies are checked as the whole loop or
  branch.

  Args:
    fn: the function, e.g. ``jax.value_and_grad(lambda p, b: loss_fn(p, b) * 2.0**15)``.
    *args: its arguments (concrete arrays: it runs).
    policy: the mixed policy to check.
    rules: autocast rules already in use.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`NonFiniteReport` (``print`` it), or ``None`` when every value
    that is finite in f32 is finite under the policy.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax
    >>> def loss(w, x):
    ...   with jax.named_scope("blowup"):
    ...     h = (x @ w) * 1000.0
    ...   return jnp.mean(h * 1e-3)
    >>> w, x = jnp.full((4, 4), 30.0), jnp.full((2, 4), 1.0)
    >>> report = mpjax.find_nonfinite(loss, w, x, policy="mixed_fp16")
    >>> report.module, report.primitive, report.phase, report.rule
    ('blowup', 'mul', 'forward', {'*blowup*': 'fp32'})
  """
  low, _ = _replay(fn, args, kwargs, policy, rules, keep=False)
  shadow, _ = _replay(fn, args, kwargs, _F32_POLICY, None, keep=False)
  for index, (lo, sh) in enumerate(zip(low, shadow, strict=False)):
    if not lo.finite and sh.finite:
      module = module_of(lo.path)
      dtype = np.dtype(lo.dtype)
      return NonFiniteReport(
        module=module,
        path=lo.path,
        primitive=lo.primitive,
        dtype=dtype.name,
        phase="backward" if "transpose(" in lo.path else "forward",
        shadow_max=sh.max_abs,
        dtype_max=float(jnp.finfo(dtype).max) if jnp.issubdtype(dtype, jnp.floating) else math.inf,
        rule=rule_for(module, lo.primitive),
        index=index,
        policy=_policy_name(policy),
      )
  return None


def _relative_error(low: Any, ref: Any) -> float:
  """The largest relative (Frobenius) error over the floating leaves, inf where not finite."""
  worst = 0.0
  for a, b in zip(jax.tree.leaves(low), jax.tree.leaves(ref), strict=True):
    if not jnp.issubdtype(jnp.asarray(b).dtype, jnp.floating):
      continue
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all():
      return math.inf
    norm = np.linalg.norm(b)
    worst = max(worst, float(np.linalg.norm(a - b) / norm) if norm else float(np.abs(a).max()))
  return worst


def _module_errors(low: list[_Op], shadow: list[_Op]) -> dict[str, float]:
  """Per forward module, the largest relative error of its operations' results against f32."""
  errors: dict[str, float] = {}
  for lo, sh in zip(low, shadow, strict=False):
    module = module_of(lo.path)
    if not module or "transpose(" in lo.path:
      continue
    error = max(
      (_relative_error(a, b) for a, b in zip(lo.values, sh.values, strict=False)), default=0.0
    )
    errors[module] = max(errors.get(module, 0.0), error)
  return errors


def suggest_rules(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str = "mixed_fp16",
  tolerance: float = 1e-2,
  max_rules: int = 8,
  **kwargs: Any,
) -> dict[str, str]:
  """The autocast rules that make ``fn`` finite and within ``tolerance`` of f32 under ``policy``.

  Starting from no rules, it repeatedly replays ``fn`` (see
  :func:`find_nonfinite`): while an operation overflows, it adds the rule that
  runs that operation's module in f32; once every output is finite, while the
  outputs' largest relative error against f32 exceeds ``tolerance``, it adds
  the module whose results deviate most from f32. Deterministic for the same
  inputs; a greedy search, so "smallest" means: no rule is added that was not
  needed at the time.

  Args:
    fn: as for :func:`find_nonfinite`; pass ``jax.value_and_grad`` of the
      (scaled) loss so that the loss and its gradients are held to
      ``tolerance``.
    *args: its arguments.
    policy: the mixed policy.
    tolerance: the largest relative error (Frobenius norm, per output leaf)
      accepted against f32.
    max_rules: stop after this many rules.
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
    >>> mpjax.suggest_rules(jax.value_and_grad(loss), w, x)
    {'*blowup*': 'fp32'}
  """
  if not tolerance > 0:
    raise ValueError(f"suggest_rules: tolerance={tolerance!r} must be positive, e.g. 1e-2.")
  shadow_ops, reference = _replay(fn, args, kwargs, _F32_POLICY, None, keep=True)
  rules: dict[str, str] = {}
  for _ in range(max_rules + 1):
    ops, outs = _replay(fn, args, kwargs, policy, rules, keep=True)
    report = next(
      (
        (lo, i)
        for i, (lo, sh) in enumerate(zip(ops, shadow_ops, strict=False))
        if not lo.finite and sh.finite
      ),
      None,
    )
    if report is not None:
      lo, _ = report
      new = rule_for(module_of(lo.path), lo.primitive)
    elif _relative_error(outs, reference) > tolerance:
      errors = _module_errors(ops, shadow_ops)
      candidates = {m: e for m, e in errors.items() if f"*{m}*" not in rules}
      if not candidates:
        break
      worst = max(sorted(candidates), key=lambda m: candidates[m])
      new = rule_for(worst, "")
    else:
      return rules
    if set(new) <= set(rules) or len(rules) >= max_rules:
      break
    rules.update(new)
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
    flushes to 0: below half its smallest subnormal), ``subnormal`` (share of
    non-zero entries below its smallest normal, where precision is lost),
    ``overflow`` (share beyond its largest finite value), ``max`` (the
    largest magnitude), ``nonfinite`` (count of inf/NaN entries).

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> grads = {"params": {"Dense_0": {"kernel": jnp.array([0.0, 1e-9, 1e-6, 1.0])}}}
    >>> health = mpjax.grad_health(grads, jnp.float16)["params/Dense_0"]
    >>> float(health["zero"]), float(health["underflow"]), float(health["subnormal"])
    (0.25, 0.25, 0.5)
  """
  info = jnp.finfo(dtype)
  tiny = float(info.smallest_subnormal)
  normal = float(info.smallest_normal)
  big = float(info.max)
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
    health[module] = {
      "zero": jnp.sum(a == 0) / n,
      "underflow": jnp.sum(nonzero & (a < tiny / 2)) / n,
      "subnormal": jnp.sum(nonzero & (a < normal)) / n,
      "overflow": jnp.sum(finite & (a > big)) / n,
      "max": jnp.max(jnp.where(finite, a, 0.0)),
      "nonfinite": jnp.sum(~finite),
    }
  return health
