"""The experiments extra (``pip install "mpjax[experiments]"``): checked before it is needed.

The library (``import mpjax``) needs only jax, flax, optax, jmp and chex. The
experiments (:mod:`mpjax.experiment`, the ``mpjax`` command line) and the
datasets of :mod:`mpjax.data` need more; without them they fail at once, with
the command that installs them, rather than after an hour of training.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXPERIMENTS", "MissingExtraError", "require_experiments"]

# The modules the experiments import, and the distributions that provide them
# (pyproject.toml's `experiments` extra).
EXPERIMENTS = {
  "ml_collections": "ml_collections",
  "orbax.checkpoint": "orbax-checkpoint",
  "sklearn": "scikit-learn",
  "matplotlib": "matplotlib",
  "tqdm": "tqdm",
}
INSTALL = (
  'pip install "mpjax[experiments]" (or, in a checkout of mpjax: pip install -e ".[experiments]")'
)


class MissingExtraError(ImportError):
  """An optional dependency is not installed; the message says what to install."""


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a missing parent package, or a broken module
    return False


def require_experiments(what: str, modules: tuple[str, ...] = tuple(EXPERIMENTS)) -> None:
  """Raises :class:`MissingExtraError` if any of ``modules`` (default: the whole extra) is missing.

  Args:
    what: what needs them, for the message, e.g. ``"mpjax train"``.
    modules: module names, keys of :data:`EXPERIMENTS`.

  Raises:
    MissingExtraError: naming the missing distributions and the ``pip install``
      that adds them.

  Example:
    >>> from mpjax._extras import require_experiments
    >>> require_experiments("mpjax train")  # the tests install the extra: nothing missing
  """
  missing = [EXPERIMENTS[m] for m in modules if not _installed(m)]
  if missing:
    raise MissingExtraError(
      f"{what} needs mpjax's experiments extra ({', '.join(missing)} "
      f"{'is' if len(missing) == 1 else 'are'} not installed); install it: {INSTALL}."
    )
