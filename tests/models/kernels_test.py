"""The two forms of the layers' hot operations (`jaxsim.models.kernels`) compute the same
function: vectors and every parameter gradient, with dropout on, in float32 (to rounding) and
bfloat16 (to bf16 rounding); 'auto' picks the CPU forms on a CPU backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.errors import ConfigError
from jaxsim.models import kernels
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder

CONFIG = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=64)


def vectors_and_grads(form: str, dtype, hidden_act: str = "gelu"):
    config = CONFIG if hidden_act == "gelu" else BertConfig(**{**CONFIG.__dict__,
                                                              "hidden_act": hidden_act})
    ids = jax.random.randint(jax.random.key(0), (3, 10), 1, 100)
    mask = jnp.ones((3, 10), jnp.int32).at[0, 6:].set(0)  # a padded row
    encoder = SentenceEncoder(config, pooler="avg", dtype=dtype, kernels=form)
    params = encoder.init(jax.random.key(1), ids, mask)
    run = lambda p: encoder.apply(p, ids, mask, train=True,  # noqa: E731
                                  rngs={"dropout": jax.random.key(2)})
    z, vjp = jax.vjp(run, params)
    weights = jax.random.normal(jax.random.key(3), z.shape)
    return np.asarray(z, np.float32), jax.tree.map(np.asarray, vjp(weights.astype(z.dtype))[0])


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 0.05)])
def test_both_forms_compute_the_same_vectors_and_gradients(dtype, atol):
    z_cpu, g_cpu = vectors_and_grads("cpu", dtype)
    z_xla, g_xla = vectors_and_grads("xla", dtype)
    np.testing.assert_allclose(z_xla, z_cpu, atol=atol, rtol=0)
    assert np.max(np.abs(z_cpu)) > 0.1  # not vacuous
    for path, a in jax.tree_util.tree_leaves_with_path(g_cpu):
        b = g_xla
        for k in path:
            b = b[k.key]
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                   atol=atol * max(1.0, float(np.max(np.abs(a)))), rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


def test_other_activations_match_too():
    z_cpu, _ = vectors_and_grads("cpu", jnp.float32, "relu")
    z_xla, _ = vectors_and_grads("xla", jnp.float32, "relu")
    np.testing.assert_allclose(z_xla, z_cpu, atol=1e-5, rtol=0)


def test_auto_is_the_cpu_forms_on_a_cpu_backend():
    assert jax.default_backend() == "cpu"
    assert kernels.use_cpu_forms("auto") and kernels.use_cpu_forms("cpu")
    assert not kernels.use_cpu_forms("xla")


def test_an_unknown_form_is_refused_by_name():
    with pytest.raises(ConfigError, match="kernels must be one of auto, xla, cpu, got 'tpu'"):
        kernels.use_cpu_forms("tpu")
