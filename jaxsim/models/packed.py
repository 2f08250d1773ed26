"""The encoder's side of sequence packing (`jaxsim.data.packing` builds the layout).

Padded sentences [N, L] are gathered into packed rows [R, P] through `pack_index`, attention is
kept within each sentence, and every hidden state is gathered back to [N, L, H] through
`unpack_index`, so poolers, objectives and the masked-LM head see the padded layout they always
do.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_packed(x: jax.Array, pack_index: jax.Array) -> jax.Array:
    """[N, L] -> [R, P]: the value at each packed slot's source token, 0 in empty slots."""
    return jnp.take(x.reshape(-1), pack_index, mode='fill', fill_value=0)


def packed_attention_bias(pack_index: jax.Array, length: int) -> jax.Array:
    """Additive attention bias [R, 1, P, P]: 0 between slots of one sentence, the most negative
    float across sentences. Empty slots form one more 'sentence' of their own, so they never
    mix with real tokens (and their rows stay finite)."""
    sentence = pack_index // length
    same = sentence[:, None, :, None] == sentence[:, None, None, :]
    return jnp.where(same, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


def unpack(hidden: jax.Array, unpack_index: jax.Array) -> jax.Array:
    """[R, P, H] -> [N, L, H] (padding slots hold some real token's state: poolers mask them)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return jnp.take(flat, unpack_index, axis=0, mode='clip')
