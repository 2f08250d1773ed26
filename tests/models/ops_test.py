"""The encoder's fused operations: same values and gradients as the plain JAX expressions."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.models import ops


def _rand(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_matmul_float32_and_bf16_with_a_multi_axis_kernel():
    rng = np.random.default_rng(0)
    x, w, r = _rand(rng, 3, 5, 12), _rand(rng, 12, 3, 7), _rand(rng, 3, 5, 3, 7)

    def loss(x, w, dtype):
        out = ops.matmul(x, w, dtype)
        assert out.dtype == jnp.float32 and out.shape == (3, 5, 3, 7)
        return jnp.sum(out * r)

    plain = jax.value_and_grad(lambda x, w: jnp.sum(jnp.einsum("bli,ijk->bljk", x, w) * r),
                               argnums=(0, 1))(x, w)
    f32 = jax.value_and_grad(loss, argnums=(0, 1))(x, w, jnp.float32)
    np.testing.assert_allclose(f32[0], plain[0], rtol=1e-5)
    for ours, ref in zip(f32[1], plain[1]):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    bf16 = jax.value_and_grad(loss, argnums=(0, 1))(x, w, jnp.bfloat16)
    for ours, ref in zip(bf16[1], plain[1]):
        assert ours.dtype == jnp.float32
        rel = float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))
        assert 0 < rel < 2e-2  # bf16 operands: visible but small rounding


def test_bias_gelu_is_the_exact_gelu_with_its_exact_gradient():
    rng = np.random.default_rng(1)
    d, b, r = _rand(rng, 4, 6, 9) * 3, _rand(rng, 9), _rand(rng, 4, 6, 9)
    h = np.asarray(d + b, np.float64)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(h / np.sqrt(2)))
    exact = h * cdf  # float64 x Phi(x)
    exact_grad = np.asarray(r, np.float64) * (cdf + h * np.exp(-h * h / 2) / np.sqrt(2 * np.pi))
    np.testing.assert_allclose(ops.bias_gelu(d, b), exact, rtol=0, atol=2e-6)
    dd, db = jax.grad(lambda d, b: jnp.sum(ops.bias_gelu(d, b) * r), argnums=(0, 1))(d, b)
    np.testing.assert_allclose(dd, exact_grad, rtol=0, atol=2e-6)
    np.testing.assert_allclose(db, exact_grad.sum(axis=(0, 1)), rtol=0, atol=2e-5)
    # jax's own exact GELU agrees; the tanh approximation differs by ~1e-3 (the test would
    # see the wrong formula).
    np.testing.assert_allclose(jax.nn.gelu(d + b, approximate=False), exact, rtol=0, atol=2e-6)
    assert float(np.abs(np.asarray(jax.nn.gelu(d + b, approximate=True)) - exact).max()) > 1e-4


def test_mixed_precision_dot_general_routes_only_the_dense_contraction():
    a = jnp.ones((3, 4), jnp.bfloat16)
    b = jnp.ones((5, 4), jnp.bfloat16)
    out = ops.mixed_precision_dot_general(a, b, (((1,), (1,)), ((), ())))
    assert out.dtype == jnp.float32 and out.shape == (3, 5) and float(out[0, 0]) == 4.0
    dense = ops.mixed_precision_dot_general(a, b.T, (((1,), (0,)), ((), ())))
    assert dense.dtype == jnp.float32 and float(dense[0, 0]) == 4.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_bias_gelu_matches_the_plain_formula(dtype):
    """gelu(x @ w + b) in `dtype` with its gradients against jax.grad of the plain float32
    expression (exact GELU) on the same operands."""
    rng = np.random.default_rng(4)
    x, w, b, r = _rand(rng, 3, 5, 8), _rand(rng, 8, 12) / 3, _rand(rng, 12), _rand(rng, 3, 5, 12)
    x, w = (a.astype(dtype).astype(jnp.float32) for a in (x, w))  # representable in dtype

    def plain(x, w, b):
        return jnp.sum(jax.nn.gelu(jnp.einsum("bli,io->blo", x, w) + b, approximate=False) * r)

    def ours(x, w, b):
        out = ops.dense_bias_gelu(x, w, b, dtype)
        assert out.dtype == dtype and out.shape == r.shape
        return jnp.sum(out.astype(jnp.float32) * r)

    exact = dtype == jnp.float32
    reference = jax.nn.gelu(jnp.einsum("bli,io->blo", x, w) + b, approximate=False)
    np.testing.assert_allclose(np.asarray(ops.dense_bias_gelu(x, w, b, dtype), np.float32),
                               reference, rtol=1e-5 if exact else 8e-3, atol=1e-6)
    want = jax.grad(plain, argnums=(0, 1, 2))(x, w, b)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(x, w, b)
    for g, ref in zip(got, want):
        assert g.dtype == jnp.float32 and g.shape == ref.shape
        rel = float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref))
        assert rel < (1e-5 if exact else 1e-2), rel  # bf16: rounding of the gradient only


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_bias_matches_the_plain_formula(dtype):
    """x @ w + b (float32 result) with its gradients against jax.grad of the plain float32
    expression on the same operands."""
    rng = np.random.default_rng(6)
    x, w, b, r = _rand(rng, 3, 5, 8), _rand(rng, 8, 6), _rand(rng, 6), _rand(rng, 3, 5, 6)
    x, w = (a.astype(dtype).astype(jnp.float32) for a in (x, w))  # representable in dtype

    def plain(x, w, b):
        return jnp.einsum("bli,io->blo", x, w) + b

    def ours(x, w, b):
        out = ops.dense_bias(x, w, b, dtype)
        assert out.dtype == jnp.float32 and out.shape == r.shape
        return out

    np.testing.assert_allclose(ours(x, w, b), plain(x, w, b), rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda *a: jnp.sum(plain(*a) * r), argnums=(0, 1, 2))(x, w, b)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * r), argnums=(0, 1, 2)))(x, w, b)
    exact = dtype == jnp.float32
    for g, ref in zip(got, want):
        assert g.dtype == jnp.float32 and g.shape == ref.shape
        rel = float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref))
        assert rel < (1e-5 if exact else 1e-2), rel  # bf16: rounding of the gradient only
