"""The mixed-precision train step: scaled loss, unscaled fp32 grads, skip if non-finite."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from mpjax._backend import by_platform
from mpjax._dtypes import cast_floating, is_floating, to_f32
from mpjax.autocast import autocast as autocast_fn
from mpjax.autocast import autocast_with_fp8_scales, count_delayed_fp8_gemms
from mpjax.fp8 import Fp8State, advance, delayed_scales
from mpjax.layout import cast_shards, constrain_to_layout, mesh_in_context, splits_a_leaf
from mpjax.loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  all_finite,
  select_tree,
)
from mpjax.policy import Policy
from mpjax.rounding import rounded_update, uses_rounded_storage
from mpjax.train_state import MAKING_FP8_STATE, TrainState

__all__ = ["make_train_step"]

LossFn = Callable[[Any, Any], Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]


def _split_loss(out: Any) -> tuple[jax.Array, Any]:
  """``loss`` or ``(loss, aux)`` into ``(loss, aux)``, checking the loss is a float scalar."""
  if isinstance(out, (tuple, list)):
    if len(out) != 2:
      raise ValueError(
        f"loss_fn returned a {type(out).__name__} of {len(out)} items; it must return a "
        "scalar loss or a pair (loss, aux)."
      )
    loss, aux = out
  else:
    loss, aux = out, None
  shape = getattr(loss, "shape", None)
  if shape != () or not is_floating(loss):
    kind = (
      f"an array of shape {tuple(shape)} and dtype {loss.dtype}"
      if shape is not None
      else f"a {type(loss).__name__}"
    )
    raise ValueError(
      f"loss_fn must return a floating scalar loss (or (loss, aux)), but its loss is {kind}. "
      "Reduce it to a scalar, e.g. return jnp.mean(per_example_loss)."
    )
  return loss, aux


def _like(new: Any, old: Any) -> Any:
  """``new`` with the dtypes of ``old``, so the state keeps a stable dtype step after step."""
  return jax.tree.map(lambda n, o: n.astype(o.dtype) if hasattr(o, "dtype") else n, new, old)


def _as_varying(tree: Any, axis_name: Hashable | Sequence[Hashable]) -> Any:
  """Marks ``tree`` as per-device over ``axis_name``, so ``jax.grad`` gives local gradients.

  Under ``shard_map`` (which tracks what varies over each axis), the gradient
  of a replicated value that meets sharded data is summed over the devices by
  the transpose itself, in the compute dtype and on scaled values; the ``pmean``
  that follows would then leave that sum unchanged. With the params marked as
  varying, each device gets its own gradient and the ``pmean`` averages them in
  f32. Under ``pmap`` and ``check_vma=False`` the cast changes nothing.
  """
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)

  def vary(x):
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    varying = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    missing = tuple(n for n in names if n not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(vary, tree)


# The fused gradient norm (XLA:GPU): leaves per kernel (under XLA:GPU's limit
# of operands per fusion) and the row width of its reduction.
_LEAVES_PER_KERNEL = 64
_NORM_ROW = 1024


def _grad_norm(grads: Any, sharded: bool = False) -> jax.Array:
  """The global L2 norm of the (f32) gradients, read the way the backend reads fastest.

  XLA:GPU makes ``optax.tree.norm`` one or two reduction kernels per leaf (70
  more launches for a 4-layer transformer step, 200 for GPT-2 small's), and
  its simplifier splits a sum over the concatenated leaves back into those. A
  concatenation padded by at least one zero stays whole: XLA fuses it into one
  reduction kernel per 64 leaves that reads every gradient once and writes
  nothing their size. XLA:CPU keeps optax's per-leaf sums, which it fuses into
  the kernels that produce the gradients. The backend is the one XLA lowers
  for (:func:`by_platform`). Gradients ``sharded`` over devices (FSDP) keep the
  per-leaf sums everywhere: each device sums its shards and one scalar is
  all-reduced, where a concatenation would gather every gradient whole onto
  every device.
  """
  if sharded:
    return optax.tree.norm(grads)
  return by_platform(grads, cpu=optax.tree.norm, other=_fused_norm)


def _fused_norm(grads: Any) -> jax.Array:
  """The global L2 norm in one reduction kernel per 64 leaves (XLA:GPU)."""
  squares = [jnp.ravel(jnp.square(g)) for g in jax.tree.leaves(grads)]
  total = jnp.zeros((), jnp.float32)
  for i in range(0, len(squares), _LEAVES_PER_KERNEL):
    flat = jnp.concatenate(squares[i : i + _LEAVES_PER_KERNEL])
    flat = jnp.pad(flat, (0, _NORM_ROW - flat.size % _NORM_ROW))  # 1 to _NORM_ROW zeros
    total = total + jnp.sum(flat.reshape(-1, _NORM_ROW), dtype=jnp.float32)
  return jnp.sqrt(total)


def make_train_step(
  loss_fn: LossFn,
  *,
  axis_name: Hashable | Sequence[Hashable] | None = None,
  max_grad_norm: float | None = None,
  cast_batch: bool = True,
  cast_params: bool = True,
  autocast: bool | None = None,
  autocast_rules: Mapping[str, str] | None = None,
  with_model_state: bool = False,
  skip_nonfinite: bool | None = None,
) -> StepFn:
  """Builds a pure mixed-precision training step ``step(state, batch) -> (state, metrics)``.

  For a policy that computes in bf16 or f16 (the mixed ones, and the bf16
  storage of ``pure_bf16`` and ``bf16_sr``) the step runs ``loss_fn`` under
  :func:`mpjax.autocast`: it gets the stored params and the batch as they are,
  and each operation runs in its class's precision (GEMMs bf16/fp16 x bf16/fp16
  -> f32, forward and backward; softmax, norms, reductions and the loss in
  f32), whatever dtype the model declares for its layers (``float32`` too).
  Otherwise (fp32), or with ``autocast=False``, the step casts the
  params (and the batch's floating leaves) to the policy's compute dtype before
  ``loss_fn``; with ``cast_params=False`` a model that takes the policy itself
  (:func:`mpjax.linen_kwargs`, :func:`mpjax.nnx_apply_policy`) gets the f32
  masters as they are. Either way it takes the loss in f32, scales it,
  differentiates with respect to the master params, unscales the gradients
  with the same scale, clips them if asked, and applies the optax update in
  f32. Where fp16's range makes a non-finite gradient an expected event (a
  scaled loss or fp16 compute; see ``skip_nonfinite``) it first decides once,
  for all devices, whether the gradients are finite: on a non-finite step
  params, optimizer state and ``step`` stay bit-identical; only the loss scale
  and ``skipped_steps`` move.

  Wrap the step in ``jax.jit``, donating the state:
  ``jax.jit(step, donate_argnums=0)``.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a scalar loss or ``(loss, aux)``.
      Under autocast it gets the stored params and the batch as they are; else
      params (unless ``cast_params=False``) and, with ``cast_batch``, the batch
      in the compute dtype. Integer leaves such as labels are untouched. Compute
      the loss from f32 logits (``logits.astype(jnp.float32)``) for fp16 safety.
    axis_name: under ``shard_map`` or ``pmap``, the data-parallel axis name(s):
      gradients and the loss are averaged over it and the finite decision is
      shared. Leave ``None`` under ``jit`` with shardings, where everything is
      global already.
    max_grad_norm: if set, gradients are clipped to this global norm (after
      unscaling).
    cast_batch: without autocast, cast the batch's f16/bf16/f32 leaves to the
      compute dtype; turn off for inputs that must stay f32.
    cast_params: without autocast, cast the params to the compute dtype. Turn
      off for a model that takes the policy itself (built with
      :func:`mpjax.linen_kwargs` or :func:`mpjax.nnx_apply_policy`): it then
      gets the f32 masters as they are and casts each weight where it uses it,
      and the step does not autocast it (``autocast=True`` with
      ``cast_params=False`` is refused).
    autocast: run ``loss_fn`` under :func:`mpjax.autocast` with the state's
      policy. ``None`` (default): yes for f16 or bf16 compute (the faster path,
      :attr:`mpjax.Policy.computes_in_half`) unless ``cast_params=False``.
    autocast_rules: ``rules`` for :func:`mpjax.autocast`, e.g.
      ``{"*head*": "fp32"}``.
    with_model_state: for models with non-trained state such as BatchNorm
      statistics (``state.model_state``). ``loss_fn`` is then
      ``loss_fn(params, model_state, batch)`` and returns
      ``(loss, new_model_state)`` or ``((loss, aux), new_model_state)``, the
      shape of ``model.apply(..., mutable=["batch_stats"])``'s result. The new
      state is kept in its old dtypes, averaged over ``axis_name``, and, like
      everything else, left as it was on a skipped step.
    skip_nonfinite: check the gradients and skip a step whose gradients are
      not all finite. ``None`` (default) means yes when the state's loss is
      scaled (:class:`mpjax.StaticLossScale`, :class:`mpjax.DynamicLossScale`)
      or the policy computes in fp16, and no for fp32 and bf16 without loss
      scaling, whose step then costs what a plain optax step costs: the check
      reads every gradient once more, which can keep XLA from fusing the
      update into the GEMMs that produce them and can cost step time (the CPU
      benchmark's transformer: 1.055x the fp32 step's time against 0.999x
      unchecked; its MLP: 0.967x against 0.988x, ``results/cpu/bench.json``).
      ``True`` adds the check anywhere (``optax.apply_if_finite``'s guard, at
      no copy of the state); ``False`` with a dynamic loss scale is refused,
      as its scale could never come down.

  Returns:
    ``step(state, batch) -> (state, metrics)``; ``metrics`` holds ``loss``
    (unscaled, f32), ``loss_scale`` (the scale this step used), ``aux`` when
    ``loss_fn`` returns one, ``grad_norm`` (before clipping) when the step
    checks or clips the gradients, and ``grads_finite`` when it checks them.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> import mpjax
    >>> model = nn.Dense(1)
    >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    >>> state = mpjax.TrainState.create(apply_fn=model.apply,
    ...     params=model.init(jax.random.key(0), x), tx=optax.sgd(0.1))
    >>> def loss_fn(params, batch):
    ...   pred = model.apply(params, batch["x"])
    ...   return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)
    >>> step = jax.jit(mpjax.make_train_step(loss_fn), donate_argnums=0)
    >>> state, metrics = step(state, {"x": x, "y": y})
    >>> int(state.step), metrics["loss"].dtype, sorted(metrics)
    (1, dtype('float32'), ['loss', 'loss_scale'])
  """
  autocast = _checked_options(
    loss_fn, max_grad_norm, skip_nonfinite, autocast_rules, autocast, cast_params
  )
  options = _StepOptions(
    axis_name=axis_name,
    max_grad_norm=max_grad_norm,
    cast_batch=cast_batch,
    cast_params=cast_params,
    autocast=autocast,
    autocast_rules=autocast_rules,
    with_model_state=with_model_state,
    skip_nonfinite=skip_nonfinite,
  )

  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    return _train_step(loss_fn, options, state, batch)

  return step


class _StepOptions(NamedTuple):
  """:func:`make_train_step`'s options, checked (``autocast`` is ``False`` without
  ``cast_params``)."""

  axis_name: Hashable | Sequence[Hashable] | None
  max_grad_norm: float | None
  cast_batch: bool
  cast_params: bool
  autocast: bool | None
  autocast_rules: Mapping[str, str] | None
  with_model_state: bool
  skip_nonfinite: bool | None


def _checked_options(
  loss_fn: LossFn,
  max_grad_norm: float | None,
  skip_nonfinite: bool | None,
  autocast_rules: Mapping[str, str] | None,
  autocast: bool | None,
  cast_params: bool,
) -> bool | None:
  """Refuses options no step can use; returns ``autocast`` (``False`` without ``cast_params``)."""
  if not callable(loss_fn):
    raise TypeError(
      f"make_train_step: loss_fn must be a function loss_fn(params, batch), got "
      f"{type(loss_fn).__name__}."
    )
  if max_grad_norm is not None and not max_grad_norm > 0:
    raise ValueError(
      f"make_train_step: max_grad_norm={max_grad_norm!r} must be positive, or None for no clipping."
    )
  if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
    raise TypeError(
      f"make_train_step: skip_nonfinite={skip_nonfinite!r} must be True, False or None (check "
      "where the loss is scaled or the compute is fp16)."
    )
  if autocast_rules is not None:
    autocast_fn(loss_fn, "mixed_bf16", rules=autocast_rules)  # checks the rules now
  if not cast_params:
    if autocast:
      raise ValueError(
        "make_train_step: cast_params=False is for models that take the policy themselves, "
        "which the step does not autocast; drop autocast=True, or keep cast_params=True."
      )
    autocast = False
  return autocast


def _train_step(
  loss_fn: Callable[..., Any], options: _StepOptions, state: TrainState, batch: Any
) -> tuple[TrainState, dict[str, Any]]:
  """One step: loss and grads, unscale, finite check, update, loss-scale and FP8 bookkeeping."""
  if not isinstance(state, TrainState):
    raise TypeError(
      f"train step: state must be an mpjax.TrainState (from TrainState.create), got "
      f"{type(state).__name__}."
    )
  policy, loss_scale, axis_name = state.policy, state.loss_scale, options.axis_name
  model_fn = loss_fn if options.with_model_state else _with_model_state(loss_fn)
  use_autocast = options.autocast if options.autocast is not None else policy.computes_in_half
  fp8_state, fp8_scales = _fp8_this_step(
    model_fn, state, batch, use_autocast, options.autocast_rules
  )
  run = _forward(model_fn, policy, batch, use_autocast, options)
  check = _checks_gradients(options.skip_nonfinite, policy, loss_scale)

  gather = _gather_dtype(policy, use_autocast and axis_name is None)
  out = _loss_and_grads(run, state, batch, fp8_scales, axis_name, gather)
  new_fp8 = _advance_fp8(fp8_state, out.fp8_scales, out.fp8_amaxes, axis_name)
  grads, loss, model_state = _unscale_and_average(
    out.grads, out.loss, out.model_state, loss_scale, axis_name, policy.reduce_dtype
  )
  metrics = {"loss": loss, "loss_scale": loss_scale.loss_scale}
  if check or options.max_grad_norm is not None:
    # One pass over the gradients gives both the norm and the finite check:
    # the sum of squares is non-finite iff some gradient is inf/NaN (or the
    # norm itself overflows f32, > 1.8e19, a step no one wants applied either).
    sharded = splits_a_leaf(grads, state.params_layout)
    metrics["grad_norm"] = grad_norm = _grad_norm(grads, sharded)
  if options.max_grad_norm is not None:
    grads = _clip(grads, grad_norm, options.max_grad_norm)

  operands = (
    state.params,
    state.opt_state,
    state.model_state,
    fp8_state,
    grads,
    model_state,
    new_fp8,
  )
  if not check:
    new_state = _apply(state, operands)
  else:
    metrics["grads_finite"] = grads_finite = all_finite(grad_norm, axis_name=axis_name)
    new_state = _apply_if_finite(state, operands, grads_finite)
  if out.aux is not None:
    metrics["aux"] = out.aux
  # Under shard_map or pmap (axis_name) each device holds its own state: there is no layout.
  return constrain_to_layout(new_state, state.layout if axis_name is None else None), metrics


def _with_model_state(loss_fn: LossFn) -> Callable[..., Any]:
  """``loss_fn(params, batch)`` as ``(params, model_state, batch) -> (out, model_state)``."""

  def model_fn(params, model_state, batch):
    return loss_fn(params, batch), model_state

  return model_fn


def _log_fp8_state_made_in_step() -> None:
  """Says (at trace time) that the FP8 state is made in the step, and how to compile once."""
  if MAKING_FP8_STATE.get():
    return
  logging.getLogger("mpjax").warning(
    "mpjax: the FP8 state is made by the first train step, so a jitted step compiles again on "
    "the second (the state's structure changes). To compile once, make it with the state: "
    "mpjax.TrainState.create(..., train_step=step, example_batch=batch), or "
    "state = mpjax.init_fp8_state(step, state, batch) (mpjax train does)."
  )


def _fp8_this_step(
  model_fn: Callable[..., Any],
  state: TrainState,
  batch: Any,
  use_autocast: bool,
  rules: Mapping[str, str] | None,
) -> tuple[Fp8State | None, jax.Array | None]:
  """The FP8 delayed-scaling state (made on the first step) and this step's scales from it."""
  policy = state.policy
  if policy.fp8 is not None and not use_autocast:
    raise ValueError(
      f"train step: the policy has FP8 GEMMs ({policy.fp8}), which run through autocast, "
      "but this step does not autocast (autocast=False or cast_params=False). Leave "
      "autocast and cast_params unset, or use mixed_bf16."
    )
  fp8_state = state.fp8
  if policy.fp8 is not None and fp8_state is None:  # the first step makes the delayed state
    gemms = count_delayed_fp8_gemms(
      model_fn, policy, state.params, state.model_state, batch, rules=rules
    )
    fp8_state = Fp8State.initial(policy.fp8, gemms) if gemms else None
    if gemms:
      _log_fp8_state_made_in_step()
  # This step's scale of every FP8 tensor, from its history (delayed scaling).
  fp8_scales = None if fp8_state is None else delayed_scales(fp8_state, policy.fp8)
  return fp8_state, fp8_scales


def _forward(
  model_fn: Callable[..., Any],
  policy: Policy,
  batch: Any,
  use_autocast: bool,
  options: _StepOptions,
) -> Callable[..., Any]:
  """``run(fp8_scales, params, model_state, batch)``: ``model_fn`` in the policy's precision."""
  if use_autocast:  # autocast casts params and batch where each operation uses them
    # The loss and the model state come back as computed (in f32), whatever the policy's
    # output dtype (pure_bf16's is bf16): the step takes the loss in f32.
    full = policy.with_output_dtype(jnp.float32)
    return autocast_with_fp8_scales(model_fn, full, rules=options.autocast_rules)
  compute_batch = policy.cast_to_compute(batch) if options.cast_batch else batch

  def run(_, params, model_state, __):
    params = policy.cast_to_compute(params) if options.cast_params else params
    return model_fn(params, model_state, compute_batch)

  return run


def _gather_dtype(policy: Policy, autocasts: bool) -> Any:
  """The dtype sharded params are cast to before they are gathered, or ``None`` for no cast.

  The policy's ``gather_dtype``, else a bf16 compute dtype, for a step that autocasts under
  ``jit`` (under ``shard_map`` or ``pmap`` each device holds whole params: nothing gathers);
  f32 means no cast. Not by default for fp16, whose weight gradients the GEMMs write in the
  weight's dtype (f32 for a master, for range: an fp16 weight's loss-scaled gradient would
  overflow), nor under FP8, whose recipe plans its GEMMs on the f32 masters, nor with a
  ``reduce_dtype`` wider than the gather dtype: a GEMM's gradient takes its operand's dtype,
  and XLA may sum it after that rounding (the gather is then XLA's to place).
  """
  if not autocasts or policy.fp8 is not None:
    return None
  if policy.reduce_dtype is not None and policy.reduce_dtype.itemsize > 2:
    return None
  dtype = policy.gather_dtype
  if dtype is None and policy.compute_dtype == jnp.bfloat16:
    dtype = policy.compute_dtype
  return None if dtype is None or dtype == jnp.float32 else dtype


def _checks_gradients(skip_nonfinite: bool | None, policy: Policy, loss_scale: LossScale) -> bool:
  """Whether the step checks its gradients and skips a non-finite update (see make_train_step)."""
  if skip_nonfinite is None:
    fp16 = jnp.dtype(policy.compute_dtype) == jnp.float16
    return fp16 or not isinstance(loss_scale, NoOpLossScale)
  if not skip_nonfinite and isinstance(loss_scale, DynamicLossScale):
    raise ValueError(
      "make_train_step: skip_nonfinite=False with a DynamicLossScale: the scale only comes "
      "down on a skipped step, so it could never recover from an overflow. Leave "
      "skip_nonfinite unset, or use StaticLossScale / NoOpLossScale."
    )
  return skip_nonfinite


class _Grads(NamedTuple):
  """What the backward pass of the scaled loss gives."""

  grads: Any  # of the scaled loss, with respect to the master params
  loss: jax.Array  # unscaled, f32
  aux: Any
  model_state: Any  # the new model state, in the old one's dtypes
  fp8_scales: jax.Array | None  # the scales differentiated (varying over axis_name)
  fp8_amaxes: jax.Array | None  # their "gradient": this step's amaxes (see mpjax.fp8.fp8_dot)


def _loss_and_grads(
  run: Callable[..., Any],
  state: TrainState,
  batch: Any,
  fp8_scales: jax.Array | None,
  axis_name: Hashable | Sequence[Hashable] | None,
  gather_dtype: Any = None,
) -> _Grads:
  """The scaled loss's gradients with respect to the params (and the FP8 scales).

  With a ``gather_dtype`` each sharded param is cast to it on its own shard first
  (:func:`mpjax.layout.cast_shards`), so its all-gathers move that dtype.
  """

  def scaled_loss(params, fp8_scales):
    if gather_dtype is not None:
      params = cast_shards(params, state.params_layout, gather_dtype)
    out = run(fp8_scales, params, state.model_state, batch)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise ValueError(
        "with_model_state=True: loss_fn(params, model_state, batch) must return "
        f"(loss, new_model_state) or ((loss, aux), new_model_state), got {type(out).__name__}."
      )
    loss, aux = _split_loss(out[0])
    loss = loss.astype(jnp.float32)
    return state.loss_scale.scale(loss), (loss, aux, _like(out[1], state.model_state))

  params = state.params
  if axis_name is not None:
    params, fp8_scales = _as_varying((params, fp8_scales), axis_name)
  # The model traces under the state's mesh, where the layers that ask for one find it
  # (block-scaled GEMMs keep each device's blocks whole).
  with mesh_in_context(state.layout):
    (grads, fp8_amaxes), (loss, aux, model_state) = jax.grad(
      scaled_loss, argnums=(0, 1), has_aux=True
    )(params, fp8_scales)
  return _Grads(grads, loss, aux, model_state, fp8_scales, fp8_amaxes)


def _advance_fp8(
  fp8_state: Fp8State | None,
  fp8_scales: jax.Array | None,
  fp8_amaxes: jax.Array | None,
  axis_name: Hashable | Sequence[Hashable] | None,
) -> Fp8State | None:
  """The FP8 state with this step's amaxes pushed into its history."""
  if fp8_state is None:
    return None
  if axis_name is not None:  # the amaxes of all devices' shards
    fp8_amaxes, fp8_scales = lax.pmax((fp8_amaxes, fp8_scales), axis_name)
  return advance(fp8_state, fp8_scales, fp8_amaxes)


def _unscale_and_average(
  grads: Any,
  loss: jax.Array,
  model_state: Any,
  loss_scale: LossScale,
  axis_name: Hashable | Sequence[Hashable] | None,
  reduce_dtype: Any = None,
) -> tuple[Any, jax.Array, Any]:
  """Unscaled f32 gradients, loss and model state, averaged over ``axis_name``.

  With a ``reduce_dtype`` (:attr:`mpjax.Policy.reduce_dtype`) the gradients are averaged in it,
  still scaled (a half-precision sum of unscaled fp16 gradients would underflow); else in f32.
  """
  in_reduce_dtype = axis_name is not None and reduce_dtype is not None
  if in_reduce_dtype:
    grads = lax.pmean(cast_floating(grads, reduce_dtype), axis_name)
  # f32 gradients whatever the params' dtype (pure_bf16), for the norm and the update.
  grads = jax.tree.map(to_f32, loss_scale.unscale(grads))
  if axis_name is not None:
    if not in_reduce_dtype:
      grads = lax.pmean(grads, axis_name)
    loss = lax.pmean(loss, axis_name)
    model_state = jax.tree.map(
      lambda x: lax.pmean(x, axis_name) if is_floating(x) else x, model_state
    )
  return grads, loss, model_state


def _clip(grads: Any, grad_norm: jax.Array, max_grad_norm: float) -> Any:
  """``grads`` scaled down to the global norm ``max_grad_norm`` if above it."""
  return jax.tree.map(lambda g: g * jnp.minimum(1.0, max_grad_norm / grad_norm), grads)


# The operands of an update: (params, opt_state, model_state, fp8) as they were, then
# (grads, model_state, fp8) as this step made them.
_Operands = tuple[Any, Any, Any, Any, Any, Any, Any]


def _update(
  tx: optax.GradientTransformation, operands: _Operands, policy: Policy
) -> tuple[Any, Any, Any, Any]:
  """The optax update: new params, optimizer state, model state and FP8 state."""
  params, opt_state, _, _, grads, new_model_state, new_fp8 = operands
  if uses_rounded_storage(policy):  # f32 update, rounded writes
    return (*rounded_update(tx, policy, grads, opt_state, params), new_model_state, new_fp8)
  updates, new_opt_state = tx.update(_like(grads, params), opt_state, params)
  # apply_updates keeps each param's dtype; optimizers may not keep theirs.
  new_params = optax.apply_updates(params, updates)
  return new_params, _like(new_opt_state, opt_state), new_model_state, new_fp8


def _keep(operands: _Operands) -> tuple[Any, Any, Any, Any]:
  """Params, optimizer state, model state and FP8 state as they were (a skipped step)."""
  return operands[:4]


def _apply(state: TrainState, operands: _Operands) -> TrainState:
  """The next state, updated unchecked."""
  params, opt_state, model_state, fp8_state = _update(state.tx, operands, state.policy)
  return state.replace(
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    model_state=model_state,
    fp8=fp8_state,
  )


def _apply_if_finite(state: TrainState, operands: _Operands, grads_finite: jax.Array) -> TrainState:
  """The next state: updated if the gradients are finite, else only the loss scale and
  ``skipped_steps`` move."""
  apply_update = functools.partial(_update, state.tx, policy=state.policy)
  # Per backend (the one XLA lowers for). XLA:CPU: a conditional, so a
  # skipped step costs nothing and a finite one no extra pass. XLA:GPU: a
  # conditional keeps the update from fusing and copies the train state in
  # and out of it, so the update is computed and selected leaf by leaf, which
  # fuses into the optimizer's own kernels.
  params, opt_state, model_state, fp8_state = by_platform(
    operands,
    grads_finite,
    cpu=lambda ops, ok: lax.cond(ok, apply_update, _keep, ops),
    other=lambda ops, ok: select_tree(ok, apply_update(ops), _keep(ops)),
  )
  skipped = (~grads_finite).astype(jnp.int32)
  return state.replace(
    step=state.step + 1 - skipped,
    params=params,
    opt_state=opt_state,
    loss_scale=state.loss_scale.adjust(grads_finite),
    skipped_steps=state.skipped_steps + skipped,
    model_state=model_state,
    fp8=fp8_state,
  )
