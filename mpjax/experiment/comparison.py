"""``mpjax compare``: train one config under several policies; a markdown table and plots."""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections

from mpjax.experiment.config import LOSS_SCALES, ConfigError
from mpjax.experiment.loop import train
from mpjax.experiment.metrics import read_health, read_metrics
from mpjax.experiment.run_dir import prepare_run_dir
from mpjax.policy import POLICY_ENV_VAR, cpu_has_native_bf16_dot, cpuinfo, get_policy

__all__ = ["compare", "device_description"]


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


def device_description() -> str:
  """What the timings ran on: the device kind, and on a CPU whether it has bf16 dot instructions."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    return device.device_kind
  model = next(
    (line.split(":", 1)[1].strip() for line in cpuinfo().splitlines() if "model name" in line),
    "unknown CPU",
  )
  native = "with" if cpu_has_native_bf16_dot() else "without"
  return f"{model}, {native} native bf16 dot instructions"


def _step_time_spread(run_dir: pathlib.Path) -> float:
  """(max - min) / mean of the step time over a run's log intervals (NaN with fewer than 2)."""
  times = [r["interval_step_time_s"] for r in read_metrics(run_dir) if "interval_step_time_s" in r]
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
      rows = read_metrics(run)
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
  health = {name: read_health(run) for name, run in runs.items()}
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
  results_dir = prepare_run_dir(config, run_dir or pathlib.Path("runs") / f"{config.name}-compare")
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
    f"device(s) ({device_description()}), one run of each policy in one process "
    "(`POLICY:LOSS_SCALE` sets the loss scale too). The last train loss is that of the last "
    "batch; test loss and accuracy cover the whole test split. Timings are of one run on a "
    "shared machine: ms/step is the mean after the first step, and the ± is the spread (max - "
    "min, over the mean) of the step time between log intervals of that run; differences "
    "within it are noise.\n\n"
  )
  images = "".join(f"![{p}]({p})\n" for p in plots)
  (results_dir / "results.md").write_text(header + table + "\n" + images)
  return results
