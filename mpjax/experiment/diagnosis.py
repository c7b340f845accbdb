"""``mpjax diagnose``: replay a run's train step where it went wrong, and suggest rules."""

from __future__ import annotations

import copy
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from mpjax.diagnose import find_nonfinite, suggest_rules
from mpjax.experiment.config import RESUMABLE_KEYS, ConfigError, Experiment

__all__ = ["diagnose"]


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
    ``{"report": NonFiniteReport, UncheckedReport (what could not be checked) or
    None, "rules": dict, "from_step": int,
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
  state = exp.init_state(step_fn, batch)
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
    merge(config, {k: v for k, v in saved.items() if k not in RESUMABLE_KEYS})
  return config


def _checkpoint_steps(path: pathlib.Path) -> list[int]:
  folder = path / "checkpoints"
  if not folder.is_dir():
    return []
  with ocp.CheckpointManager(folder) as manager:
    return list(manager.all_steps())
