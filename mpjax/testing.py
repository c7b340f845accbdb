"""chex-style assertions for the numerics of your own models under mixed precision.

Each raises an ``AssertionError`` whose message names the leaf or module at
fault and the figures, and returns nothing when the property holds:

- :func:`assert_matches_f32`: a function (a loss, a model's ``apply``) under a
  policy against its f32 run, outputs and gradients, within tolerances suited
  to the compute dtype;
- :func:`assert_fast_path`: every GEMM of a function (a train step: forward and
  backward) on the fast path, except the modules you keep in f32, which must be;
- :func:`assert_skip_keeps_state`: a non-finite batch leaves the whole state
  (params, optimizer, model and FP8 state, step) bit-identical;
- :func:`assert_checkpoint_round_trip`: a train state survives orbax bit-identically.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._extras import require_experiments
from mpjax.audit import audit
from mpjax.autocast import autocast
from mpjax.fp8 import Fp8State
from mpjax.policy import Policy, get_policy

__all__ = [
  "assert_checkpoint_round_trip",
  "assert_fast_path",
  "assert_matches_f32",
  "assert_skip_keeps_state",
]


def _raw(x: Any) -> np.ndarray:
  """A leaf as host bytes-comparable numpy (a typed PRNG key as its key data)."""
  if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(jax.device_get(x))


def default_tolerance(policy: Policy | str) -> float:
  """The relative tolerance :func:`assert_matches_f32` uses: 4 ulps of the compute dtype.

  bf16: 0.031, fp16: 0.0039, f32: 4.8e-7.
  """
  return 4 * float(jnp.finfo(get_policy(policy).compute_dtype).eps)


def _relative_errors(actual: Any, expected: Any) -> list[tuple[str, float]]:
  """(path, max |a - e| / max |e|) for each floating leaf, worst first."""
  errors = []
  for (path, a), e in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
  ):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    if not np.issubdtype(e.dtype, np.floating):
      continue
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    error = float(np.max(np.abs(a - e))) if e.size else 0.0
    if not np.all(np.isfinite(a)):
      error = float("inf")
    errors.append((jax.tree_util.keystr(path) or "(the value)", error / scale if scale else error))
  return sorted(errors, key=lambda pe: -pe[1])


def assert_matches_f32(
  fn: Callable[..., Any],
  *args: Any,
  policy: Policy | str = "mixed_bf16",
  rtol: float | None = None,
  grads: bool = True,
) -> None:
  """Asserts that ``fn`` under ``policy`` (autocast, jitted) matches its f32 run.

  Compares the outputs and, for a scalar output (a loss) with ``grads=True``,
  the gradients with respect to the first argument: for each floating leaf,
  ``max |x - x_f32| / max |x_f32| <= rtol``.

  Args:
    fn: the function, e.g. ``loss_fn(params, batch)``.
    *args: its arguments, in f32.
    policy: the policy to test.
    rtol: the tolerance; default :func:`default_tolerance` of the policy.
    grads: also compare gradients (when ``fn`` returns a scalar).

  Raises:
    AssertionError: naming the worst leaf, its error and the tolerance.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax.testing
    >>> w, x = jnp.ones((8, 4)) / 8, jnp.ones((2, 8))
    >>> mpjax.testing.assert_matches_f32(lambda w, x: jnp.mean(jnp.tanh(x @ w)), w, x)
  """
  rtol = default_tolerance(policy) if rtol is None else rtol
  mixed = autocast(fn, policy)
  out, ref = jax.jit(mixed)(*args), jax.jit(fn)(*args)
  checks = [("output", out, ref)]
  if grads and jnp.ndim(ref) == 0:
    checks.append(("gradient", jax.jit(jax.grad(mixed))(*args), jax.jit(jax.grad(fn))(*args)))
  for what, actual, expected in checks:
    errors = _relative_errors(actual, expected)
    if errors and errors[0][1] > rtol:
      path, error = errors[0]
      raise AssertionError(
        f"mpjax.testing: {what} {path} under {get_policy(policy)} is off its f32 value by "
        f"{error:.3g} (max |x - x_f32| / max |x_f32|), above rtol={rtol:.3g}; "
        f"{sum(e > rtol for _, e in errors)} of {len(errors)} leaves exceed it. Keep the "
        "module in f32 with an autocast rule, or use a wider compute dtype."
      )


def assert_fast_path(fn: Callable[..., Any], *args: Any, f32_modules: Sequence[str] = ()) -> None:
  """Asserts that every GEMM of ``fn(*args)`` is on the fast path, but the f32 modules.

  Args:
    fn: the function, e.g. a jitted train step (forward and backward GEMMs).
    *args: its arguments.
    f32_modules: globs of module paths (as :func:`mpjax.audit` prints them) that
      must stay f32, e.g. ``["*head*"]``; each must match at least one GEMM.

  Raises:
    AssertionError: listing each GEMM off the fast path (module, shape, dtypes,
      flags), each f32 module that is not f32, and each glob that matched nothing.

  Example:
    >>> import jax, jax.numpy as jnp, mpjax, mpjax.testing
    >>> w, x = jnp.ones((16, 8)), jnp.ones((8, 16))
    >>> mpjax.testing.assert_fast_path(
    ...   jax.grad(mpjax.autocast(lambda w, x: jnp.sum(x @ w))), w, x)
  """
  report = audit(fn, *args)
  problems, matched = [], set()
  for row in report.rows:
    globs = [g for g in f32_modules if fnmatch.fnmatch(row.path, g)]
    matched.update(globs)
    where = f"{row.path or '(top level)'} {row.shape} {row.dtypes}"
    if globs:
      if "float32" not in (row.lhs_dtype, row.rhs_dtype):
        problems.append(f"{where}: expected in f32 ({globs[0]})")
    elif not row.fast:
      problems.append(f"{where}: {', '.join(f.code for f in row.flags) or 'not fast'}")
  problems += [f"f32 module glob {g!r} matched no GEMM" for g in f32_modules if g not in matched]
  if problems:
    raise AssertionError(
      f"mpjax.testing: {len(problems)} GEMM problem(s), fast-path share "
      f"{report.fast_path_share:.1%}:\n  " + "\n  ".join(problems)
    )


# What a skipped step moves: the loss scale (down, for a dynamic one) and the
# skip counter. Every other field of the state must come back bit-identical.
_MOVED_ON_A_SKIP = ("loss_scale", "skipped_steps")


def _kept_fields(state: Any) -> dict[str, Any]:
  """The state's fields a skipped step must keep: every pytree field but the moved ones."""
  if not dataclasses.is_dataclass(state):
    raise TypeError(
      f"mpjax.testing: the state is a {type(state).__name__}, not an mpjax.TrainState; pass "
      "the state the step takes (mpjax.TrainState.create(...))."
    )
  names = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
  return {n: getattr(state, n) for n in names if n not in _MOVED_ON_A_SKIP}


def _first_change(name: str, old: Any, new: Any, state: Any) -> str | None:
  """The path of the first leaf of field ``name`` that differs, or ``None``."""
  if name == "fp8" and old is None and isinstance(new, Fp8State):
    # A state without its FP8 state yet: the step makes the initial one (what
    # mpjax.init_fp8_state gives), and a skipped step must leave it at that.
    old = Fp8State.initial(state.policy.fp8, new.gemms)
  if jax.tree.structure(old) != jax.tree.structure(new):
    return name
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new), strict=True
  ):
    a, b = _raw(a), _raw(b)
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
      return name + jax.tree_util.keystr(path)
  return None


def assert_skip_keeps_state(step: Callable[..., Any], state: Any, bad_batch: Any) -> None:
  """Asserts that a train step skips a non-finite batch and leaves the state as it was.

  The step runs on a copy of ``state`` (it may donate); its metrics must say
  the gradients were not finite, and every field of the state but the loss
  scale and ``skipped_steps`` must be bit-identical to before: ``step``,
  params, optimizer state, model state (e.g. BatchNorm statistics) and the FP8
  state (a state without one yet may come back with the initial one, scales
  of 1 and an empty history), with one more skipped step.

  Args:
    step: a train step from :func:`mpjax.make_train_step` (jitted or not) that
      checks gradients (fp16, a loss scale, or ``skip_nonfinite=True``).
    state: an :class:`mpjax.TrainState`.
    bad_batch: a batch that makes the gradients non-finite (e.g. an inf input).

  Raises:
    AssertionError: if the gradients were finite (the premise fails), or a
      leaf the skip must keep changed (named, e.g. ``model_state['batch_stats']...``),
      or ``skipped_steps`` did not grow by one.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpjax, mpjax.testing
    >>> params = {"w": jnp.ones((4, 2))}
    >>> loss = lambda p, x: jnp.mean((x @ p["w"]).astype(jnp.float32) ** 2)
    >>> state = mpjax.TrainState.create(
    ...     apply_fn=None, params=params, tx=optax.adam(1e-3), policy="mixed_fp16")
    >>> step = jax.jit(mpjax.make_train_step(loss))
    >>> mpjax.testing.assert_skip_keeps_state(step, state, jnp.full((8, 4), jnp.inf))
  """
  kept = jax.tree.map(_raw, _kept_fields(state))
  skipped_before = int(state.skipped_steps)
  new_state, metrics = step(jax.tree.map(jnp.copy, state), bad_batch)
  if "grads_finite" not in metrics:
    raise AssertionError(
      "mpjax.testing: the step does not check gradients (no 'grads_finite' metric); make it "
      "with skip_nonfinite=True, or use fp16 / a loss scale."
    )
  if bool(metrics["grads_finite"]):
    raise AssertionError(
      "mpjax.testing: the batch gave finite gradients, so nothing was skipped; pass a batch "
      "that overflows (e.g. an inf input)."
    )
  after = _kept_fields(new_state)
  for name in _kept_fields(state):  # in the order of the state's fields
    changed = _first_change(name, kept[name], after[name], state)
    if changed is not None:
      raise AssertionError(f"mpjax.testing: a skipped step changed {changed}.")
  if int(new_state.skipped_steps) != skipped_before + 1:
    raise AssertionError(
      f"mpjax.testing: after a skipped step, skipped_steps {skipped_before} -> "
      f"{int(new_state.skipped_steps)}; expected it to grow by one."
    )


def assert_checkpoint_round_trip(state: Any, directory: str | None = None) -> None:
  """Asserts that ``state`` survives an orbax save and restore bit-identically.

  Saves with ``orbax.checkpoint.StandardCheckpointer`` and restores into the
  state's abstract structure, as a resumed run does.

  Args:
    state: an :class:`mpjax.TrainState` or any pytree.
    directory: where to write; default a temporary directory.

  Raises:
    AssertionError: naming the first leaf that differs in value or dtype.

  Example:
    >>> import jax.numpy as jnp, mpjax, mpjax.testing
    >>> mpjax.testing.assert_checkpoint_round_trip({"scale": mpjax.DynamicLossScale()})
  """
  require_experiments("mpjax.testing.assert_checkpoint_round_trip", ("orbax.checkpoint",))
  import orbax.checkpoint as ocp

  with tempfile.TemporaryDirectory() as tmp:
    path = f"{directory or tmp}/mpjax_round_trip"
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, state)
      ckptr.wait_until_finished()
      restored = ckptr.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  if jax.tree.structure(restored) != jax.tree.structure(state):
    raise AssertionError("mpjax.testing: the restored state has another tree structure.")
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(restored), strict=True
  ):
    a, b = _raw(a), _raw(b)
    if a.dtype != b.dtype or a.tobytes() != b.tobytes():
      raise AssertionError(
        f"mpjax.testing: {jax.tree_util.keystr(path)} did not survive the checkpoint: "
        f"{a.dtype}{list(a.shape)} saved, {b.dtype}{list(b.shape)} restored"
        + ("" if a.dtype != b.dtype else ", values differ")
        + "."
      )
