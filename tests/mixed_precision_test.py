"""bf16 compute: Dense products take bf16 operands but return float32, forward and backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.models.bert import _mixed_precision_dot_general

DENSE_DIMS = (((2,), (0,)), ((), ()))  # what flax Dense passes for x [B, L, in] @ w [in, out]


def test_mixed_precision_dense_matches_float32_forward_and_backward():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 5, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 7)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((4, 5, 7)), jnp.float32)

    def loss(x, w, low):
        if low:
            out = _mixed_precision_dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
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
    out = _mixed_precision_dot_general(a, b, (((1,), (1,)), ((), ())))
    assert out.dtype == jnp.float32 and out.shape == (3, 5) and float(out[0, 0]) == 4.0
