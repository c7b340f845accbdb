"""Experiments from configs: train one, resume it, compare precisions, on all devices.

A config is a Python file whose ``get_config()`` returns an ``ml_collections``
``ConfigDict`` (see ``configs/default.py``). :func:`train` builds the dataset,
the model, the :class:`~mpjax.TrainState` and the jitted step from it, trains
over a mesh of every device (of every process after
``jax.distributed.initialize``): data parallel by default, FSDP with
``--config.mesh.fsdp=N``. It logs metrics as JSONL, keeps orbax checkpoints
that resume bit-identically (on another mesh or device count too: each array
is read back onto the current mesh), and returns a summary.
:func:`compare` trains one config under several policies and writes a markdown
table and plots. The ``mpjax`` command line (:mod:`mpjax.cli`) calls both.

One module per job:

- :mod:`~mpjax.experiment.config`: find, load and override a config; build the
  :class:`Experiment` (dataset, model, policy, mesh, loss and step) from it.
- :mod:`~mpjax.experiment.sharding`: where the arrays go on the mesh: batches
  over every device, params over ``fsdp`` (or as their Flax metadata says).
- :mod:`~mpjax.experiment.run_dir`: the run directory, and what the processes
  of a multi-host run agree on (the run, its step, its data, when to stop).
- :mod:`~mpjax.experiment.metrics`: ``metrics.jsonl``, written and read.
- :mod:`~mpjax.experiment.loop`: :func:`train`, the training loop.
- :mod:`~mpjax.experiment.comparison`: :func:`compare`, its table and plots.
- :mod:`~mpjax.experiment.diagnosis`: :func:`diagnose`, a replay of a run's step.

They need the experiments extra (``pip install "mpjax[experiments]"``):
importing this package without it raises an ImportError that says so.
"""

# ruff: noqa: E402 (the extra is checked before the modules that need it are imported)

from mpjax._extras import require_experiments

require_experiments("mpjax.experiment")

from mpjax.experiment.comparison import compare as compare
from mpjax.experiment.comparison import device_description as device_description
from mpjax.experiment.config import LOSS_SCALES as LOSS_SCALES
from mpjax.experiment.config import MODELS as MODELS
from mpjax.experiment.config import ConfigError as ConfigError
from mpjax.experiment.config import Experiment as Experiment
from mpjax.experiment.config import find_config as find_config
from mpjax.experiment.config import load_config as load_config
from mpjax.experiment.diagnosis import diagnose as diagnose
from mpjax.experiment.loop import DIVERGED_EXIT_STATUS as DIVERGED_EXIT_STATUS
from mpjax.experiment.loop import train as train

__all__ = [
  "DIVERGED_EXIT_STATUS",
  "LOSS_SCALES",
  "MODELS",
  "ConfigError",
  "Experiment",
  "compare",
  "device_description",
  "diagnose",
  "find_config",
  "load_config",
  "train",
]
