"""Standard-normal prior and the flow negative log-likelihood, in nats and bits per dimension."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_LOG_2PI = math.log(2.0 * math.pi)


def standard_normal_logprob(z: jax.Array) -> jax.Array:
    """log N(z; 0, I) per row. z: [batch, dim] -> [batch] (nats)."""
    return -0.5 * jnp.sum(z.astype(jnp.float32) ** 2 + _LOG_2PI, axis=-1)


def nll_nats(z: jax.Array, logdet: jax.Array) -> jax.Array:
    """-log p(x) = -(log p_Z(z) + log|det dz/dx|) per row, in nats: latents z = f(x)
    [batch, dim] and logdet [batch] -> [batch]."""
    return -(standard_normal_logprob(z) + logdet)


def nats_to_bits_per_dim(nll: jax.Array, dim: int) -> jax.Array:
    """Converts an NLL in nats per example into bits per dimension."""
    return nll / (dim * math.log(2.0))


def bits_per_dim(z: jax.Array, logdet: jax.Array) -> jax.Array:
    """Per-row NLL in bits/dim. z: [batch, dim], logdet: [batch] -> [batch]."""
    return nats_to_bits_per_dim(nll_nats(z, logdet), z.shape[-1])
