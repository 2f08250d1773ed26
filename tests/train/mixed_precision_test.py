"""bf16 compute: Dense products take bf16 operands but return float32, forward and backward;
a bf16 training loss keeps float32 master parameters and gradients."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.models.ops import mixed_precision_dot_general
from jaxsim.objectives import get_objective
from jaxsim.train.step import compiler_options, make_loss_fn

DENSE_DIMS = (((2,), (0,)), ((), ()))  # what flax Dense passes for x [B, L, in] @ w [in, out]


def test_mixed_precision_dense_matches_float32_forward_and_backward():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 5, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 7)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((4, 5, 7)), jnp.float32)

    def loss(x, w, low):
        if low:
            out = mixed_precision_dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                              DENSE_DIMS)
            assert out.dtype == jnp.float32  # accumulated and returned in float32
        else:
            out = jax.lax.dot_general(x, w, DENSE_DIMS)
        return jnp.sum(out * r)

    value16, grads16 = jax.value_and_grad(loss, argnums=(0, 1))(x, w, True)
    value32, grads32 = jax.value_and_grad(loss, argnums=(0, 1))(x, w, False)
    assert grads16[0].dtype == jnp.float32 and grads16[1].dtype == jnp.float32
    np.testing.assert_allclose(value16, value32, rtol=2e-2)
    for g16, g32 in zip(grads16, grads32):
        rel = np.linalg.norm(g16 - g32) / np.linalg.norm(g32)
        assert 0 < rel < 1e-2  # bf16 rounding is visible but small


def test_other_contractions_fall_back_to_float32_output():
    a = jnp.ones((3, 4), jnp.bfloat16)
    b = jnp.ones((5, 4), jnp.bfloat16)
    out = mixed_precision_dot_general(a, b, (((1,), (1,)), ((), ())))
    assert out.dtype == jnp.float32 and out.shape == (3, 5) and float(out[0, 0]) == 4.0


def test_bf16_training_loss_keeps_fp32_master_params_and_grads():
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=24, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    f32 = SentenceEncoder(config, pooler='avg')
    bf16 = f32.clone(dtype=jnp.bfloat16)
    params = init_params(f32, jax.random.key(0))
    assert all(p.dtype == jnp.float32
               for p in jax.tree.leaves(init_params(bf16, jax.random.key(0))))
    ids = np.random.default_rng(0).integers(3, 50, size=(6, 1, 9)).astype(np.int32)
    batch = {'input_ids': ids, 'attention_mask': np.ones_like(ids),
             'token_type_ids': np.zeros_like(ids)}
    loss = get_objective('unsup').loss
    jit = functools.partial(jax.jit, compiler_options=compiler_options(True))
    value_and_grad = lambda enc: jit(jax.value_and_grad(  # noqa: E731
        make_loss_fn(enc, loss, 2), has_aux=True))
    (l32, _), g32 = value_and_grad(f32)(params, batch, jax.random.key(1))
    (l16, _), grads = value_and_grad(bf16)(params, batch, jax.random.key(1))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert l16.dtype == jnp.float32 and np.isfinite(float(l16))
    # bf16 operands (8 bits of mantissa) move this loss of ~1 by ~1e-3, never by 1e-2; the
    # gradient keeps its direction. Another model's loss is further away than the tolerance.
    tol = 1e-2
    assert abs(float(l16) - float(l32)) < tol
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    a, b = flat(grads), flat(g32)
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99
    assert abs(np.linalg.norm(a) / np.linalg.norm(b) - 1) < 0.05
    other = init_params(f32, jax.random.key(7))
    (l_other, _), _ = value_and_grad(f32)(other, batch, jax.random.key(1))
    assert abs(float(l_other) - float(l32)) > tol
