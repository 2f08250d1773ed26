"""Attention's products written for XLA's fast kernels: the query/key/value projection into
head-major layout (`qkv_heads`) and the two batched products, q k^T and probs v.

The batched products contract over the [batch, heads] axes with float32 accumulation and
return float32. Their VJPs take the float32 cotangent in the operands' dtype, as
`ops.matmul`'s does: under bf16 compute the gradient products are then bf16 x bf16 -> float32,
where JAX's own transpose multiplied the float32 cotangent with operands converted to float32
(float32 copies of q, k, v and the probabilities, and slower dot kernels on XLA:CPU).

The CPU form of attention (`jaxsim.models.kernels`); figures in docs/performance.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsim.models import ops

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


def _heads_layout(d: jax.Array, bias: jax.Array, scale: jax.Array, heads: int, dtype):
    """[B, L, 3 * H] float32 + bias [3, H], times scale [3] -> [3, B, heads, L, H / heads]."""
    b, length, width = d.shape
    qkv = (d.reshape(b, length, 3, width // 3) + bias) * scale[:, None]
    qkv = qkv.reshape(b, length, 3, heads, width // (3 * heads))
    return jnp.transpose(qkv, (2, 0, 3, 1, 4)).astype(dtype)


def qkv_heads(x: jax.Array, kernel: jax.Array, bias: jax.Array, scale: jax.Array, heads: int,
              dtype) -> jax.Array:
    """x [B, L, H] @ kernel [H, 3, H] + bias [3, H], each of q, k, v times its `scale` [3],
    laid out head-major [3, B, heads, L, H / heads] in `dtype`.

    Under low-precision compute the VJP takes the gradient in that dtype and writes it back
    token-major in it once: the product's gradients and the bias sum read it there (JAX's own
    VJP laid it out and scaled it in float32, and converted it again for the products).
    """
    w = kernel.reshape(kernel.shape[0], -1)
    if jnp.dtype(dtype) == jnp.float32:
        return _heads_layout(ops.matmul_2d(x, w), bias, scale, heads, dtype)
    return _qkv_low(x.astype(dtype), w.astype(dtype), bias, scale, heads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _qkv_low(x, w, bias, scale, heads):
    return _heads_layout(ops.matmul_2d(x, w), bias, scale, heads, x.dtype)


def _qkv_low_fwd(x, w, bias, scale, heads):
    return _qkv_low(x, w, bias, scale, heads), (x, w, scale)


def _qkv_low_bwd(heads, residuals, g):
    x, w, scale = residuals
    _, n, _, length, head_dim = g.shape
    g = jnp.transpose(g, (1, 3, 0, 2, 4)).reshape(n, length, 3, heads * head_dim)
    g = (g.astype(jnp.float32) * scale[:, None]).astype(x.dtype)  # [B, L, 3, H]
    d_bias = jnp.sum(g.astype(jnp.float32), axis=(0, 1))
    _, product_vjp = jax.vjp(ops.matmul_2d, x, w)
    dx, dw = product_vjp(g.reshape(n, length, -1).astype(jnp.float32))
    return dx, dw, d_bias, jnp.zeros_like(scale)


_qkv_low.defvjp(_qkv_low_fwd, _qkv_low_bwd)
