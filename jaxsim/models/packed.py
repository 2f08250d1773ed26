"""The encoder's side of sequence packing (`jaxsim.data.packing` builds the layout).

Padded sentences [N, L] are gathered into packed rows through `pack_index` [S, R, P], attention
is kept within each sentence, and every hidden state is gathered back to [N, L, H] through
`unpack_index`, so poolers, objectives and the masked-LM head see the padded layout they always
do. Both gathers run per batch shard (axis S, indices local to the shard): on a mesh each device
gathers from its own rows only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_packed(x: jax.Array, pack_index: jax.Array) -> jax.Array:
    """[N, L] -> [S * R, P]: the value at each packed slot's source token, 0 in empty slots."""
    shards, rows, width = pack_index.shape
    take = lambda a, i: jnp.take(a, i, mode='fill', fill_value=0)  # noqa: E731
    return jax.vmap(take)(x.reshape(shards, -1), pack_index).reshape(shards * rows, width)


def packed_attention_bias(pack_index: jax.Array, length: int) -> jax.Array:
    """Additive attention bias [S * R, 1, P, P]: 0 between slots of one sentence, the most
    negative float across sentences. Empty slots form one more 'sentence' of their own, so they
    never mix with real tokens (and their rows stay finite)."""
    sentence = pack_index.reshape(-1, pack_index.shape[-1]) // length
    same = sentence[:, None, :, None] == sentence[:, None, None, :]
    return jnp.where(same, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


def unpack(hidden: jax.Array, unpack_index: jax.Array, shards: int) -> jax.Array:
    """[S * R, P, H] -> [N, L, H] (padding slots hold some real token's state: poolers mask
    them)."""
    n, length = unpack_index.shape
    take = lambda a, i: jnp.take(a, i, axis=0, mode='clip')  # noqa: E731
    out = jax.vmap(take)(hidden.reshape(shards, -1, hidden.shape[-1]),
                         unpack_index.reshape(shards, -1))
    return out.reshape(n, length, hidden.shape[-1])
