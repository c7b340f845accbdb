"""Experiments from configs: train one, resume it, compare precisions, on all devices.

A config is a Python file whose ``get_config()`` returns an ``ml_collections``
``ConfigDict`` (see ``configs/default.py``). :func:`train` builds the dataset,
the model, the :class:`~mpjax.TrainState` and the jitted step from it, trains
with data parallelism over every device (of every process after
``jax.distributed.initialize``), logs metrics as JSONL, keeps
orbax checkpoints that resume bit-identically, and returns a summary.
:func:`compare` trains one config under several policies and writes a markdown
table and plots. The ``mpjax`` command line (:mod:`mpjax.cli`) calls both.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import pathlib
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax import data as data_lib
from mpjax import models
from mpjax.autocast import autocast
from mpjax.diagnose import find_nonfinite, grad_health, suggest_rules
from mpjax.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from mpjax.policy import (
  POLICY_ENV_VAR,
  Policy,
  _cpu_has_native_bf16_dot,
  _cpuinfo,
  get_policy,
)
from mpjax.train_state import TrainState
from mpjax.train_step import init_fp8_state, make_train_step

__all__ = ["ConfigError", "Experiment", "compare", "find_config", "load_config", "train"]

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
# Keys that may change between a run and its resumption.
_RESUMABLE_KEYS = (
  "steps",
  "log_every",
  "eval_every",
  "checkpoint_every",
  "run_dir",
  "progress",
  "health_every",
  "stop_after_skips",
  "stop_at_min_scale",
)

# The exit status of a run stopped by the divergence guard.
DIVERGED_EXIT_STATUS = 3


class ConfigError(ValueError):
  """A config, an override or a run directory that cannot be used; the message says why."""


# --------------------------------------------------------------------------- configs


def _repo_configs() -> pathlib.Path:
  """The shipped configs: ``configs/`` of the repository, or ``mpjax/configs`` when installed."""
  here = pathlib.Path(__file__).resolve().parent
  repo = here.parent / "configs"
  return repo if (repo / "default.py").is_file() else here / "configs"


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


# --------------------------------------------------------------------------- the experiment


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
    mesh: a one-axis (``"data"``) mesh over the devices used.

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
    if config.batch_size % n:
      raise ConfigError(
        f"config.batch_size={config.batch_size} is not divisible by the {n} devices it is "
        f"split over; use a multiple of {n} or set config.num_devices."
      )
    self.mesh = Mesh(np.array(devices[:n]), ("data",))
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

    if self.policy.is_mixed:
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

  def init_state(self) -> TrainState:
    """The initial train state, replicated over the mesh."""
    config = self.config
    sample = self.dataset.batch(0, 1, config.seed)
    kwargs = {"train": False} if self.takes_train_flag else {}
    variables = self.model.init(jax.random.key(config.seed), self._inputs(sample), **kwargs)
    params = {"params": variables["params"]}
    model_state = {k: v for k, v in variables.items() if k != "params"}
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
    )
    # From host values, which every process computes alike, onto all devices.
    return jax.device_put(jax.device_get(state), NamedSharding(self.mesh, P()))

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A global batch (the same on every process), split over the mesh's ``data`` axis."""
    return jax.device_put(batch, NamedSharding(self.mesh, P("data")))

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


# --------------------------------------------------------------------------- run directory


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


def _run_dir(config: ml_collections.ConfigDict, run_dir: str | os.PathLike | None) -> pathlib.Path:
  path = pathlib.Path(run_dir or config.run_dir or pathlib.Path("runs") / config.name)
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write_test_{jax.process_index()}"
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise ConfigError(
      f"run directory {path} is not writable ({e.strerror}); pass another with --run_dir."
    ) from None
  return path.resolve()


def _comparable(config: ml_collections.ConfigDict) -> dict[str, Any]:
  items = json.loads(config.to_json())
  return {k: v for k, v in items.items() if k not in _RESUMABLE_KEYS}


def _from_every_process(value: int) -> np.ndarray:
  """``value`` as each process has it (one entry per process)."""
  if jax.process_count() == 1:
    return np.array([value])
  return np.asarray(multihost_utils.process_allgather(np.int32(value)))


def _check_same_run(path: pathlib.Path, config: ml_collections.ConfigDict, policy: Policy) -> None:
  saved = path / "config.json"
  current = {**_comparable(config), "resolved_policy": str(policy)}
  if jax.process_index() == 0 and not saved.exists():
    tmp = path / "config.json.tmp"  # written whole, then renamed: no process reads half of it
    tmp.write_text(json.dumps(current, indent=2, sort_keys=True))
    os.replace(tmp, saved)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("mpjax: config.json written")
    if not saved.exists():
      raise ConfigError(
        f"process {jax.process_index()} does not see process 0's {saved}; put the run "
        "directory on a file system every process shares."
      )
  before = json.loads(saved.read_text())
  changed = sorted(k for k in set(before) | set(current) if before.get(k) != current.get(k))
  if changed:
    raise ConfigError(
      f"run directory {path} holds a run with a different config ({', '.join(changed)} "
      "changed); resume it with the same config, or pass a new --run_dir."
    )


def _check_processes_agree(path: pathlib.Path, start: int, dataset: data_lib.Dataset) -> None:
  """In a multi-process run: every process resumes from the same step and has the same data."""
  if jax.process_count() == 1:
    return
  starts = _from_every_process(start)
  if (starts != start).any():
    raise ConfigError(
      f"the processes see different checkpoints in {path} (latest steps "
      f"{sorted(set(starts.tolist()))}); put the run directory on a file system every process "
      "shares."
    )
  crc = 0
  for key in sorted(dataset.train):
    crc = zlib.crc32(np.ascontiguousarray(dataset.train[key]).tobytes(), crc)
  crc &= 0x7FFFFFFF  # an int32 for the all-gather
  if (_from_every_process(crc) != crc).any():
    raise ConfigError(
      f"the processes built different {dataset.name!r} datasets (a different Python or "
      "scikit-learn on some host?); every process must see the same data."
    )


def _agreed_stop(stop: dict[str, int], step: int, config: ml_collections.ConfigDict) -> int:
  """The signal to stop on after ``step`` (0: go on), the same in every process.

  A single process stops after the step it was signalled in. The processes of
  a multi-process run must all save the same step and leave the collectives
  together, so they agree at each log step, whichever of them was signalled.
  """
  local = stop.get("signal", 0)
  if jax.process_count() == 1:
    return local
  if step % config.log_every and step != config.steps:
    return 0
  return int(_from_every_process(local).max())


class _Metrics:
  """Appends metrics as JSONL (and TensorBoard events when tensorboardX is installed).

  Only process 0 of a multi-process run writes; the others' ``write`` does nothing.
  """

  def __init__(self, path: pathlib.Path, resume_from: int):
    self.path = path / "metrics.jsonl"
    self.file = self.tb = None
    if jax.process_index() != 0:
      return
    if self.path.exists():  # lines past the checkpoint are replayed: drop them
      kept = [
        line
        for line in self.path.read_text().splitlines()
        if line and json.loads(line)["step"] <= resume_from
      ]
      self.path.write_text("".join(line + "\n" for line in kept))
    self.file = self.path.open("a")
    try:
      from tensorboardX import SummaryWriter
    except ImportError:
      self.tb = None
    else:
      self.tb = SummaryWriter(str(path / "tensorboard"))

  def write(self, step: int, values: dict[str, float]) -> None:
    if self.file is None:
      return
    self.file.write(json.dumps({"step": step, **values}) + "\n")
    self.file.flush()
    if self.tb is not None:
      for key, value in values.items():
        self.tb.add_scalar(key, value, step)

  def close(self) -> None:
    if self.file is not None:
      self.file.close()
    if self.tb is not None:
      self.tb.close()


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[dict[str, int]]:
  """Turns SIGINT/SIGTERM into a request to stop after the current step."""
  requested: dict[str, int] = {}
  if threading.current_thread() is not threading.main_thread():
    yield requested
    return

  def handler(signum, _frame):
    requested["signal"] = signum

  previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield requested
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def _last_logged(path: pathlib.Path, step: int) -> dict[str, Any]:
  """The last training metrics logged up to ``step`` (for a run resumed at its end)."""
  rows = _read_metrics(path) if (path / "metrics.jsonl").exists() else []
  rows = [r for r in rows if r["step"] <= step]
  return rows[-1] if rows else {}


def _autoprecision(exp: Experiment) -> Experiment:
  """``exp`` with ``config.autocast_rules`` extended by :func:`mpjax.suggest_rules` on batch 0."""
  if not exp.policy.is_mixed:
    return exp
  state = exp.init_state()
  batch = exp.put_batch(exp.dataset.batch(0, exp.config.batch_size, exp.config.seed))
  d = exp.diagnosis(state, batch)
  found = suggest_rules(d["fn"], *d["args"], policy=d["policy"], loss_scale=d["loss_scale"])
  rules = {**exp.rules, **found}
  if jax.process_index() == 0:
    print(
      f"mpjax: autoprecision: config.autocast_rules = {rules!r}"
      + ("" if found else " (nothing to change: every value is finite and close to f32)"),
      file=sys.stderr,
    )
  config = copy.deepcopy(exp.config)
  config.autocast_rules = repr(rules)
  return Experiment(config)


class _DivergenceGuard:
  """At each log step: is the run stuck, skipping every step or sitting at its minimum scale?"""

  def __init__(self, config: ml_collections.ConfigDict, state: TrainState, it: int):
    self.config = config
    self.applied, self.it = int(state.step), it
    self.skipping = self.at_min = 0
    scale = state.loss_scale
    self.min_scale = scale.min_loss_scale if isinstance(scale, DynamicLossScale) else None

  def check(self, it: int, state: TrainState, metrics: dict[str, Any]) -> str | None:
    steps, self.it = it - self.it, it
    applied = int(state.step)
    self.skipping = self.skipping + steps if applied == self.applied else 0
    self.applied = applied
    scale = float(metrics["loss_scale"])
    at_min = self.min_scale is not None and scale <= self.min_scale
    self.at_min = self.at_min + steps if at_min else 0
    limit = self.config.stop_after_skips
    if limit and self.skipping >= limit:
      return (
        f"the last {self.skipping} steps were all skipped (non-finite gradients); "
        f"config.stop_after_skips={limit}"
      )
    limit = self.config.stop_at_min_scale
    if limit and self.at_min >= limit:
      return (
        f"the dynamic loss scale has sat at its minimum ({self.min_scale:g}) for "
        f"{self.at_min} steps; config.stop_at_min_scale={limit}"
      )
    if not math.isfinite(float(metrics["loss"])) and bool(metrics.get("grads_finite", True)):
      return "the loss is not finite while its gradients are"
    return None


def _diverged_message(
  exp: Experiment, state: TrainState, batch: Any, it: int, reason: str, path: pathlib.Path
) -> str:
  """What stopped the run, the operation that overflows on its last batch, and what to try."""
  report = None
  if exp.policy.is_mixed:
    d = exp.diagnosis(state, batch)
    report = find_nonfinite(
      d["fn"], *d["args"], policy=d["policy"], rules=exp.rules or None, loss_scale=d["loss_scale"]
    )
  if report is not None:
    cause = f'{report}\nPut it in the config: --config.autocast_rules="{dict(report.rule)!r}".'
  else:
    cause = (
      "No operation overflows in the policy's precision where f32 stays finite: the run "
      "diverges in f32 too; lower config.learning_rate or set config.max_grad_norm."
    )
  return (
    f"mpjax: stopped at step {it} (checkpoint saved in {path}): {reason}.\n{cause}\n"
    f"Replay it: mpjax diagnose {exp.config.name} --step {it} --run_dir {path}"
  )


def _health_values(health: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
  """:func:`mpjax.grad_health` as flat ``health/<module>/<figure>`` metrics."""
  return {
    f"health/{module}/{key}": float(value)
    for module, figures in health.items()
    for key, value in figures.items()
  }


def _progress(total: int, initial: int, enabled: bool) -> Any:
  from tqdm import tqdm

  return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


# --------------------------------------------------------------------------- train


def train(
  config: ml_collections.ConfigDict,
  *,
  run_dir: str | os.PathLike | None = None,
  progress: bool = False,
  log_lines: bool = False,
) -> dict[str, Any]:
  """Trains a config, resuming from ``run_dir``'s latest checkpoint if there is one.

  Each step's batch is a pure function of ``(seed, step)``, so a run that was
  stopped (Ctrl-C, SIGTERM, or a crash after a checkpoint) and rerun with the
  same run directory continues bit-identically on CPU. SIGINT and SIGTERM
  finish the current step, write a checkpoint and return.

  Args:
    config: a config from :func:`load_config`.
    run_dir: where checkpoints, ``metrics.jsonl``, ``config.json`` and
      ``summary.json`` go; default ``config.run_dir`` or ``runs/<config name>``.
    progress: show a progress bar (loss, loss scale, skipped steps, step time).
    log_lines: instead of a bar (e.g. when stderr is a file), print one line
      of the same figures to stderr at each log step.

  A rerun in a run directory with a checkpoint says on stderr that it resumes,
  from which step toward how many; a run already complete says so and returns
  its saved summary without training.

  Returns:
    The summary: final ``loss``, ``test_loss``, ``test_accuracy``,
    ``steps_per_second``, ``examples_per_second`` (tokens for language
    models), ``skipped_steps``, ``step_memory_mib`` (XLA's temporary memory of
    the compiled step), ``policy``, ``devices``, ``steps``, ``interrupted``
    (the signal's name, or ``None``) and ``run_dir``.

  Raises:
    ConfigError: if the config or run directory cannot be used.

  Example:
    >>> import tempfile, mpjax.experiment as ex
    >>> config = ex.load_config("digits_mlp", ["steps=20", "log_every=10"])
    >>> summary = ex.train(config, run_dir=tempfile.mkdtemp())
    >>> summary["steps"], summary["skipped_steps"]
    (20, 0)
  """
  exp = Experiment(config)
  if config.autoprecision:
    exp = _autoprecision(exp)
    config = exp.config
  path = _run_dir(config, run_dir)
  _check_same_run(path, config, exp.policy)
  with _stop_on_signals() as stop:  # from here on, a signal means: checkpoint and stop
    step_fn = exp.make_step()
    first_batch = exp.put_batch(exp.dataset.batch(0, config.batch_size, 0))
    # An FP8 policy's delayed-scaling state, made before the step is compiled
    # (and as the checkpoint's restore target), replicated like the rest.
    state = init_fp8_state(step_fn, exp.init_state(), first_batch)
    state = state.replace(fp8=jax.device_put(state.fp8, NamedSharding(exp.mesh, P())))
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    with ocp.CheckpointManager(path / "checkpoints", options=options) as manager:
      start = manager.latest_step() or 0
      _check_processes_agree(path, start, exp.dataset)
      leader = jax.process_index() == 0
      saved_summary = path / "summary.json"
      if start >= config.steps and saved_summary.is_file():
        if leader:
          print(
            f"mpjax: {path} is already complete ({start} of {config.steps} steps); nothing to "
            "train. Raise --config.steps to train further, or pass a new --run_dir.",
            file=sys.stderr,
          )
        return {**json.loads(saved_summary.read_text()), "interrupted": None}
      if start and leader:
        print(
          f"mpjax: resuming {path} from step {start} of {config.steps} (checkpoint of step "
          f"{start}).",
          file=sys.stderr,
        )
      if start:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        try:
          state = manager.restore(start, args=ocp.args.StandardRestore(target))
        except ValueError as e:
          detail = " ".join(str(e).split())[:160]
          raise ConfigError(
            f"the checkpoint of step {start} in {path} does not fit this config's model and "
            f"optimizer ({detail}); it was written by another version of the model: pass a new "
            "--run_dir."
          ) from None
      metrics_log = _Metrics(path, start)
      compiled = step_fn.lower(state, first_batch)
      compiled = compiled.compile()
      memory = compiled.memory_analysis()
      step_memory_mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
      bar = _progress(config.steps, start, progress and jax.process_index() == 0)
      last = _last_logged(path, start) if jax.process_index() == 0 else {}
      timed_steps, timed_seconds, interrupted, diverged = 0, 0.0, None, None
      it = tick_it = start
      guard = _DivergenceGuard(config, state, start)
      tick = time.perf_counter()
      while it < config.steps:
        batch = exp.put_batch(exp.dataset.batch(it, config.batch_size, config.seed))
        state, metrics = compiled(state, batch)
        it += 1
        bar.update(1)
        stopping = _agreed_stop(stop, it, config)
        if it == start + 1:  # time from the end of the first step: it pays for warm-up
          jax.block_until_ready(state)
          tick, tick_it = time.perf_counter(), it
        if it % config.log_every == 0 or it == config.steps or stopping:
          metrics = jax.device_get(metrics)
          interval_steps, interval_seconds = it - tick_it, time.perf_counter() - tick
          timed_steps += interval_steps
          timed_seconds += interval_seconds
          tick, tick_it = time.perf_counter(), it
          last = {
            "loss": float(metrics["loss"]) / exp.dataset.loss_multiplier,
            "loss_scale": float(metrics["loss_scale"]),
            "skipped_steps": int(state.skipped_steps),
            "grad_norm": float(metrics["grad_norm"]),
            "step_time_s": timed_seconds / timed_steps if timed_steps else float("nan"),
            "interval_step_time_s": (
              interval_seconds / interval_steps if interval_steps else float("nan")
            ),
          }
          metrics_log.write(it, last)
          figures = dict(
            loss=f"{last['loss']:.4f}",
            scale=f"{last['loss_scale']:.0f}",
            skipped=last["skipped_steps"],
            ms=f"{1e3 * last['step_time_s']:.1f}",
          )
          bar.set_postfix(figures)
          if log_lines and leader:
            print(
              f"step {it}/{config.steps}: " + ", ".join(f"{k} {v}" for k, v in figures.items()),
              file=sys.stderr,
              flush=True,
            )
          reason = guard.check(it, state, metrics)
          if reason is not None:
            diverged = _diverged_message(exp, state, batch, it, reason, path)
            stopping = stopping or DIVERGED_EXIT_STATUS
        if config.health_every and it % config.health_every == 0:
          health = jax.device_get(exp.health_fn(state, batch))
          metrics_log.write(it, _health_values(health))
          tick, tick_it = time.perf_counter(), it  # step times leave the measurement out
        if config.eval_every and it % config.eval_every == 0 and it < config.steps:
          metrics_log.write(it, exp.evaluate(state))
          tick, tick_it = time.perf_counter(), it
        if (config.checkpoint_every and it % config.checkpoint_every == 0) or stopping:
          manager.save(it, args=ocp.args.StandardSave(state))
        if stopping:
          if diverged is None:
            interrupted = signal.Signals(stopping).name
          break
      bar.close()
      if it == config.steps and manager.latest_step() != it:
        manager.save(it, args=ocp.args.StandardSave(state))
      manager.wait_until_finished()
  evaluation = exp.evaluate(state)
  metrics_log.write(it, evaluation)
  metrics_log.close()
  # No timed steps when resumed at the end: the rates are then NaN.
  seconds_per_step = timed_seconds / timed_steps if timed_steps else float("nan")
  summary = {
    "config": config.name,
    "policy": os.environ.get(POLICY_ENV_VAR, "").strip() or config.policy,
    "dtypes": str(exp.policy),
    "loss_scale": config.loss_scale,
    "devices": exp.mesh.size,
    "steps": it,
    "loss": last.get("loss", float("nan")),
    **evaluation,
    "skipped_steps": int(state.skipped_steps),
    "final_loss_scale": float(state.loss_scale.loss_scale),
    "steps_per_second": 1.0 / seconds_per_step,
    "examples_per_second": exp.examples_per_step() / seconds_per_step,
    "examples_unit": "tokens" if exp.dataset.kind == "language_model" else "examples",
    "step_memory_mib": step_memory_mib,
    "interrupted": interrupted,
    "diverged": diverged,
    "autocast_rules": exp.rules,
    "run_dir": str(path),
  }
  if diverged is not None and jax.process_index() == 0:
    print(diverged, file=sys.stderr)
  if jax.process_index() == 0:
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary


def diagnose(
  config: ml_collections.ConfigDict, *, step: int = 0, run_dir: str | os.PathLike | None = None
) -> dict[str, Any]:
  """Replays ``config``'s train step with :func:`mpjax.find_nonfinite` and ``suggest_rules``.

  The state is the run's latest checkpoint at or before ``step`` (the initial
  state when there is none), the batch the one of step ``step``; the loss is
  scaled by the state's loss scale, as the step's backward pass sees it.

  Args:
    config: a loaded config.
    step: the step to replay.
    run_dir: the run's directory (default: ``runs/<config name>``).

  Returns:
    ``{"report": NonFiniteReport or None, "rules": dict, "from_step": int,
    "text": what ``mpjax diagnose`` prints}``.

  Raises:
    ConfigError: for a config that does not build or a negative ``step``.
  """
  if step < 0:
    raise ConfigError(f"--step={step} must be >= 0.")
  path = pathlib.Path(run_dir or config.run_dir or pathlib.Path("runs") / config.name)
  saved_config = path / "config.json"
  if saved_config.is_file():  # the run's own values (policy, learning rate, rules...)
    config = _with_saved_values(config, json.loads(saved_config.read_text()))
  exp = Experiment(config)
  step_fn = exp.make_step()
  batch = exp.put_batch(exp.dataset.batch(step, config.batch_size, config.seed))
  state = init_fp8_state(step_fn, exp.init_state(), batch)
  source = 0
  saved = [s for s in _checkpoint_steps(path) if s <= step]
  if saved:
    source = max(saved)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    with ocp.CheckpointManager(path / "checkpoints") as manager:
      state = manager.restore(source, args=ocp.args.StandardRestore(target))
  d = exp.diagnosis(state, batch)
  report = find_nonfinite(
    d["fn"], *d["args"], policy=d["policy"], rules=exp.rules or None, loss_scale=d["loss_scale"]
  )
  suggested = {}
  if exp.policy.is_mixed:
    suggested = suggest_rules(d["fn"], *d["args"], policy=d["policy"], loss_scale=d["loss_scale"])
  where = f"the checkpoint of step {source} in {path}" if saved else "the initial state"
  lines = [
    f"Replayed the train step of {config.name} [{config.policy}] on the batch of step {step}, "
    f"from {where}, loss scale {float(state.loss_scale.loss_scale):g}.",
    "",
    str(report) if report is not None else "No operation overflows where f32 stays finite.",
    "",
    f'Suggested rules (mpjax.suggest_rules): --config.autocast_rules="{suggested!r}"'
    if suggested
    else "Suggested rules: none needed (every value finite, outputs within 1% of f32).",
  ]
  return {"report": report, "rules": suggested, "from_step": source, "text": "\n".join(lines)}


def _with_saved_values(
  config: ml_collections.ConfigDict, saved: Mapping[str, Any]
) -> ml_collections.ConfigDict:
  """``config`` with the values a run saved in its ``config.json`` (JSON lists back to tuples)."""
  config = copy.deepcopy(config)

  def merge(node, values):
    for key, value in values.items():
      if key not in node:
        continue
      if isinstance(node[key], ml_collections.ConfigDict) and isinstance(value, dict):
        merge(node[key], value)
      else:
        node[key] = tuple(value) if isinstance(node[key], tuple) else value

  with config.unlocked():
    merge(config, {k: v for k, v in saved.items() if k not in _RESUMABLE_KEYS})
  return config


def _checkpoint_steps(path: pathlib.Path) -> list[int]:
  folder = path / "checkpoints"
  if not folder.is_dir():
    return []
  with ocp.CheckpointManager(folder) as manager:
    return list(manager.all_steps())


# --------------------------------------------------------------------------- compare


def _read_metrics(run_dir: pathlib.Path) -> list[dict[str, Any]]:
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return [row for row in map(json.loads, lines) if "loss" in row]


def _variant(name: str, config: ml_collections.ConfigDict) -> tuple[str, str]:
  """``"mixed_fp16:none"`` -> ``("mixed_fp16", "none")``; a bare policy keeps the config's scale."""
  policy, _, loss_scale = name.partition(":")
  loss_scale = loss_scale or config.loss_scale
  try:
    get_policy(policy)
  except ValueError as e:
    raise ConfigError(f"--policies: {e}") from None
  if loss_scale not in LOSS_SCALES:
    raise ConfigError(
      f"--policies: {name!r}: loss scale {loss_scale!r} is not one of {sorted(LOSS_SCALES)} "
      "(write POLICY or POLICY:LOSS_SCALE, e.g. mixed_fp16:none)."
    )
  return policy, loss_scale


def _device_description() -> str:
  """What the timings ran on: the device kind, and on a CPU whether it has bf16 dot instructions."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    return device.device_kind
  model = next(
    (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if "model name" in line),
    "unknown CPU",
  )
  native = "with" if _cpu_has_native_bf16_dot() else "without"
  return f"{model}, {native} native bf16 dot instructions"


def _step_time_spread(run_dir: pathlib.Path) -> float:
  """(max - min) / mean of the step time over a run's log intervals (NaN with fewer than 2)."""
  times = [r["interval_step_time_s"] for r in _read_metrics(run_dir) if "interval_step_time_s" in r]
  times = [t for t in times if math.isfinite(t)]
  if len(times) < 2:
    return float("nan")
  return (max(times) - min(times)) / (sum(times) / len(times))


def _table(
  config: ml_collections.ConfigDict,
  results: dict[str, dict[str, Any]],
  spreads: dict[str, float],
) -> str:
  # The reference: fp32 when it ran, else the first policy (mixed_bf16 for an FP8 compare).
  ref = "fp32" if "fp32" in results else next(iter(results))
  base = results[ref]
  unit = next(iter(results.values()))["examples_unit"] + "/s"
  rows = [
    f"| policy | ms/step | speedup vs {ref} | {unit} | step memory (MiB) | memory vs {ref} "
    f"| last train loss | test loss | test loss vs {ref} | test accuracy | accuracy vs {ref} (pp) "
    "| skipped steps |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():

    def rel(key, r=r, fmt="{:.3f}x"):
      if not base[key] or not math.isfinite(base[key]):
        return "-"
      return fmt.format(r[key] / base[key])

    accuracy_diff = f"{100 * (r['test_accuracy'] - base['test_accuracy']):+.2f}"
    loss_diff = f"{100 * (r['test_loss'] / base['test_loss'] - 1):+.2f}%"
    spread = spreads.get(name, float("nan"))
    noise = f" ±{100 * spread:.0f}%" if math.isfinite(spread) else ""
    rows.append(
      f"| {name} | {1e3 / r['steps_per_second']:.2f}{noise} | "
      f"{rel('steps_per_second')} | {r['examples_per_second']:.0f} | "
      f"{r['step_memory_mib']:.2f} | {rel('step_memory_mib')} | {r['loss']:.4f} | "
      f"{r['test_loss']:.4f} | {loss_diff} | {r['test_accuracy']:.4f} | {accuracy_diff} | "
      f"{r['skipped_steps']} |"
    )
  return "\n".join(rows) + "\n"


def _plot(results_dir: pathlib.Path, runs: dict[str, pathlib.Path], title: str) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []
  for key, ylabel, filename, log in (
    ("loss", "training loss", "loss.png", False),
    ("loss_scale", "loss scale", "loss_scale.png", True),
  ):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
      rows = _read_metrics(run)
      ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
      ax.set_yscale("log", base=2)
    ax.set_title(f"{title}: {ylabel}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results_dir / filename, dpi=100)
    plt.close(fig)
    written.append(filename)
  health = {name: _read_health(run) for name, run in runs.items()}
  if any(health.values()):  # runs with --config.health_every
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in health.items():
      for key in sorted({k for r in rows for k in r if k.endswith("/underflow")}):
        module = key.removeprefix("health/").removesuffix("/underflow")
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*points, strict=True), marker=".", label=f"{name}: {module}")
    ax.set_xlabel("step")
    ax.set_ylabel("share of gradient entries")
    ax.set_title(f"{title}: gradients that underflow the compute dtype")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(results_dir / "underflow.png", dpi=100)
    plt.close(fig)
    written.append("underflow.png")
  return written


def _read_health(run_dir: pathlib.Path) -> list[dict[str, Any]]:
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return [row for row in map(json.loads, lines) if any(k.startswith("health/") for k in row)]


def compare(
  config: ml_collections.ConfigDict,
  policies: Sequence[str],
  *,
  run_dir: str | os.PathLike | None = None,
  progress: bool = False,
) -> dict[str, dict[str, Any]]:
  """Trains ``config`` under each policy and writes a comparison table and plots.

  Each policy trains in ``run_dir/<policy>`` (resuming if stopped). The
  results go to ``run_dir``: ``results.md`` (time per step, speedup over
  fp32, examples or tokens per second, step memory, final loss and test
  accuracy against fp32, skipped steps), ``results.json``, and ``loss.png`` and
  ``loss_scale.png``.

  Args:
    config: a config from :func:`load_config`.
    policies: policy names, e.g. ``["fp32", "mixed_bf16", "mixed_fp16"]``; a
      ``POLICY:LOSS_SCALE`` name also sets ``config.loss_scale`` for that run
      (``"mixed_fp16:none"``: fp16 without loss scaling).
    run_dir: the results folder; default ``runs/<config name>-compare``.
    progress: show progress bars.

  Returns:
    The summary of each policy's run, by policy name.

  Raises:
    ConfigError: on an invalid policy, an empty list, or ``MPJAX_POLICY`` set
      (it would override every policy in the list).

  Example:
    >>> import tempfile, mpjax.experiment as ex
    >>> config = ex.load_config("digits_mlp", ["steps=10", "log_every=5"])
    >>> results = ex.compare(config, ["fp32", "mixed_bf16"], run_dir=tempfile.mkdtemp())
    >>> sorted(results)
    ['fp32', 'mixed_bf16']
  """
  if os.environ.get(POLICY_ENV_VAR):
    raise ConfigError(
      f"{POLICY_ENV_VAR} is set, which would override every policy compared; unset it."
    )
  if not policies:
    raise ConfigError("compare needs at least one policy, e.g. --policies fp32,mixed_bf16.")
  variants = {name: _variant(name, config) for name in policies}
  results_dir = _run_dir(config, run_dir or pathlib.Path("runs") / f"{config.name}-compare")
  results, runs = {}, {}
  for name, (policy, loss_scale) in variants.items():
    run_config = ml_collections.ConfigDict(config.to_dict())
    run_config.policy, run_config.loss_scale = policy, loss_scale
    runs[name] = results_dir / name.replace(":", "-")
    results[name] = train(run_config, run_dir=runs[name], progress=progress)
    if results[name]["interrupted"]:
      return results  # stopped: the same command resumes, then compares
  spreads = {name: _step_time_spread(runs[name]) for name in runs}
  table = _table(config, results, spreads)
  plots = _plot(results_dir, runs, config.name)
  (results_dir / "results.json").write_text(json.dumps(results, indent=2))
  devices = next(iter(results.values()))["devices"]
  header = (
    f"# {config.name}: {', '.join(policies)}\n\n"
    f"{config.steps} steps of batch {config.batch_size} on {devices} {jax.default_backend()} "
    f"device(s) ({_device_description()}), one run of each policy in one process "
    "(`POLICY:LOSS_SCALE` sets the loss scale too). The last train loss is that of the last "
    "batch; test loss and accuracy cover the whole test split. Timings are of one run on a "
    "shared machine: ms/step is the mean after the first step, and the ± is the spread (max - "
    "min, over the mean) of the step time between log intervals of that run; differences "
    "within it are noise.\n\n"
  )
  images = "".join(f"![{p}]({p})\n" for p in plots)
  (results_dir / "results.md").write_text(header + table + "\n" + images)
  return results
