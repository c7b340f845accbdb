"""A run's ``metrics.jsonl``: written during training, read to report and compare runs."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax

__all__ = ["MetricsWriter", "read_health", "read_metrics"]


class MetricsWriter:
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


def read_metrics(run_dir: pathlib.Path) -> list[dict[str, Any]]:
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return [row for row in map(json.loads, lines) if "loss" in row]


def read_health(run_dir: pathlib.Path) -> list[dict[str, Any]]:
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return [row for row in map(json.loads, lines) if any(k.startswith("health/") for k in row)]
