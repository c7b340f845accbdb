"""The training loop: resume or start a run, train it step by step, log, and summarize it.

:func:`train` trains an experiment over its mesh of every device (of every
process after ``jax.distributed.initialize``; data parallel, or FSDP with
``config.mesh.fsdp``), logs metrics as JSONL,
keeps orbax checkpoints that resume bit-identically, stops with a diagnosis
when the run diverges, and returns a summary.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pathlib
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from mpjax.diagnose import NonFiniteReport, find_nonfinite, suggest_rules
from mpjax.experiment.config import ConfigError, Experiment
from mpjax.experiment.metrics import MetricsWriter, read_metrics
from mpjax.experiment.run_dir import (
  agreed_stop,
  check_processes_agree,
  check_same_run,
  prepare_run_dir,
  stop_on_signals,
)
from mpjax.loss_scale import DynamicLossScale
from mpjax.policy import POLICY_ENV_VAR
from mpjax.train_state import TrainState

__all__ = ["DIVERGED_EXIT_STATUS", "train"]

# The exit status of a run stopped by the divergence guard.
DIVERGED_EXIT_STATUS = 3


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
  finish the current step, write a checkpoint and return. The rerun may use
  another mesh or device count (``config.mesh``, ``config.num_devices``):
  the checkpoint is read onto its mesh, and it trains on from the same step
  with the same math, its sums in another order.

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
    the compiled step), ``policy``, ``devices``, ``mesh`` (its axis sizes),
    ``steps``, ``interrupted``
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
  path = prepare_run_dir(config, run_dir)
  check_same_run(path, config, exp.policy)
  with stop_on_signals() as stop:  # from here on, a signal means: checkpoint and stop
    step_fn = exp.make_step()
    first_batch = exp.put_batch(exp.dataset.batch(0, config.batch_size, 0))
    # Placed on the mesh, with an FP8 policy's delayed-scaling state made before the step is
    # compiled: the restore target of a checkpoint, whatever mesh wrote it.
    state = exp.init_state(step_fn, first_batch)
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    with ocp.CheckpointManager(path / "checkpoints", options=options) as manager:
      start = manager.latest_step() or 0
      check_processes_agree(path, start, exp.dataset)
      if start >= config.steps and (path / "summary.json").is_file():
        return _complete_run(path, start, config)
      state = _resume(manager, state, start, path, config)
      compiled = step_fn.lower(state, first_batch).compile()
      step_memory_mib = _step_memory_mib(compiled)
      log = _Log(path, config, start, progress=progress, log_lines=log_lines)
      run = _run_steps(exp, compiled, state, start, manager, stop, log, path)
      log.close_bar()
      if run.steps == config.steps and manager.latest_step() != run.steps:
        manager.save(run.steps, args=ocp.args.StandardSave(run.state))
      manager.wait_until_finished()
  evaluation = exp.evaluate(run.state)
  log.finish(run.steps, evaluation)
  summary = _summary(exp, path, run, evaluation, log.last, step_memory_mib)
  if run.diverged is not None and jax.process_index() == 0:
    print(run.diverged, file=sys.stderr)
  if jax.process_index() == 0:
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary


# --------------------------------------------------------------------------- resume or init


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


def _complete_run(
  path: pathlib.Path, start: int, config: ml_collections.ConfigDict
) -> dict[str, Any]:
  """The saved summary of a run already trained to ``config.steps``, saying so on stderr."""
  if jax.process_index() == 0:
    print(
      f"mpjax: {path} is already complete ({start} of {config.steps} steps); nothing to "
      "train. Raise --config.steps to train further, or pass a new --run_dir.",
      file=sys.stderr,
    )
  return {**json.loads((path / "summary.json").read_text()), "interrupted": None}


def _resume(
  manager: ocp.CheckpointManager,
  state: TrainState,
  start: int,
  path: pathlib.Path,
  config: ml_collections.ConfigDict,
) -> TrainState:
  """``state`` restored from the checkpoint of step ``start`` (as it is when ``start`` is 0).

  Each array comes back with the sharding it has in ``state``, on this run's mesh, whatever
  mesh and device count wrote the checkpoint (orbax reads each device's shard).
  """
  if not start:
    return state
  if jax.process_index() == 0:
    print(
      f"mpjax: resuming {path} from step {start} of {config.steps} (checkpoint of step {start}).",
      file=sys.stderr,
    )
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  try:
    return manager.restore(start, args=ocp.args.StandardRestore(target))
  except ValueError as e:
    detail = " ".join(str(e).split())[:160]
    raise ConfigError(
      f"the checkpoint of step {start} in {path} does not fit this config's model and "
      f"optimizer ({detail}); it was written by another version of the model: pass a new "
      "--run_dir."
    ) from None


def _step_memory_mib(compiled: Any) -> float:
  """XLA's temporary memory of the compiled step, in MiB (NaN where XLA does not say)."""
  memory = compiled.memory_analysis()
  return memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")


# --------------------------------------------------------------------------- run steps


@dataclasses.dataclass
class _Run:
  """Where the loop stopped: the state after ``steps`` steps, and why it stopped early."""

  state: TrainState
  steps: int
  seconds_per_step: float  # NaN with no timed step (a run resumed at its end)
  interrupted: str | None = None  # the signal's name
  diverged: str | None = None  # the divergence guard's message


class _StepTimer:
  """Mean seconds per step from the end of the first step (which pays for warm-up), leaving out
  the time of evaluations and gradient-health measurements."""

  def __init__(self, step: int):
    self.steps, self.seconds = 0, 0.0
    self.restart(step)

  def restart(self, step: int) -> None:
    self.tick, self.tick_step = time.perf_counter(), step

  def lap(self, step: int) -> float:
    """Adds the steps since the last (re)start; returns their mean seconds per step."""
    interval_steps, interval_seconds = step - self.tick_step, time.perf_counter() - self.tick
    self.steps += interval_steps
    self.seconds += interval_seconds
    self.restart(step)
    return interval_seconds / interval_steps if interval_steps else float("nan")

  @property
  def mean(self) -> float:
    return self.seconds / self.steps if self.steps else float("nan")


def _run_steps(
  exp: Experiment,
  compiled: Any,
  state: TrainState,
  start: int,
  manager: ocp.CheckpointManager,
  stop: dict[str, int],
  log: _Log,
  path: pathlib.Path,
) -> _Run:
  """Trains from step ``start`` to ``config.steps``, or until a signal or the divergence guard
  stops it; logs, measures and checkpoints on the way."""
  config = exp.config
  it = start
  timer, guard = _StepTimer(start), _DivergenceGuard(config, state, start)
  interrupted = diverged = None
  while it < config.steps:
    batch = exp.put_batch(exp.dataset.batch(it, config.batch_size, config.seed))
    state, metrics = compiled(state, batch)
    it += 1
    log.bar.update(1)
    stopping = agreed_stop(stop, it, config)
    if it == start + 1:  # time from the end of the first step: it pays for warm-up
      jax.block_until_ready(state)
      timer.restart(it)
    if it % config.log_every == 0 or it == config.steps or stopping:
      metrics = jax.device_get(metrics)
      log.train_figures(it, _train_figures(exp, state, metrics, timer, it))
      reason = guard.check(it, state, metrics)
      if reason is not None:
        diverged = _diverged_message(exp, state, batch, it, reason, path)
        stopping = stopping or DIVERGED_EXIT_STATUS
    if config.health_every and it % config.health_every == 0:
      health = jax.device_get(exp.health_fn(state, batch))
      log.write(it, _health_values(health))
      timer.restart(it)  # step times leave the measurement out
    if config.eval_every and it % config.eval_every == 0 and it < config.steps:
      log.write(it, exp.evaluate(state))
      timer.restart(it)
    if (config.checkpoint_every and it % config.checkpoint_every == 0) or stopping:
      manager.save(it, args=ocp.args.StandardSave(state))
    if stopping:
      if diverged is None:
        interrupted = signal.Signals(stopping).name
      break
  return _Run(state, it, timer.mean, interrupted, diverged)


def _train_figures(
  exp: Experiment, state: TrainState, metrics: dict[str, Any], timer: _StepTimer, it: int
) -> dict[str, float]:
  """The training metrics logged at a log step (the timer's interval ends here)."""
  interval_step_time = timer.lap(it)
  return {
    "loss": float(metrics["loss"]) / exp.dataset.loss_multiplier,
    "loss_scale": float(metrics["loss_scale"]),
    "skipped_steps": int(state.skipped_steps),
    "grad_norm": float(metrics["grad_norm"]),
    "step_time_s": timer.mean,
    "interval_step_time_s": interval_step_time,
  }


def _health_values(health: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
  """:func:`mpjax.grad_health` as flat ``health/<module>/<figure>`` metrics."""
  return {
    f"health/{module}/{key}": float(value)
    for module, figures in health.items()
    for key, value in figures.items()
  }


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
  if isinstance(report, NonFiniteReport):
    cause = f'{report}\nPut it in the config: --config.autocast_rules="{dict(report.rule)!r}".'
  elif report is not None:  # an UncheckedReport: it names what it could not check
    cause = str(report)
  else:
    cause = (
      "No operation overflows in the policy's precision where f32 stays finite: the run "
      "diverges in f32 too; lower config.learning_rate or set config.max_grad_norm."
    )
  return (
    f"mpjax: stopped at step {it} (checkpoint saved in {path}): {reason}.\n{cause}\n"
    f"Replay it: mpjax diagnose {exp.config.name} --step {it} --run_dir {path}"
  )


# --------------------------------------------------------------------------- log


class _Log:
  """What a run reports: ``metrics.jsonl`` (process 0), and a progress bar or a line on stderr
  per log step; ``last`` holds the last training figures logged."""

  def __init__(
    self,
    path: pathlib.Path,
    config: ml_collections.ConfigDict,
    start: int,
    *,
    progress: bool,
    log_lines: bool,
  ):
    leader = jax.process_index() == 0
    self.config = config
    self.metrics = MetricsWriter(path, start)
    self.bar = _progress_bar(config.steps, start, progress and leader)
    self.lines = log_lines and leader
    self.last = _last_logged(path, start) if leader else {}

  def train_figures(self, it: int, figures: dict[str, float]) -> None:
    """Logs a log step's training figures."""
    self.last = figures
    self.metrics.write(it, figures)
    shown = dict(
      loss=f"{figures['loss']:.4f}",
      scale=f"{figures['loss_scale']:.0f}",
      skipped=figures["skipped_steps"],
      ms=f"{1e3 * figures['step_time_s']:.1f}",
    )
    self.bar.set_postfix(shown)
    if self.lines:
      print(
        f"step {it}/{self.config.steps}: " + ", ".join(f"{k} {v}" for k, v in shown.items()),
        file=sys.stderr,
        flush=True,
      )

  def write(self, it: int, values: dict[str, float]) -> None:
    """Logs other figures (an evaluation, gradient health) to ``metrics.jsonl``."""
    self.metrics.write(it, values)

  def close_bar(self) -> None:
    self.bar.close()

  def finish(self, it: int, evaluation: dict[str, float]) -> None:
    """Logs the final evaluation and closes the metrics file."""
    self.metrics.write(it, evaluation)
    self.metrics.close()


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
  from tqdm import tqdm

  return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def _last_logged(path: pathlib.Path, step: int) -> dict[str, Any]:
  """The last training metrics logged up to ``step`` (for a run resumed at its end)."""
  rows = read_metrics(path) if (path / "metrics.jsonl").exists() else []
  rows = [r for r in rows if r["step"] <= step]
  return rows[-1] if rows else {}


# --------------------------------------------------------------------------- summarize


def _summary(
  exp: Experiment,
  path: pathlib.Path,
  run: _Run,
  evaluation: dict[str, float],
  last: dict[str, Any],
  step_memory_mib: float,
) -> dict[str, Any]:
  """The run's summary (see :func:`train`)."""
  config = exp.config
  seconds_per_step = run.seconds_per_step  # NaN when resumed at the end: so are the rates
  return {
    "config": config.name,
    "policy": os.environ.get(POLICY_ENV_VAR, "").strip() or config.policy,
    "dtypes": repr(exp.policy),
    "loss_scale": config.loss_scale,
    "devices": exp.mesh.size,
    "mesh": dict(exp.mesh.shape),
    "steps": run.steps,
    "loss": last.get("loss", float("nan")),
    **evaluation,
    "skipped_steps": int(run.state.skipped_steps),
    "final_loss_scale": float(run.state.loss_scale.loss_scale),
    "steps_per_second": 1.0 / seconds_per_step,
    "examples_per_second": exp.examples_per_step() / seconds_per_step,
    "examples_unit": "tokens" if exp.dataset.kind == "language_model" else "examples",
    "step_memory_mib": step_memory_mib,
    "interrupted": run.interrupted,
    "diverged": run.diverged,
    "autocast_rules": exp.rules,
    "run_dir": str(path),
  }
