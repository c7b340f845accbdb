"""Which of autocast's GEMMs run in FP8, and the rows of delayed-scaling state they read.

A first evaluation of the traced program meets each FP8-eligible GEMM in
program order (:class:`Fp8Gemm`); :func:`choose_fp8_gemms` picks those that run
in FP8 (all but those the recipe's ``keep_bf16`` names); later evaluations read
that plan and hand each delayed-scaling GEMM its row of
:func:`mpjax.fp8.delayed_scales` (:class:`Fp8Run`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence

import jax

from mpjax.block_scaled import BlockScaledRecipe
from mpjax.fp8 import Fp8Recipe


@dataclasses.dataclass(frozen=True)
class Fp8Gemm:
  """An FP8-eligible GEMM, as one evaluation met it (in program order)."""

  path: str
  recipe: Fp8Recipe | BlockScaledRecipe
  stateless: bool  # in a loop body: current scaling, no delayed state


@dataclasses.dataclass
class Fp8Run:
  """The FP8 GEMMs of one evaluation: which run in FP8, and the delayed scales they read.

  ``plan`` is ``None`` while a first evaluation finds the eligible GEMMs
  (``found``); then ``plan[i]`` says whether the ``i``-th runs in FP8.
  ``scales`` is the ``(gemms, 3)`` array of :func:`mpjax.fp8.delayed_scales`,
  a row for each FP8 GEMM under ``recipe`` with delayed scaling, in order;
  ``None`` runs every FP8 GEMM with current scaling.
  """

  plan: tuple[bool, ...] | None
  recipe: Fp8Recipe | None = None
  scales: jax.Array | None = None
  found: list[Fp8Gemm] = dataclasses.field(default_factory=list)
  used: int = 0

  def delayed(self, gemm: Fp8Gemm) -> bool:
    """Whether an FP8 GEMM keeps delayed state: outside loops, under the state's recipe."""
    return (
      not gemm.stateless
      and gemm.recipe == self.recipe
      and isinstance(gemm.recipe, Fp8Recipe)
      and gemm.recipe.scaling == "delayed"
    )

  def next(self, gemm: Fp8Gemm) -> tuple[bool, jax.Array | None]:
    """Whether the next eligible GEMM runs in FP8, and its scales (None: current scaling)."""
    index = len(self.found)
    self.found.append(gemm)
    if self.plan is None or index >= len(self.plan) or not self.plan[index]:
      return False, None
    if self.scales is None or not self.delayed(gemm):
      return True, None
    self.used += 1
    if self.used > self.scales.shape[0]:  # a state made for another model: see autocast's _run
      return True, None
    return True, self.scales[self.used - 1]


def choose_fp8_gemms(found: Sequence[Fp8Gemm]) -> tuple[bool, ...]:
  """Which of the eligible GEMMs run in FP8: all but those their recipe keeps in bf16."""
  plan = []
  for i, gemm in enumerate(found):
    keep = gemm.recipe.keep_bf16
    kept = (
      ("first" in keep and i == 0)
      or ("last" in keep and i == len(found) - 1)
      or any(fnmatch.fnmatchcase(gemm.path, k) for k in keep if k not in ("first", "last"))
    )
    plan.append(not kept)
  return tuple(plan)
