import gzip
import platform
import random

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax.data as data
import mpjax.experiment
from mpjax.data import Dataset, load_char_corpus, load_dataset, load_digits, load_underflow_task
from mpjax.loss_scale import DynamicLossScale, NoOpLossScale
from mpjax.models import MLP
from mpjax.train_state import TrainState
from mpjax.train_step import make_train_step


def _toy(n=10):
  """A classification dataset whose x is each example's own index."""
  index = np.arange(n, dtype=np.float32)[:, None]
  labels = np.arange(n, dtype=np.int32) % 2
  return Dataset(
    name="toy",
    kind="classification",
    train={"x": index, "y": labels},
    test={"x": index[:3], "y": labels[:3]},
    num_classes=2,
  )


def test_classification_batch_is_a_pure_function_of_seed_and_step():
  ds = load_digits()
  numpy_state, python_state = np.random.get_state(), random.getstate()
  first = ds.batch(step=5, batch_size=32, seed=3)
  ds.batch(step=6, batch_size=32, seed=3)
  again = ds.batch(step=5, batch_size=32, seed=3)
  chex.assert_trees_all_equal(first, again)
  assert first["x"].dtype == np.float32 and first["y"].dtype == np.int32
  assert first["x"].shape == (32, 64) and first["y"].shape == (32,)
  assert not np.array_equal(first["x"], ds.batch(step=6, batch_size=32, seed=3)["x"])
  assert not np.array_equal(first["x"], ds.batch(step=5, batch_size=32, seed=4)["x"])
  # The global random states are untouched.
  assert random.getstate() == python_state
  chex.assert_trees_all_equal(np.random.get_state()[1], numpy_state[1])


@pytest.mark.parametrize("batch_size", [5, 4, 10, 23])
def test_each_epoch_visits_every_example_once(batch_size):
  ds = _toy(10)
  steps = -(-30 // batch_size)  # enough steps for three epochs
  stream = np.concatenate([ds.batch(s, batch_size, seed=0)["x"][:, 0] for s in range(steps)])
  epochs = [stream[e * 10 : (e + 1) * 10] for e in range(3)]
  for epoch in epochs:
    np.testing.assert_array_equal(np.sort(epoch), np.arange(10))
  assert not all(np.array_equal(epochs[0], e) for e in epochs[1:])  # reshuffled per epoch
  # The labels travel with their examples.
  y = np.concatenate([ds.batch(s, batch_size, seed=0)["y"] for s in range(steps)])
  np.testing.assert_array_equal(y, stream.astype(np.int32) % 2)


def test_digits_epoch_covers_the_training_split():
  ds = load_digits()
  assert ds.num_train == 1437 == 3 * 479
  y = np.concatenate([ds.batch(s, 479, seed=7)["y"] for s in range(3)])
  np.testing.assert_array_equal(np.bincount(y, minlength=10), np.bincount(ds.train["y"]))


def test_digits_split_is_fixed_stratified_and_complete():
  from sklearn.datasets import load_digits as sk_digits

  ds = load_digits()
  chex.assert_trees_all_equal(ds.train, load_digits(seed=0).train)
  assert not np.array_equal(ds.test["x"], load_digits(seed=1).test["x"])
  assert ds.kind == "classification" and ds.num_classes == 10 and ds.input_shape == (64,)
  assert len(ds.test["y"]) == 360 and ds.num_train == 1437
  assert ds.train["x"].min() == 0.0 and ds.train["x"].max() == 1.0
  # Stratified: each class holds its share of the test split, within one example.
  full = sk_digits()
  expected = np.bincount(full.target) * 360 / 1797
  assert np.all(np.abs(np.bincount(ds.test["y"], minlength=10) - expected) <= 1)
  # Train and test together are the whole dataset (as a multiset of rows).
  rows = np.concatenate([ds.train["x"], ds.test["x"]]) * 16
  labels = np.concatenate([ds.train["y"], ds.test["y"]])
  got = np.column_stack([rows, labels])
  want = np.column_stack([full.data, full.target])
  np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)])
  # image=True is the same split as NHWC.
  images = load_digits(image=True)
  assert images.input_shape == (8, 8, 1) and images.name == "digits_image"
  np.testing.assert_array_equal(images.train["x"].reshape(-1, 64), ds.train["x"])


def test_arrays_are_read_only():
  ds = load_digits()
  with pytest.raises(ValueError, match="read-only"):
    ds.train["x"][0, 0] = 1.0
  mine = np.zeros((4, 2), np.float32)
  Dataset(
    "mine",
    "classification",
    {"x": mine, "y": np.zeros(4, np.int32)},
    {"x": mine, "y": np.zeros(4, np.int32)},
    num_classes=2,
  )
  mine[0, 0] = 1.0  # the caller's own array stays writeable


def test_eval_batches_cover_the_test_split_in_order_with_a_mask():
  ds = load_digits()
  batches = list(ds.eval_batches(100))
  assert len(batches) == 4
  for batch in batches:
    assert batch["x"].shape == (100, 64) and batch["mask"].dtype == np.bool_
  np.testing.assert_array_equal([b["mask"].sum() for b in batches], [100, 100, 100, 60])
  x = np.concatenate([b["x"][b["mask"]] for b in batches])
  np.testing.assert_array_equal(x, ds.test["x"])
  np.testing.assert_array_equal(batches[-1]["x"][60:], 0.0)


@pytest.fixture
def corpus_dir(tmp_path):
  return tmp_path / "cache"


def test_char_corpus_cache_round_trip(corpus_dir, monkeypatch):
  ds = load_char_corpus(seq_len=32, max_chars=50_000, cache_dir=corpus_dir)
  assert ds.kind == "language_model" and ds.vocab_size == len(ds.vocab) == 98
  assert ds.train["tokens"].size + ds.test["tokens"].size == 50_000
  assert ds.test["tokens"].size == 5_000
  (npy,) = corpus_dir.glob("*.npy")
  (meta,) = corpus_dir.glob("*.json")
  assert npy.name == f"char_corpus-cpython-{platform.python_version()}-50000-{npy.name[-16:]}"
  assert npy.stem == meta.stem and '"max_chars": 50000' in meta.read_text()
  # The text decodes back to the standard library's source (ASCII kept, others unknown).
  first = data._stdlib_files()[0].read_text(encoding="utf-8")[:2000]
  decoded = "".join(ds.vocab[i] for i in ds.train["tokens"][:2000])
  assert decoded == "".join(c if c in ds.vocab[1:] else "\ufffd" for c in first)

  def no_build(max_chars):
    raise AssertionError("the cache should have been used")

  monkeypatch.setattr(data, "stdlib_text", no_build)
  cached = load_char_corpus(seq_len=32, max_chars=50_000, cache_dir=corpus_dir)
  chex.assert_trees_all_equal(cached.train, ds.train)
  chex.assert_trees_all_equal(cached.test, ds.test)
  monkeypatch.undo()

  # A corrupt or missing cache is rebuilt, to the same tokens.
  npy.write_bytes(b"not a numpy file")
  rebuilt = load_char_corpus(seq_len=32, max_chars=50_000, cache_dir=corpus_dir)
  chex.assert_trees_all_equal(rebuilt.train, ds.train)
  npy.unlink()
  rebuilt = load_char_corpus(seq_len=32, max_chars=50_000, cache_dir=corpus_dir)
  chex.assert_trees_all_equal(rebuilt.train, ds.train)
  # Other parameters, another cache file.
  load_char_corpus(seq_len=32, max_chars=40_000, cache_dir=corpus_dir)
  assert len(list(corpus_dir.glob("*.npy"))) == 2


def test_char_corpus_from_a_text_file_is_the_same_stream_under_any_python(tmp_path):
  # The standard library's text, written to a file (plain or gzip), gives the stream the
  # standard library gives; its cache directory stays empty (a file is read each time).
  text, files = data.stdlib_text(30_000)
  assert len(text) == 30_000 and files == sorted(files)
  plain, packed = tmp_path / "corpus.txt", tmp_path / "corpus.txt.gz"
  plain.write_text(text, encoding="utf-8")
  with gzip.open(packed, "wt", encoding="utf-8") as f:
    f.write(text)
  cache = tmp_path / "cache"
  stdlib = load_char_corpus(seq_len=32, max_chars=30_000, cache_dir=tmp_path / "stdlib")
  for file in (plain, packed):
    ds = load_char_corpus(seq_len=32, max_chars=30_000, cache_dir=cache, text_file=file)
    chex.assert_trees_all_equal((ds.train, ds.test), (stdlib.train, stdlib.test))
  assert not cache.exists()
  # A user's own text, cut at max_chars; characters outside the vocabulary are id 0.
  own = tmp_path / "own.txt"
  own.write_text("def f(x):\n\treturn x  # \u00e9\n" * 100, encoding="utf-8")
  ds = load_char_corpus(seq_len=8, max_chars=300, test_fraction=0.5, text_file=own)
  decoded = "".join(ds.vocab[i] for i in ds.train["tokens"])
  assert len(decoded) == 150 and decoded.startswith("def f(x):\n\treturn x  # \ufffd\n")


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_text_file_is_refused_at_config_load(tmp_path, content):
  file = tmp_path / "corpus.txt"
  if content is not None:
    file.write_text(content)
  with pytest.raises(ValueError, match="text_file=.*corpus.txt.* (is not a file|is empty)"):
    load_char_corpus(text_file=file)
  # Through an experiment's config, as gpu_check.py sets it: a ConfigError naming config.data.
  config = mpjax.experiment.load_config(None, ["steps=1"])
  config.data.text_file = str(file)
  with pytest.raises(mpjax.experiment.ConfigError, match="config.data: load_char_corpus: text"):
    mpjax.experiment.Experiment(config)


def test_char_corpus_cache_dir_from_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(data.CACHE_ENV_VAR, str(tmp_path / "env"))
  load_char_corpus(max_chars=20_000)
  assert len(list((tmp_path / "env").glob("char_corpus-*.npy"))) == 1


def test_language_model_batches(corpus_dir):
  ds = load_char_corpus(seq_len=16, max_chars=20_000, cache_dir=corpus_dir)
  batch = ds.batch(step=2, batch_size=8, seed=1)
  assert batch["tokens"].shape == batch["targets"].shape == (8, 16)
  assert batch["tokens"].dtype == batch["targets"].dtype == np.int32
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
  chex.assert_trees_all_equal(batch, ds.batch(step=2, batch_size=8, seed=1))
  assert not np.array_equal(batch["tokens"], ds.batch(step=3, batch_size=8, seed=1)["tokens"])
  # Every window is a real stretch of the training stream.
  stream = ds.train["tokens"]
  for row, target in zip(batch["tokens"], batch["targets"], strict=True):
    window = np.concatenate([row, target[-1:]])
    starts = np.flatnonzero(stream[: len(stream) - 16] == window[0])
    assert any(np.array_equal(stream[s : s + 17], window) for s in starts)
  # Evaluation: consecutive windows over the test stream, the last batch padded.
  batches = list(ds.eval_batches(8))
  tokens = np.concatenate([b["tokens"][b["mask"]] for b in batches]).reshape(-1)
  count = (ds.test["tokens"].size - 1) // 16
  np.testing.assert_array_equal(tokens, ds.test["tokens"][: count * 16])
  assert sum(int(b["mask"].sum()) for b in batches) == count


def test_underflow_task_needs_loss_scaling_in_fp16():
  ds = load_underflow_task()
  assert ds.loss_multiplier == data.UNDERFLOW_LOSS_MULTIPLIER
  model = MLP(features=(32,), num_classes=ds.num_classes)
  params = model.init(jax.random.key(0), ds.train["x"][:1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return ds.loss_multiplier * ce

  @jax.jit
  def accuracy(params):
    logits = model.apply(params, ds.test["x"])
    return jnp.mean(jnp.argmax(logits, -1) == ds.test["y"])

  def train(policy, loss_scale):
    state = TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-2), policy=policy, loss_scale=loss_scale
    )
    # Checked in every policy, for the gradient norm it reports.
    step = jax.jit(make_train_step(loss_fn, skip_nonfinite=True), donate_argnums=0)
    for i in range(100):
      state, metrics = step(state, ds.batch(i, 64, seed=0))
    return state, metrics

  fp32, fp32_metrics = train("fp32", None)
  noop, noop_metrics = train("mixed_fp16", NoOpLossScale())
  dynamic, dynamic_metrics = train("mixed_fp16", DynamicLossScale())
  # In f32 the gradients are small but there, below fp16's half smallest subnormal per logit.
  assert 0.0 < float(fp32_metrics["grad_norm"]) < 1e-5
  assert float(accuracy(fp32.params)) > 0.85
  # Unscaled fp16: every gradient underflowed to zero; no parameter ever moved.
  assert float(noop_metrics["grad_norm"]) == 0.0
  chex.assert_trees_all_equal(noop.params, params)
  assert float(accuracy(noop.params)) == float(accuracy(params)) < 0.4
  # Dynamic loss scaling (2**15) matches fp32.
  assert float(dynamic_metrics["loss_scale"]) == 2.0**15 and int(dynamic.skipped_steps) == 0
  assert abs(float(accuracy(dynamic.params)) - float(accuracy(fp32.params))) < 0.02
  chex.assert_trees_all_close(
    dynamic_metrics["loss"] / ds.loss_multiplier,
    fp32_metrics["loss"] / ds.loss_multiplier,
    atol=0.03,
  )


def test_registry_and_bad_input(corpus_dir):
  assert data.DATASETS == ("digits", "digits_image", "char_corpus", "underflow")
  assert load_dataset("digits_image").input_shape == (8, 8, 1)
  assert load_dataset("underflow", n_train=64, n_test=16).num_train == 64
  assert load_dataset("char_corpus", max_chars=5_000, cache_dir=corpus_dir).seq_len == 64
  with pytest.raises(ValueError, match="Unknown dataset 'mnist'.*'digits', 'digits_image'"):
    load_dataset("mnist")
  with pytest.raises(TypeError, match="multiple values for keyword argument 'image'"):
    load_dataset("digits_image", image=False)
  ds = _toy()
  with pytest.raises(ValueError, match="step=-1 must be an integer >= 0"):
    ds.batch(-1, 4, seed=0)
  with pytest.raises(ValueError, match="batch_size=0 must be an integer >= 1"):
    next(ds.eval_batches(0))
  with pytest.raises(ValueError, match="seed=1.5 must be an integer"):
    ds.batch(0, 4, seed=1.5)
  with pytest.raises(ValueError, match="test_fraction=1.0 must be in"):
    load_digits(test_fraction=1.0)
  with pytest.raises(ValueError, match="kind='regression' must be one of"):
    Dataset("bad", "regression", ds.train, ds.test, num_classes=2)
  with pytest.raises(ValueError, match="must hold exactly \\('tokens',\\)"):
    Dataset("bad", "language_model", ds.train, ds.test, vocab_size=4, seq_len=2)
  with pytest.raises(ValueError, match="fewer than one sequence"):
    load_char_corpus(seq_len=600, max_chars=5_000, cache_dir=corpus_dir)
