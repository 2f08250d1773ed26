"""Attention's batched products: values and gradients of the plain einsum expressions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.models import attention_ops


def _rand(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_products_match_einsum_values_and_gradients(dtype):
    """q k^T and probs v with their VJPs against jnp.einsum on the same operands (float32
    reference), for unequal query / key / head sizes so that a swapped axis would show."""
    rng = np.random.default_rng(3)
    q, k, v = _rand(rng, 2, 3, 5, 4), _rand(rng, 2, 3, 7, 4), _rand(rng, 2, 3, 7, 4)
    r_scores, r_out = _rand(rng, 2, 3, 5, 7), _rand(rng, 2, 3, 5, 4)
    q, k, v = (x.astype(dtype).astype(jnp.float32) for x in (q, k, v))  # representable

    def plain(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.sum(s * r_scores) + jnp.sum(jnp.einsum("bhqk,bhkd->bhqd", p, v) * r_out)

    def ours(q, k, v):
        s = attention_ops.attention_scores(q.astype(dtype), k.astype(dtype))
        assert s.dtype == jnp.float32
        p = jax.nn.softmax(s, axis=-1)
        out = attention_ops.attention_mix(p.astype(dtype), v.astype(dtype))
        assert out.dtype == jnp.float32
        return jnp.sum(s * r_scores) + jnp.sum(out * r_out)

    want = jax.value_and_grad(plain, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v)
    exact = dtype == jnp.float32
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5 if exact else 2e-2)
    for g, w in zip(got[1], want[1]):
        assert g.dtype == jnp.float32 and g.shape == w.shape
        rel = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
        assert rel < (1e-5 if exact else 1e-2), rel  # bf16: the cotangents' rounding only


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qkv_heads_matches_the_plain_projection(dtype):
    """The head-major q, k, v projection and its gradients (input, kernel, bias) against the
    plain float32 expression on the same operands."""
    rng = np.random.default_rng(5)
    heads, head_dim = 2, 3
    hidden = heads * head_dim
    x, kernel = _rand(rng, 4, 5, hidden), _rand(rng, hidden, 3, hidden) / 3
    bias, r = _rand(rng, 3, hidden), _rand(rng, 3, 4, heads, 5, head_dim)
    x, kernel = (a.astype(dtype).astype(jnp.float32) for a in (x, kernel))
    scale = jnp.asarray([0.5, 1.0, 1.0], jnp.float32)

    def plain(x, kernel, bias):
        qkv = (jnp.einsum("bli,ijo->bljo", x, kernel) + bias) * scale[:, None]
        return jnp.transpose(qkv.reshape(4, 5, 3, heads, head_dim), (2, 0, 3, 1, 4))

    def ours(x, kernel, bias):
        out = attention_ops.qkv_heads(x, kernel, bias, scale, heads, dtype)
        assert out.dtype == dtype and out.shape == r.shape
        return out.astype(jnp.float32)

    exact = dtype == jnp.float32
    np.testing.assert_allclose(ours(x, kernel, bias), plain(x, kernel, bias),
                               rtol=1e-5 if exact else 8e-3, atol=1e-6 if exact else 1e-2)
    want = jax.grad(lambda *a: jnp.sum(plain(*a) * r), argnums=(0, 1, 2))(x, kernel, bias)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * r), argnums=(0, 1, 2)))(x, kernel,
                                                                                   bias)
    for g, ref in zip(got, want):
        assert g.dtype == jnp.float32 and g.shape == ref.shape
        rel = float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref))
        assert rel < (1e-5 if exact else 1e-2), rel  # bf16: rounding of the gradient only
