"""Attention's two batched products, q k^T and probs v, written for XLA's fast kernels.

Both contract over the [batch, heads] batch axes with float32 accumulation and return float32.
Their VJPs take the float32 cotangent in the operands' dtype, as `ops.matmul`'s does: under
bf16 compute the gradient products are then bf16 x bf16 -> float32, where JAX's own transpose
multiplied the float32 cotangent with operands converted to float32 (float32 copies of q, k, v
and the probabilities, and slower dot kernels on XLA:CPU).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_BATCH = ((0, 1), (0, 1))


def _swapped(a: jax.Array) -> jax.Array:
    """a [B, heads, m, k] -> [B, heads, k, m], written out: going through a unit axis keeps XLA
    from folding the transpose back into the consuming product (as `ops._transposed`)."""
    b, h, m, k = a.shape
    return jnp.transpose(a.reshape(b, h, m, k, 1), (0, 1, 3, 2, 4)).reshape(b, h, k, m)


def _batched(x: jax.Array, y: jax.Array, x_axis: int = 3, y_axis: int = 2) -> jax.Array:
    """Contract axis `x_axis` of x with `y_axis` of y over the two leading batch axes, in
    float32.

    Low-precision operands are first brought to the plain form (x's last axis with y's axis
    2): XLA:CPU runs other bf16 batched contractions by converting both operands to float32
    and calling a slower dot kernel; a written-out transpose of an [L, L] or [L, head_dim]
    block is cheaper.
    """
    if x.dtype != jnp.float32:
        x, x_axis = (_swapped(x), 3) if x_axis == 2 else (x, x_axis)
        y, y_axis = (_swapped(y), 2) if y_axis == 3 else (y, y_axis)
    return lax.dot_general(x, y, (((x_axis,), (y_axis,)), _BATCH),
                           preferred_element_type=jnp.float32)


@jax.custom_vjp
def attention_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, heads, Lq, d] . k [B, heads, Lk, d] -> [B, heads, Lq, Lk] float32 (operands of one
    dtype, float32 accumulation)."""
    return _batched(q, k, 3, 3)


def _attention_scores_fwd(q, k):
    return _batched(q, k, 3, 3), (q, k)


def _attention_scores_bwd(residuals, g):
    # As matmul's VJP: the float32 cotangent in the operands' dtype keeps both gradient products
    # bf16 x bf16 -> float32 under bf16 compute, where JAX's own transpose multiplies it with
    # the operand converted to float32 (copies of q and k in float32, slower dot kernels).
    q, k = residuals
    g = g.astype(q.dtype)
    return _batched(g, k, 3, 2).astype(q.dtype), _batched(g, q, 2, 2).astype(k.dtype)


attention_scores.defvjp(_attention_scores_fwd, _attention_scores_bwd)


@jax.custom_vjp
def attention_mix(p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B, heads, Lq, Lk] . v [B, heads, Lk, d] -> [B, heads, Lq, d] float32 (operands of one
    dtype, float32 accumulation)."""
    return _batched(p, v, 3, 2)


def _attention_mix_fwd(p, v):
    return _batched(p, v, 3, 2), (p, v)


def _attention_mix_bwd(residuals, g):
    p, v = residuals
    g = g.astype(v.dtype)
    return _batched(g, v, 3, 3).astype(p.dtype), _batched(p, g, 2, 2).astype(v.dtype)


attention_mix.defvjp(_attention_mix_fwd, _attention_mix_bwd)
