"""Sentence poolers: pure functions of the encoder outputs and the attention mask.

Padding never counts: every average is over the masked (real) tokens only. Layer choices follow
the reference SimCSE / BERT-flow evaluation code:
  - `avg_first_last` averages hidden_states[1] (the FIRST TRANSFORMER LAYER's output) and
    hidden_states[-1], as SimCSE's `avg_first_last` and BERT-flow's `first-last-avg` compute it.
  - `avg_embed_last` averages hidden_states[0] (embedding output) and hidden_states[-1], the
    variant behind the SimCSE paper's original table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsim.models.bert import BertOutput

POOLERS = ("cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last", "avg_embed_last")


class PoolerError(ValueError):
    """A pooler that cannot be computed for this model."""


def check_pooler(name: str, has_pooler: bool = True) -> None:
    """Raises PoolerError when `name` is unknown, or is 'cls' for a model without a pooler."""
    if name not in POOLERS:
        raise PoolerError(f"unknown pooler {name!r}; choose one of {POOLERS}")
    if name == "cls" and not has_pooler:
        raise PoolerError(
            "pooler 'cls' needs the dense+tanh pooler weights, which this model does not have "
            "(use 'cls_before_pooler' or an average pooler)")


def masked_mean(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Mean over real tokens. hidden [batch, len, dim], mask [batch, len] -> [batch, dim]."""
    mask = attention_mask.astype(jnp.float32)[:, :, None]
    total = jnp.sum(hidden.astype(jnp.float32) * mask, axis=1)
    # max(.., 1) keeps an all-padding row finite (zeros) instead of NaN.
    return total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def pool(name: str, output: BertOutput, attention_mask: jax.Array) -> jax.Array:
    """Pools encoder outputs into sentence vectors [batch, hidden] (float32)."""
    check_pooler(name, output.pooler_output is not None)
    states = output.hidden_states
    if name == "cls":
        return output.pooler_output.astype(jnp.float32)
    if name == "cls_before_pooler":
        return states[-1][:, 0].astype(jnp.float32)
    if name == "avg":
        return masked_mean(states[-1], attention_mask)
    pairs = {"avg_top2": (-2, -1), "avg_first_last": (1, -1), "avg_embed_last": (0, -1)}
    first, second = pairs[name]
    # Average of the two layers' token states, then the masked mean over tokens (SimCSE order).
    mixed = (states[first].astype(jnp.float32) + states[second].astype(jnp.float32)) / 2.0
    return masked_mean(mixed, attention_mask)
