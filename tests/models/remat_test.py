"""Per-layer rematerialization: same parameters, same loss, same gradients, less kept memory."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.errors import ConfigError
from jaxsim.models.bert import BertConfig, remat_layer
from jaxsim.models.encoder import SentenceEncoder, init_params, param_shapes
from jaxsim.train.step import compiler_options

TINY = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=24, max_position_embeddings=20, hidden_dropout_prob=0.1,
                  attention_probs_dropout_prob=0.1)


def _loss_and_grads(remat: str, params, ids, mask):
    encoder = SentenceEncoder(TINY, pooler="cls", remat=remat)

    def loss(p):  # dropout on: the recomputed layers must draw the same masks
        z = encoder.apply({"params": p}, ids, mask, train=True,
                          rngs={"dropout": jax.random.key(7)})
        return jnp.sum(jnp.sin(z))

    # XLA -O0 on CPU: compiling is nearly all the cost here; both sides get the same options.
    return jax.jit(jax.value_and_grad(loss), compiler_options=compiler_options(True))(params)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_loss_and_gradients(remat):
    ids = np.random.default_rng(0).integers(1, 60, (6, 10)).astype(np.int32)
    mask = (np.arange(10)[None] < np.array([10, 7, 3, 10, 5, 9])[:, None]).astype(np.int32)
    params = init_params(SentenceEncoder(TINY, pooler="cls"), jax.random.key(0))
    assert jax.tree.structure(param_shapes(SentenceEncoder(TINY, pooler="cls", remat=remat))) \
        == jax.tree.structure(params)  # same parameter names: checkpoints load either way
    base_loss, base_grads = _loss_and_grads("none", params, ids, mask)
    loss, grads = _loss_and_grads(remat, params, ids, mask)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
        np.testing.assert_allclose(g, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()) + 1e-9)


@pytest.mark.parametrize("remat,count", [("none", 0), ("full", 3), ("dots", 3)])
def test_remat_wraps_every_layer(remat, count):
    # XLA:CPU expands the optimization barriers that keep recomputation apart, so the memory
    # effect shows on GPU/TPU only (benchmarks/remat_memory.py); here: one checkpointed region
    # per transformer layer in the differentiated program.
    encoder = SentenceEncoder(TINY, pooler="avg", remat=remat)
    ids = jnp.ones((2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(encoder.apply(
        {"params": p}, ids, ids, train=True, rngs={"dropout": jax.random.key(0)}))))(
        param_shapes(encoder))
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert sum(n in ("checkpoint", "remat", "remat2") for n in names) == count, names


def test_unknown_remat_is_refused():
    with pytest.raises(ConfigError, match="unknown remat 'some'"):
        remat_layer("some")
