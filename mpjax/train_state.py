"""The mixed-precision train state: fp32 master params, optimizer state, loss scale."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding

from mpjax._dtypes import cast_floating, is_floating
from mpjax.fp8 import Fp8State
from mpjax.layout import layout_of, like_params, mesh_of, normalized_sharding
from mpjax.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from mpjax.policy import Policy, get_policy
from mpjax.rounding import init_opt_state

__all__ = ["TrainState", "init_fp8_state"]

# True while init_fp8_state traces the step to make the FP8 state (the step then
# has nothing to say about making it itself).
MAKING_FP8_STATE = contextvars.ContextVar("making_fp8_state", default=False)


def default_loss_scale(policy: Policy) -> LossScale:
  """Dynamic scaling for fp16 compute (its gradients underflow), none otherwise."""
  if policy.compute_dtype == jnp.float16:
    return DynamicLossScale()
  return NoOpLossScale()


def _own(x: Any, original: Any) -> Any:
  """A copy of ``x`` if it is the caller's own array, else ``x``."""
  return jnp.copy(x) if x is original and isinstance(x, jax.Array) else x


class TrainState(struct.PyTreeNode):
  """Everything a mixed-precision training step reads and writes.

  Attributes:
    step: the number of updates applied (int32); a skipped step leaves it.
    params: the master parameters, in the policy's ``param_dtype``.
    opt_state: the optax optimizer state, built from the master parameters;
      for a policy that stores it in its own dtype or rounds its writes
      (``"bf16_sr"``), an :class:`mpjax.RoundingState` around it, holding the
      rounding's key (see :func:`mpjax.init_opt_state`).
    loss_scale: a :class:`NoOpLossScale`, :class:`StaticLossScale` or
      :class:`DynamicLossScale`.
    skipped_steps: the number of steps skipped for non-finite gradients (int32).
    model_state: the model's non-trained variables, such as BatchNorm running
      statistics (Flax's ``batch_stats``): kept in f32, updated by the loss
      function (see ``make_train_step(..., with_model_state=True)``), never by
      the optimizer. An empty dict for models without any.
    fp8: for an FP8 policy with delayed scaling, an :class:`mpjax.Fp8State`
      (the scales and amax histories of every FP8 GEMM); ``None`` otherwise,
      until it is made: by :meth:`create` given the step and a batch, by
      :func:`mpjax.init_fp8_state`, or else by the first step (which then
      compiles again on the second). Each step moves it on, a skipped step
      leaves it.
    apply_fn: the model's apply function (static), e.g. ``model.apply``.
    tx: the optax optimizer (static).
    policy: the precision :class:`Policy` (static: a new policy is a new
      compiled step).
    layout: the sharding of every leaf, in ``jax.tree.leaves`` order, which
      each train step gives its new state (static), so a jitted step keeps
      the layout it was given and compiles once; ``None`` for a state on one
      device (or made under ``jit``), whose step leaves placement to XLA. Set
      by :meth:`create` for params sharded over a mesh, or by
      :meth:`keep_layout`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> import mpjax
    >>> model = nn.Dense(4)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> state = mpjax.TrainState.create(
    ...     apply_fn=model.apply, params=params, tx=optax.adam(1e-3), policy="mixed_fp16")
    >>> type(state.loss_scale).__name__, state.params["params"]["kernel"].dtype
    ('DynamicLossScale', dtype('float32'))
  """

  step: jax.Array
  params: Any
  opt_state: optax.OptState
  loss_scale: LossScale
  skipped_steps: jax.Array
  model_state: Any
  fp8: Fp8State | None
  apply_fn: Callable[..., Any] = struct.field(pytree_node=False)
  tx: optax.GradientTransformation = struct.field(pytree_node=False)
  policy: Policy = struct.field(pytree_node=False)
  layout: tuple[jax.sharding.Sharding, ...] | None = struct.field(pytree_node=False, default=None)

  def keep_layout(self) -> TrainState:
    """This state, recording its leaves' shardings for every train step to keep.

    :meth:`create` records them when the params are sharded over a mesh; call
    this after placing a state otherwise (``jax.device_put(state, shardings)``,
    a checkpoint restored onto another mesh). Under ``jax.jit`` XLA chooses
    where a step's outputs go, and a replicated LayerNorm scale can come back
    sharded, the jitted step then compiling again; with a recorded layout the
    step puts each new leaf where the old one was.

    Returns:
      The state with ``layout`` set (``None`` when every leaf is on one
      device: nothing to keep).

    Example:
      >>> import jax, jax.numpy as jnp, optax, mpjax
      >>> state = mpjax.TrainState.create(apply_fn=None, params={"w": jnp.ones(4)},
      ...     tx=optax.sgd(0.1))
      >>> state.keep_layout().layout is None  # one device: nothing to keep
      True
    """
    return self.replace(layout=layout_of(self))

  @property
  def params_layout(self) -> tuple[jax.sharding.Sharding, ...] | None:
    """The recorded shardings of the params' leaves alone (see ``layout``), or ``None``."""
    if self.layout is None:
      return None
    shardings = jax.tree.unflatten(jax.tree.structure(self), self.layout)
    return tuple(jax.tree.leaves(shardings.params))

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any],
    params: Any,
    tx: optax.GradientTransformation,
    policy: Policy | str | Any = "mixed_bf16",
    loss_scale: LossScale | None = None,
    model_state: Any = None,
    rounding_key: jax.Array | int | None = None,
    train_step: Callable[[TrainState, Any], Any] | None = None,
    example_batch: Any = None,
  ) -> TrainState:
    """Builds a state with step 0 and the optimizer initialised on the master params.

    Args:
      apply_fn: the model's apply function.
      params: the initial parameters; cast to the policy's ``param_dtype``.
      tx: an optax optimizer.
      policy: anything :func:`mpjax.get_policy` reads (``MPJAX_POLICY``
        overrides it).
      loss_scale: the loss-scale state; ``None`` means the policy's default:
        :class:`DynamicLossScale` for fp16 compute, :class:`NoOpLossScale`
        otherwise.
      model_state: non-trained model variables, e.g. ``{"batch_stats": ...}``
        from ``model.init``; ``None`` means none. Floating leaves are kept f32.
      rounding_key: for a policy that rounds stochastically (``"bf16_sr"``),
        the key its random bits come from: ``jax.random.key(seed)`` or an int
        seed; ``None`` means seed 0. Ignored by other policies.
      train_step: with ``example_batch``, the step the state will train with
        (from :func:`mpjax.make_train_step`, jitted or not). For an FP8 policy
        with delayed scaling, the state is made with its FP8 state
        (:func:`mpjax.init_fp8_state`: the step is traced for shapes, nothing
        runs), so the jitted step compiles once, not again on its second call.
        Ignored by other policies, so code that switches policies can always
        pass them.
      example_batch: a batch of the shapes ``train_step`` trains on.

    Returns:
      The new state.

    Raises:
      ValueError: if the policy cannot be read or ``params`` holds no floating
        leaf to train.
      TypeError: if ``tx`` or ``loss_scale`` is of the wrong kind, or only one
        of ``train_step`` and ``example_batch`` is given.
    """
    policy = get_policy(policy)
    if (train_step is None) != (example_batch is None):
      given, missing = (
        ("train_step", "example_batch")
        if example_batch is None
        else ("example_batch", "train_step")
      )
      raise TypeError(
        f"TrainState.create: {given} was given without {missing}; the FP8 state is sized by "
        "tracing the step on a batch, so pass both (train_step=step, example_batch=batch) or "
        "neither."
      )
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
      # Duck-typed, as optax and Flax's TrainState take it: optax.MultiSteps is a class
      # with init and update, not a GradientTransformation.
      raise TypeError(
        "TrainState.create: tx must be an optax optimizer (an optax.GradientTransformation "
        "such as optax.adam(1e-3), or anything with init and update, such as "
        f"optax.MultiSteps), got {type(tx).__name__}."
      )
    if loss_scale is None:
      loss_scale = default_loss_scale(policy)
    elif not isinstance(loss_scale, LossScale):
      raise TypeError(
        "TrainState.create: loss_scale must be mpjax.NoOpLossScale(), "
        "mpjax.StaticLossScale(scale), mpjax.DynamicLossScale() or None (the policy's "
        f"default), got {type(loss_scale).__name__}."
      )
    leaves = jax.tree.leaves(params)
    if not any(is_floating(x) for x in leaves):
      raise ValueError(
        "TrainState.create: params has no floating-point leaf to train "
        f"({len(leaves)} leaves, none float). Pass the model's parameters, e.g. "
        "model.init(rng, x), not its config or an empty tree."
      )
    # The state owns its buffers: donating it to a jitted step must not delete
    # the arrays the caller passed in.
    params = jax.tree.map(_own, policy.cast_to_param(params), params)
    loss_scale = jax.tree.map(lambda x: _own(x, x), loss_scale)
    model_state = {} if model_state is None else model_state
    model_state = jax.tree.map(_own, cast_floating(model_state, jnp.float32), model_state)
    state = cls(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=init_opt_state(tx, policy, params, rounding_key),
      loss_scale=loss_scale,
      skipped_steps=jnp.zeros((), jnp.int32),
      model_state=model_state,
      fp8=None,
      apply_fn=apply_fn,
      tx=tx,
      policy=policy,
    )
    if train_step is not None:
      state = init_fp8_state(train_step, state, example_batch)
    return _place_on_params_mesh(state)


def _place_on_params_mesh(state: TrainState) -> TrainState:
  """``state`` with every leaf on the params' mesh, and its layout recorded (see ``layout``).

  What :meth:`TrainState.create` makes beside the params goes on the params' mesh: an optimizer
  leaf of a param's path and shape (Adam's ``mu`` and ``nu``, a Kahan buffer) sharded like that
  param, everything else (scalars, keys, FP8 histories, model state not placed yet) replicated
  (:func:`mpjax.layout.like_params`). Params on one device leave the state as it is.
  """
  mesh = mesh_of(state.params)
  if mesh is None:
    return state
  param_shardings = jax.tree.map(lambda x: x.sharding, state.params)
  planned = like_params(state, state.params, param_shardings, mesh)

  def place(x: Any, sharding: Any) -> Any:
    own = getattr(x, "sharding", None)
    if isinstance(own, NamedSharding) and own.mesh == mesh:  # what the caller placed already
      sharding = normalized_sharding(own)
    return x if own == sharding else jax.device_put(x, sharding)

  return jax.tree.map(place, state, planned).keep_layout()


def init_fp8_state(
  step: Callable[[TrainState, Any], Any], state: TrainState, batch: Any
) -> TrainState:
  """``state`` with the FP8 delayed-scaling state its first step would make.

  The first step of an FP8 policy makes ``state.fp8`` (an
  :class:`mpjax.Fp8State`, a row per FP8 GEMM) itself, and a jitted step then
  compiles again on its second call (the state's structure changed). Making it
  first compiles the step once: ``TrainState.create(..., train_step=step,
  example_batch=batch)`` calls this; call it yourself for a state made
  otherwise, e.g. the target to restore an FP8 run's checkpoint into. Traces
  ``step`` (shapes only; nothing runs). A state that has it, or a policy
  without FP8, comes back as it is.

  Args:
    step: the train step (from :func:`mpjax.make_train_step`, jitted or not).
    state: a state from :meth:`TrainState.create`.
    batch: a batch of the shapes the step trains on.

  Returns:
    The state with ``fp8`` filled: scales of 1, empty histories.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> import mpjax
    >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((16, 32))
    >>> state = mpjax.TrainState.create(apply_fn=model.apply,
    ...     params=model.init(jax.random.key(0), x), tx=optax.sgd(0.1), policy="mixed_fp8")
    >>> step = mpjax.make_train_step(lambda p, b: jnp.mean(model.apply(p, b) ** 2))
    >>> mpjax.init_fp8_state(step, state, x).fp8.gemms  # the middle Dense; first and last bf16
    1
  """
  if state.fp8 is not None or state.policy.fp8 is None:
    return state
  token = MAKING_FP8_STATE.set(True)
  try:
    made = jax.eval_shape(step, state, batch)[0].fp8
  finally:
    MAKING_FP8_STATE.reset(token)
  if made is None:  # current scaling, or no FP8 GEMM
    return state
  return state.replace(fp8=Fp8State.initial(state.policy.fp8, made.gemms))
