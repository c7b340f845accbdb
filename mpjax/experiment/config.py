"""Configs: find a config file, load its ``get_config()``, apply overrides, build the experiment.

A config is a Python file whose ``get_config()`` returns an ``ml_collections``
``ConfigDict`` (see ``configs/default.py``). :func:`load_config` checks every
value by building an :class:`Experiment` from it: the dataset, the model, the
policy and the mesh (``config.mesh``: data parallel, FSDP, or both; see
:mod:`mpjax.experiment.sharding`), with the loss, evaluation and jitted train
step the training loop (:mod:`mpjax.experiment.loop`) runs.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import pathlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax import data as data_lib
from mpjax import models
from mpjax.autocast import autocast
from mpjax.diagnose import grad_health
from mpjax.experiment.sharding import BATCH_SPEC, MESH_AXES, param_specs, put_on_mesh
from mpjax.layout import mesh_of
from mpjax.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from mpjax.policy import Policy, get_policy
from mpjax.train_state import TrainState
from mpjax.train_step import make_train_step

__all__ = [
  "LOSS_SCALES",
  "MODELS",
  "RESUMABLE_KEYS",
  "ConfigError",
  "Experiment",
  "find_config",
  "load_config",
  "mesh_shape",
]

MODELS: dict[str, type[nn.Module]] = {
  "mlp": models.MLP,
  "cnn": models.CNN,
  "transformer_lm": models.TransformerLM,
}
LOSS_SCALES: dict[str, Callable[[], LossScale | None]] = {
  "default": lambda: None,  # the policy's default: dynamic for fp16, none otherwise
  "dynamic": DynamicLossScale,
  "none": NoOpLossScale,
}
# Keys that may change between a run and its resumption: none changes the math (the mesh and
# the device count only change the order in which a step's sums add up).
RESUMABLE_KEYS = (
  "steps",
  "num_devices",
  "mesh",
  "log_every",
  "eval_every",
  "checkpoint_every",
  "run_dir",
  "progress",
  "health_every",
  "stop_after_skips",
  "stop_at_min_scale",
)


class ConfigError(ValueError):
  """A config, an override or a run directory that cannot be used; the message says why."""


def _repo_configs() -> pathlib.Path:
  """The shipped configs: ``configs/`` of the repository, or ``mpjax/configs`` when installed."""
  package = pathlib.Path(__file__).resolve().parent.parent
  repo = package.parent / "configs"
  return repo if (repo / "default.py").is_file() else package / "configs"


def find_config(name: str | None = None) -> pathlib.Path:
  """The config file for ``name``: a path, or a name in ``./configs`` or mpjax's own configs.

  Args:
    name: a path to a ``.py`` file, or a config name such as ``"digits_mlp"``;
      ``None`` means ``"default"``.

  Returns:
    The path of the config file.

  Raises:
    ConfigError: if no such file exists.

  Example:
    >>> import mpjax.experiment as ex
    >>> ex.find_config("digits_mlp").name
    'digits_mlp.py'
  """
  name = name or "default"
  path = pathlib.Path(name)
  if path.suffix == ".py" or path.parent != pathlib.Path("."):
    if path.is_file():
      return path
    raise ConfigError(f"config file {name} does not exist; pass a path to a .py config file.")
  for folder in (pathlib.Path("configs"), _repo_configs()):
    if (folder / f"{name}.py").is_file():
      return folder / f"{name}.py"
  names = sorted(p.stem for p in _repo_configs().glob("*.py") if not p.stem.startswith("_"))
  raise ConfigError(f"unknown config {name!r}; use a path to a .py file or one of {names}.")


@contextlib.contextmanager
def _importable_from(folder: pathlib.Path) -> Iterator[None]:
  """Lets a config import its siblings as Flax's examples do: ``from configs import default``."""
  package = folder.name
  for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
    origin = getattr(sys.modules[name], "__file__", None) or ""
    if not origin.startswith(str(folder)):
      del sys.modules[name]  # a same-named package from elsewhere
  sys.path.insert(0, str(folder.parent))
  try:
    yield
  finally:
    sys.path.remove(str(folder.parent))


def _parse_value(text: str) -> Any:
  lowered = text.strip().lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _apply_override(config: ml_collections.ConfigDict, override: str) -> None:
  if "=" not in override:
    raise ConfigError(f"override {override!r} has no value; write --config.KEY=VALUE.")
  key, text = override.split("=", 1)
  key = key.removeprefix("--").removeprefix("config.")
  *parents, leaf = key.split(".")
  node = config
  for i, part in enumerate(parents):
    node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(f"unknown config key {'.'.join(parents[: i + 1])!r} in --config.{key}.")
  if leaf not in node:
    if parents == ["mesh"]:
      raise ConfigError(f"--config.{key}: {_unknown_axes_message([leaf])}")
    known = ", ".join(sorted(node.keys()))
    raise ConfigError(f"unknown config key {key!r}; the keys here are: {known}.")
  old, value = node[leaf], _parse_value(text)
  if isinstance(old, str) and not isinstance(value, str):
    value = text  # a string field keeps the text as written, e.g. --config.policy=fp32
  if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if isinstance(old, bool) != isinstance(value, bool) or not isinstance(value, type(old)):
    raise ConfigError(
      f"--config.{key}={text}: expected a value of type {type(old).__name__} "
      f"(the default is {old!r}), got {type(value).__name__}."
    )
  node[leaf] = value


def load_config(
  name: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> ml_collections.ConfigDict:
  """Loads a config file's ``get_config()``, applies overrides and checks every value.

  Args:
    name: a path or config name (see :func:`find_config`); ``None`` is the
      default experiment.
    overrides: ``"KEY=VALUE"`` strings (``--config.`` prefix allowed), e.g.
      ``["steps=100", "model.d_model=64"]``; a value must have the type of the
      default it replaces.

  Returns:
    The checked config. ``MPJAX_POLICY``, when set, decides the policy at
    training time.

  Raises:
    ConfigError: on a missing file, an unknown key, a value of the wrong type,
      or a value :func:`train` cannot use.

  Example:
    >>> import mpjax.experiment as ex
    >>> config = ex.load_config("digits_mlp", ["steps=10"])
    >>> config.steps, config.model.name
    (10, 'mlp')
  """
  path = find_config(None if name is None else str(name)).resolve()
  try:
    with _importable_from(path.parent):
      spec = importlib.util.spec_from_file_location(f"{path.parent.name}.{path.stem}", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      config = module.get_config()
  except Exception as e:  # a broken config file: name it
    raise ConfigError(f"config {path} failed to load: {type(e).__name__}: {e}") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config {path}: get_config() must return an ml_collections.ConfigDict.")
  config.name = config.get("name") or path.stem
  for override in overrides:
    _apply_override(config, override)
  Experiment(config)  # checks every value now, before any work
  return config


def _unknown_axes_message(names: Sequence[str]) -> str:
  listed = ", ".join(repr(n) for n in names)
  return (
    f"unknown mesh axis {listed}: an experiment's mesh has the axes {' and '.join(MESH_AXES)} "
    "(e.g. --config.mesh.fsdp=8); remove it. To shard otherwise, annotate the model's params "
    "with nn.with_partitioning over these axes."
  )


def _describe(shape: dict[str, int]) -> str:
  return " x ".join(f"{axis}={size}" for axis, size in shape.items())


def mesh_shape(config: ml_collections.ConfigDict, devices: int) -> dict[str, int]:
  """The size of each mesh axis, ``{"data": ..., "fsdp": ...}``, from ``config.mesh``.

  ``config.mesh.data`` 0 takes the devices the other axes leave; a config without
  ``config.mesh`` is data parallel over every device.

  Args:
    config: the config.
    devices: how many devices the run uses (``config.num_devices``, or all).

  Returns:
    Axis name -> size, in mesh order; the sizes multiply to ``devices``.

  Raises:
    ConfigError: for an unknown axis, a size that is not an integer (>= 1; >= 0 for
      ``data``), or sizes whose product is not ``devices``.

  Example:
    >>> import mpjax.experiment as ex
    >>> from mpjax.experiment.config import mesh_shape
    >>> config = ex.load_config("default")
    >>> config.mesh.fsdp = 4
    >>> mesh_shape(config, 8)
    {'data': 2, 'fsdp': 4}
  """
  mesh = config.get("mesh")
  if mesh is None:
    return {"data": devices, "fsdp": 1}
  if not isinstance(mesh, ml_collections.ConfigDict):
    raise ConfigError(
      f"config.mesh={mesh!r} must be a ConfigDict of axis sizes, e.g. "
      "ml_collections.ConfigDict(dict(data=0, fsdp=1))."
    )
  unknown = [k for k in mesh if k not in MESH_AXES]
  if unknown:
    raise ConfigError(f"config.mesh: {_unknown_axes_message(unknown)}")
  sizes = {axis: mesh.get(axis, 0 if axis == "data" else 1) for axis in MESH_AXES}
  for axis, size in sizes.items():
    least = 0 if axis == "data" else 1
    if not isinstance(size, int) or isinstance(size, bool) or size < least:
      what = ">= 0 (0: the devices the other axes leave)" if axis == "data" else ">= 1"
      raise ConfigError(f"config.mesh.{axis}={size!r} must be an integer {what}.")
  used = f"config.num_devices={config.get('num_devices', 0)}" + (
    ": all of them" if not config.get("num_devices") else ""
  )
  inner = int(np.prod([size for axis, size in sizes.items() if axis != "data"]))
  if sizes["data"] == 0:
    if devices % inner:
      raise ConfigError(
        f"config.mesh.fsdp={sizes['fsdp']} does not divide the {devices} devices this run "
        f"uses ({used}); use a divisor of {devices}, or set config.num_devices to a multiple "
        f"of {sizes['fsdp']}."
      )
    sizes["data"] = devices // inner
  elif sizes["data"] * inner != devices:
    product = sizes["data"] * inner
    fewer = f", or set config.num_devices={product}" if product < devices else ""
    raise ConfigError(
      f"config.mesh {_describe(sizes)} holds {product} devices, but this run uses {devices} "
      f"({used}); give axis sizes whose product is {devices} (config.mesh.data=0 takes the "
      f"devices the other axes leave){fewer}."
    )
  return sizes


def _positive(config: ml_collections.ConfigDict, *keys: str, allow_zero: bool = False) -> None:
  for key in keys:
    value = config[key]
    if not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
      bound = ">= 0" if allow_zero else ">= 1"
      raise ConfigError(f"config.{key}={value!r} must be an integer {bound}.")


@dataclasses.dataclass
class Experiment:
  """A config turned into dataset, model, policy, optimizer and mesh, checked at construction.

  Attributes:
    config: the config it was built from.
    policy: the precision policy (``MPJAX_POLICY`` applied).
    dataset: the :class:`mpjax.data.Dataset`.
    model: the Flax module.
    mesh: the ``("data", "fsdp")`` mesh over the devices used (``config.mesh``).
    param_specs: where each parameter goes on the mesh, a ``PartitionSpec`` per leaf of
      ``{"params": ...}`` (see :func:`mpjax.experiment.sharding.param_specs`).

  Example:
    >>> import mpjax.experiment as ex
    >>> e = ex.Experiment(ex.load_config("digits_mlp"))
    >>> e.policy.compute_dtype
    dtype(bfloat16)
  """

  config: ml_collections.ConfigDict
  policy: Policy = dataclasses.field(init=False)
  rules: dict[str, str] = dataclasses.field(init=False)
  dataset: Any = dataclasses.field(init=False)
  model: nn.Module = dataclasses.field(init=False)
  mesh: Mesh = dataclasses.field(init=False)
  param_specs: Any = dataclasses.field(init=False)

  def __post_init__(self) -> None:
    config = self.config
    try:
      self.policy = get_policy(config.policy)
    except ValueError as e:
      raise ConfigError(f"config.policy: {e}") from None
    if config.loss_scale not in LOSS_SCALES:
      raise ConfigError(
        f"config.loss_scale={config.loss_scale!r} is not one of {sorted(LOSS_SCALES)}."
      )
    _positive(config, "steps", "batch_size", "log_every")
    _positive(config, "eval_every", "checkpoint_every", "num_devices", allow_zero=True)
    _positive(config, "health_every", "stop_after_skips", "stop_at_min_scale", allow_zero=True)
    self.rules = _parse_autocast_rules(config.autocast_rules)
    _positive(config, "warmup_steps", allow_zero=True)
    if not config.learning_rate > 0:
      raise ConfigError(f"config.learning_rate={config.learning_rate!r} must be positive.")
    devices = jax.devices()  # every process's devices after jax.distributed.initialize
    n = config.num_devices or len(devices)
    if n > len(devices) or (jax.process_count() > 1 and n != len(devices)):
      raise ConfigError(
        f"config.num_devices={n} but this run has {len(devices)} devices over "
        f"{jax.process_count()} process(es); use 0 for all of them."
      )
    shape = mesh_shape(config, n)
    if config.batch_size % n:
      raise ConfigError(
        f"config.batch_size={config.batch_size} is not divisible by the {n} devices it is "
        f"split over (config.mesh {_describe(shape)}); use a multiple of {n}, or set "
        "config.num_devices and config.mesh for fewer devices."
      )
    self.mesh = Mesh(np.array(devices[:n]).reshape(tuple(shape.values())), tuple(shape))
    data_kwargs = {k: v for k, v in config.data.items() if k != "name"}
    try:
      self.dataset = data_lib.load_dataset(config.data.name, **data_kwargs)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.data: {e}") from None
    model_kwargs = {k: v for k, v in config.model.items() if k != "name"}
    if config.model.name not in MODELS:
      raise ConfigError(f"config.model.name={config.model.name!r} is not one of {sorted(MODELS)}.")
    if self.dataset.kind == "language_model":
      model_kwargs.update(vocab_size=self.dataset.vocab_size, max_len=self.dataset.seq_len)
    else:
      model_kwargs.update(num_classes=self.dataset.num_classes)
    try:
      self.model = MODELS[config.model.name](**model_kwargs)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.model: {e}") from None
    try:  # where each parameter goes; the shapes only, nothing is initialised
      self.param_specs = param_specs(self.abstract_params(), shape)
    except ValueError as e:
      raise ConfigError(f"config.mesh: {e}") from None

  # -- pieces of the step

  @property
  def takes_train_flag(self) -> bool:
    return "train" in inspect.signature(type(self.model).__call__).parameters

  def _inputs(self, batch: dict[str, Any]) -> Any:
    return batch["tokens"] if self.dataset.kind == "language_model" else batch["x"]

  def _labels(self, batch: dict[str, Any]) -> Any:
    return batch["targets"] if self.dataset.kind == "language_model" else batch["y"]

  def loss_fn(self, params: Any, model_state: Any, batch: dict[str, Any]) -> Any:
    """The training loss (mean cross-entropy from f32 logits) and the new model state.

    The loss carries the dataset's ``loss_multiplier`` (1 except for the
    underflow task); metrics report it without.
    """
    variables = {**params, **model_state}
    if model_state:
      logits, new_state = self.model.apply(
        variables, self._inputs(batch), train=True, mutable=list(model_state)
      )
    else:
      kwargs = {"train": True} if self.takes_train_flag else {}
      logits, new_state = self.model.apply(variables, self._inputs(batch), **kwargs), model_state
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), self._labels(batch)
    )
    return jnp.mean(loss) * self.dataset.loss_multiplier, new_state

  def eval_fn(self, params: Any, model_state: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Summed loss, correct predictions and count over a test batch, in the policy's precision."""

    def forward(params, model_state, inputs):
      kwargs = {"train": False} if self.takes_train_flag else {}
      return self.model.apply({**params, **model_state}, inputs, **kwargs)

    if self.policy.computes_in_half:  # as the train step runs it
      run = autocast(forward, self.policy, rules=self.rules or None)
      logits = run(params, model_state, self._inputs(batch))
    else:
      inputs = self.policy.cast_to_compute(self._inputs(batch))
      logits = forward(self.policy.cast_to_compute(params), model_state, inputs)
    logits = logits.astype(jnp.float32)
    labels = self._labels(batch)
    mask = batch["mask"].astype(jnp.float32)
    mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (labels.ndim - 1)), labels.shape)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return {"loss": jnp.sum(loss * mask), "correct": jnp.sum(correct * mask), "n": jnp.sum(mask)}

  def _init_variables(self) -> Any:
    sample = self.dataset.batch(0, 1, self.config.seed)
    kwargs = {"train": False} if self.takes_train_flag else {}
    return self.model.init(jax.random.key(self.config.seed), self._inputs(sample), **kwargs)

  def abstract_params(self) -> Any:
    """The model's ``{"params": ...}`` as ``jax.ShapeDtypeStruct`` s, Flax metadata boxes kept."""
    return {"params": jax.eval_shape(self._init_variables)["params"]}

  def init_state(self, step: Callable[..., Any] | None = None, batch: Any = None) -> TrainState:
    """The initial train state, placed on the mesh.

    The params are initialised on the host (the same in every process) and placed as
    :attr:`param_specs` says (sharded over ``fsdp``, or replicated); model state such as
    BatchNorm statistics is replicated, and :meth:`mpjax.TrainState.create` places the rest
    (Adam's moments like their params) and records the layout each step keeps.

    Args:
      step: with ``batch``, the step the state trains with (:meth:`make_step`): an FP8
        policy's delayed-scaling state is then made and placed too (see
        :func:`mpjax.init_fp8_state`).
      batch: a batch of the step's shapes (:meth:`put_batch`).

    Returns:
      The state.
    """
    config = self.config
    variables = nn.unbox(self._init_variables())
    params = put_on_mesh({"params": variables["params"]}, self.mesh, self.param_specs)
    model_state = put_on_mesh({k: v for k, v in variables.items() if k != "params"}, self.mesh)
    schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, min(config.warmup_steps, config.steps - 1), config.steps
    )
    tx = optax.adamw(schedule, weight_decay=config.weight_decay)
    if config.max_grad_norm:
      tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), tx)
    state = TrainState.create(
      apply_fn=self.model.apply,
      params=params,
      tx=tx,
      policy=self.policy,
      loss_scale=LOSS_SCALES[config.loss_scale](),
      model_state=model_state,
      # The stochastic rounding's key (bf16_sr, bf16_kahan), apart from the init's; it is
      # kept in the optimizer state, so a resumed run takes it from the checkpoint.
      rounding_key=jax.random.fold_in(jax.random.key(config.seed), 1),
      train_step=step,
      example_batch=batch,
    )
    if mesh_of(state.params) is None:  # one device: create placed nothing, place it all
      state = jax.device_put(state, NamedSharding(self.mesh, P()))
    return state

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A global batch (the same on every process), split over every device of the mesh."""
    return put_on_mesh(batch, self.mesh, jax.tree.map(lambda _: BATCH_SPEC, batch))

  def make_step(self) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """The jitted train step, donating the state."""
    # A run checks every step, whatever the policy: a bad batch is skipped, not trained on.
    step = make_train_step(
      self.loss_fn, with_model_state=True, skip_nonfinite=True, autocast_rules=self.rules or None
    )
    return jax.jit(step, donate_argnums=0)

  def diagnosis(self, state: TrainState, batch: Any) -> dict[str, Any]:
    """The arguments :func:`mpjax.find_nonfinite` and :func:`mpjax.suggest_rules` take to
    replay this state's train step on ``batch``: ``fn`` (``params -> loss``),
    ``args``, ``policy``, ``loss_scale``."""

    def loss(params):
      return self.loss_fn(params, state.model_state, batch)[0]

    scale = float(state.loss_scale.loss_scale)
    return {"fn": loss, "args": (state.params,), "policy": self.policy, "loss_scale": scale}

  @functools.cached_property
  def health_fn(self) -> Callable[[TrainState, Any], dict[str, dict[str, jax.Array]]]:
    """``(state, batch) -> mpjax.grad_health`` of the step's gradients, jitted.

    The gradients are computed in f32 and measured against the compute dtype
    (fp16 or bf16; f32 for fp32 policies) at the state's loss scale: what a
    backward pass in that dtype would flush to zero or overflow.
    """

    def health(state, batch):
      grads = jax.grad(lambda p: self.loss_fn(p, state.model_state, batch)[0])(state.params)
      return grad_health(grads, self.policy.compute_dtype, state.loss_scale.loss_scale)

    return jax.jit(health)

  @functools.cached_property
  def _eval_step(self) -> Callable[..., dict[str, Any]]:
    return jax.jit(self.eval_fn)

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """Mean loss and accuracy over the test split."""
    totals = {"loss": 0.0, "correct": 0.0, "n": 0.0}
    for batch in self.dataset.eval_batches(self.config.batch_size):
      out = jax.device_get(self._eval_step(state.params, state.model_state, self.put_batch(batch)))
      totals = {k: totals[k] + float(out[k]) for k in totals}
    n = max(totals["n"], 1.0)
    return {"test_loss": totals["loss"] / n, "test_accuracy": totals["correct"] / n}

  def examples_per_step(self) -> int:
    if self.dataset.kind == "language_model":
      return self.config.batch_size * self.dataset.seq_len  # tokens
    return self.config.batch_size


def _parse_autocast_rules(text: Any) -> dict[str, str]:
  """``config.autocast_rules`` (a dict literal) as a dict, checked the way autocast checks rules."""
  try:
    rules = ast.literal_eval(text) if isinstance(text, str) else text
  except (ValueError, SyntaxError):
    rules = None
  if not isinstance(rules, dict):
    raise ConfigError(
      f"config.autocast_rules={text!r} is not a dict literal; write e.g. "
      "--config.autocast_rules=\"{'*attn*': 'fp32'}\" (mpjax diagnose prints one)."
    )
  try:
    autocast(lambda: None, "mixed_bf16", rules=rules)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.autocast_rules: {e}") from None
  return dict(rules)
