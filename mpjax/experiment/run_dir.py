"""The run directory and what the processes of a run agree on.

A run directory holds a run's ``config.json`` (the values a resumption must
keep), its checkpoints and metrics. In a multi-process run every process checks
that it resumes the same run from the same step on the same data, and they stop
together, after the same step, when any of them is signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from mpjax import data as data_lib
from mpjax.experiment.config import RESUMABLE_KEYS, ConfigError
from mpjax.policy import Policy

__all__ = [
  "agreed_stop",
  "check_processes_agree",
  "check_same_run",
  "prepare_run_dir",
  "stop_on_signals",
]


def prepare_run_dir(
  config: ml_collections.ConfigDict, run_dir: str | os.PathLike | None
) -> pathlib.Path:
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
  return {k: v for k, v in items.items() if k not in RESUMABLE_KEYS}


def _from_every_process(value: int) -> np.ndarray:
  """``value`` as each process has it (one entry per process)."""
  if jax.process_count() == 1:
    return np.array([value])
  return np.asarray(multihost_utils.process_allgather(np.int32(value)))


def check_same_run(path: pathlib.Path, config: ml_collections.ConfigDict, policy: Policy) -> None:
  saved = path / "config.json"
  current = {**_comparable(config), "resolved_policy": repr(policy)}
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


def check_processes_agree(path: pathlib.Path, start: int, dataset: data_lib.Dataset) -> None:
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


def agreed_stop(stop: dict[str, int], step: int, config: ml_collections.ConfigDict) -> int:
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


@contextlib.contextmanager
def stop_on_signals() -> Iterator[dict[str, int]]:
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
