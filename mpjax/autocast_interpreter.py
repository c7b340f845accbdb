"""Autocast's interpreter: a jaxpr evaluated with each operation in its class's precision.

:func:`eval_closed` evaluates a closed jaxpr equation by equation under an
:class:`EvalContext` (the policy, the parsed rules, the level, remat, FP8 and
a probe called after each equation), casting each operation's operands as its
class (:mod:`mpjax.op_classes`) calls for, lowering GEMMs and convolutions to
:mod:`mpjax.gemm`'s mixed-precision ones (or :func:`mpjax.fp8.fp8_dot`), and
entering higher-order primitives (``jit``, ``cond``, ``while``, ``scan``,
``remat``, ``shard_map``, ``custom_jvp``, ``custom_vjp``). Each value carries
how it came about (:data:`LITERAL`, :data:`INPUT`, :data:`COMPUTED`,
:data:`GEMM_RESULT`), which decides promotion, lookups and FP8 eligibility.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from mpjax._dtypes import is_castable_dtype as _castable
from mpjax.block_scaled import BlockScaledRecipe, block_scaled_dot
from mpjax.fp8 import Fp8Recipe, fp8_dot
from mpjax.fp8_plan import Fp8Gemm, Fp8Run
from mpjax.gemm import SAVED as _SAVED
from mpjax.gemm import mixed_conv, mixed_dot, mixed_ragged_dot
from mpjax.gemm_equations import gemm_flops
from mpjax.hlo import dot_dims
from mpjax.jax_compat import scan_layout, shard_map_manual_axes, source_info_util
from mpjax.op_classes import ENTERED, FP16_RANGE, VIEWS, Rules, module_of, warn_unclassified
from mpjax.policy import Policy

_F32 = np.dtype(jnp.float32)

# How each value came about: from literals only; from the function's inputs
# (or closed-over arrays) through views only; computed; or the result of a
# lowered GEMM or convolution (through views only).
LITERAL, INPUT, COMPUTED, GEMM_RESULT = 0, 1, 2, 3


@dataclasses.dataclass
class OpRecord:
  """One operation as autocast ran it (what :func:`mpjax.autocast_report` counts)."""

  path: str
  op_class: str
  dtype: str
  flops: float
  lowered: bool
  count: float


@dataclasses.dataclass(frozen=True)
class EvalContext:
  """How :func:`eval_closed` evaluates: policy, rules, level, remat, FP8 run, probe."""

  policy: Policy
  rules: Rules
  level: str
  remat: bool | None = False
  records: list[OpRecord] | None = None
  repeat: float = 1.0
  # In a custom_jvp rule, GEMMs may take tangents, which reverse mode transposes:
  # they run as plain bf16 x bf16 -> f32 GEMMs, not through mixed_dot's custom_vjp
  # (which JAX cannot transpose), so their transposes take an f32 cotangent.
  linear: bool = False
  fp8: Fp8Run | None = None
  # In a loop body: one history cannot follow a GEMM that runs many times.
  stateless: bool = False
  # Called as probe(eqn, path, invals, outs) after each equation (mpjax.diagnose's replay).
  probe: Callable[[Any, str, list[Any], list[Any]], None] | None = None

  def scaled(self, repeat: float) -> EvalContext:
    return dataclasses.replace(self, repeat=self.repeat * repeat)


def cast_value(x: Any, dtype: Any, kind: int = COMPUTED) -> Any:
  """``x`` as ``dtype``; a finite constant saturates at the target's finite range.

  Infinities stay infinite: ``-inf`` (the identity of a max, e.g. the
  ``initial`` of ``jnp.max`` in ``jax.nn.softmax``) is exact in every float
  dtype, and XLA simplifies ``max(x, -inf)`` away, which keeps softmax one kernel.
  """
  dtype = np.dtype(dtype)
  if x.dtype == dtype:
    return x
  saturate = kind == LITERAL and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max
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
  if eqn.primitive.name != "gather" or cls != "follow" or kinds[0] != INPUT:
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
    cast_value(x, v.aval.dtype, k) if _castable(v.aval.dtype) and x.dtype != v.aval.dtype else x
    for x, v, k in zip(invals, eqn.invars, kinds, strict=True)
  ]


def _explicit(eqn: Any, compute: np.dtype) -> bool:
  """Whether a GEMM's dtypes were chosen by its author (a precision, a mixed or other dtype).

  An f32 operand meeting a compute-dtype one with an f32 result is no choice: it is what
  ``x @ w`` gives for an f32 activation and a bf16-stored (or bf16-gathered) weight.
  """
  lhs_t, rhs_t = (np.dtype(v.aval.dtype) for v in eqn.invars[:2])
  pet = eqn.params.get("preferred_element_type")
  promoted = {lhs_t, rhs_t} == {compute, _F32} and (pet is None or np.dtype(pet) == _F32)
  return (
    eqn.params.get("precision") is not None
    or eqn.params.get("group_offset") is not None
    or (eqn.primitive.name == "ragged_dot_general" and eqn.params.get("out_sharding") is not None)
    or (not promoted and pet is not None and np.dtype(pet) != lhs_t)
    or (not promoted and lhs_t != rhs_t)
    or not _castable(lhs_t)
  )


def _fp8_gemm(
  ctx: EvalContext, eqn: Any, kinds: Sequence[int], path: str, policy: Policy
) -> tuple[Fp8Recipe | BlockScaledRecipe | None, jax.Array | None]:
  """The recipe (``None``: not in FP8) and delayed scales of a GEMM autocast lowers.

  FP8-eligible: a ``dot_general`` of which an operand is an input of the
  function (a layer's weight, or the model's input), outside ``custom_jvp``
  and ``custom_vjp`` functions; a block-scaled recipe runs those of them whose
  M, N and K fit its blocks (the others stay in the compute dtype).
  """
  if (
    policy.fp8 is None
    or ctx.fp8 is None
    or ctx.linear
    or eqn.primitive.name != "dot_general"
    or INPUT not in kinds[:2]
  ):
    return None, None
  in_fp8, scales = ctx.fp8.next(Fp8Gemm(path, policy.fp8, ctx.stateless))
  if in_fp8 and isinstance(policy.fp8, BlockScaledRecipe):
    # After the plan, so that keep_bf16's "first" and "last" name the same GEMMs as mixed_fp8's.
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    sizes = dot_dims(lhs, rhs, lc, rc, lb, rb)
    in_fp8 = policy.fp8.fits(sizes["M"], sizes["N"], sizes["K"])
  return (policy.fp8 if in_fp8 else None), scales


def _lower(
  ctx: EvalContext,
  eqn: Any,
  invals: list[Any],
  kinds: list[int],
  compute: np.dtype,
  fp8: tuple[Fp8Recipe | BlockScaledRecipe | None, jax.Array | None] = (None, None),
):
  """A GEMM or convolution with compute-dtype operands and f32 accumulation (or FP8 ones)."""
  # Computed operands come cast already (see _eval_jaxpr), so that the backward
  # pass keeps the compute-dtype copy; an input (a weight) goes in as it is and
  # is cast inside, so no low-precision copy of it is kept.
  ops = [
    x if k == INPUT or not _castable(x.dtype) else cast_value(x, compute, k)
    for x, k in zip(invals, kinds, strict=True)
  ]
  if eqn.primitive.name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    recipe, scales = fp8
    if isinstance(recipe, BlockScaledRecipe):
      inputs = (kinds[0] == INPUT, kinds[1] == INPUT)  # kept by the caller: saved as they are
      out = block_scaled_dot(ops[0], ops[1], dims, recipe, compute, inputs)
    elif recipe is not None:
      out = fp8_dot(ops[0], ops[1], scales, dims, recipe, compute, eqn.params.get("out_sharding"))
    else:
      reduce = ctx.policy.reduce_dtype
      if ctx.linear:
        out = mixed_dot.fun(ops[0], ops[1], dims, compute, eqn.params.get("out_sharding"))
      else:
        out = mixed_dot(ops[0], ops[1], dims, compute, eqn.params.get("out_sharding"), reduce)
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
  ctx: EvalContext,
  eqn: Any,
  cls: str,
  invals: list[Any],
  kinds: list[int],
  compute: np.dtype,
  fp8: tuple[Fp8Recipe | BlockScaledRecipe | None, jax.Array | None] = (None, None),
) -> list[Any]:
  if cls == "lower" and not _explicit(eqn, compute):
    return _lower(ctx, eqn, invals, kinds, compute, fp8)
  if cls in ("lower", "keep"):
    return _bind(eqn, _as_traced(eqn, invals, kinds))
  traced = [np.dtype(v.aval.dtype) if _castable(v.aval.dtype) else None for v in eqn.invars]
  invals = list(invals)
  if cls == "fp32":
    for i, t in enumerate(traced):
      if t is not None:
        invals[i] = cast_value(invals[i], _F32, kinds[i])
    return _bind(eqn, invals)
  # promote / follow: operands traced in one dtype get one dtype again.
  result_dtype = None
  for group in {t for t in traced if t is not None}:
    idx = [i for i, t in enumerate(traced) if t == group]
    if cls == "follow":
      target = invals[idx[0]].dtype
    else:
      cands = [i for i in idx if kinds[i] != LITERAL and invals[i].ndim > 0]
      cands = cands or [i for i in idx if kinds[i] != LITERAL] or idx
      target = _widest([np.dtype(invals[i].dtype) for i in cands])
      if any(kinds[i] == GEMM_RESULT for i in idx) and all(kinds[i] != COMPUTED for i in idx):
        # A GEMM's bias joins the GEMM's result in its dtype, as in torch's
        # linear(x, weight, bias); the add itself runs in f32, so the bias
        # gradient (a sum over the batch) accumulates in f32.
        result_dtype = next(invals[i].dtype for i in idx if kinds[i] == GEMM_RESULT)
    for i in idx:
      invals[i] = cast_value(invals[i], target, kinds[i])
  outs = _bind(eqn, invals)
  if result_dtype is not None:
    outs = [cast_value(o, result_dtype) for o in outs]
  return outs


def _scope(ctx: EvalContext, path: str) -> Policy:
  """The policy of the first rule whose glob matches ``path``, with or without its wrappers."""
  module = module_of(path)
  for pattern, policy in ctx.rules.scopes:
    if fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(module, pattern):
      return policy
  return ctx.policy


def _eval_jaxpr(
  ctx: EvalContext,
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
    if kind != COMPUTED or not _castable(v.aval.dtype):  # a ragged dot's group sizes stay
      return x
    if (v, dtype) not in operands:
      x = cast_value(x, dtype)
      operands[v, dtype] = checkpoint_name(x, _SAVED) if ctx.remat else x
    return operands[v, dtype]

  def read(v):
    if isinstance(v, jcore.Literal):
      return np.asarray(v.val, v.aval.dtype) if hasattr(v.aval, "dtype") else v.val, LITERAL
    return env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = (x, INPUT)  # closed-over arrays count as inputs, as weights often are
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
      if name in ENTERED:
        # A jit-like call is transparent: its outputs came about as they did
        # inside it (a lookup or GEMM inside jnp.take or jnp.einsum stays one).
        inner_kinds: list[int] = []
        outs = _enter(ctx, eqn, invals, in_kinds, path, inner_kinds)
        result_kinds = inner_kinds or [COMPUTED] * len(outs)
      else:
        policy = _scope(ctx, path)
        compute = np.dtype(policy.compute_dtype)
        cls = ctx.rules.classes.get(name)
        if cls is None:
          warn_unclassified(name)
          cls = "keep"
        if compute == _F32 or (ctx.level == "gemm_only" and cls != "lower"):
          cls = "keep"
        elif cls == "fp32" and name in FP16_RANGE and compute != np.dtype(jnp.float16):
          cls = "follow"
        fp8 = (None, None)
        if cls == "lower" and not _explicit(eqn, compute):
          invals = [operand(*a, compute) for a in zip(eqn.invars, invals, in_kinds, strict=True)]
          fp8 = _fp8_gemm(ctx, eqn, in_kinds, path, policy)
        outs = _run_class(ctx, eqn, cls, invals, in_kinds, compute, fp8)
        lookup = _is_lookup(eqn, cls, in_kinds, compute)
        if lookup:
          outs = [cast_value(outs[0], compute)]
        if all(k == LITERAL for k in in_kinds):
          out_kind = LITERAL
        elif lookup:
          out_kind = GEMM_RESULT
        elif name in VIEWS and in_kinds[0] in (INPUT, GEMM_RESULT):
          out_kind = in_kinds[0]
        elif cls == "lower":  # f32 scopes were turned to "keep" above
          out_kind = GEMM_RESULT
        else:
          out_kind = COMPUTED
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
            OpRecord(path, cls, str(out_dtype), flops * ctx.repeat, lowered, ctx.repeat)
          )
    if ctx.probe is not None:
      ctx.probe(eqn, path, invals, outs)
    for v, x, k in zip(eqn.outvars, outs, result_kinds, strict=True):
      if not isinstance(v, jcore.DropVar):
        env[v] = (x, k)

  if out_kinds is not None:
    out_kinds[:] = [read(v)[1] for v in jaxpr.outvars]
  return [read(v)[0] for v in jaxpr.outvars]


def eval_closed(ctx, closed, args, kinds, prefix, out_kinds=None):
  """Evaluates the closed jaxpr ``closed`` with autocast (see ``_eval_jaxpr``)."""
  return _eval_jaxpr(ctx, closed.jaxpr, closed.consts, args, kinds, prefix, out_kinds)


def _to_dtypes(xs: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
  """The floating ``xs`` cast to the dtypes of ``avals`` (float0 tangents stay)."""
  return [
    cast_value(x, a.dtype) if _castable(a.dtype) and _castable(getattr(x, "dtype", None)) else x
    for x, a in zip(xs, avals, strict=True)
  ]


def _avals_as(xs: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
  """The abstract values of ``xs`` (sharding, varying axes) with the dtypes of ``avals``."""
  return [
    jax.typeof(x).update(dtype=a.dtype) if _castable(a.dtype) and _castable(x.dtype) else x
    for x, a in zip(xs, avals, strict=True)
  ]


def _enter(
  ctx: EvalContext,
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
    return eval_closed(ctx, closed, invals, kinds, path, out_kinds)

  if name in ("remat2", "checkpoint"):

    def body(*xs):
      return _eval_jaxpr(ctx, p["jaxpr"], (), xs, kinds, path)

    return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals))

  if name == "cond":
    branches = p["branches"]

    def branch(closed):
      return lambda *xs: _to_dtypes(eval_closed(ctx, closed, xs, kinds[1:], path), out_avals)

    return list(lax.switch(invals[0], [branch(b) for b in branches], *invals[1:]))

  if name == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    ck, bk = kinds[:cn], kinds[cn : cn + bn]
    carry_avals = p["body_jaxpr"].out_avals
    n = len(init)

    ctx = dataclasses.replace(ctx, stateless=True)

    def cond_fun(carry):
      out = eval_closed(ctx, p["cond_jaxpr"], [*cconsts, *carry], [*ck, *[COMPUTED] * n], path)
      return out[0]

    def body_fun(carry):
      out = eval_closed(ctx, p["body_jaxpr"], [*bconsts, *carry], [*bk, *[COMPUTED] * n], path)
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
      ks = [*kinds[:nc], *[COMPUTED] * ncarry, *xkinds]
      out = eval_closed(inner, closed, args, ks, path)
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
    return eval_closed(ctx, call, xs, kinds, path)

  def rule(primals, tangents):
    _, jvp = eqn.primitive.get_bind_params(dict(eqn.params))["subfuns"]
    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *primals)]
    # The rule, traced at the dtypes it was written for (actual values keep
    # their sharding and varying axes), then autocast like the primal.
    jvp_jaxpr = jax.make_jaxpr(lambda *a: jvp.call_wrapped(*a))(
      *_avals_as(primals, in_avals), *_avals_as(tangents, in_avals)
    )
    tkinds = [COMPUTED] * len(tangents)
    # Reverse mode transposes what the rule does to tangents: no checkpoint
    # names (JAX names no tangent either) and no custom_vjp GEMMs.
    plain = dataclasses.replace(ctx, remat=False, linear=True)
    outs = eval_closed(plain, jvp_jaxpr, [*primals, *tangents], [*kinds, *tkinds], path)
    n = len(out_dtypes)
    primal_out = [cast_value(o, d) for o, d in zip(outs[:n], out_dtypes, strict=True)]
    tangent_out = [
      cast_value(t, d) if _castable(d) else t for t, d in zip(outs[n:], out_dtypes, strict=True)
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
    return eval_closed(ctx, call, xs, kinds, path)

  def fwd(*xs):
    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *xs)]
    outs, vjp_fn = jax.vjp(original, *_to_dtypes(xs, in_avals))
    return [cast_value(o, d) for o, d in zip(outs, out_dtypes, strict=True)], vjp_fn

  def bwd(vjp_fn, cts):
    cts = _to_dtypes(cts, call.out_avals)
    grads = vjp_fn(list(cts))
    return tuple(
      cast_value(g, d) if _castable(d) and _castable(g.dtype) else g
      for g, d in zip(grads, in_dtypes, strict=True)
    )

  f = jax.custom_vjp(primal)
  f.defvjp(fwd, bwd)
  return list(f(*invals))
