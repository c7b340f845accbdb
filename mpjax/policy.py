"""Precision policies: which dtype params, compute and outputs use.

A :class:`Policy` is a frozen, hashable value. It is given to the code that is
traced (a :class:`mpjax.TrainState` carries it as a static field), so changing
the policy changes what is compiled; there is no global precision setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from mpjax._dtypes import cast_floating
from mpjax.block_scaled import MXFP8, NVFP4, BlockScaledRecipe
from mpjax.fp8 import Fp8Recipe
from mpjax.rounding import ROUNDINGS

__all__ = [
  "Policy",
  "get_policy",
  "POLICY_ENV_VAR",
  "PRESETS",
  "cast_to_full",
  "cast_to_half",
  "dtype_to_names",
  "half_dtype",
]

T = TypeVar("T")

POLICY_ENV_VAR = "MPJAX_POLICY"
"""Environment variable that, when set, overrides every policy resolved from a spec."""

_log = logging.getLogger("mpjax")


def _canonical_dtype(value: Any, field: str) -> np.dtype:
  if isinstance(value, str) and value.strip().lower() in (*_DTYPE_NAMES, "half"):
    return _parse_dtype(value.strip().lower(), value)
  try:
    dtype = np.dtype(jnp.dtype(value))
  except TypeError as e:
    raise ValueError(
      f"Policy {field}={value!r}: Unknown dtype; use jnp.float32, jnp.bfloat16 or "
      "jnp.float16, or a name mpjax.get_policy reads, such as 'bf16', 'f16', 'full' or 'half' "
      "(mpjax.dtype_to_names)."
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"Policy {field}={dtype.name} is not a floating dtype; use jnp.float32, "
      "jnp.bfloat16 or jnp.float16."
    )
  if dtype.itemsize > 8:
    raise ValueError(
      f"Policy {field}={value!r} is {dtype.name}, which JAX does not compute in; use "
      "jnp.float32, jnp.bfloat16 or jnp.float16."
    )
  return dtype


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtype parameters, computation and outputs use.

  A policy is static: it is hashable, compares by value, and is carried by the
  code that is traced, so a new policy means a new compiled program.

  Attributes:
    param_dtype: dtype of the stored (master) parameters.
    compute_dtype: dtype the forward and backward computation runs in.
    output_dtype: dtype of what the model returns.
    fp8: an :class:`mpjax.Fp8Recipe` to run the GEMMs of layers in FP8
      (under :func:`mpjax.autocast` and :func:`mpjax.make_train_step`), the
      rest as the dtypes say, or an :class:`mpjax.BlockScaledRecipe` to run
      them block-scaled (MXFP8, NVFP4: Blackwell's Tensor Cores); ``None``
      (default) for neither. It needs
      ``compute_dtype`` bf16 or f16 (what FP8 values are widened to).
    opt_state_dtype: dtype the optimizer's per-parameter state (Adam's
      moments, a momentum) is stored in, e.g. ``jnp.bfloat16`` for half its
      bytes; the optimizer still computes in f32. ``None`` (default): as the
      optimizer makes it from the params (in ``param_dtype``).
    rounding: how each update is written to a stored bf16 value:
      ``"nearest"`` (default; an update below half of bf16's spacing is lost),
      ``"stochastic"`` (up with probability equal to the remainder: right in
      expectation) or ``"kahan"`` (bf16 params with a bf16 compensation buffer
      that keeps what rounding lost; the optimizer state rounded
      stochastically). See :mod:`mpjax.rounding` and the ``"bf16_sr"`` preset.
      An optimizer that casts its own state (``optax.adam(lr,
      mu_dtype=jnp.bfloat16)``) rounds it to nearest whatever this says: set
      ``opt_state_dtype`` instead.
    reduce_dtype: the dtype gradients are summed in across devices (FSDP2's
      ``reduce_dtype``): ``jnp.float32``, or the compute dtype for half the
      bytes. Each GEMM's gradient writes it, so the reduce-scatter or
      all-reduce XLA makes of a sharded batch's partial sums moves it (under
      ``shard_map``/``pmap`` the step's ``pmean`` casts to it). Under ``jit``
      the gradients no GEMM writes (biases, norm scales: a few bytes) are
      summed in f32 whatever it says. ``None``
      (default): as the GEMM writes, bf16 for bf16 on a GPU, f32 for fp16 and
      on a CPU.
    gather_dtype: the dtype sharded params travel in to the devices that
      compute with them (FSDP2's ``param_dtype``): each shard is cast before it
      leaves its device, the cast pinned to the shard, for a state whose layout
      is recorded (:attr:`mpjax.TrainState.layout`). ``None`` (default): bf16
      for bf16 compute. fp16, FP8 and a ``reduce_dtype`` wider than the gather
      dtype leave the gather to XLA (see :mod:`mpjax.layout`).

  Example:
    >>> import jax.numpy as jnp
    >>> import mpjax
    >>> policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> policy
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    >>> print(policy)  # jmp's form, which mpjax.get_policy reads back
    p=full,c=bf16,o=full
    >>> policy.cast_to_compute({"w": jnp.ones(2), "label": jnp.array(3)})["w"].dtype
    dtype(bfloat16)
  """

  param_dtype: DTypeLike
  compute_dtype: DTypeLike
  output_dtype: DTypeLike
  fp8: Fp8Recipe | BlockScaledRecipe | None = None
  opt_state_dtype: DTypeLike | None = None
  rounding: str = "nearest"
  reduce_dtype: DTypeLike | None = None
  gather_dtype: DTypeLike | None = None

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, _canonical_dtype(getattr(self, field), field))
    for field in ("opt_state_dtype", "reduce_dtype", "gather_dtype"):
      if getattr(self, field) is not None:
        object.__setattr__(self, field, _canonical_dtype(getattr(self, field), field))
    _check_rounding(self)
    _check_collectives(self)
    if self.fp8 is not None:
      if not isinstance(self.fp8, Fp8Recipe | BlockScaledRecipe):
        raise ValueError(
          f"Policy fp8={self.fp8!r} is not an mpjax.Fp8Recipe or mpjax.BlockScaledRecipe; pass "
          "mpjax.Fp8Recipe(...) (one scale per tensor), mpjax.BlockScaledRecipe(...) (MXFP8, "
          "NVFP4) or None."
        )
      if not self.is_mixed:
        raise ValueError(
          f"Policy fp8=...: FP8 GEMMs need f32 params and bf16 or f16 compute (what the FP8 "
          f"values are widened to), not params {self.param_dtype.name} and compute "
          f"{self.compute_dtype.name}. Use mpjax.get_policy('mixed_fp8')."
        )

  @property
  def is_mixed(self) -> bool:
    """f32 master params with f16/bf16 compute: the policies autocast is for."""
    return self.param_dtype == np.float32 and self.compute_dtype in (
      np.dtype(jnp.bfloat16),
      np.dtype(jnp.float16),
    )

  @property
  def computes_in_half(self) -> bool:
    """bf16 or f16 compute, whatever the params' dtype: the policies the train step autocasts.

    Under these, :func:`mpjax.make_train_step` runs the loss under :func:`mpjax.autocast`, so
    a model that declares ``dtype=jnp.float32`` still runs its GEMMs in the compute dtype:
    ``mixed_bf16`` (f32 masters) as much as ``pure_bf16`` and ``bf16_sr`` (bf16 storage).
    """
    return self.compute_dtype in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

  def cast_to_param(self, tree: T) -> T:
    """Casts the f16/bf16/f32 leaves of ``tree`` to ``param_dtype``."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the f16/bf16/f32 leaves of ``tree`` to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the f16/bf16/f32 leaves of ``tree`` to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, output_dtype: DTypeLike) -> Policy:
    """Returns this policy with ``output_dtype`` replaced."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def _extra_fields(self) -> list[tuple[str, Any]]:
    """The fields past the three dtypes whose value is not their default."""
    extra = []
    for f in dataclasses.fields(self)[3:]:
      value = getattr(self, f.name)
      # `is` first: numpy reads None as float64, so np.dtype("float64") == None.
      if value is not f.default and (f.default is None or value != f.default):
        extra.append((f.name, value))
    return extra

  def __repr__(self) -> str:
    def show(value: Any) -> str:
      return value.name if isinstance(value, np.dtype) else repr(value)

    fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)[:3]]
    fields += self._extra_fields()
    return f"Policy({', '.join(f'{name}={show(value)}' for name, value in fields)})"

  def __str__(self) -> str:
    """jmp's form, ``p=full,c=bf16,o=full`` (names from :data:`dtype_to_names`).

    A field jmp has no key for is appended when not at its default, e.g.
    ``p=bf16,c=bf16,o=full,opt_state_dtype=bf16,rounding=stochastic``.
    :func:`get_policy` reads it back for the dtypes, ``opt_state_dtype`` and
    ``rounding``; not for an FP8 policy, whose ``fp8=Fp8Recipe(...)`` it
    refuses (build that policy with ``mpjax.Policy(..., fp8=...)`` or the
    ``"mixed_fp8"`` preset).
    """

    def show(value: Any) -> str:
      if isinstance(value, np.dtype):
        return _dtype_name(value)
      return value if isinstance(value, str) else repr(value)

    dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
    parts = [f"{key}={_dtype_name(dtype)}" for key, dtype in zip("pco", dtypes, strict=True)]
    parts += [f"{name}={show(value)}" for name, value in self._extra_fields()]
    return ",".join(parts)


_F32, _BF16, _F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def _check_rounding(policy: Policy) -> None:
  """Refuses an opt_state_dtype or rounding that no train state can store."""
  rounding = policy.rounding
  if rounding not in ROUNDINGS:
    raise ValueError(
      f"Policy rounding={rounding!r} is not one of {', '.join(map(repr, ROUNDINGS))}; use "
      "rounding='stochastic' for bf16 params and optimizer state (the 'bf16_sr' preset)."
    )
  if policy.opt_state_dtype is not None and policy.opt_state_dtype not in (_F32, _BF16):
    why = (
      "fp16's range flushes Adam's second moment, a squared gradient, to zero"
      if policy.opt_state_dtype == _F16
      else f"the optimizer computes in float32, so {policy.opt_state_dtype.name} would only "
      "store float32 values in more bytes"
    )
    raise ValueError(
      f"Policy opt_state_dtype={policy.opt_state_dtype.name}: optimizer state is stored in "
      f"float32 or bfloat16 ({why}); use opt_state_dtype=jnp.bfloat16, or None to keep the "
      "optimizer's own dtypes."
    )
  if rounding == "nearest":
    return
  stored = [policy.param_dtype] + [policy.opt_state_dtype] * (policy.opt_state_dtype is not None)
  if _F16 in stored:
    raise ValueError(
      f"Policy rounding={rounding!r} rounds f32 to bfloat16, not float16; use param_dtype "
      "jnp.bfloat16, or rounding='nearest' for fp16."
    )
  if rounding == "kahan" and policy.param_dtype != _BF16:
    raise ValueError(
      f"Policy rounding='kahan' compensates bf16 params, but param_dtype is "
      f"{policy.param_dtype.name}; use param_dtype=jnp.bfloat16 (the 'bf16_kahan' preset), "
      "or rounding='stochastic' for bf16 optimizer state with f32 params."
    )
  if _BF16 not in stored:
    raise ValueError(
      f"Policy rounding={rounding!r} rounds values stored in bfloat16, but this policy stores "
      f"params and optimizer state in {policy.param_dtype.name}; "
      "set param_dtype or opt_state_dtype to jnp.bfloat16, or use rounding='nearest'."
    )


def _check_collectives(policy: Policy) -> None:
  """Refuses a reduce_dtype or gather_dtype other than f32 or the compute dtype."""
  for field in ("reduce_dtype", "gather_dtype"):
    dtype = getattr(policy, field)
    if dtype is not None and dtype not in (_F32, policy.compute_dtype):
      raise ValueError(
        f"Policy {field}={dtype.name}: collectives move float32 or the compute dtype "
        f"({policy.compute_dtype.name}); use {field}=jnp.float32 or "
        f"{field}=jnp.{policy.compute_dtype.name}, or None for the default."
      )


PRESETS: dict[str, Policy] = {
  "fp32": Policy(_F32, _F32, _F32),
  "mixed_bf16": Policy(_F32, _BF16, _F32),
  "mixed_fp16": Policy(_F32, _F16, _F32),
  "mixed_fp8": Policy(_F32, _BF16, _F32, fp8=Fp8Recipe()),
  "mixed_mxfp8": Policy(_F32, _BF16, _F32, fp8=MXFP8),
  "mixed_nvfp4": Policy(_F32, _BF16, _F32, fp8=NVFP4),
  "pure_bf16": Policy(_BF16, _BF16, _BF16),
  "bf16_sr": Policy(_BF16, _BF16, _F32, opt_state_dtype=_BF16, rounding="stochastic"),
  "bf16_kahan": Policy(_BF16, _BF16, _F32, opt_state_dtype=_BF16, rounding="kahan"),
}
"""The named policies; ``"auto"`` picks one of them for the running backend."""


class _DtypeNames(Mapping[np.dtype, tuple[str, ...]]):
  """A read-only table keyed by dtype that any spelling of the dtype finds.

  ``np.float16``, ``jnp.float16``, ``np.dtype("float16")`` and ``"float16"``
  are one key, as jmp's table (keyed by ``jnp`` scalar types) finds both
  ``np.float16`` and ``jnp.float16``.
  """

  def __init__(self, table: dict[np.dtype, tuple[str, ...]]):
    self._table = table

  def __getitem__(self, key: DTypeLike) -> tuple[str, ...]:
    if key is None:
      raise KeyError(key)
    try:
      return self._table[np.dtype(jnp.dtype(key))]
    except TypeError:
      raise KeyError(key) from None

  def __iter__(self) -> Iterator[np.dtype]:
    return iter(self._table)

  def __len__(self) -> int:
    return len(self._table)

  def __repr__(self) -> str:
    return f"dtype_to_names({self._table!r})"


dtype_to_names: Mapping[np.dtype, tuple[str, ...]] = _DtypeNames(
  {
    _BF16: ("bf16", "bfloat16"),
    _F16: ("f16", "float16", "fp16"),
    _F32: ("full", "f32", "float32", "fp32", "single"),
    np.dtype(np.float64): ("f64", "float64", "double"),
  }
)
"""The names :func:`get_policy` reads for each dtype, jmp's ``jmp._src.policy.dtype_to_names``.

Each tuple starts with jmp's names in jmp's order (``str(policy)`` prints the
first, as jmp does); mpjax also reads the names after them. ``"half"`` is
:func:`half_dtype`. Any spelling of a dtype finds its entry.

Example:
  >>> import jax.numpy as jnp, numpy as np, mpjax
  >>> mpjax.dtype_to_names[jnp.bfloat16], mpjax.dtype_to_names[np.float32][0]
  (('bf16', 'bfloat16'), 'full')
"""

_DTYPE_NAMES = {name: dtype for dtype, names in dtype_to_names.items() for name in names}


def _dtype_name(dtype: DTypeLike) -> str:
  """The short name ``str(policy)`` prints for ``dtype``: jmp's, else numpy's."""
  names = dtype_to_names.get(dtype)
  return names[0] if names else np.dtype(jnp.dtype(dtype)).name


_KEYS = {
  "p": "param",
  "params": "param",
  "c": "compute",
  "compute": "compute",
  "o": "output",
  "output": "output",
}


def cpuinfo() -> str:
  """The text of ``/proc/cpuinfo`` (empty where there is none)."""
  try:
    with open("/proc/cpuinfo") as f:
      return f.read()
  except OSError:
    return ""


def cpu_has_native_bf16_dot() -> bool:
  """Whether this x86 CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
  return any(flag in cpuinfo().split() for flag in ("avx512_bf16", "amx_bf16"))


def _auto_policy() -> tuple[Policy, str]:
  """The fastest safe policy for the default backend, and why."""
  device = jax.devices()[0]
  if device.platform == "tpu":
    return PRESETS["mixed_bf16"], "TPU: bf16 matrix units"
  if device.platform == "gpu":
    capability = getattr(device, "compute_capability", None)
    try:
      major = int(str(capability).split(".")[0])
    except ValueError:
      major = 0
    if major >= 8:
      return PRESETS["mixed_bf16"], f"GPU of compute capability {capability}: bf16 Tensor Cores"
    if major == 7:
      return PRESETS[
        "mixed_fp16"
      ], f"GPU of compute capability {capability}: fp16 Tensor Cores only"
    return PRESETS[
      "fp32"
    ], f"GPU of compute capability {capability}: no half-precision Tensor Cores"
  if device.platform == "cpu" and cpu_has_native_bf16_dot():
    return PRESETS["mixed_bf16"], "CPU with native bf16 dot instructions (AVX512-BF16/AMX)"
  return PRESETS["fp32"], f"{device.platform} without native bf16 dot instructions"


def half_dtype() -> np.dtype:
  """jmp's half-precision dtype: bf16 on a TPU, fp16 elsewhere (``jmp.half_dtype``).

  Example:
    >>> import mpjax
    >>> mpjax.half_dtype()  # on a CPU
    dtype('float16')
  """
  return _BF16 if jax.devices()[0].platform == "tpu" else _F16


def cast_to_half(tree: T) -> T:
  """The f32/f16/bf16 leaves of ``tree`` in :func:`half_dtype` (``jmp.cast_to_half``).

  Integers, booleans, PRNG keys and (with x64 on) float64 stay as they are.

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> mpjax.cast_to_half({"w": jnp.ones(2), "n": jnp.arange(2)})["w"].dtype
    dtype('float16')
  """
  return cast_floating(tree, half_dtype())


def cast_to_full(tree: T) -> T:
  """The f32/f16/bf16 leaves of ``tree`` in f32 (``jmp.cast_to_full``).

  Example:
    >>> import jax.numpy as jnp, mpjax
    >>> mpjax.cast_to_full(jnp.ones(2, jnp.bfloat16)).dtype
    dtype('float32')
  """
  return cast_floating(tree, _F32)


def _parse_dtype(name: str, spec: str) -> np.dtype:
  if name == "half":
    return half_dtype()
  if name in _DTYPE_NAMES:
    return _DTYPE_NAMES[name]
  raise _spec_error(spec, f"Unknown dtype {name!r}")


def _spec_error(spec: Any, problem: str) -> ValueError:
  names = [*PRESETS, "auto"]
  nearest = difflib.get_close_matches(str(spec).strip().lower(), names, n=1, cutoff=0.0)
  return ValueError(
    f"Cannot read precision policy {spec!r}: {problem}. Accepted forms: a preset "
    f"({', '.join(repr(n) for n in names)}); jmp's grammar such as "
    "'params=float32,compute=bfloat16,output=float32', 'p=f32,c=bf16' or a single dtype "
    "('half', 'full', 'bf16', 'f16', 'f32'), with mpjax's keys 'opt=' (or "
    "'opt_state_dtype='), 'rounding=', 'reduce=' and 'gather=' (e.g. 'p=bf16,c=bf16,o=f32,"
    "opt=bf16,rounding=stochastic', 'p=f32,c=bf16,reduce=f32'); a jmp.Policy; or an "
    "mpjax.Policy. "
    f"Nearest preset: {nearest[0]!r}."
  )


def _parse_string(spec: str) -> tuple[Policy, str]:
  text = spec.strip().lower()
  if text == "auto":
    policy, why = _auto_policy()
    return policy, f"'auto' on {why}"
  if text in PRESETS:
    return PRESETS[text], f"preset {text!r}"
  if "=" not in text:
    dtype = _parse_dtype(text, spec)
    return Policy(dtype, dtype, dtype), f"dtype {text!r} for params, compute and output"
  dtypes: dict[str, np.dtype] = {}
  storage: dict[str, Any] = {}  # opt_state_dtype and rounding, mpjax's keys past jmp's
  for part in text.split(","):
    key, sep, value = (s.strip() for s in part.partition("="))
    if sep and key in ("opt", "opt_state_dtype"):
      storage["opt_state_dtype"] = _parse_dtype(value, spec)
      continue
    if sep and key == "rounding":
      storage["rounding"] = value
      continue
    if sep and key in ("reduce", "reduce_dtype", "gather", "gather_dtype"):
      storage[key.removesuffix("_dtype") + "_dtype"] = _parse_dtype(value, spec)
      continue
    if key == "fp8":
      raise ValueError(
        f"Cannot read precision policy {spec!r}: an 'fp8=' key (str() of an FP8 policy) does "
        "not read back; use the 'mixed_fp8' preset, or build the policy with "
        "mpjax.Policy(..., fp8=mpjax.Fp8Recipe(...))."
      )
    if not sep or key not in _KEYS:
      raise _spec_error(
        spec,
        f"Unknown key {key!r}: {part.strip()!r} is not 'params=', 'compute=', 'output=', "
        "'opt=', 'opt_state_dtype=', 'rounding=', 'reduce=' or 'gather='",
      )
    dtypes[_KEYS[key]] = _parse_dtype(value, spec)
  # jmp's defaults: params f32, compute follows params, output follows compute.
  param = dtypes.get("param", _F32)
  compute = dtypes.get("compute", param)
  output = dtypes.get("output", compute)
  return Policy(param, compute, output, **storage), f"spec {spec!r}"


def _resolve(spec: Any) -> tuple[Policy, str]:
  if isinstance(spec, Policy):
    return spec, "an mpjax.Policy"
  if isinstance(spec, str):
    return _parse_string(spec)
  if all(hasattr(spec, a) for a in ("param_dtype", "compute_dtype", "output_dtype")):
    # A jmp.Policy, or any object with the same three fields.
    policy = Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
    return policy, f"a {type(spec).__name__}"
  raise _spec_error(spec, f"a {type(spec).__name__} is not a policy spec")


@functools.cache
def _log_override_once(env_value: str, policy: Policy, why: str) -> None:
  _log.warning(
    "%s=%r is set: every policy resolved from a spec is %s (%s), whatever the code asks for.",
    POLICY_ENV_VAR,
    env_value,
    policy,
    why,
  )


def get_policy(spec: Policy | str | Any = "mixed_bf16") -> Policy:
  """Resolves a policy from a preset name, jmp's string grammar, a jmp.Policy or a Policy.

  Presets: ``"fp32"``; ``"mixed_bf16"`` (params f32, compute bf16, output f32);
  ``"mixed_fp16"`` (the same with fp16); ``"mixed_fp8"`` (``"mixed_bf16"``
  with the GEMMs of layers in FP8: E4M3 operands, E5M2 gradients, delayed
  scaling in a train step, see :class:`mpjax.Fp8Recipe`); ``"mixed_mxfp8"`` and
  ``"mixed_nvfp4"`` (the same GEMMs block-scaled, :data:`mpjax.MXFP8` and
  :data:`mpjax.NVFP4`: native on Blackwell, emulated at the bf16 rate
  elsewhere, so ``"auto"`` never picks them); ``"pure_bf16"`` (all bf16);
  ``"bf16_sr"`` (params and optimizer state stored in bf16, half of
  ``"mixed_bf16"``'s train state, every write rounded stochastically; compute
  bf16, output f32); ``"bf16_kahan"`` (the same with Kahan-compensated params:
  a bf16 compensation buffer more, closer to f32 masters); ``"auto"``
  (bf16 on TPU and on NVIDIA GPUs of compute capability >= 8.0, fp16 on 7.x,
  bf16 on CPUs with AVX512-BF16 or AMX, else fp32). Beyond jmp's keys, a
  spec may say ``opt=bf16`` (``opt_state_dtype``) and ``rounding=stochastic``
  (or ``nearest``, ``kahan``), e.g. ``"p=f32,c=bf16,o=f32,opt=bf16,rounding=stochastic"``
  for f32 masters with bf16 moments; ``str(policy)`` reads back, except an FP8
  policy's (an ``fp8=`` key is refused).

  When the environment variable ``MPJAX_POLICY`` is set, its value is resolved
  in place of ``spec`` (the way ``TF_ENABLE_AUTO_MIXED_PRECISION`` switches a
  TensorFlow program without code changes), and a warning says so once.

  Args:
    spec: what to resolve.

  Returns:
    The policy.

  Raises:
    ValueError: if ``spec`` (or ``MPJAX_POLICY``) cannot be read; the message
      lists the accepted forms and the nearest preset.

  Example:
    >>> import mpjax
    >>> mpjax.get_policy("p=f32,c=bf16,o=f32") == mpjax.get_policy("mixed_bf16")
    True
  """
  env_value = os.environ.get(POLICY_ENV_VAR, "").strip()
  if env_value:
    try:
      policy, why = _parse_string(env_value)
    except ValueError as e:
      raise ValueError(f"Environment variable {POLICY_ENV_VAR}: {e}") from None
    _log_override_once(env_value, policy, why)
    return policy
  return _resolve(spec)[0]
