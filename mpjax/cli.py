"""The ``mpjax`` command line: train a config, compare precisions, audit a train step.

    mpjax train                                   # configs/default.py, the char-level LM
    mpjax train digits_cnn --config.steps=500     # any config, any value overridden
    mpjax compare digits_mlp --policies fp32,mixed_bf16,mixed_fp16
    mpjax doctor                                  # every GEMM of the default train step
    mpjax doctor --target h100 --compare fp32,mixed_bf16,mixed_fp16   # the H100 program
    mpjax doctor --target h100 --mesh fsdp=8      # and the collectives of its FSDP step
    mpjax train --config.mesh.fsdp=8              # FSDP over 8 devices (the batch over all)
    MPJAX_POLICY=mixed_fp16 mpjax train           # switch precision without editing a file

Bad input (an unknown config or key, a value of the wrong type, an invalid
policy, an unwritable run directory) prints one line and exits with status 2.
Every command needs the experiments extra (``pip install "mpjax[experiments]"``);
without it the command prints that line and exits with status 1, before any work.
SIGINT or SIGTERM finishes the current step, writes a checkpoint and exits with
128 + the signal number; the same command resumes the run.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import pathlib
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

# mpjax.experiment needs the experiments extra: main checks for it first, and the functions
# below import from it when they run, so that without it a command says what to install.
from mpjax._extras import MissingExtraError, require_experiments
from mpjax.policy import POLICY_ENV_VAR

if TYPE_CHECKING:
  from mpjax.audit import AuditReport
  from mpjax.collectives import CollectiveReport

__all__ = ["main"]

_COMMANDS = {
  "train": "train a config (default: configs/default.py), resuming from its run directory",
  "compare": "train a config under several policies; write a table and plots",
  "doctor": "audit every GEMM of a config's train step: dtypes, alignment, fast-path share",
  "diagnose": "replay a config's train step (at --step N of its run) under its policy and in "
  "f32: the operation that overflows, and the autocast rules that fix it",
}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="mpjax",
    description="Mixed-precision training experiments with mpjax.",
    epilog="Override any config value with --config.KEY=VALUE, e.g. --config.steps=100.",
  )
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name, help_text in _COMMANDS.items():
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.add_argument(
      "config",
      nargs="?" if name != "compare" else None,
      default=None,
      help="a config name in configs/ (e.g. digits_mlp) or a path to a .py config file",
    )
    if name == "compare":
      sub.add_argument(
        "--policies",
        default="fp32,mixed_bf16,mixed_fp16",
        help="comma-separated policies, each POLICY or POLICY:LOSS_SCALE (e.g. mixed_fp16:none) "
        "(default: %(default)s)",
      )
    if name == "doctor":
      sub.add_argument(
        "--target",
        default=None,
        help="compile for this GPU without one (h100, h200, b200, a100, l4; needs XLA's CUDA "
        "compiler plugin): each GEMM's call, then a kernel report",
      )
      sub.add_argument(
        "--compare",
        default=None,
        help="with --target: comma-separated policies for the kernel report (default: the "
        "config's policy and fp32)",
      )
      sub.add_argument(
        "--mesh",
        default=None,
        help="with --target: compile the step sharded as a run with this config.mesh shards "
        "it, over that many GPUs of the target (axis=size pairs, comma-separated, e.g. fsdp=8 "
        "or data=2,fsdp=8), and report its collectives",
      )
      sub.add_argument(
        "--gemm_backend",
        default="default",
        choices=("default", "cublaslt", "triton"),
        help="with --target: the GEMM mode to compile in: 'default' is XLA's default mode, the "
        "one users run (Triton GEMM fusions on), 'cublaslt' turns Triton GEMMs off (every GEMM "
        "a cuBLASLt call); 'triton' is the same as 'default' (default: %(default)s)",
      )
    if name == "diagnose":
      sub.add_argument(
        "--step",
        type=int,
        default=0,
        help="replay the step after this one, from the run's latest checkpoint at or before it "
        "(default: 0, the initial state)",
      )
      sub.add_argument("--run_dir", default=None, help="the run's directory")
    if name in ("train", "compare"):
      sub.add_argument("--run_dir", default=None, help="where checkpoints and metrics go")
      sub.add_argument(
        "--no_progress", action="store_true", help="no progress bar (e.g. in CI logs)"
      )
    if name == "train":
      hosts = sub.add_argument_group(
        "multi-process runs (jax.distributed.initialize; run the same command on every host)"
      )
      hosts.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run: the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) "
        "is detected, or JAX_COORDINATOR_ADDRESS and the flags below say it",
      )
      hosts.add_argument("--coordinator_address", help="HOST:PORT of process 0")
      hosts.add_argument("--num_processes", type=int, help="how many processes take part")
      hosts.add_argument("--process_id", type=int, help="this process's index, from 0")
  return parser


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """``--config.KEY=VALUE`` (or ``--config.KEY VALUE``) arguments apart from the rest."""
  rest, overrides = [], []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith("--config."):
      if "=" not in arg and args:
        arg = f"{arg}={args.pop(0)}"
      overrides.append(arg)
    else:
      rest.append(arg)
  return rest, overrides


def _print_summary(summary: dict) -> None:
  unit = summary["examples_unit"]
  print(
    f"{summary['config']} [{summary['policy']}] on {summary['devices']} device(s): "
    f"{summary['steps']} steps, loss {summary['loss']:.4f}, test loss "
    f"{summary['test_loss']:.4f}, test accuracy {summary['test_accuracy']:.4f}, "
    f"{summary['steps_per_second']:.2f} steps/s ({summary['examples_per_second']:.0f} {unit}/s), "
    f"{summary['skipped_steps']} skipped steps, step memory {summary['step_memory_mib']:.1f} MiB; "
    f"run directory {summary['run_dir']}"
  )


def _experiment_step_and_args(config: Any) -> tuple[Any, Any, Any, Any]:
  from mpjax.experiment import Experiment

  exp = Experiment(config)
  step = exp.make_step()
  batch = exp.put_batch(exp.dataset.batch(0, config.batch_size, config.seed))
  # As a run has it: an FP8 policy's delayed-scaling state made before the first step.
  return exp, step, exp.init_state(step, batch), batch


def _step_and_args(config: Any) -> tuple[Any, Any, Any]:
  return _experiment_step_and_args(config)[1:]


def parse_mesh(text: str, config: Any) -> dict[str, int]:
  """``--mesh fsdp=8`` as the axis sizes of an experiment's mesh, in mesh order.

  Args:
    text: ``axis=size`` pairs, comma-separated (``"data=2,fsdp=8"``); an axis left out has
      size 1.
    config: the config whose batch the mesh splits.

  Returns:
    Axis name -> size, e.g. ``{"data": 1, "fsdp": 8}``.

  Raises:
    ConfigError: for a malformed pair, an unknown axis, a size below 1, or a batch size that
      the devices do not divide.
  """
  from mpjax.experiment import ConfigError
  from mpjax.experiment.sharding import MESH_AXES

  sizes = dict.fromkeys(MESH_AXES, 1)
  for pair in (p.strip() for p in text.split(",") if p.strip()):
    axis, _, size = pair.partition("=")
    axis = axis.strip()
    if axis not in MESH_AXES:
      raise ConfigError(
        f"--mesh {text}: unknown mesh axis {axis!r}; an experiment's mesh has the axes "
        f"{' and '.join(MESH_AXES)}: write e.g. --mesh fsdp=8 or --mesh data=2,fsdp=8."
      )
    if not size.strip().isdigit() or int(size) < 1:
      raise ConfigError(
        f"--mesh {text}: {pair!r} needs an integer size >= 1, e.g. --mesh {axis}=8."
      )
    sizes[axis] = int(size)
  devices = math.prod(sizes.values())
  if config.batch_size % devices:
    raise ConfigError(
      f"--mesh {text}: config.batch_size={config.batch_size} is not divisible by the "
      f"{devices} devices it is split over; use a mesh of a divisor of {config.batch_size} "
      "devices, or set --config.batch_size."
    )
  return sizes


def doctor_collectives(
  config: Any, target: str, axes: Mapping[str, int], gemm_backend: str = "default"
) -> CollectiveReport:
  """The collectives of ``config``'s train step sharded over ``axes`` GPUs of ``target``.

  The step is compiled (:func:`mpjax.compile_for`, no GPU needed) on a
  :func:`mpjax.target_mesh` of ``axes`` as a run with that ``config.mesh``
  places it: the batch over every device, each parameter as
  :attr:`mpjax.experiment.Experiment.param_specs` says for that mesh (FSDP),
  Adam's moments like their params, the rest replicated; the nodes are as few
  as the target's node size allows.

  Args:
    config: a loaded config.
    target: a GPU target name.
    axes: mesh axis sizes (:func:`parse_mesh`).
    gemm_backend: the GEMM mode (see :func:`doctor_report`).

  Returns:
    The :class:`mpjax.CollectiveReport` of the compiled step.

  Raises:
    ConfigError: for a mesh the model's partitioning or the target's nodes do not fit.
  """
  from jax.sharding import NamedSharding

  from mpjax.collectives import collective_report
  from mpjax.experiment import ConfigError
  from mpjax.experiment.sharding import BATCH_SPEC, abstract_state, param_specs
  from mpjax.gpu import compile_for, get_target, target_mesh

  exp, step, state, batch = _experiment_step_and_args(config)
  devices = math.prod(axes.values())
  nodes = -(-devices // get_target(target).max_gpus_per_node)
  try:
    specs = param_specs(exp.abstract_params(), axes)
    mesh = target_mesh(target, axes, nodes=nodes)
  except ValueError as e:
    raise ConfigError(f"--mesh: {e}") from None
  batch_sharding = NamedSharding(mesh, BATCH_SPEC)
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding), batch
  )
  compiled = compile_for(
    step, abstract_state(state, mesh, specs), batch, target=target, gemm_backend=gemm_backend
  )
  return collective_report(
    compiled, target=target, gpus_per_node=devices // nodes, reduce_dtype=exp.policy.reduce_dtype
  )


def doctor_report(
  config: Any, target: str | None = None, gemm_backend: str = "default"
) -> AuditReport:
  """The GEMM audit of ``config``'s train step on its first batch: what ``mpjax doctor`` prints.

  Args:
    config: a loaded config (:func:`mpjax.experiment.load_config`).
    target: a GPU target to compile for (``"h100"``); ``None`` audits for
      JAX's backend here.
    gemm_backend: with ``target``, the GEMM mode: ``"default"`` (XLA's default,
      Triton GEMMs on) or ``"cublaslt"`` (Triton GEMMs off).

  Returns:
    The :class:`mpjax.audit.AuditReport` of the jitted train step (forward and
    backward GEMMs) for the config's policy, model and batch size.

  Raises:
    ConfigError: if the config does not build (a bad policy, model or data).
  """
  from mpjax.audit import audit

  step, state, batch = _step_and_args(config)
  return audit(step, state, batch, target=target, gemm_backend=gemm_backend)


def doctor_kernels(
  config: Any, policies: Sequence[str], target: str, gemm_backend: str = "default"
) -> dict[str, Any]:
  """The :class:`mpjax.KernelReport` of ``config``'s train step under each policy, for ``target``.

  Args:
    config: a loaded config.
    policies: the policies to compare, the baseline first.
    target: a GPU target name.
    gemm_backend: the GEMM mode: ``"default"`` (XLA's default, Triton GEMMs
      on) or ``"cublaslt"`` (Triton GEMMs off).

  Returns:
    policy -> kernel report, in the order given.

  Raises:
    ConfigError: for a policy that cannot be read.
  """
  from mpjax.kernels import kernel_report

  reports = {}
  for policy in policies:
    variant = copy.deepcopy(config)
    variant.policy = policy
    reports[policy] = kernel_report(
      *_step_and_args(variant), target=target, gemm_backend=gemm_backend
    )
  return reports


def block_scaling_line(report: AuditReport, target: str | None, policy: Any) -> str:
  """What ``mpjax doctor`` says of a block-scaled policy's GEMMs (MXFP8, NVFP4) where it runs.

  Args:
    report: the audit of the train step.
    target: the GPU target it was compiled for, or ``None`` (JAX's backend here).
    policy: the step's policy (a name or an :class:`mpjax.Policy`).

  Returns:
    One paragraph, or ``""`` for a policy that is not block-scaled.

  Example:
    >>> from mpjax.audit import AuditReport
    >>> from mpjax.cli import block_scaling_line
    >>> block_scaling_line(AuditReport((), "cpu", ""), None, "mixed_bf16")
    ''
  """
  from mpjax.block_scaled import BlockScaledRecipe
  from mpjax.policy import get_policy

  if not isinstance(get_policy(policy).fp8, BlockScaledRecipe):
    return ""
  if target is None:
    return (
      f"Block scaling here ({report.platform}): its GEMMs take the block-scaled operands "
      "dequantized into bf16 (exactly) and sum them in f32: the numerics of the recipe, at the "
      "bf16 rate. Blackwell GPUs run them natively: `mpjax doctor --target b200` shows the "
      "cuDNN calls."
    )
  blocked = [r for r in report.rows if r.block_scales]
  if not blocked:
    return (
      f"Block scaling on {target}: no GEMM of this step is block-scaled: none of those the "
      "recipe would quantize has M, N and K that are multiples of its block size, so all run "
      "in bf16."
    )
  emulated = [r for r in blocked if "block-scaled-emulated" in {f.code for f in r.flags}]
  native = [r for r in blocked if r.call_kind == "cudnn_block_scaled"]
  if emulated:
    return (
      f"Block scaling on {target}: EMULATED. {len(emulated)} of {len(blocked)} block-scaled "
      f"GEMMs compiled as wider GEMMs: {target} has no block-scaled Tensor Cores (Blackwell, "
      "compute capability 10.x, has), so this policy runs at the bf16 rate or slower, with extra "
      "quantization passes. Use mixed_bf16 here, or mixed_fp8 (per-tensor FP8) on a Hopper GPU."
    )
  return (
    f"Block scaling on {target}: native. {len(native)} of {len(blocked)} block-scaled GEMMs are "
    "cuDNN block-scaled calls (`__cudnn$blockScaledDot`) at the FP8 or FP4 Tensor Core rate."
  )


def _doctor(config: Any, parsed: argparse.Namespace) -> None:
  from mpjax.experiment import ConfigError
  from mpjax.gpu import describe_gemm_backend, get_target
  from mpjax.kernels import kernel_table

  target = parsed.target
  if target is not None:
    try:
      target = get_target(target).name
    except ValueError as e:
      raise ConfigError(f"--target: {e}") from None
  elif parsed.compare:
    raise ConfigError("--compare needs --target (e.g. --target h100): it compares GPU programs.")
  elif parsed.mesh:
    raise ConfigError(
      "--mesh needs --target (e.g. --target h100 --mesh fsdp=8): it compiles the sharded step "
      "for that many GPUs."
    )
  axes = parse_mesh(parsed.mesh, config) if parsed.mesh else None
  try:
    report = doctor_report(config, target, parsed.gemm_backend)
  except RuntimeError as e:
    raise ConfigError(str(e)) from None
  policy = os.environ.get(POLICY_ENV_VAR, "").strip() or config.policy
  where = report.platform
  if target:
    mode = describe_gemm_backend(parsed.gemm_backend)
    where = f"{target} (compiled here, no GPU needed, in {mode})"
  print(
    f"Train step of {config.name} [{policy}], batch {config.batch_size}, on "
    f"{where}: every GEMM and convolution, forward and backward.\n"
  )
  print(report)
  block_line = block_scaling_line(report, target, policy)
  if block_line:
    print(f"\n{block_line}")
  if target is None:
    return
  if axes is not None:
    try:
      collectives = doctor_collectives(config, target, axes, parsed.gemm_backend)
    except RuntimeError as e:
      raise ConfigError(str(e)) from None
    shape = " x ".join(f"{axis}={size}" for axis, size in axes.items())
    print(
      f"\n**Collectives per train step on {math.prod(axes.values())} x {target}, mesh {shape}** "
      "(the batch over every device, the params sharded as config.mesh shards them)\n"
    )
    print(collectives)
  policies = [p.strip() for p in (parsed.compare or f"fp32,{policy}").split(",") if p.strip()]
  print(f"\n**Kernels per train step on {target}**\n")
  print(
    kernel_table(doctor_kernels(config, list(dict.fromkeys(policies)), target, parsed.gemm_backend))
  )


def _initialize_distributed(parsed: argparse.Namespace) -> None:
  """``jax.distributed.initialize`` for ``train --distributed`` (or any of its flags)."""
  from mpjax.experiment import ConfigError

  explicit = {k: getattr(parsed, k) for k in ("coordinator_address", "num_processes", "process_id")}
  if not parsed.distributed and all(v is None for v in explicit.values()):
    return
  try:
    jax.distributed.initialize(**explicit)
  except (ValueError, TypeError, RuntimeError) as e:
    raise ConfigError(
      f"--distributed: jax.distributed.initialize failed ({e}); outside a detected cluster "
      "pass --coordinator_address HOST:PORT --num_processes N --process_id I on every host."
    ) from None


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the ``mpjax`` command line and returns its exit status.

  Args:
    argv: the arguments after ``mpjax``; default ``sys.argv[1:]``.

  Returns:
    0 on success, 1 when the experiments extra is not installed (the message
    says what to install), 2 on bad input, 3 when the divergence guard
    stopped a run (after writing a checkpoint and saying why), 128 + the
    signal number when training was stopped by SIGINT or SIGTERM (after
    writing a checkpoint).

  Example:
    >>> import mpjax.cli
    >>> mpjax.cli.main(["train", "no_such_config"])
    2
  """
  args, overrides = _split_overrides(sys.argv[1:] if argv is None else argv)
  parsed = _parser().parse_args(args)
  try:  # before any work: without the experiments extra, say what to install
    require_experiments(f"mpjax {parsed.command}")
  except MissingExtraError as e:
    print(f"mpjax: error: {e}", file=sys.stderr)
    return 1
  from mpjax.experiment import (
    DIVERGED_EXIT_STATUS,
    ConfigError,
    compare,
    diagnose,
    load_config,
    train,
  )

  try:
    if parsed.command == "train":  # before anything starts JAX's backend
      _initialize_distributed(parsed)
    config = load_config(parsed.config, overrides)
    if parsed.command == "doctor":
      _doctor(config, parsed)
      return 0
    if parsed.command == "diagnose":
      print(diagnose(config, step=parsed.step, run_dir=parsed.run_dir)["text"])
      return 0
    # A bar on a terminal; with stderr going to a file, one line per log step.
    progress = not parsed.no_progress and sys.stderr.isatty()
    log_lines = not parsed.no_progress and not progress
    if parsed.command == "compare":
      policies = [p.strip() for p in parsed.policies.split(",") if p.strip()]
      results = compare(config, policies, run_dir=parsed.run_dir, progress=progress)
      summaries = list(results.values())
      table = pathlib.Path(summaries[0]["run_dir"]).parent / "results.md"
      if not summaries[-1]["interrupted"]:
        print(table.read_text())
        print(f"results written to {table}")
    else:
      summaries = [train(config, run_dir=parsed.run_dir, progress=progress, log_lines=log_lines)]
      if jax.process_index() == 0:
        _print_summary(summaries[0])
  except ConfigError as e:
    print(f"mpjax: error: {e}", file=sys.stderr)
    return 2
  for summary in summaries:
    if summary.get("diverged"):
      return DIVERGED_EXIT_STATUS
    if summary["interrupted"]:
      signum = signal.Signals[summary["interrupted"]]
      print(
        f"mpjax: stopped by {summary['interrupted']} after step {summary['steps']}; "
        f"checkpoint written to {summary['run_dir']}; rerun the same command to resume.",
        file=sys.stderr,
      )
      return 128 + int(signum)
  return 0


if __name__ == "__main__":
  sys.exit(main())
