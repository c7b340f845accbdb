"""mpjax: functional mixed-precision training for JAX and Flax."""

# First: on import it quiets XLA's CUDA compiler plugin on machines without CUDA.
from mpjax import _backend  # noqa: F401
from mpjax import testing as testing
from mpjax.audit import AuditReport as AuditReport
from mpjax.audit import audit as audit
from mpjax.autocast import OP_CLASSES as OP_CLASSES
from mpjax.autocast import AutocastReport as AutocastReport
from mpjax.autocast import autocast as autocast
from mpjax.autocast import autocast_report as autocast_report
from mpjax.block_scaled import MXFP8 as MXFP8
from mpjax.block_scaled import NVFP4 as NVFP4
from mpjax.block_scaled import NVFP4_FP4_GRADIENTS as NVFP4_FP4_GRADIENTS
from mpjax.block_scaled import BlockQuantized as BlockQuantized
from mpjax.block_scaled import BlockScaledRecipe as BlockScaledRecipe
from mpjax.block_scaled import block_scaled_dot as block_scaled_dot
from mpjax.block_scaled import dequantize_blocks as dequantize_blocks
from mpjax.block_scaled import quantize_blocks as quantize_blocks
from mpjax.collectives import Collective as Collective
from mpjax.collectives import CollectiveReport as CollectiveReport
from mpjax.collectives import collective_report as collective_report
from mpjax.data import Dataset as Dataset
from mpjax.data import load_dataset as load_dataset
from mpjax.diagnose import NonFiniteReport as NonFiniteReport
from mpjax.diagnose import UncheckedOp as UncheckedOp
from mpjax.diagnose import UncheckedReport as UncheckedReport
from mpjax.diagnose import find_nonfinite as find_nonfinite
from mpjax.diagnose import grad_health as grad_health
from mpjax.diagnose import suggest_rules as suggest_rules
from mpjax.flax_policy import linen_kwargs as linen_kwargs
from mpjax.flax_policy import nnx_apply_policy as nnx_apply_policy
from mpjax.fp8 import Fp8Recipe as Fp8Recipe
from mpjax.fp8 import Fp8State as Fp8State
from mpjax.gemm import mixed_dot_general as mixed_dot_general
from mpjax.gpu import TARGETS as TARGETS
from mpjax.gpu import GpuTarget as GpuTarget
from mpjax.gpu import compile_for as compile_for
from mpjax.gpu import get_target as get_target
from mpjax.gpu import target_mesh as target_mesh
from mpjax.kernels import KernelReport as KernelReport
from mpjax.kernels import kernel_report as kernel_report
from mpjax.loss_scale import DynamicLossScale as DynamicLossScale
from mpjax.loss_scale import LossScale as LossScale
from mpjax.loss_scale import NoOpLossScale as NoOpLossScale
from mpjax.loss_scale import StaticLossScale as StaticLossScale
from mpjax.loss_scale import all_finite as all_finite
from mpjax.loss_scale import select_tree as select_tree
from mpjax.policy import POLICY_ENV_VAR as POLICY_ENV_VAR
from mpjax.policy import PRESETS as PRESETS
from mpjax.policy import Policy as Policy
from mpjax.policy import cast_to_full as cast_to_full
from mpjax.policy import cast_to_half as cast_to_half
from mpjax.policy import dtype_to_names as dtype_to_names
from mpjax.policy import get_policy as get_policy
from mpjax.policy import half_dtype as half_dtype
from mpjax.rounding import RoundingState as RoundingState
from mpjax.rounding import init_opt_state as init_opt_state
from mpjax.rounding import kahan_add as kahan_add
from mpjax.rounding import rounded_update as rounded_update
from mpjax.rounding import state_bytes as state_bytes
from mpjax.rounding import stochastic_round as stochastic_round
from mpjax.train_state import TrainState as TrainState
from mpjax.train_state import init_fp8_state as init_fp8_state
from mpjax.train_step import make_train_step as make_train_step
from mpjax.xla import configure_xla as configure_xla
from mpjax.xla import pad_to_multiple as pad_to_multiple

__version__ = "0.1.0"

__all__ = [
  "AuditReport",
  "Dataset",
  "NonFiniteReport",
  "UncheckedReport",
  "UncheckedOp",
  "find_nonfinite",
  "grad_health",
  "suggest_rules",
  "audit",
  "linen_kwargs",
  "load_dataset",
  "nnx_apply_policy",
  "AutocastReport",
  "OP_CLASSES",
  "autocast",
  "autocast_report",
  "Collective",
  "CollectiveReport",
  "collective_report",
  "DynamicLossScale",
  "Fp8Recipe",
  "Fp8State",
  "BlockQuantized",
  "BlockScaledRecipe",
  "MXFP8",
  "NVFP4",
  "NVFP4_FP4_GRADIENTS",
  "block_scaled_dot",
  "dequantize_blocks",
  "quantize_blocks",
  "LossScale",
  "NoOpLossScale",
  "POLICY_ENV_VAR",
  "PRESETS",
  "Policy",
  "StaticLossScale",
  "TrainState",
  "all_finite",
  "get_policy",
  "half_dtype",
  "cast_to_half",
  "cast_to_full",
  "dtype_to_names",
  "make_train_step",
  "init_fp8_state",
  "mixed_dot_general",
  "GpuTarget",
  "KernelReport",
  "TARGETS",
  "compile_for",
  "get_target",
  "target_mesh",
  "kernel_report",
  "configure_xla",
  "pad_to_multiple",
  "select_tree",
  "RoundingState",
  "init_opt_state",
  "kahan_add",
  "rounded_update",
  "state_bytes",
  "stochastic_round",
  "testing",
]
