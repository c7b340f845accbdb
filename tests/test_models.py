import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax.autocast import autocast
from mpjax.flax_policy import linen_kwargs
from mpjax.models import CNN, MLP, TransformerLM

TINY_LM = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=16)
TINY_CNN = dict(num_classes=10, features=(8, 16), dense=32)


def _rel_err(got, want):
  """||got - want|| / ||want||, in f32."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _images(n=8):
  return jax.random.uniform(jax.random.key(1), (n, 8, 8, 1))


def _tokens(n=4, length=16):
  return jax.random.randint(jax.random.key(2), (n, length), 0, TINY_LM["vocab_size"])


def test_mlp_shapes_and_dtypes():
  model = MLP(features=[32, 16], num_classes=10)
  assert model.features == (32, 16)
  x = _images()
  variables = model.init(jax.random.key(0), x)
  out = jax.jit(model.apply)(variables, x)
  chex.assert_shape(out, (8, 10))
  chex.assert_type(out, jnp.float32)
  mixed = MLP(features=(32, 16), num_classes=10, **linen_kwargs("mixed_bf16"))
  chex.assert_trees_all_equal_shapes_and_dtypes(mixed.init(jax.random.key(0), x), variables)
  got = jax.jit(mixed.apply)(variables, x)
  chex.assert_type(got, jnp.bfloat16)
  assert _rel_err(got, out) < 2e-2


def _cnn_train_apply(way):
  """``apply(variables, x) -> (logits, updates)`` in train mode: plain, policy or autocast."""
  if way == "policy":
    model = CNN(**TINY_CNN, **linen_kwargs("mixed_bf16", layer=("dense", "conv")))
    fn = model.apply
  else:
    model = CNN(**TINY_CNN)
    fn = autocast(model.apply, "mixed_bf16") if way == "autocast" else model.apply
  return jax.jit(lambda v, x: fn(v, x, train=True, mutable=["batch_stats"]))


def test_cnn_shapes_dtypes_and_eval_mode():
  model = CNN(**TINY_CNN)
  x = _images()
  variables = model.init(jax.random.key(0), x, train=False)
  assert set(variables) == {"params", "batch_stats"}
  out = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
  chex.assert_shape(out, (8, 10))
  chex.assert_type(out, jnp.float32)
  policy_model = CNN(**TINY_CNN, **linen_kwargs("mixed_bf16", layer=("dense", "conv")))
  chex.assert_trees_all_equal_shapes_and_dtypes(
    policy_model.init(jax.random.key(0), x, train=False), variables
  )
  got = jax.jit(lambda v, x: policy_model.apply(v, x, train=False))(variables, x)
  chex.assert_type(got, jnp.bfloat16)
  assert _rel_err(got, out) < 3e-2


@pytest.mark.parametrize("way", ["plain", "policy", "autocast"])
def test_cnn_batchnorm_statistics_update_in_train_mode_and_stay_f32(way):
  x = _images()
  variables = CNN(**TINY_CNN).init(jax.random.key(0), x, train=False)
  logits, updates = _cnn_train_apply(way)(variables, x)
  chex.assert_shape(logits, (8, 10))
  chex.assert_type(jax.tree.leaves(updates["batch_stats"]), jnp.float32)
  _, want = _cnn_train_apply("plain")(variables, x)
  for layer in ("bn_0", "bn_1"):
    new, old = updates["batch_stats"][layer], variables["batch_stats"][layer]
    assert not np.allclose(new["mean"], old["mean"]) and not np.allclose(new["var"], old["var"])
    for stat in ("mean", "var"):
      assert _rel_err(new[stat], want["batch_stats"][layer][stat]) < 2e-2, (way, layer, stat)


def test_transformer_shapes_dtypes_and_masked_padding():
  model = TransformerLM(**TINY_LM)
  assert model.vocab_padded == 56
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  chex.assert_type(jax.tree.leaves(variables), jnp.float32)
  logits = jax.jit(model.apply)(variables, tokens)
  chex.assert_shape(logits, (4, 16, 56))
  chex.assert_type(logits, jnp.float32)
  np.testing.assert_array_equal(logits[..., 50:], jnp.finfo(jnp.float32).min)
  assert np.all(np.isfinite(logits))
  probs = jax.nn.softmax(logits, axis=-1)
  np.testing.assert_array_equal(probs[..., 50:], 0.0)
  np.testing.assert_allclose(probs[..., :50].sum(-1), 1.0, rtol=1e-5)
  # Shorter sequences use the first positions.
  chex.assert_shape(jax.jit(model.apply)(variables, tokens[:, :5]), (4, 5, 56))
  # A vocabulary that is a multiple of 8 is not padded.
  aligned = TransformerLM(**{**TINY_LM, "vocab_size": 48})
  chex.assert_shape(aligned.apply(aligned.init(jax.random.key(0), tokens), tokens), (4, 16, 48))


def test_transformer_is_causal():
  model = TransformerLM(**TINY_LM)
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  apply = jax.jit(model.apply)
  changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % TINY_LM["vocab_size"])
  before, after = apply(variables, tokens), apply(variables, changed)
  chex.assert_trees_all_close(after[:, :9], before[:, :9], atol=1e-6, rtol=0)
  assert np.all(np.abs(np.asarray(after[:, 9:] - before[:, 9:])).max(axis=(1, 2)) > 1e-3)


def test_transformer_policy_and_autocast_match_f32():
  model = TransformerLM(**TINY_LM)
  tokens = _tokens()
  variables = model.init(jax.random.key(0), tokens)
  want = jax.jit(model.apply)(variables, tokens)[..., :50]
  policy_model = TransformerLM(**TINY_LM, **linen_kwargs("mixed_bf16"))
  chex.assert_trees_all_equal_shapes_and_dtypes(
    policy_model.init(jax.random.key(0), tokens), variables
  )
  got = jax.jit(policy_model.apply)(variables, tokens)
  chex.assert_type(got, jnp.bfloat16)
  assert _rel_err(got[..., :50], want) < 2e-2
  np.testing.assert_array_equal(got[..., 50:], jnp.finfo(jnp.bfloat16).min)


@pytest.mark.parametrize("policy", ["mixed_bf16", "mixed_fp16"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_models_under_autocast_match_f32(name, policy):
  if name == "mlp":
    model, x, kw = MLP(features=(32, 16), num_classes=10), _images(), {}
  elif name == "cnn":
    model, x, kw = CNN(**TINY_CNN), _images(), {"train": False}
  else:
    model, x, kw = TransformerLM(**TINY_LM), _tokens(), {}
  variables = model.init(jax.random.key(0), x, **kw)
  want = jax.jit(lambda v, x: model.apply(v, x, **kw))(variables, x)
  mixed = autocast(model.apply, policy)
  got = jax.jit(lambda v, x: mixed(v, x, **kw))(variables, x)
  chex.assert_type(got, jnp.float32)  # the policy's output dtype
  if name == "transformer":
    # The padded logits: f32's most negative value, saturated to the compute dtype's.
    half = {"mixed_bf16": jnp.bfloat16, "mixed_fp16": jnp.float16}[policy]
    np.testing.assert_array_equal(got[..., 50:], float(jnp.finfo(half).min))
    got, want = got[..., :50], want[..., :50]
  tolerance = 2e-2 if policy == "mixed_bf16" else 4e-3
  assert _rel_err(got, want) < tolerance


@pytest.mark.parametrize(
  "fields, message",
  [
    ({"d_model": 100}, r"d_model=100 is not a multiple of 8 \(GEMM alignment\); use d_model=104"),
    ({"d_model": 30}, "d_model=30 is not a multiple of 8 .*; use d_model=32"),
    ({"d_ff": 250}, "d_ff=250 is not a multiple of 8 .*; use d_ff=248"),
    ({"n_heads": 3}, "n_heads=3 does not divide d_model=32; use n_heads=4"),
    ({"n_heads": 8}, "n_heads=8 gives a head dimension of 4 .* not a multiple of 8; use n_heads=4"),
    ({"vocab_size": 0}, "vocab_size=0 must be an integer >= 1"),
    ({"n_layers": 1.5}, "n_layers=1.5 must be an integer >= 1"),
  ],
)
def test_transformer_bad_dimensions_raise_at_construction(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerLM(**{**TINY_LM, **fields})


def test_bad_inputs_raise():
  model = TransformerLM(**TINY_LM)
  variables = model.init(jax.random.key(0), _tokens())
  with pytest.raises(ValueError, match="sequence length 17 exceeds max_len=16"):
    model.apply(variables, _tokens(length=17))
  with pytest.raises(ValueError, match="tokens must be integer ids"):
    model.apply(variables, jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="is not NHWC"):
    CNN(**TINY_CNN).init(jax.random.key(0), jnp.ones((2, 64)), train=False)
  with pytest.raises(ValueError, match=r"MLP: features\[1\]=0 must be an integer >= 1"):
    MLP(features=(8, 0), num_classes=3)
  with pytest.raises(ValueError, match="CNN: momentum=1.0 must be in"):
    CNN(num_classes=3, momentum=1.0)
