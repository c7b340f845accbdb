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
import difflib
import fnmatch
import functools
import logging
import math
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from mpjax._backend import lowering_platform
from mpjax._dtypes import is_castable_dtype as _castable
from mpjax.fp8 import Fp8Recipe, fp8_dot
from mpjax.gemm import SAVED as _SAVED
from mpjax.gemm import mixed_conv, mixed_dot, mixed_ragged_dot
from mpjax.jax_compat import (
  scan_layout,
  shard_map_manual_axes,
  softmax_custom_jvp,
  source_info_util,
  trace_context,
)
from mpjax.policy import Policy, get_policy

__all__ = ["autocast", "autocast_report", "AutocastReport", "OP_CLASSES"]

_log = logging.getLogger("mpjax")

CLASSES = ("lower", "fp32", "promote", "follow", "keep")
LEVELS = ("full", "gemm_only")

_F32 = np.dtype(jnp.float32)

_LOWER = ("dot_general", "ragged_dot_general", "conv_general_dilated")
_FP32 = (
  "exp exp2 expm1 log log1p pow integer_pow square rsqrt tan asin acos asinh acosh atanh "
  "sinh cosh erf_inv lgamma digamma igamma igammac igamma_grad_a random_gamma_grad "
  "polygamma zeta bessel_i0e bessel_i1e regularized_incomplete_beta "
  "reduce_sum reduce_prod cumsum cumprod cumlogsumexp reduce_window_sum "
  "cholesky triangular_solve lu qr eigh eig svd schur householder_product tridiagonal "
  "tridiagonal_solve lu_pivots_to_permutation fft"
).split()
_PROMOTE = (
  "add sub mul div max min atan2 rem nextafter select_n clamp concatenate stack "
  "dynamic_update_slice add_any"
).split()
_FOLLOW = (
  "reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice gather pad rev "
  "unstack "
  "copy copy_p reduce_precision convert_element_type stop_gradient optimization_barrier "
  "reduce_max reduce_min argmax argmin reduce_and reduce_or reduce_xor cummax cummin "
  "reduce_window_max reduce_window_min top_k sort "
  "eq ne lt le gt ge is_finite not and or xor "
  "abs neg sign floor ceil round tanh logistic erf erfc sqrt cbrt sin cos atan real imag "
  "conj iota split sharding_constraint mesh_cast reshard pvary pcast psum pmax pmin "
  "psum_invariant all_gather all_to_all ppermute psum_scatter axis_index"
).split()
# Primitives whose params hold a jaxpr typed for the traced dtypes, or whose
# dtype is part of their meaning: they run as traced, silently.
_KEEP = (
  "bitcast_convert_type scatter scatter-add scatter_add scatter_mul scatter_min scatter_max "
  "scatter_apply reduce reduce_window select_and_scatter_add select_and_gather_add "
  "random_bits random_seed random_wrap random_unwrap random_fold_in random_split "
  "threefry2x32 rng_bit_generator rng_uniform shift_left shift_right_logical "
  "shift_right_arithmetic population_count clz debug_callback pure_callback io_callback "
  "debug_print"
).split()

# In the fp32 class for fp16's range only (x**3 overflows fp16 for |x| > 40);
# bf16 has f32's range, so with bf16 compute they follow their input.
_FP16_RANGE = frozenset({"integer_pow"})

OP_CLASSES: Mapping[str, str] = {
  **{p: "keep" for p in _KEEP},
  **{p: "follow" for p in _FOLLOW},
  **{p: "promote" for p in _PROMOTE},
  **{p: "fp32" for p in _FP32},
  **{p: "lower" for p in _LOWER},
}
"""The default class of each primitive autocast knows; ``rules`` can move any of them."""

_ENTERED = frozenset(
  "jit pjit closed_call core_call remat2 checkpoint custom_jvp_call custom_vjp_call cond "
  "while scan shard_map".split()
)
# Ops that only move data: a weight seen through one is still that weight.
_VIEWS = frozenset("reshape transpose broadcast_in_dim squeeze expand_dims slice".split())

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

# How each value came about: from literals only; from the function's inputs
# (or closed-over arrays) through views only; computed; or the result of a
# lowered GEMM or convolution (through views only).
_LIT, _INPUT, _ACT, _GEMM = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class _Rules:
  classes: Mapping[str, str]
  scopes: tuple[tuple[str, Policy], ...]


def _parse_rules(rules: Mapping[str, str] | None) -> _Rules:
  classes = dict(OP_CLASSES)
  scopes = []
  if rules is None:
    return _Rules(classes, ())
  if not isinstance(rules, Mapping):
    raise TypeError(
      f"autocast: rules must be a dict such as {{'tanh': 'fp32', '*/head*': 'fp32'}}, got "
      f"{type(rules).__name__}."
    )
  for key, value in rules.items():
    if not isinstance(key, str) or not isinstance(value, str | Policy):
      raise TypeError(f"autocast: rule {key!r}: {value!r} must map a string to a string.")
    if any(c in key for c in "*?[/"):
      try:
        scopes.append((key, get_policy(value)))
      except ValueError as e:
        raise ValueError(f"autocast: rule {key!r}: {value!r} names no policy. {e}") from None
      continue
    if key not in classes:
      near = difflib.get_close_matches(key, list(classes), n=1)
      hint = f" Did you mean {near[0]!r}?" if near else ""
      raise ValueError(
        f"autocast: rule {key!r} is neither a primitive autocast knows nor a name-stack "
        f"pattern.{hint} A module pattern needs a wildcard or a '/', e.g. '*{key}*'; the known "
        "primitives are the keys of mpjax.OP_CLASSES."
      )
    if value not in CLASSES:
      near = difflib.get_close_matches(str(value), CLASSES, n=1)
      hint = f" Did you mean {near[0]!r}?" if near else ""
      raise ValueError(
        f"autocast: rule {key!r}: {value!r} is not an op class; use one of "
        f"{', '.join(map(repr, CLASSES))}.{hint}"
      )
    classes[key] = value
  return _Rules(classes, tuple(scopes))


@functools.cache
def _warn_unknown(name: str) -> None:
  _log.warning(
    "autocast: primitive %r is not classified; it runs in the dtypes it was traced with. "
    "Give it a class with rules={%r: 'follow'} (or 'fp32', 'promote', 'keep').",
    name,
    name,
  )


@dataclasses.dataclass
class _Record:
  path: str
  op_class: str
  dtype: str
  flops: float
  lowered: bool
  count: float


@dataclasses.dataclass(frozen=True)
class _Fp8Gemm:
  """An FP8-eligible GEMM, as one evaluation met it (in program order)."""

  path: str
  recipe: Fp8Recipe
  stateless: bool  # in a loop body: current scaling, no delayed state


@dataclasses.dataclass
class _Fp8Run:
  """The FP8 GEMMs of one evaluation: which run in FP8, and the delayed scales they read.

  ``plan`` is ``None`` while a first evaluation finds the eligible GEMMs
  (``found``); then ``plan[i]`` says whether the ``i``-th runs in FP8.
  ``scales`` is the ``(gemms, 3)`` array of :func:`mpjax.fp8.delayed_scales`,
  a row for each FP8 GEMM under ``recipe`` with delayed scaling, in order;
  ``None`` runs every FP8 GEMM with current scaling.
  """

  plan: tuple[bool, ...] | None
  recipe: Fp8Recipe | None = None
  scales: jax.Array | None = None
  found: list[_Fp8Gemm] = dataclasses.field(default_factory=list)
  used: int = 0

  def delayed(self, gemm: _Fp8Gemm) -> bool:
    """Whether an FP8 GEMM keeps delayed state: outside loops, under the state's recipe."""
    return not gemm.stateless and gemm.recipe == self.recipe and gemm.recipe.scaling == "delayed"

  def next(self, gemm: _Fp8Gemm) -> tuple[bool, jax.Array | None]:
    """Whether the next eligible GEMM runs in FP8, and its scales (None: current scaling)."""
    index = len(self.found)
    self.found.append(gemm)
    if self.plan is None or index >= len(self.plan) or not self.plan[index]:
      return False, None
    if self.scales is None or not self.delayed(gemm):
      return True, None
    self.used += 1
    if self.used > self.scales.shape[0]:  # a state made for another model: see _run
      return True, None
    return True, self.scales[self.used - 1]


def _fp8_plan(found: Sequence[_Fp8Gemm]) -> tuple[bool, ...]:
  """Which of the eligible GEMMs run in FP8: all but those their recipe keeps in bf16."""
  plan = []
  for i, gemm in enumerate(found):
    keep = gemm.recipe.keep_bf16
    kept = (
      ("first" in keep and i == 0)
      or ("last" in keep and i == len(found) - 1)
      or any(fnmatch.fnmatchcase(gemm.path, k) for k in keep if k not in ("first", "last"))
    )
    plan.append(not kept)
  return tuple(plan)


@dataclasses.dataclass(frozen=True)
class _Ctx:
  policy: Policy
  rules: _Rules
  level: str
  remat: bool | None = False
  records: list[_Record] | None = None
  repeat: float = 1.0
  # In a custom_jvp rule, GEMMs may take tangents, which reverse mode transposes:
  # they run as plain bf16 x bf16 -> f32 GEMMs, not through mixed_dot's custom_vjp
  # (which JAX cannot transpose), so their transposes take an f32 cotangent.
  linear: bool = False
  fp8: _Fp8Run | None = None
  # In a loop body: one history cannot follow a GEMM that runs many times.
  stateless: bool = False
  # Called as probe(eqn, path, invals, outs) after each equation (mpjax.diagnose's replay).
  probe: Callable[[Any, str, list[Any], list[Any]], None] | None = None

  def scaled(self, repeat: float) -> _Ctx:
    return dataclasses.replace(self, repeat=self.repeat * repeat)


def _cast(x: Any, dtype: Any, kind: int = _ACT) -> Any:
  """``x`` as ``dtype``; a finite constant saturates at the target's finite range.

  Infinities stay infinite: ``-inf`` (the identity of a max, e.g. the
  ``initial`` of ``jnp.max`` in ``jax.nn.softmax``) is exact in every float
  dtype, and XLA simplifies ``max(x, -inf)`` away, which keeps softmax one kernel.
  """
  dtype = np.dtype(dtype)
  if x.dtype == dtype:
    return x
  saturate = kind == _LIT and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max
  if isinstance(x, np.ndarray | np.generic):  # a literal: cast now, not in the program
    big = float(jnp.finfo(dtype).max)
    x = np.asarray(x)
    return (np.where(np.isinf(x), x, np.clip(x, -big, big)) if saturate else x).astype(dtype)
  if saturate:
    big = float(jnp.finfo(dtype).max)
    x = jnp.where(jnp.isinf(x), x, jnp.clip(x, -big, big))
  return lax.convert_element_type(x, dtype)


def _is_lookup(eqn: Any, cls: str, kinds: Sequence[int], compute: np.dtype) -> bool:
  """Whether ``eqn`` looks up rows of an input table (an embedding) under bf16 compute.

  Such a lookup stands for a one-hot GEMM and returns the compute dtype, as
  that GEMM would; the residual stream that starts there then runs in bf16, as
  under Flax ``dtype=bfloat16``, jmp and Megatron-LM. fp16 keeps an f32 lookup
  (and so an f32 residual stream) for range, as ``torch.autocast`` does.
  """
  if eqn.primitive.name != "gather" or cls != "follow" or kinds[0] != _INPUT:
    return False
  table = eqn.invars[0].aval
  return (
    compute == np.dtype(jnp.bfloat16)
    and _castable(table.dtype)
    and table.ndim == 2
    and tuple(eqn.params["slice_sizes"]) == (1, table.shape[1])
  )


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
  """The one dtype of ``dtypes``, or f32 where they differ (bf16 and fp16 meet in f32)."""
  distinct = set(dtypes)
  return distinct.pop() if len(distinct) == 1 else _F32


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
  bind_params = eqn.primitive.get_bind_params(dict(eqn.params))
  out = eqn.primitive.bind(*invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _as_traced(eqn: Any, invals: Sequence[Any], kinds: Sequence[int]) -> list[Any]:
  """The operands back in the dtypes they were traced with."""
  return [
    _cast(x, v.aval.dtype, k) if _castable(v.aval.dtype) and x.dtype != v.aval.dtype else x
    for x, v, k in zip(invals, eqn.invars, kinds, strict=True)
  ]


def _dot_numbers(eqn: Any) -> Any:
  """A dot's ``((lhs, rhs) contracting, (lhs, rhs) batch)`` dims, ragged or not."""
  if eqn.primitive.name == "ragged_dot_general":
    return eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
  return eqn.params["dimension_numbers"]


def gemm_flops(eqn: Any) -> float:
  """The FLOPs (2 per multiply-add) of a GEMM or convolution equation; 0 for any other."""
  name = eqn.primitive.name
  out = math.prod(eqn.outvars[0].aval.shape)
  if name in ("dot_general", "ragged_dot_general"):
    (lc, _), _ = _dot_numbers(eqn)
    lhs = eqn.invars[0].aval.shape
    flops = 2.0 * out * math.prod(lhs[d] for d in lc)
    if (
      name == "ragged_dot_general"
      and not eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
    ):
      # The ragged dimension is contracted: the result has a group dimension
      # and each group contracts only its own rows.
      flops /= eqn.invars[2].aval.shape[0]
    return flops
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, *spatial)
    per_output = math.prod(rhs[d] for d in spec[1:])
    # An input dilation (the input gradient of a strided convolution) inserts zeros that no
    # multiply touches: of each window's taps only 1 in prod(lhs_dilation) is real.
    dilation = math.prod(eqn.params.get("lhs_dilation") or (1,))
    return 2.0 * out * per_output / eqn.params["batch_group_count"] / dilation
  return 0.0


def _explicit(eqn: Any) -> bool:
  """Whether a GEMM's dtypes were chosen by its author (a precision, a mixed or other dtype)."""
  lhs_t, rhs_t = (v.aval.dtype for v in eqn.invars[:2])
  pet = eqn.params.get("preferred_element_type")
  return (
    eqn.params.get("precision") is not None
    or eqn.params.get("group_offset") is not None
    or (eqn.primitive.name == "ragged_dot_general" and eqn.params.get("out_sharding") is not None)
    or (pet is not None and np.dtype(pet) != np.dtype(lhs_t))
    or lhs_t != rhs_t
    or not _castable(lhs_t)
  )


def _fp8_gemm(
  ctx: _Ctx, eqn: Any, kinds: Sequence[int], path: str, policy: Policy
) -> tuple[Fp8Recipe | None, jax.Array | None]:
  """The recipe (``None``: not in FP8) and delayed scales of a GEMM autocast lowers.

  FP8-eligible: a ``dot_general`` of which an operand is an input of the
  function (a layer's weight, or the model's input), outside ``custom_jvp``
  and ``custom_vjp`` functions.
  """
  if (
    policy.fp8 is None
    or ctx.fp8 is None
    or ctx.linear
    or eqn.primitive.name != "dot_general"
    or _INPUT not in kinds[:2]
  ):
    return None, None
  in_fp8, scales = ctx.fp8.next(_Fp8Gemm(path, policy.fp8, ctx.stateless))
  return (policy.fp8 if in_fp8 else None), scales


def _lower(
  ctx: _Ctx,
  eqn: Any,
  invals: list[Any],
  kinds: list[int],
  compute: np.dtype,
  fp8: tuple[Fp8Recipe | None, jax.Array | None] = (None, None),
):
  """A GEMM or convolution with compute-dtype operands and f32 accumulation (or FP8 ones)."""
  # Computed operands come cast already (see _eval_jaxpr), so that the backward
  # pass keeps the compute-dtype copy; an input (a weight) goes in as it is and
  # is cast inside, so no low-precision copy of it is kept.
  ops = [
    x if k == _INPUT or not _castable(x.dtype) else _cast(x, compute, k)
    for x, k in zip(invals, kinds, strict=True)
  ]
  if eqn.primitive.name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    recipe, scales = fp8
    if recipe is not None:
      out = fp8_dot(ops[0], ops[1], scales, dims, recipe, compute, eqn.params.get("out_sharding"))
    else:
      dot = mixed_dot.fun if ctx.linear else mixed_dot
      out = dot(ops[0], ops[1], dims, compute, eqn.params.get("out_sharding"))
  elif eqn.primitive.name == "ragged_dot_general":
    ragged = mixed_ragged_dot.fun if ctx.linear else mixed_ragged_dot
    out = ragged(*ops, eqn.params["ragged_dot_dimension_numbers"], compute)
  else:
    conv_params = {
      k: v for k, v in eqn.params.items() if k not in ("precision", "preferred_element_type")
    }
    conv = mixed_conv.fun if ctx.linear else mixed_conv
    out = conv(ops[0], ops[1], tuple(sorted(conv_params.items())), compute)
  if ctx.remat:
    out = checkpoint_name(out, _SAVED)
  if ctx.level == "gemm_only":
    out = out.astype(eqn.outvars[0].aval.dtype)
  return [out]


def _run_class(
  ctx: _Ctx,
  eqn: Any,
  cls: str,
  invals: list[Any],
  kinds: list[int],
  compute: np.dtype,
  fp8: tuple[Fp8Recipe | None, jax.Array | None] = (None, None),
) -> list[Any]:
  if cls == "lower" and not _explicit(eqn):
    return _lower(ctx, eqn, invals, kinds, compute, fp8)
  if cls in ("lower", "keep"):
    return _bind(eqn, _as_traced(eqn, invals, kinds))
  traced = [np.dtype(v.aval.dtype) if _castable(v.aval.dtype) else None for v in eqn.invars]
  invals = list(invals)
  if cls == "fp32":
    for i, t in enumerate(traced):
      if t is not None:
        invals[i] = _cast(invals[i], _F32, kinds[i])
    return _bind(eqn, invals)
  # promote / follow: operands traced in one dtype get one dtype again.
  result_dtype = None
  for group in {t for t in traced if t is not None}:
    idx = [i for i, t in enumerate(traced) if t == group]
    if cls == "follow":
      target = invals[idx[0]].dtype
    else:
      cands = [i for i in idx if kinds[i] != _LIT and invals[i].ndim > 0]
      cands = cands or [i for i in idx if kinds[i] != _LIT] or idx
      target = _widest([np.dtype(invals[i].dtype) for i in cands])
      if any(kinds[i] == _GEMM for i in idx) and all(kinds[i] != _ACT for i in idx):
        # A GEMM's bias joins the GEMM's result in its dtype, as in torch's
        # linear(x, weight, bias); the add itself runs in f32, so the bias
        # gradient (a sum over the batch) accumulates in f32.
        result_dtype = next(invals[i].dtype for i in idx if kinds[i] == _GEMM)
    for i in idx:
      invals[i] = _cast(invals[i], target, kinds[i])
  outs = _bind(eqn, invals)
  if result_dtype is not None:
    outs = [_cast(o, result_dtype) for o in outs]
  return outs


def module_of(path: str) -> str:
  """A name-stack path without JAX's transformation wrappers.

  ``"transpose(jvp(MLP))/Dense_1"`` -> ``"MLP/Dense_1"``: what a module's
  operations are called wherever they run (forward, backward, under ``vmap``).
  """
  return re.sub(r"[A-Za-z_]\w*\(|\)", "", path).strip("/")


def _scope(ctx: _Ctx, path: str) -> Policy:
  """The policy of the first rule whose glob matches ``path``, with or without its wrappers."""
  module = module_of(path)
  for pattern, policy in ctx.rules.scopes:
    if fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(module, pattern):
      return policy
  return ctx.policy


def _eval_jaxpr(
  ctx: _Ctx,
  jaxpr: Any,
  consts: Sequence[Any],
  args: Sequence[Any],
  kinds: Sequence[int],
  prefix: str = "",
  out_kinds: list[int] | None = None,
) -> list[Any]:
  """Evaluates ``jaxpr`` with autocast; ``kinds`` says how each argument came about.

  ``out_kinds``, when given, is filled with how each output came about.
  """
  env: dict[Any, tuple[Any, int]] = {}
  operands: dict[tuple[Any, np.dtype], Any] = {}

  def operand(v, x, kind, dtype):
    """A computed GEMM operand in ``dtype``: cast once, and under remat kept for the backward."""
    if kind != _ACT or not _castable(v.aval.dtype):  # a ragged dot's group sizes stay
      return x
    if (v, dtype) not in operands:
      x = _cast(x, dtype)
      operands[v, dtype] = checkpoint_name(x, _SAVED) if ctx.remat else x
    return operands[v, dtype]

  def read(v):
    if isinstance(v, jcore.Literal):
      return np.asarray(v.val, v.aval.dtype) if hasattr(v.aval, "dtype") else v.val, _LIT
    return env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = (x, _INPUT)  # closed-over arrays count as inputs, as weights often are
  for v, x, k in zip(jaxpr.invars, args, kinds, strict=True):
    env[v] = (x, k)

  base = source_info_util.current_name_stack()
  for eqn in jaxpr.eqns:
    # Each operation is bound under its equation's name stack (after the one
    # it runs in, e.g. jvp()) and traceback, as jax.core.eval_jaxpr binds it:
    # module paths survive for audit, profiles and HLO metadata.
    info = eqn.source_info
    with source_info_util.user_context(info.traceback, name_stack=base + info.name_stack):
      invals, in_kinds = zip(*map(read, eqn.invars), strict=True) if eqn.invars else ((), ())
      invals, in_kinds = list(invals), list(in_kinds)
      name = eqn.primitive.name
      local = str(eqn.source_info.name_stack)
      path = "/".join(p for p in (prefix, local) if p)
      if name in _ENTERED:
        # A jit-like call is transparent: its outputs came about as they did
        # inside it (a lookup or GEMM inside jnp.take or jnp.einsum stays one).
        inner_kinds: list[int] = []
        outs = _enter(ctx, eqn, invals, in_kinds, path, inner_kinds)
        result_kinds = inner_kinds or [_ACT] * len(outs)
      else:
        policy = _scope(ctx, path)
        compute = np.dtype(policy.compute_dtype)
        cls = ctx.rules.classes.get(name)
        if cls is None:
          _warn_unknown(name)
          cls = "keep"
        if compute == _F32 or (ctx.level == "gemm_only" and cls != "lower"):
          cls = "keep"
        elif cls == "fp32" and name in _FP16_RANGE and compute != np.dtype(jnp.float16):
          cls = "follow"
        fp8 = (None, None)
        if cls == "lower" and not _explicit(eqn):
          invals = [operand(*a, compute) for a in zip(eqn.invars, invals, in_kinds, strict=True)]
          fp8 = _fp8_gemm(ctx, eqn, in_kinds, path, policy)
        outs = _run_class(ctx, eqn, cls, invals, in_kinds, compute, fp8)
        lookup = _is_lookup(eqn, cls, in_kinds, compute)
        if lookup:
          outs = [_cast(outs[0], compute)]
        if all(k == _LIT for k in in_kinds):
          out_kind = _LIT
        elif lookup:
          out_kind = _GEMM
        elif name in _VIEWS and in_kinds[0] in (_INPUT, _GEMM):
          out_kind = in_kinds[0]
        elif cls == "lower":  # f32 scopes were turned to "keep" above
          out_kind = _GEMM
        else:
          out_kind = _ACT
        result_kinds = [out_kind] * len(outs)
        if ctx.records is not None:
          flops = gemm_flops(eqn)
          out_dtype = next((o.dtype for o in outs if hasattr(o, "dtype")), None)
          traced_half = any(
            _castable(v.aval.dtype) and np.dtype(v.aval.dtype).itemsize < 4 for v in eqn.invars
          )
          lowered = flops > 0 and (
            traced_half or (cls == "lower" and eqn.params.get("precision") is None)
          )
          ctx.records.append(
            _Record(path, cls, str(out_dtype), flops * ctx.repeat, lowered, ctx.repeat)
          )
    if ctx.probe is not None:
      ctx.probe(eqn, path, invals, outs)
    for v, x, k in zip(eqn.outvars, outs, result_kinds, strict=True):
      if not isinstance(v, jcore.DropVar):
        env[v] = (x, k)

  if out_kinds is not None:
    out_kinds[:] = [read(v)[1] for v in jaxpr.outvars]
  return [read(v)[0] for v in jaxpr.outvars]


def _eval_closed(ctx, closed, args, kinds, prefix, out_kinds=None):
  return _eval_jaxpr(ctx, closed.jaxpr, closed.consts, args, kinds, prefix, out_kinds)


def _to_dtypes(xs: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
  """The floating ``xs`` cast to the dtypes of ``avals`` (float0 tangents stay)."""
  return [
    _cast(x, a.dtype) if _castable(a.dtype) and _castable(getattr(x, "dtype", None)) else x
    for x, a in zip(xs, avals, strict=True)
  ]


def _avals_as(xs: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
  """The abstract values of ``xs`` (sharding, varying axes) with the dtypes of ``avals``."""
  return [
    jax.typeof(x).update(dtype=a.dtype) if _castable(a.dtype) and _castable(x.dtype) else x
    for x, a in zip(xs, avals, strict=True)
  ]


def _enter(
  ctx: _Ctx,
  eqn: Any,
  invals: list[Any],
  kinds: list[int],
  path: str,
  out_kinds: list[int] | None = None,
) -> list[Any]:
  """Runs a higher-order primitive with autocast applied inside it.

  For a jit-like call, ``out_kinds`` is filled with how its outputs came about.
  """
  name, p = eqn.primitive.name, eqn.params
  out_avals = [v.aval for v in eqn.outvars]

  if name in ("jit", "pjit", "closed_call", "core_call"):
    closed = p["jaxpr"] if "jaxpr" in p else p["call_jaxpr"]
    return _eval_closed(ctx, closed, invals, kinds, path, out_kinds)

  if name in ("remat2", "checkpoint"):

    def body(*xs):
      return _eval_jaxpr(ctx, p["jaxpr"], (), xs, kinds, path)

    return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals))

  if name == "cond":
    branches = p["branches"]

    def branch(closed):
      return lambda *xs: _to_dtypes(_eval_closed(ctx, closed, xs, kinds[1:], path), out_avals)

    return list(lax.switch(invals[0], [branch(b) for b in branches], *invals[1:]))

  if name == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    ck, bk = kinds[:cn], kinds[cn : cn + bn]
    carry_avals = p["body_jaxpr"].out_avals
    n = len(init)

    ctx = dataclasses.replace(ctx, stateless=True)

    def cond_fun(carry):
      out = _eval_closed(ctx, p["cond_jaxpr"], [*cconsts, *carry], [*ck, *[_ACT] * n], path)
      return out[0]

    def body_fun(carry):
      out = _eval_closed(ctx, p["body_jaxpr"], [*bconsts, *carry], [*bk, *[_ACT] * n], path)
      return tuple(_to_dtypes(out, carry_avals))

    return list(lax.while_loop(cond_fun, body_fun, tuple(_to_dtypes(init, carry_avals))))

  if name == "scan":
    (nc, ncarry), closed = scan_layout(p), p["jaxpr"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    xkinds = kinds[nc + ncarry :]
    carry_avals = closed.out_avals[:ncarry]
    inner = dataclasses.replace(ctx.scaled(p["length"]), stateless=True)

    def scan_body(carry, x):
      args = [*consts, *carry, *x]
      ks = [*kinds[:nc], *[_ACT] * ncarry, *xkinds]
      out = _eval_closed(inner, closed, args, ks, path)
      return tuple(_to_dtypes(out[:ncarry], carry_avals)), tuple(out[ncarry:])

    carry, ys = lax.scan(
      scan_body,
      tuple(_to_dtypes(init, carry_avals)),
      tuple(xs),
      length=p["length"],
      reverse=p["reverse"],
      unroll=p["unroll"],
    )
    return [*carry, *ys]

  if name == "shard_map":

    def body(*xs):  # a tuple, as out_specs is
      return tuple(_eval_jaxpr(ctx, p["jaxpr"], (), xs, kinds, path))

    mapped = jax.shard_map(
      body,
      mesh=p["mesh"],
      in_specs=p["in_specs"],
      out_specs=p["out_specs"],
      check_vma=p["check_vma"],
      axis_names=shard_map_manual_axes(p),
    )
    return list(mapped(*invals))

  if name == "custom_jvp_call":
    return _custom_jvp(ctx, eqn, invals, kinds, path)
  return _custom_vjp(ctx, eqn, invals, kinds, path)


def _custom_jvp(ctx, eqn, invals, kinds, path):
  """The primal and the user's JVP rule, both autocast; tangents follow their primals."""
  ctx = dataclasses.replace(ctx, fp8=None)  # evaluated more than once: no FP8 GEMMs
  call = eqn.params["call_jaxpr"]
  in_avals = call.in_avals

  def primal(*xs):
    return _eval_closed(ctx, call, xs, kinds, path)

  def rule(primals, tangents):
    _, jvp = eqn.primitive.get_bind_params(dict(eqn.params))["subfuns"]
    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *primals)]
    # The rule, traced at the dtypes it was written for (actual values keep
    # their sharding and varying axes), then autocast like the primal.
    jvp_jaxpr = jax.make_jaxpr(lambda *a: jvp.call_wrapped(*a))(
      *_avals_as(primals, in_avals), *_avals_as(tangents, in_avals)
    )
    tkinds = [_ACT] * len(tangents)
    # Reverse mode transposes what the rule does to tangents: no checkpoint
    # names (JAX names no tangent either) and no custom_vjp GEMMs.
    plain = dataclasses.replace(ctx, remat=False, linear=True)
    outs = _eval_closed(plain, jvp_jaxpr, [*primals, *tangents], [*kinds, *tkinds], path)
    n = len(out_dtypes)
    primal_out = [_cast(o, d) for o, d in zip(outs[:n], out_dtypes, strict=True)]
    tangent_out = [
      _cast(t, d) if _castable(d) else t for t, d in zip(outs[n:], out_dtypes, strict=True)
    ]
    return primal_out, tangent_out

  f = jax.custom_jvp(primal)
  f.defjvp(rule)
  return list(f(*invals))


def _custom_vjp(ctx, eqn, invals, kinds, path):
  """The primal autocast; under differentiation the user's fwd and bwd run as traced."""
  ctx = dataclasses.replace(ctx, fp8=None)  # evaluated more than once: no FP8 GEMMs
  call = eqn.params["call_jaxpr"]
  in_avals = call.in_avals
  in_dtypes = [x.dtype for x in invals]

  def original(*xs):
    return _bind(eqn, xs)

  def primal(*xs):
    return _eval_closed(ctx, call, xs, kinds, path)

  def fwd(*xs):
    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *xs)]
    outs, vjp_fn = jax.vjp(original, *_to_dtypes(xs, in_avals))
    return [_cast(o, d) for o, d in zip(outs, out_dtypes, strict=True)], vjp_fn

  def bwd(vjp_fn, cts):
    cts = _to_dtypes(cts, call.out_avals)
    grads = vjp_fn(list(cts))
    return tuple(
      _cast(g, d) if _castable(d) and _castable(g.dtype) else g
      for g, d in zip(grads, in_dtypes, strict=True)
    )

  f = jax.custom_vjp(primal)
  f.defvjp(fwd, bwd)
  return list(f(*invals))


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray | np.generic)


def _all_f32(policy: Policy, rules: _Rules) -> bool:
  """Whether everything computes in f32 (no module rule lowers any): autocast changes nothing."""
  return all(np.dtype(p.compute_dtype) == _F32 for p in (policy, *(p for _, p in rules.scopes)))


def _check(fn: Any, policy: Any, rules: Any, level: str) -> tuple[Policy, _Rules]:
  if not callable(fn):
    raise TypeError(f"autocast: fn must be callable, got {type(fn).__name__}.")
  policy = get_policy(policy)
  parsed = _parse_rules(rules)
  if level not in LEVELS:
    raise ValueError(f"autocast: level={level!r} is not one of {', '.join(map(repr, LEVELS))}.")
  return policy, parsed


def _saved_for_backward(prim: Any, *_: Any, **params: Any) -> bool:
  """The remat policy: what the backward pass keeps rather than computes again (see _SAVED)."""
  if prim.name == "name":
    return params["name"] == _SAVED
  return prim.name in _KEPT or prim.name not in OP_CLASSES


_CACHE_SIZE = 32


def _with_arrays(
  fn: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[int]
) -> Callable[..., Any]:
  """``fn`` as a function of the array leaves at ``dynamic``; the other leaves stay as given."""

  def flat_fn(*xs):
    full = list(leaves)
    for i, x in zip(dynamic, xs, strict=True):
      full[i] = x
    a, k = jax.tree.unflatten(treedef, full)
    return fn(*a, **k)

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

  flat_fn = _with_arrays(fn, leaves, treedef, dynamic)
  with softmax_custom_jvp(not remat or softmax_custom_jvp.value):
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*(leaves[i] for i in dynamic))
  out_leaves, out_tree = jax.tree.flatten(out_shape)
  traced = closed, out_tree, [_castable(o.dtype) for o in out_leaves], {}
  # A function that closes over another transformation's tracers is traced anew
  # each call: its jaxpr holds them.
  if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
    cache[key] = traced
    if len(cache) > _CACHE_SIZE:
      cache.popitem(last=False)
  return traced


def _uses_fp8(ctx: _Ctx) -> bool:
  return ctx.policy.fp8 is not None or any(p.fp8 is not None for _, p in ctx.rules.scopes)


def _run(
  ctx: _Ctx,
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
  dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
  arrays = [leaves[i] for i in dynamic]
  remat = lowering_platform(arrays) == "cpu" if ctx.remat is None else ctx.remat
  closed, out_tree, floating, learnt = _trace(fn, leaves, treedef, dynamic, cache, remat)
  # Side effects (prints, callbacks) would run again in the recomputation.
  remat = remat and not closed.effects
  ctx = dataclasses.replace(ctx, remat=remat)

  def evaluate(xs, fp8):
    return _eval_closed(dataclasses.replace(ctx, fp8=fp8), closed, xs, [_INPUT] * len(xs), "")

  plan = None
  if _uses_fp8(ctx):
    if "fp8" not in learnt:  # which GEMMs are eligible: one evaluation, shapes only
      found = _Fp8Run(plan=None)
      jax.eval_shape(lambda xs: evaluate(xs, found), arrays)
      learnt["fp8"] = (_fp8_plan(found.found), tuple(found.found))
    plan, found = learnt["fp8"]
    if count_fp8:
      delayed = _Fp8Run(plan, ctx.policy.fp8).delayed
      return sum(in_fp8 and delayed(g) for g, in_fp8 in zip(found, plan, strict=True))
  elif count_fp8:
    return 0

  def run(scales, *xs):
    fp8 = None if plan is None else _Fp8Run(plan, ctx.policy.fp8, scales)
    outs = evaluate(xs, fp8)
    if scales is not None and (fp8 is None or fp8.used != scales.shape[0]):
      raise ValueError(
        f"FP8 state: the train state holds the state of {scales.shape[0]} FP8 GEMMs but the "
        f"loss function has {0 if fp8 is None else fp8.used}; was the state made for another "
        "model? Start from TrainState.create (its first step makes the state), or "
        "mpjax.init_fp8_state."
      )
    return outs

  if remat:
    run = jax.checkpoint(run, policy=_saved_for_backward)
  outs = run(fp8_scales, *arrays)
  out_dtype = np.dtype(ctx.policy.output_dtype)
  outs = [_cast(x, out_dtype) if f else x for x, f in zip(outs, floating, strict=True)]
  return jax.tree.unflatten(out_tree, outs)


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
  range). Floating outputs come back in ``policy.output_dtype``.
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
      ``{"tanh": "fp32"}``. A glob with ``*`` or ``/`` matches the name stack
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
      second time (on an H100-compiled LM step: 34 extra standalone casts and
      1.16x the kernels of fp32, against 1.03x without). Without remat,
      ``jax.nn.softmax`` is traced as JAX's custom-JVP softmax, whose backward
      XLA:GPU fuses into one kernel (see ``jax_softmax_custom_jvp``). A ``fn``
      with side effects (prints, callbacks) is not rematerialised, so they run once.

  Returns:
    The autocast function.

  Raises:
    ValueError: for a policy that cannot be read, a rule naming an unknown
      primitive, class or policy, or an unknown level.

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
  ctx = _Ctx(policy, parsed, level, remat)
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
  ctx = _Ctx(*_check(fn, policy, rules, "full"), "full", None)
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
  ctx = _Ctx(*_check(fn, policy, rules, "full"), "full", None)
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
  records: list[_Record] = []
  ctx = _Ctx(policy, parsed, level, records=records)
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
