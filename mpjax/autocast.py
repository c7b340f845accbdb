"""Autocast: run each operation of any JAX function in the precision its class calls for.

:func:`autocast` traces the function it wraps to a jaxpr and evaluates that
jaxpr equation by equation, choosing each operation's dtypes from its class
(what ``torch.autocast`` and TensorFlow's AMP graph rewrite do):

- ``lower``: GEMMs (``dot_general``, and ``ragged_dot_general``: the grouped
  GEMMs of mixture-of-experts layers) and convolutions take compute-dtype
  operands, accumulate in f32 (``preferred_element_type``) and return the
  compute dtype. The two GEMMs (or convolutions) of each one's gradient do the
  same, and gradients with respect to f32 operands come back f32.
- ``fp32``: exp, log, pow, rsqrt, squares, reductions, cumulative sums, linear
  algebra: inputs go up to f32. Softmax, log-softmax, logsumexp and norm
  statistics are built from these, so they run in f32 too.
- ``promote``: n-ary elementwise ops: the widest floating input wins. Constants
  (literals and what is computed from them alone) and rank-0 values do not
  promote, as Python scalars and 0-d tensors do not in PyTorch.
- ``follow``: everything else that moves or compares values keeps the dtype of
  its first floating input. One exception: under bf16 compute, a lookup of
  rows of an input table (an embedding) returns bf16, as the one-hot GEMM it
  stands for would, so the residual stream that starts there is bf16.
- ``keep``: runs in the dtypes it was traced with. Unknown primitives are kept,
  and autocast logs once which.

A constant cast down to fp16 saturates at the largest finite value, so a
``-1e9`` attention mask becomes ``-65504``, not ``-inf``.

Under differentiation the backward pass keeps each GEMM's compute-dtype
operands and output and computes the cheap operations between GEMMs again
(a ``jax.checkpoint`` around the function, see ``remat``), so what it keeps is
half precision and a fraction of what the f32 function keeps. The traced
program is cached per argument structure and abstract values, as ``jax.jit``
caches its traces.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._backend import lowering_platform
from mpjax._dtypes import is_castable_dtype as _castable
from mpjax.autocast_interpreter import INPUT, EvalContext, OpRecord, cast_value, eval_closed
from mpjax.fp8_plan import Fp8Run, choose_fp8_gemms
from mpjax.gemm import SAVED as _SAVED
from mpjax.jax_compat import softmax_custom_jvp, trace_context
from mpjax.op_classes import CLASSES, LEVELS, OP_CLASSES, Rules, check_declared, parse_rules
from mpjax.op_classes import module_of as module_of  # re-exported: rules match module paths
from mpjax.policy import Policy, get_policy

__all__ = ["autocast", "autocast_report", "AutocastReport", "OP_CLASSES"]

_F32 = np.dtype(jnp.float32)

# Under remat (see autocast), the backward pass keeps the compute-dtype operands
# and the output of every GEMM and convolution autocast lowers (they carry this
# checkpoint name), and the results of primitives in _KEPT or unknown to
# autocast: costly to compute again (unlowered GEMMs, linear algebra, sorts,
# cumulative ops) or small (reductions). It computes the rest again: the
# elementwise and layout ops between GEMMs, in whatever precision they ran.
_KEPT = frozenset(
  "dot_general ragged_dot_general conv_general_dilated reduce_sum reduce_prod reduce_max "
  "reduce_min argmax argmin reduce_and reduce_or cumsum cumprod cumlogsumexp cummax cummin sort "
  "top_k fft cholesky triangular_solve lu qr eigh eig svd schur householder_product tridiagonal "
  "tridiagonal_solve".split()
)


def is_array(x: Any) -> bool:
  """Whether an argument leaf is an array: an input of the traced program."""
  return isinstance(x, jax.Array | np.ndarray | np.generic)


def _all_f32(policy: Policy, rules: Rules) -> bool:
  """Whether everything computes in f32 (no module rule lowers any): autocast changes nothing."""
  return all(np.dtype(p.compute_dtype) == _F32 for p in (policy, *(p for _, p in rules.scopes)))


def _check(fn: Any, policy: Any, rules: Any, level: str) -> tuple[Policy, Rules]:
  if not callable(fn):
    raise TypeError(f"autocast: fn must be callable, got {type(fn).__name__}.")
  policy = get_policy(policy)
  parsed = parse_rules(rules)
  if level not in LEVELS:
    raise ValueError(f"autocast: level={level!r} is not one of {', '.join(map(repr, LEVELS))}.")
  return policy, parsed


def _saved_for_backward(prim: Any, *_: Any, **params: Any) -> bool:
  """The remat policy: what the backward pass keeps rather than computes again (see _SAVED)."""
  if prim.name == "name":
    return params["name"] == _SAVED
  return prim.name in _KEPT or prim.name not in OP_CLASSES


_CACHE_SIZE = 32


def nnx_variables(tree: Any) -> list[Any]:
  """The Flax NNX ``Variable`` objects in ``tree`` (params, BatchNorm statistics, RNG counts), in
  flattening order: the state a function may set in place."""
  from flax import nnx

  found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return [x for x in found if isinstance(x, nnx.Variable)]


def with_arrays(
  fn: Callable[..., Any],
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
  written: list[int] | None = None,
) -> Callable[..., Any]:
  """``fn`` as a function of the array leaves at ``dynamic``; the other leaves stay as given.

  With ``written``, the function returns ``(fn's result, new values)``: the values ``fn`` set
  on its arguments' NNX ``Variable`` objects, whose indices (in :func:`nnx_variables` order) it puts
  in ``written``.
  """

  def flat_fn(*xs):
    full = list(leaves)
    for i, x in zip(dynamic, xs, strict=True):
      full[i] = x
    a, k = jax.tree.unflatten(treedef, full)
    if written is None:
      return fn(*a, **k)
    variables = nnx_variables((a, k))
    before = [v.get_raw_value() for v in variables]
    out = fn(*a, **k)
    changed = [v.get_raw_value() is not b for v, b in zip(variables, before, strict=True)]
    written[:] = [i for i, c in enumerate(changed) if c]
    return out, [variables[i].get_raw_value() for i in written]

  return flat_fn


def _trace(
  fn: Callable[..., Any],
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
  cache: OrderedDict,
  remat: bool,
) -> tuple[Any, Any, list[bool], dict[str, Any]]:
  """``fn`` traced for these arguments: the closed jaxpr, output tree, which outputs are floats.

  The last item is a dict kept with the trace, for what is learnt from it
  once (which GEMMs run in FP8).

  Without ``remat`` (the GPU lowering), ``jax.nn.softmax`` is traced as JAX's
  custom-JVP softmax, whose gradient ``y * (dy - sum(y * dy))`` XLA:GPU computes
  in the one kernel that reads ``dy``, recomputing ``y`` there. The default
  softmax's gradient also reads the row sum of the forward, which XLA:GPU then
  computes in a kernel of its own: one more read of the scores per layer, and
  f32 softmax would move more bytes than a bf16 one. Under ``remat`` (the CPU
  lowering) the default softmax keeps less for the backward pass.

  Cached as ``jax.jit`` caches its traces: by argument structure, static leaves,
  the abstract values of array leaves and JAX's tracing configuration.
  """
  arrays = set(dynamic)
  static = tuple((i, x) for i, x in enumerate(leaves) if i not in arrays)
  avals = tuple(jax.typeof(leaves[i]) for i in dynamic)
  try:
    key = (treedef, static, avals, remat, trace_context())
    hit = cache.get(key)
  except TypeError:  # an unhashable static leaf
    key, hit = None, None
  if hit is not None:
    cache.move_to_end(key)
    return hit

  written: list[int] = []
  flat_fn = with_arrays(fn, leaves, treedef, dynamic, written)
  with softmax_custom_jvp(not remat or softmax_custom_jvp.value):
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*(leaves[i] for i in dynamic))
  out_leaves, out_tree = jax.tree.flatten(out_shape)
  results = len(jax.tree.leaves(out_shape[0]))  # then the NNX Variables' new values
  floating = [i < results and _castable(o.dtype) for i, o in enumerate(out_leaves)]
  traced = closed, out_tree, floating, {"written": (tuple(written), out_shape[1])}
  # A function that closes over another transformation's tracers is traced anew
  # each call: its jaxpr holds them.
  if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
    cache[key] = traced
    if len(cache) > _CACHE_SIZE:
      cache.popitem(last=False)
  return traced


def _uses_fp8(ctx: EvalContext) -> bool:
  return ctx.policy.fp8 is not None or any(p.fp8 is not None for _, p in ctx.rules.scopes)


def _run(
  ctx: EvalContext,
  fn: Callable[..., Any],
  args: tuple,
  kwargs: dict,
  cache: OrderedDict,
  fp8_scales: jax.Array | None = None,
  count_fp8: bool = False,
) -> Any:
  """``fn(*args, **kwargs)`` under autocast; its FP8 GEMMs read ``fp8_scales`` (delayed scaling).

  With ``count_fp8``, returns instead how many FP8 GEMMs keep delayed state.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
  arrays = [leaves[i] for i in dynamic]
  remat = lowering_platform(arrays) == "cpu" if ctx.remat is None else ctx.remat
  closed, out_tree, floating, learnt = _trace(fn, leaves, treedef, dynamic, cache, remat)
  check_declared(ctx.rules, closed.jaxpr)
  # Side effects (prints, callbacks) would run again in the recomputation.
  remat = remat and not closed.effects
  ctx = dataclasses.replace(ctx, remat=remat)

  def evaluate(xs, fp8):
    return eval_closed(dataclasses.replace(ctx, fp8=fp8), closed, xs, [INPUT] * len(xs), "")

  plan = None
  if _uses_fp8(ctx):
    if "fp8" not in learnt:  # which GEMMs are eligible: one evaluation, shapes only
      found = Fp8Run(plan=None)
      jax.eval_shape(lambda xs: evaluate(xs, found), arrays)
      learnt["fp8"] = (choose_fp8_gemms(found.found), tuple(found.found))
    plan, found = learnt["fp8"]
    if count_fp8:
      delayed = Fp8Run(plan, ctx.policy.fp8).delayed
      return sum(in_fp8 and delayed(g) for g, in_fp8 in zip(found, plan, strict=True))
  elif count_fp8:
    return 0

  def run(scales, *xs):
    fp8 = None if plan is None else Fp8Run(plan, ctx.policy.fp8, scales)
    outs = evaluate(xs, fp8)
    if scales is not None and (fp8 is None or fp8.used != scales.shape[0]):
      raise ValueError(
        f"FP8 state: the train state holds the state of {scales.shape[0]} FP8 GEMMs but the "
        f"loss function has {0 if fp8 is None else fp8.used}; was the state made for another "
        "model? Make the state with this step: TrainState.create(..., train_step=step, "
        "example_batch=batch), or mpjax.init_fp8_state(step, state, batch)."
      )
    return outs

  if remat:
    run = jax.checkpoint(run, policy=_saved_for_backward)
  outs = run(fp8_scales, *arrays)
  out_dtype = np.dtype(ctx.policy.output_dtype)
  outs = [cast_value(x, out_dtype) if f else x for x, f in zip(outs, floating, strict=True)]
  result, values = jax.tree.unflatten(out_tree, outs)
  # What fn set on its arguments' NNX Variables (BatchNorm statistics, RNG counts) is set on
  # the caller's, in the dtypes fn wrote, as calling fn would: NNX's transforms carry it on.
  indices, traced = learnt["written"]
  variables = nnx_variables((args, kwargs)) if indices else []
  for i, value, was in zip(indices, values, traced, strict=True):
    variables[i].set_raw_value(jax.tree.map(lambda x, t: cast_value(x, t.dtype), value, was))
  return result


def autocast(
  fn: Callable[..., Any],
  policy: Policy | str | Any = "mixed_bf16",
  *,
  rules: Mapping[str, str] | None = None,
  level: Literal["full", "gemm_only"] = "full",
  remat: bool | None = None,
) -> Callable[..., Any]:
  """Returns ``fn`` with each of its operations run in the precision its class calls for.

  The returned function has ``fn``'s signature. It traces ``fn`` (array
  arguments become inputs; other leaves, such as ``train=True``, stay Python
  values) and evaluates the traced program under the classes in
  :data:`OP_CLASSES`: GEMMs and convolutions take ``policy.compute_dtype``
  operands and accumulate in f32, forward and backward; exp, log, pow, squares
  and reductions (so softmax and norm statistics) run in f32; elementwise ops
  take their widest input. f32 weights stay f32 in memory and are cast where a
  GEMM consumes them. Under bf16 compute an embedding lookup (rows gathered
  from a 2-D input table) returns bf16, as its one-hot GEMM would, so a
  transformer's residual stream runs in bf16, as under Flax
  ``dtype=bfloat16``, jmp and Megatron-LM; ``rules={"*Embed*": "fp32"}``
  keeps it f32, as ``torch.autocast`` does (and as fp16 compute does, for
  range). Floating outputs come back in ``policy.output_dtype``. What ``fn``
  sets on its arguments' Flax NNX ``Variable`` objects (BatchNorm statistics,
  RNG counts) is set on the caller's, as calling ``fn`` would, so
  ``nnx.value_and_grad`` and ``nnx.jit`` carry it on.
  It composes with ``jax.jit``, ``jax.grad``, ``jax.vmap``, ``jax.checkpoint``,
  ``lax.scan``, ``shard_map`` and :func:`mpjax.make_train_step`, and enters
  ``jit``, ``cond``, ``while``, ``scan``, ``remat``, ``shard_map`` and
  ``custom_jvp`` functions (their JVP rules are autocast too). A ``custom_vjp``
  function is autocast when not differentiated; under differentiation its own
  fwd and bwd run in the dtypes they were written for. Reverse mode only:
  each lowered GEMM carries a custom VJP (so its gradient GEMMs also take
  compute-dtype operands), and JAX refuses forward mode (``jax.jvp``,
  ``jax.jacfwd``, ``jax.hessian``) through a custom VJP; use ``jax.jacrev``,
  or differentiate the f32 function.

  A user's explicit choices stay: ``astype``, a GEMM's ``precision``, or a
  ``preferred_element_type`` that differs from its operands' dtype.

  Like ``jax.jit``, it traces ``fn`` once per argument structure, static
  leaves, and array shapes, dtypes and shardings, and reuses that trace: a
  ``fn`` that reads Python state which changes between calls (a global flag, a
  closed-over array rebound to a new one) sees it as it was when traced. Call
  ``autocast`` again for a fresh function.

  Args:
    fn: any JAX function: a Flax ``model.apply``, an NNX module called through
      ``nnx.merge``, a loss function.
    policy: anything :func:`mpjax.get_policy` reads. A policy whose compute
      dtype is f32 returns ``fn`` itself.
    rules: edits, by key. A primitive name maps to a class (``"lower"``,
      ``"fp32"``, ``"promote"``, ``"follow"``, ``"keep"``), e.g.
      ``{"tanh": "fp32"}``. A primitive autocast does not know (it warns, and
      runs it as traced) can be named too, e.g. ``{"pallas_call": "keep"}``.
      A glob with ``*`` or ``/`` matches the name stack
      Flax and ``jax.named_scope`` give each operation, and maps to the policy
      its operations use, e.g. ``{"*head*": "fp32", "*/LayerNorm_*": "fp32"}``
      (an f32 scope runs as traced). The first matching pattern wins.
    level: ``"full"`` (every class) or ``"gemm_only"`` (only GEMMs and
      convolutions change: compute-dtype operands, f32 accumulation, results
      back in the traced dtype; everything else runs as traced).
    remat: under differentiation, keep for the backward pass only what is
      costly to compute again: each GEMM's and convolution's compute-dtype
      operands and output, reductions, linear algebra, sorts. The elementwise
      and layout operations between them (bias, activation, norm, softmax,
      casts, in f32 where they ran in f32) are computed again from those
      (``jax.checkpoint`` around ``fn``). ``False`` keeps what JAX keeps by
      default. ``None`` (the default) chooses by the backend the function is
      traced for: ``True`` on a CPU, where it saves most of the activation
      memory at little cost; ``False`` on a GPU or TPU, where the recomputed
      elementwise kernels and casts would read their inputs from memory a
      second time. Without remat,
      ``jax.nn.softmax`` is traced as JAX's custom-JVP softmax, whose backward
      XLA:GPU fuses into one kernel (see ``jax_softmax_custom_jvp``). A ``fn``
      with side effects (prints, callbacks) is not rematerialised, so they run once.

  Returns:
    The autocast function.

  Raises:
    ValueError: for a policy that cannot be read, a rule naming an unknown
      class or policy, or an unknown level; a rule naming a primitive that
      is neither one autocast knows nor one of the traced function's (when it
      is traced), or one that cannot run in its class.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import mpjax
    >>> model = nn.Dense(4)
    >>> x = jnp.ones((2, 3))
    >>> params = model.init(jax.random.key(0), x)
    >>> apply = mpjax.autocast(model.apply, "mixed_bf16")
    >>> jax.jit(apply)(params, x).dtype  # the GEMM ran bf16 x bf16 -> f32
    dtype('float32')
  """
  policy, parsed = _check(fn, policy, rules, level)
  if _all_f32(policy, parsed):
    return fn
  ctx = EvalContext(policy, parsed, level, remat)
  cache: OrderedDict = OrderedDict()

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return _run(ctx, fn, args, kwargs, cache)

  return wrapped


def autocast_with_fp8_scales(
  fn: Callable[..., Any], policy: Policy, *, rules: Mapping[str, str] | None = None
) -> Callable[..., Any]:
  """:func:`autocast` whose delayed-scaling FP8 GEMMs read scales: ``f(scales, *args, **kw)``.

  ``scales`` is ``(gemms, 3)``, a row per GEMM :func:`count_delayed_fp8_gemms`
  counts, in program order (:func:`mpjax.fp8.delayed_scales`). Differentiated
  with respect to ``scales``, the result's gradient is each GEMM's amaxes of
  this step (see :func:`mpjax.fp8.fp8_dot`).
  """
  ctx = EvalContext(*_check(fn, policy, rules, "full"), "full", None)
  cache: OrderedDict = OrderedDict()

  def wrapped(scales: jax.Array | None, *args: Any, **kwargs: Any) -> Any:
    if _all_f32(ctx.policy, ctx.rules):  # as autocast: the function itself
      return fn(*args, **kwargs)
    return _run(ctx, fn, args, kwargs, cache, fp8_scales=scales)

  return wrapped


def count_delayed_fp8_gemms(
  fn: Callable[..., Any],
  policy: Policy,
  *args: Any,
  rules: Mapping[str, str] | None = None,
  **kwargs: Any,
) -> int:
  """How many of ``fn``'s GEMMs run in FP8 with delayed scaling under ``policy``'s recipe.

  0 for a policy without FP8 or with current scaling. Traces ``fn`` (shapes
  only; nothing runs).
  """
  ctx = EvalContext(*_check(fn, policy, rules, "full"), "full", None)
  return _run(ctx, fn, args, kwargs, OrderedDict(), count_fp8=True)


@dataclasses.dataclass(frozen=True)
class AutocastReport:
  """What autocast did to each operation of one call, counted.

  Attributes:
    by_class: for each class, how many operations produced each dtype.
    by_module: for each name-stack path, how many operations produced each dtype.
    gemm_flops: FLOPs of all GEMMs and convolutions in the forward pass.
    lowered_flops: of those, the FLOPs that ran with half-precision operands.
  """

  by_class: Mapping[str, Mapping[str, int]]
  by_module: Mapping[str, Mapping[str, int]]
  gemm_flops: float
  lowered_flops: float

  @property
  def lowered_share(self) -> float:
    """The share of GEMM FLOPs with half-precision operands (1.0 when there are none)."""
    return self.lowered_flops / self.gemm_flops if self.gemm_flops else 1.0

  def __str__(self) -> str:
    lines = ["class      operations by result dtype"]
    for cls, counts in self.by_class.items():
      lines.append(f"{cls:<10} " + ", ".join(f"{d}: {n}" for d, n in sorted(counts.items())))
    lines.append("")
    lines.append("module path                              operations by result dtype")
    for path, counts in self.by_module.items():
      lines.append(
        f"{(path or '(top)'):<40} " + ", ".join(f"{d}: {n}" for d, n in sorted(counts.items()))
      )
    lines.append("")
    lines.append(
      f"GEMM FLOPs (forward): {self.gemm_flops:.4g}, in the compute dtype: "
      f"{self.lowered_flops:.4g} ({100 * self.lowered_share:.1f}%)"
    )
    return "\n".join(lines)


def autocast_report(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str | Any = "mixed_bf16",
  rules: Mapping[str, str] | None = None,
  level: Literal["full", "gemm_only"] = "full",
  print_report: bool = True,
  **kwargs: Any,
) -> AutocastReport:
  """Explains what :func:`autocast` does to ``fn(*args, **kwargs)``: counts per class and module.

  Nothing is computed: the autocast program is only traced. Operations inside
  a ``scan`` count once per iteration.

  Args:
    fn: the function, as given to :func:`autocast`.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct`` s).
    policy: as for :func:`autocast`.
    rules: as for :func:`autocast`.
    level: as for :func:`autocast`.
    print_report: print the report as a table.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    An :class:`AutocastReport`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import mpjax
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> x = jnp.ones((4, 3))
    >>> params = model.init(jax.random.key(0), x)
    >>> report = mpjax.autocast_report(model.apply, params, x, print_report=False)
    >>> report.lowered_share, dict(report.by_class["lower"])
    (1.0, {'bfloat16': 2})
  """
  policy, parsed = _check(fn, policy, rules, level)
  records: list[OpRecord] = []
  ctx = EvalContext(policy, parsed, level, records=records)
  jax.eval_shape(lambda a, k: _run(ctx, fn, a, k, OrderedDict()), args, kwargs)
  by_class: dict[str, Counter] = defaultdict(Counter)
  by_module: dict[str, Counter] = defaultdict(Counter)
  for r in records:
    by_class[r.op_class][r.dtype] += int(r.count)
    by_module[r.path][r.dtype] += int(r.count)
  report = AutocastReport(
    by_class={c: dict(by_class[c]) for c in CLASSES if c in by_class},
    by_module={m: dict(v) for m, v in sorted(by_module.items())},
    gemm_flops=sum(r.flops for r in records),
    lowered_flops=sum(r.flops for r in records if r.lowered),
  )
  if print_report:
    print(report)
  return report
