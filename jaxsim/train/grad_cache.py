"""Cached-gradient large batches (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch
Size under Memory Limited Setup", GradCache).

A contrastive loss couples every example of the batch (each is a negative of the others), so
splitting the batch into independent micro-batches (`grad_accum_steps`) changes the objective.
GradCache keeps it, holding the activations of one micro-batch at a time:
  1. embed the batch micro-batch by micro-batch, keeping only the vectors (no activations);
  2. the loss of the WHOLE batch and its gradient with respect to the vectors (cheap: [B, V, H]);
  3. re-run each micro-batch with the same dropout masks and back-propagate its slice of that
     gradient (a VJP), summing the parameter gradients.
By the chain rule the result is the one-pass gradient; only float32 summation order differs.

Same masks: micro-batch i holds the contiguous rows [i M, (i + 1) M) of the batch and draws its
dropout inside `dropout.dropout_rows`, so each row gets the mask it gets in one pass (threefry keys;
an 'rbg' key draws fresh masks, the same objective in distribution). Contiguous micro-batches
are resharded over the batch axes of the mesh (an all-to-all of token ids), so every device
works on every micro-batch.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim.models import dropout
from jaxsim.models.encoder import SentenceEncoder
from jaxsim.objectives import LossFn, owned, with_context
from jaxsim.sharding import BATCH_AXES


def make_cached_grad_fn(encoder: SentenceEncoder, loss: LossFn, *, views: int,
                        micro_batch_size: int, mesh: Mesh, encode_views: Callable) -> Callable:
    """`grad_fn(params, batch, key, step=None) -> ((loss, aux), grads)`, equal to
    `jax.value_and_grad(loss(encode_views(...)), has_aux=True)` over the whole batch.

    `loss` gets the context it names (`with_context`) of the whole batch, as in the one-pass
    step; `micro_batch_size` M examples are embedded at once (M divides the batch), each
    micro-batch split over the mesh's batch axes; `encode_views` is the train step's.
    """
    m = micro_batch_size
    objective = with_context(loss)

    def constrain(x: jax.Array, leading: tuple) -> jax.Array:
        spec = P(*leading, *([None] * (x.ndim - len(leading))))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def grad_fn(trainable: Any, batch, key: jax.Array, step=None):
        params, mine = owned.split(trainable)
        b = batch['input_ids'].shape[0]
        if b % m:
            raise ValueError(f'batch of {b} examples is not divisible by micro_batch_size {m}')
        chunks = b // m
        micro = {k: constrain(v.reshape((chunks, m) + v.shape[1:]), (None, BATCH_AXES))
                 for k, v in batch.items()}

        def embed(p, mb, i):
            # Rows of the [B * V, L] array the encoder sees: micro-batch i starts at i * M * V.
            with dropout.dropout_rows(i * (m * views)):
                return encode_views(encoder, p, mb, key, views)

        # 1. Vectors only: no gradient is taken through this map, so nothing is kept.
        z = jax.lax.map(lambda xs: embed(params, xs[1], xs[0]),
                        (jnp.arange(chunks), micro))  # [C, M, V, H]
        z = constrain(z.reshape((b,) + z.shape[2:]), (BATCH_AXES,))
        # 2. The whole batch's loss and its gradient with respect to the vectors (and to the
        #    objective's own parameters: they enter the loss only).
        (value, aux), (dz, d_mine) = jax.value_and_grad(
            lambda v, p: objective(v, ids=batch['input_ids'], step=step, key=key,
                                   params=p or None), argnums=(0, 1), has_aux=True)(z, mine)
        value, aux = value.astype(jnp.float32), dict(aux)
        dz = constrain(dz.reshape((chunks, m) + dz.shape[1:]), (None, BATCH_AXES))

        # 3. Re-encode each micro-batch (same masks) and pull its vector gradient back.
        def body(acc, xs):
            i, mb, dz_i = xs
            _, pullback = jax.vjp(lambda p: embed(p, mb, i), params)
            (g,) = pullback(dz_i)
            return jax.tree.map(jnp.add, acc, g), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params),
                                (jnp.arange(chunks), micro, dz))
        return (value, aux), owned.join(grads, d_mine)

    return grad_fn
