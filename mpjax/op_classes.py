"""Autocast's op classes: which precision each primitive runs in, and the ``rules`` that move them.

:data:`OP_CLASSES` gives each primitive autocast knows one of :data:`CLASSES`
(see :mod:`mpjax.autocast` for what each class does); :func:`parse_rules`
reads a user's ``rules`` (a primitive to a class, or a name-stack glob to a
policy) into :class:`Rules`, and :func:`check_declared` checks the rules that
name a primitive autocast does not know against the traced function's own;
:func:`module_of` is the module path those globs are matched against.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import re
from collections.abc import Mapping
from typing import Any

from mpjax.jaxpr_gemms import sub_jaxprs
from mpjax.policy import Policy, get_policy

_log = logging.getLogger("mpjax")

CLASSES = ("lower", "fp32", "promote", "follow", "keep")
LEVELS = ("full", "gemm_only")

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
  "one_minus_square "
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
FP16_RANGE = frozenset({"integer_pow"})

OP_CLASSES: Mapping[str, str] = {
  **{p: "keep" for p in _KEEP},
  **{p: "follow" for p in _FOLLOW},
  **{p: "promote" for p in _PROMOTE},
  **{p: "fp32" for p in _FP32},
  **{p: "lower" for p in _LOWER},
}
"""The default class of each primitive autocast knows; ``rules`` can move any of them."""

ENTERED = frozenset(
  "jit pjit closed_call core_call remat2 checkpoint custom_jvp_call custom_vjp_call cond "
  "while scan shard_map".split()
)
# What a primitive's name looks like (``pallas_call``, ``cudnn-fused-attention``...).
_PRIMITIVE_NAME = re.compile(r"[A-Za-z_][\w\-]*")
# Ops that only move data: a weight seen through one is still that weight (an FSDP model's
# weight gathered where it is used, through a sharding constraint, too).
VIEWS = frozenset(
  "reshape transpose broadcast_in_dim squeeze expand_dims slice sharding_constraint mesh_cast "
  "reshard".split()
)


@dataclasses.dataclass(frozen=True)
class Rules:
  classes: Mapping[str, str]
  scopes: tuple[tuple[str, Policy], ...]
  # primitives a rule classifies that autocast does not know (a Pallas kernel's
  # ``pallas_call``, a library's own primitive): checked once the function is traced
  declared: frozenset[str] = frozenset()


def parse_rules(rules: Mapping[str, str] | None) -> Rules:
  classes = dict(OP_CLASSES)
  scopes = []
  declared = set()
  if rules is None:
    return Rules(classes, ())
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
    if key in ENTERED:
      raise ValueError(
        f"autocast: rule {key!r}: autocast enters {key!r} and casts what runs inside it, so it "
        f"takes no class; to run a part of the function in f32, match its name stack, e.g. "
        "{'*attention*': 'fp32'}."
      )
    if key not in classes:
      typo = difflib.get_close_matches(key, list(OP_CLASSES), n=1, cutoff=0.8)
      if typo or not _PRIMITIVE_NAME.fullmatch(key):
        near = typo or difflib.get_close_matches(key, list(OP_CLASSES), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(
          f"autocast: rule {key!r} is neither a primitive autocast knows nor a name-stack "
          f"pattern.{hint} A module pattern needs a wildcard or a '/', e.g. '*{key}*'; the "
          "known primitives are the keys of mpjax.OP_CLASSES."
        )
      declared.add(key)  # a primitive autocast does not know: checked against the trace
    if value not in CLASSES:
      near = difflib.get_close_matches(str(value), CLASSES, n=1)
      hint = f" Did you mean {near[0]!r}?" if near else ""
      raise ValueError(
        f"autocast: rule {key!r}: {value!r} is not an op class; use one of "
        f"{', '.join(map(repr, CLASSES))}.{hint}"
      )
    classes[key] = value
  return Rules(classes, tuple(scopes), frozenset(declared))


def check_declared(rules: Rules, jaxpr: Any) -> None:
  """Checks each rule naming a primitive autocast does not know against ``jaxpr``'s primitives.

  Raises:
    ValueError: for a rule whose primitive is not in the function (a typo, or a
      module name without a wildcard), and for a class other than ``"keep"`` on
      a primitive that holds a program of its own (a ``pallas_call``): that
      program is typed for the dtypes it was traced with.
  """
  if not rules.declared:
    return
  holds_program: dict[str, bool] = {}

  def visit(j: Any) -> None:
    for eqn in j.eqns:
      subs = [sub for _, sub in sub_jaxprs(eqn)]
      name = eqn.primitive.name
      holds_program[name] = holds_program.get(name, False) or bool(subs)
      for sub in subs:
        visit(sub)

  visit(jaxpr)
  for name in sorted(rules.declared):
    if name not in holds_program:
      unknown = sorted(set(holds_program) - set(OP_CLASSES) - ENTERED)
      near = difflib.get_close_matches(name, [*unknown, *OP_CLASSES], n=1)
      hint = f" Did you mean {near[0]!r}?" if near else ""
      raise ValueError(
        f"autocast: rule {name!r} names no primitive of this function and none autocast "
        f"knows.{hint} The function's primitives autocast does not know: "
        f"{', '.join(unknown) or 'none'}; a module pattern needs a wildcard or a '/', e.g. "
        f"'*{name}*'."
      )
    if holds_program[name] and rules.classes[name] != "keep":
      raise ValueError(
        f"autocast: rule {name!r}: {rules.classes[name]!r} cannot run it: {name!r} holds a "
        "program typed for the dtypes it was traced with, so it runs as traced ('keep'). To "
        "run it in another dtype, cast its inputs in your function before it is traced."
      )


@functools.cache
def warn_unclassified(name: str) -> None:
  _log.warning(
    "autocast: primitive %r is not classified; it runs in the dtypes it was traced with (cast "
    "its inputs in your function to run it in another). rules={%r: 'keep'} says so and "
    "silences this; 'follow', 'promote' or 'fp32' cast its floating inputs instead, for a "
    "primitive that takes other dtypes.",
    name,
    name,
  )


def module_of(path: str) -> str:
  """A name-stack path without JAX's transformation wrappers.

  ``"transpose(jvp(MLP))/Dense_1"`` -> ``"MLP/Dense_1"``: what a module's
  operations are called wherever they run (forward, backward, under ``vmap``).
  """
  return re.sub(r"[A-Za-z_]\w*\(|\)", "", path).strip("/")
