"""Datasets that need no download, with batches that are a pure function of (seed, step).

A training loop asks a :class:`Dataset` for ``batch(step, batch_size, seed)``:
there is no iterator state, so a run resumed from a checkpoint at step ``s``
sees bit-identical batches from ``s`` on. Every random choice comes from a
NumPy generator seeded with the tuple it depends on; the global NumPy and
Python random states are never touched.

- ``"digits"`` / ``"digits_image"``: scikit-learn's bundled 8x8 handwritten
  digits (1797 images, 10 classes), flat or NHWC.
- ``"char_corpus"``: a character-level corpus made of the Python standard
  library's own source files, cached after the first build.
- ``"underflow"``: a synthetic classification task whose loss is small enough
  that fp16 gradients underflow to zero unless the loss is scaled.

Nothing here fetches from the network.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from mpjax._extras import require_experiments

__all__ = [
  "Dataset",
  "load_dataset",
  "load_digits",
  "load_char_corpus",
  "load_underflow_task",
  "stdlib_text",
  "DATASETS",
  "CACHE_ENV_VAR",
]

CACHE_ENV_VAR = "MPJAX_CACHE"
"""Environment variable naming the cache directory (default ``~/.cache/mpjax``)."""

_KINDS = ("classification", "language_model")


def _frozen(tree: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The arrays of ``tree``, read-only, so no batch or caller can change the data."""
  out = {}
  for key, value in tree.items():
    view = np.asarray(value).view()  # a view: the caller's own array stays writeable
    view.setflags(write=False)
    out[key] = view
  return out


@functools.lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  order = np.random.default_rng((seed, epoch)).permutation(n)
  order.setflags(write=False)
  return order


def _check_count(name: str, value: Any, minimum: int) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """A train split and a test split, with the metadata a model needs.

  Classification data holds ``{"x": float32 (n, *input_shape), "y": int32 (n,)}``
  per split; language-model data holds ``{"tokens": int32 (n_tokens,)}``, one
  token stream per split. The arrays are read-only.

  Attributes:
    name: the registry name, e.g. ``"digits"``.
    kind: ``"classification"`` or ``"language_model"``.
    train: the training split.
    test: the test split.
    num_classes: classification: the number of classes.
    input_shape: classification: the shape of one example, e.g. ``(64,)``.
    vocab_size: language model: the number of token ids (the model pads it).
    seq_len: language model: the length of the sequences a batch holds.
    vocab: language model: the character of each id (``vocab[i]`` for id
      ``i``; id 0, the unknown character, is ``"\\ufffd"``).
    loss_multiplier: the factor the task's loss is defined with (1 except for
      :func:`load_underflow_task`): multiply the batch-mean loss by it before
      training on it; report and evaluate the loss without it.

  Example:
    >>> from mpjax.data import load_digits
    >>> ds = load_digits()
    >>> batch = ds.batch(step=3, batch_size=32, seed=0)
    >>> batch["x"].shape, batch["x"].dtype, batch["y"].dtype
    ((32, 64), dtype('float32'), dtype('int32'))
  """

  name: str
  kind: str
  train: Mapping[str, np.ndarray]
  test: Mapping[str, np.ndarray]
  num_classes: int | None = None
  input_shape: tuple[int, ...] | None = None
  vocab_size: int | None = None
  seq_len: int | None = None
  vocab: str | None = None
  loss_multiplier: float = 1.0

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"Dataset {self.name!r}: kind={self.kind!r} must be one of {_KINDS}.")
    keys = ("x", "y") if self.kind == "classification" else ("tokens",)
    for split in ("train", "test"):
      tree = getattr(self, split)
      if sorted(tree) != sorted(keys):
        raise ValueError(
          f"Dataset {self.name!r}: the {split} split of a {self.kind} dataset must hold "
          f"exactly {keys}, got {tuple(tree)}."
        )
      object.__setattr__(self, split, _frozen(tree))
    if self.kind == "classification":
      _check_count("num_classes", self.num_classes, 2)
      for split in (self.train, self.test):
        if len(split["x"]) != len(split["y"]) or len(split["y"]) == 0:
          raise ValueError(f"Dataset {self.name!r}: x and y must hold the same, nonzero count.")
      object.__setattr__(self, "input_shape", tuple(self.train["x"].shape[1:]))
    else:
      _check_count("vocab_size", self.vocab_size, 2)
      _check_count("seq_len", self.seq_len, 1)
      for split in ("train", "test"):
        n = len(getattr(self, split)["tokens"])
        if n < self.seq_len + 1:
          raise ValueError(
            f"Dataset {self.name!r}: the {split} stream holds {n} tokens, fewer than one "
            f"sequence of seq_len + 1 = {self.seq_len + 1}; use a shorter seq_len or more text."
          )

  @property
  def num_train(self) -> int:
    """Training examples (classification) or tokens (language model)."""
    return len(self.train["y"] if self.kind == "classification" else self.train["tokens"])

  def batch(self, step: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    """The training batch of step ``step``: a pure function of ``(seed, step, batch_size)``.

    Classification: example positions ``step * batch_size`` to
    ``(step + 1) * batch_size - 1`` of an endless stream of epochs; epoch ``e``
    visits every training example once, in the order of a permutation drawn
    from ``np.random.default_rng((seed, e))``. A batch that crosses an epoch
    boundary takes the end of one permutation and the start of the next.
    Returns ``{"x": float32 (batch_size, *input_shape), "y": int32 (batch_size,)}``.

    Language model: ``batch_size`` windows of ``seq_len + 1`` tokens at
    offsets drawn from ``np.random.default_rng((seed, step))``. Returns
    ``{"tokens": int32 (batch_size, seq_len), "targets": int32 (batch_size,
    seq_len)}``, where ``targets`` is ``tokens`` shifted by one (the next token).

    Args:
      step: the training step, >= 0.
      batch_size: examples (or sequences) per batch, >= 1.
      seed: the data seed, >= 0.

    Returns:
      The batch, as NumPy arrays.

    Raises:
      ValueError: if ``step``, ``batch_size`` or ``seed`` is not an integer in range.
    """
    _check_count("step", step, 0)
    _check_count("batch_size", batch_size, 1)
    _check_count("seed", seed, 0)
    if self.kind == "language_model":
      tokens = self.train["tokens"]
      starts = np.random.default_rng((seed, step)).integers(
        0, len(tokens) - self.seq_len, size=batch_size
      )
      windows = tokens[starts[:, None] + np.arange(self.seq_len + 1)]
      return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}
    n = self.num_train
    positions = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
    epochs, offsets = np.divmod(positions, n)
    index = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
      where = epochs == epoch
      index[where] = _epoch_permutation(seed, int(epoch), n)[offsets[where]]
    return {"x": self.train["x"][index], "y": self.train["y"][index]}

  def eval_batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """The whole test split, in its fixed order, in batches of one shape.

    Classification: the test examples in order. Language model: consecutive
    non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``, so
    every test token but the first is a target once). The last batch is padded
    to ``batch_size`` with zeros, and every batch has a ``"mask"`` (bool,
    ``(batch_size,)``) that is ``False`` on padding rows: weight per-example
    losses with it, e.g. ``sum(loss * mask) / sum(mask)``.

    Args:
      batch_size: examples (or sequences) per batch, >= 1.

    Yields:
      Batches with the keys of :meth:`batch` and ``"mask"``.

    Raises:
      ValueError: if ``batch_size`` is not an integer >= 1.
    """
    _check_count("batch_size", batch_size, 1)
    if self.kind == "classification":
      examples = dict(self.test)
    else:
      tokens = self.test["tokens"]
      count = (len(tokens) - 1) // self.seq_len
      windows = tokens[np.arange(count)[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
      examples = {"tokens": windows[:, :-1], "targets": windows[:, 1:]}
    return self._padded_batches(examples, batch_size)

  @staticmethod
  def _padded_batches(
    examples: dict[str, np.ndarray], batch_size: int
  ) -> Iterator[dict[str, np.ndarray]]:
    n = len(next(iter(examples.values())))
    for lo in range(0, n, batch_size):
      real = min(batch_size, n - lo)
      batch = {}
      for key, value in examples.items():
        part = value[lo : lo + real]
        if real < batch_size:
          pad = np.zeros((batch_size - real, *part.shape[1:]), part.dtype)
          part = np.concatenate([part, pad])
        batch[key] = part
      batch["mask"] = np.arange(batch_size) < real
      yield batch


def load_digits(*, test_fraction: float = 0.2, seed: int = 0, image: bool = False) -> Dataset:
  """scikit-learn's bundled 8x8 handwritten digits: 1797 images, 10 classes, no download.

  Pixels (0 to 16 in the source) are scaled to [0, 1]. The split is
  stratified by class and fixed by ``seed`` (``sklearn``'s
  ``train_test_split``): the same seed gives the same split on every machine
  with the same scikit-learn.

  Args:
    test_fraction: the share of images in the test split, in (0, 1).
    seed: the seed of the split, >= 0.
    image: ``True`` for NHWC images ``(n, 8, 8, 1)`` (for :class:`mpjax.models.CNN`),
      ``False`` for flat vectors ``(n, 64)``.

  Returns:
    A classification :class:`Dataset` named ``"digits"`` or ``"digits_image"``.

  Raises:
    ValueError: if ``test_fraction`` or ``seed`` is out of range.

  Example:
    >>> from mpjax.data import load_digits
    >>> ds = load_digits(image=True)
    >>> ds.train["x"].shape, ds.test["x"].shape, ds.num_classes
    ((1437, 8, 8, 1), (360, 8, 8, 1), 10)
  """
  require_experiments("mpjax.data.load_digits", ("sklearn",))
  from sklearn import datasets, model_selection

  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"load_digits: test_fraction={test_fraction!r} must be in (0, 1), e.g. 0.2.")
  _check_count("seed", seed, 0)
  digits = datasets.load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  if image:
    x = x.reshape(-1, 8, 8, 1)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
    x, y, test_size=test_fraction, random_state=seed, stratify=y
  )
  return Dataset(
    name="digits_image" if image else "digits",
    kind="classification",
    train={"x": x_train, "y": y_train},
    test={"x": x_test, "y": y_test},
    num_classes=10,
  )


_UNKNOWN = 0
_VOCAB = "\ufffd\t\n" + "".join(chr(c) for c in range(32, 127))
"""Id 0: any other character; then tab, newline and printable ASCII (98 ids)."""
_CORPUS_FORMAT = 1  # bump when the encoding changes, so old caches are not reused


def _cache_dir(cache_dir: str | os.PathLike | None) -> pathlib.Path:
  if cache_dir is not None:
    return pathlib.Path(cache_dir)
  if os.environ.get(CACHE_ENV_VAR):
    return pathlib.Path(os.environ[CACHE_ENV_VAR])
  return pathlib.Path.home() / ".cache" / "mpjax"


def _stdlib_files() -> list[pathlib.Path]:
  """The top-level ``.py`` files of the standard library, sorted by name.

  Only the top level: deeper directories can hold ``site-packages``, which
  differ between machines.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(root.glob("*.py"), key=lambda p: p.name)
  if not files:
    raise FileNotFoundError(
      f"load_char_corpus: no .py files in the standard library directory {root}; this "
      "Python ships without its sources, so use another dataset."
    )
  return files


def _encode(text: str) -> np.ndarray:
  table = np.full(128, _UNKNOWN, np.int32)
  for i, char in enumerate(_VOCAB):
    if i != _UNKNOWN:
      table[ord(char)] = i
  codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
  return np.where(codes < 128, table[np.minimum(codes, 127)], _UNKNOWN).astype(np.int32)


def stdlib_text(max_chars: int) -> tuple[str, list[str]]:
  """The text :func:`load_char_corpus` uses by default, and the files it came from.

  The top-level ``.py`` files of this Python's standard library, in sorted
  order, joined and cut at ``max_chars`` characters. It differs between Python
  versions: written to a file (its ``text_file``), it gives the same token
  stream under any of them.

  Args:
    max_chars: how many characters to take.

  Returns:
    (the text, the names of the files it came from).

  Raises:
    FileNotFoundError: if this Python ships without its standard-library sources.

  Example:
    >>> from mpjax.data import stdlib_text
    >>> text, files = stdlib_text(1000)
    >>> len(text), files[0] == "__future__.py"
    (1000, True)
  """
  parts, total, names = [], 0, []
  for path in _stdlib_files():
    text = path.read_text(encoding="utf-8", errors="replace")
    parts.append(text[: max_chars - total])
    names.append(path.name)
    total += len(parts[-1])
    if total >= max_chars:
      break
  return "".join(parts), names


def _read_text_file(path: str | os.PathLike, max_chars: int) -> str:
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"load_char_corpus: text_file={str(path)!r} is not a file; give a text file.")
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8", errors="replace") as f:
    text = f.read(max_chars)
  if not text:
    raise ValueError(f"load_char_corpus: text_file={str(path)!r} is empty.")
  return text


def _write_atomically(path: pathlib.Path, write: Callable[[Any], None], mode: str) -> None:
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  with open(tmp, mode) as f:
    write(f)
  os.replace(tmp, path)


def _load_cached(npy: pathlib.Path, info: pathlib.Path, meta: dict) -> np.ndarray | None:
  """The cached token stream, or ``None`` if it is missing, corrupt or for other parameters."""
  try:
    stored = json.loads(info.read_text())
    tokens = np.load(npy, allow_pickle=False)
  except (OSError, ValueError, EOFError):
    return None
  if stored.get("key") != meta or stored.get("num_tokens") != len(tokens):
    return None
  if tokens.dtype != np.int32 or tokens.ndim != 1 or tokens.size == 0:
    return None
  if tokens.min() < 0 or tokens.max() >= len(_VOCAB):
    return None
  return tokens


def load_char_corpus(
  *,
  seq_len: int = 64,
  max_chars: int = 2_000_000,
  test_fraction: float = 0.1,
  cache_dir: str | os.PathLike | None = None,
  text_file: str | os.PathLike | None = None,
) -> Dataset:
  """A character-level corpus: the Python standard library's own source, no download.

  The text is the top-level ``.py`` files of ``sysconfig.get_paths()["stdlib"]``
  in sorted order, cut at ``max_chars`` characters: the same on every machine
  with the same Python version (:func:`stdlib_text`), or ``text_file``'s.
  Characters map to 98 ids: tab, newline and printable ASCII, and id 0 for
  anything else. The last ``test_fraction`` of the stream is the test split.

  The standard library's encoded stream is cached as ``.npy`` (with a ``.json``
  of the parameters, Python version, vocabulary and files it came from) under
  ``cache_dir``; a missing, corrupt or mismatched cache is rebuilt, and writes
  are atomic, so concurrent runs are safe. A ``text_file`` is read each time.

  Args:
    seq_len: the length of each training sequence.
    max_chars: how many characters of the source to use.
    test_fraction: the share of the stream held out for test, in (0, 1).
    cache_dir: where to cache; ``None`` uses ``$MPJAX_CACHE``, else ``~/.cache/mpjax``.
    text_file: a UTF-8 text file (gzip-compressed if its name ends in ``.gz``)
      to use instead of the standard library's source, e.g. to train on the
      same stream under another Python version.

  Returns:
    A language-model :class:`Dataset` named ``"char_corpus"``.

  Raises:
    ValueError: if an argument is out of range, a split holds less than one sequence, or
      ``text_file`` is missing or empty.
    FileNotFoundError: if this Python ships without its standard-library sources.

  Example:
    >>> import tempfile
    >>> from mpjax.data import load_char_corpus
    >>> ds = load_char_corpus(seq_len=32, max_chars=20_000, cache_dir=tempfile.mkdtemp())
    >>> ds.vocab_size, ds.train["tokens"].size, ds.batch(0, 4, seed=0)["tokens"].shape
    (98, 18000, (4, 32))
  """
  _check_count("seq_len", seq_len, 1)
  _check_count("max_chars", max_chars, 2)
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(
      f"load_char_corpus: test_fraction={test_fraction!r} must be in (0, 1), e.g. 0.1."
    )
  if text_file is not None:
    tokens = _encode(_read_text_file(text_file, int(max_chars)))
  else:
    tokens = _stdlib_tokens(int(max_chars), _cache_dir(cache_dir))
  n_test = int(round(len(tokens) * test_fraction))
  return Dataset(
    name="char_corpus",
    kind="language_model",
    train={"tokens": tokens[: len(tokens) - n_test]},
    test={"tokens": tokens[len(tokens) - n_test :]},
    vocab_size=len(_VOCAB),
    seq_len=seq_len,
    vocab=_VOCAB,
  )


def _stdlib_tokens(max_chars: int, directory: pathlib.Path) -> np.ndarray:
  """:func:`stdlib_text` encoded, from the cache under ``directory`` or built and cached."""
  version = f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}"
  meta = {
    "format": _CORPUS_FORMAT,
    "python": version,
    "max_chars": int(max_chars),
    "vocab": _VOCAB,
  }
  digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
  stem = f"char_corpus-{version}-{max_chars}-{digest}"  # the version has dots: no with_suffix
  npy, info_path = directory / f"{stem}.npy", directory / f"{stem}.json"
  tokens = _load_cached(npy, info_path, meta)
  if tokens is None:
    text, files = stdlib_text(max_chars)
    tokens = _encode(text)
    directory.mkdir(parents=True, exist_ok=True)
    info = {"key": meta, "num_tokens": len(tokens), "files": files}
    _write_atomically(npy, lambda f: np.save(f, tokens), "wb")
    _write_atomically(info_path, lambda f: json.dump(info, f, indent=1), "w")
  return tokens


UNDERFLOW_LOSS_MULTIPLIER = 2.0**-21
"""The underflow task's loss factor (~4.8e-7); see :func:`load_underflow_task`."""


def load_underflow_task(
  *,
  n_train: int = 4096,
  n_test: int = 1024,
  dim: int = 16,
  num_classes: int = 4,
  seed: int = 0,
) -> Dataset:
  """A classification task whose loss is too small for unscaled fp16 gradients.

  The data is an ordinary teacher task: inputs ``x ~ N(0, I)`` of ``dim``
  features, labels the argmax of a fixed random linear map of ``x`` (an MLP
  learns it to >90% in a few hundred steps). What makes it an fp16 task is its
  loss, defined as the batch-mean cross-entropy times
  ``loss_multiplier = 2**-21`` (about 4.8e-7), the size of a per-element loss
  averaged over ~2 million terms (a per-pixel loss on a 1448x1448 image), or of
  a heavily down-weighted term.

  With that loss, each logit's gradient is below ``2**-21 / batch_size``: at
  most 2**-25 (3e-8, half fp16's smallest subnormal) for every batch of 16 or
  more, so the fp16 cotangent entering the output GEMM's backward pass rounds to
  zero and every weight gradient is exactly zero. Under ``mixed_fp16`` with
  :class:`mpjax.NoOpLossScale` the weights never move and accuracy stays at
  chance. :class:`mpjax.DynamicLossScale` (initial scale ``2**15``) lifts the
  gradients into fp16's range and training matches fp32; so does bf16
  (exponent range of f32). Adam makes fp32 training indifferent to the
  factor: its updates do not depend on the gradients' scale.

  Use it in the loss function: ``dataset.loss_multiplier * cross_entropy.mean()``,
  computed from f32 logits; evaluate accuracy (and report the loss) without it.

  Args:
    n_train: training examples.
    n_test: test examples.
    dim: input features.
    num_classes: classes (>= 2).
    seed: the seed of the teacher and the examples, >= 0.

  Returns:
    A classification :class:`Dataset` named ``"underflow"`` with
    ``loss_multiplier=2**-21``.

  Raises:
    ValueError: if a count is out of range.

  Example:
    >>> from mpjax.data import load_underflow_task
    >>> ds = load_underflow_task()
    >>> ds.train["x"].shape, ds.num_classes, ds.loss_multiplier == 2**-21
    ((4096, 16), 4, True)
  """
  for name, value, minimum in [
    ("n_train", n_train, 1),
    ("n_test", n_test, 1),
    ("dim", dim, 1),
    ("num_classes", num_classes, 2),
    ("seed", seed, 0),
  ]:
    _check_count(name, value, minimum)
  rng = np.random.default_rng((seed, 0x5EED))
  teacher = rng.standard_normal((dim, num_classes))
  x = rng.standard_normal((n_train + n_test, dim)).astype(np.float32)
  y = np.argmax(x @ teacher, axis=-1).astype(np.int32)
  return Dataset(
    name="underflow",
    kind="classification",
    train={"x": x[:n_train], "y": y[:n_train]},
    test={"x": x[n_train:], "y": y[n_train:]},
    num_classes=num_classes,
    loss_multiplier=UNDERFLOW_LOSS_MULTIPLIER,
  )


_LOADERS: dict[str, Callable[..., Dataset]] = {
  "digits": load_digits,
  "digits_image": lambda **kwargs: load_digits(image=True, **kwargs),
  "char_corpus": load_char_corpus,
  "underflow": load_underflow_task,
}

DATASETS = tuple(_LOADERS)
"""The names :func:`load_dataset` knows."""


def load_dataset(name: str, **kwargs: Any) -> Dataset:
  """Loads a dataset by name: ``"digits"``, ``"digits_image"``, ``"char_corpus"``, ``"underflow"``.

  Args:
    name: the dataset's name.
    **kwargs: the keyword arguments of its loader (:func:`load_digits`,
      :func:`load_char_corpus`, :func:`load_underflow_task`).

  Returns:
    The dataset.

  Raises:
    ValueError: for an unknown name; the message lists the valid names.

  Example:
    >>> from mpjax.data import load_dataset
    >>> load_dataset("digits_image", seed=1).input_shape
    (8, 8, 1)
  """
  if name not in _LOADERS:
    raise ValueError(
      f"Unknown dataset {name!r}; the datasets are {', '.join(repr(n) for n in DATASETS)}."
    )
  return _LOADERS[name](**kwargs)
