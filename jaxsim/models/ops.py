"""The encoder's hot operations in their CPU form (`jaxsim.models.kernels`), written for fewer
passes over memory on XLA:CPU.

Each function computes what the plain JAX expression would (same dtypes; same formulas up to
float32 rounding); they differ in what is stored for the backward pass and how the work is
laid out, as each docstring says. Figures: docs/performance.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_SQRT_HALF = float(np.sqrt(0.5))
_INV_SQRT_2PI = float(1.0 / np.sqrt(2.0 * np.pi))


# ---- Products

def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out], accumulated and returned in float32."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


@jax.custom_vjp
def matmul_2d(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] (float32 or low-precision operands) -> float32, accumulated in
    float32."""
    return _product(x, w)


def _matmul_2d_fwd(x, w):
    return _product(x, w), (x, w)


def _transposed(a: jax.Array) -> jax.Array:
    """a [k, m] -> [m, k], written out in memory. Going through a unit axis keeps XLA from
    folding the transpose into the consuming dot (an optimization barrier would too, but then
    XLA:CPU runs a bf16 product in float32)."""
    k, m = a.shape
    return jnp.transpose(a.reshape(k, m, 1), (1, 0, 2)).reshape(m, k)


def _weight_grad(rows: jax.Array, g_rows: jax.Array) -> jax.Array:
    """rows^T @ g_rows: [tokens, in], [tokens, out] -> [in, out] float32.

    The contraction runs over the long token axis of both operands. Left to XLA:CPU it becomes
    a transposed-operand product on a slow path (bf16 operands even run in float32, at half
    the bf16 speed), after a copy of the [tokens, out] cotangent. Transposing the narrower
    operand ourselves moves fewer bytes and keeps a plain product on the fast dot kernels.
    """
    dims = (((1,), (0,)), ((), ()))
    if rows.shape[1] <= g_rows.shape[1]:
        return lax.dot_general(_transposed(rows), g_rows, dims,
                               preferred_element_type=jnp.float32)
    return _transposed(lax.dot_general(_transposed(g_rows), rows, dims,
                                       preferred_element_type=jnp.float32))


def _matmul_2d_bwd(residuals, g):
    # The incoming cotangent is float32; casting it to the operands' dtype keeps both backward
    # products on the fast low-precision dot path (float32 accumulation).
    x, w = residuals
    g = g.astype(w.dtype)
    dx = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    dw = _weight_grad(x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]))
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul_2d.defvjp(_matmul_2d_fwd, _matmul_2d_bwd)


def matmul(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """x [..., in] @ w [in, *out] -> [..., *out] float32, computed in `dtype`.

    float32: a float32 product. bfloat16 (or any other low-precision dtype): bf16 operands
    with float32 accumulation and output. CPUs with bf16 dot units (AVX512-BF16, AMX)
    run such a product several times faster than float32, while a bf16-output dot takes a slow
    path; the float32 result also keeps the residual stream precise. A kernel with several
    output axes is applied as one [in, prod(out)] matrix (XLA:CPU's dot kernels take 2-D
    operands; a multi-axis bf16 contraction has no fast kernel).
    """
    out = matmul_2d(x.astype(dtype), w.reshape(w.shape[0], -1).astype(dtype))
    return out.reshape(x.shape[:-1] + w.shape[1:])


def mixed_precision_dot_general(lhs, rhs, dimension_numbers, precision=None,
                                preferred_element_type=None, **kwargs):
    """`lax.dot_general` for flax Dense under bf16 compute: bf16 operands, float32 result.

    The Dense contraction (lhs [..., in] with rhs [in, out]) goes through `matmul_2d` and its
    VJP; any other contraction is a plain dot with a float32 result.
    """
    (lhs_contract, rhs_contract), batch_dims = dimension_numbers
    if tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,) \
            and rhs.ndim == 2 and batch_dims == ((), ()):
        return matmul_2d(lhs, rhs)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision,
                           preferred_element_type=jnp.float32)


# ---- Exact GELU with the bias add

def _phi_cdf(h: jax.Array) -> jax.Array:
    # Phi(h) = (1 + erf(h / sqrt(2))) / 2, PyTorch's formula. XLA evaluates erf as one rational
    # polynomial; jax.nn.gelu's erfc(-h / sqrt(2)) expands into exp and division branches
    # that XLA:CPU splits over several passes. They differ by < 1e-6 here.
    return 0.5 * (1.0 + lax.erf(h * _SQRT_HALF))


def _gelu(h: jax.Array) -> jax.Array:
    return h * _phi_cdf(h)


def _gelu_derivative(h: jax.Array) -> jax.Array:
    """d/dh [h Phi(h)] = Phi(h) + h phi(h), with phi the standard normal density."""
    return _phi_cdf(h) + h * jnp.exp(-0.5 * h * h) * _INV_SQRT_2PI


@jax.custom_vjp
def bias_gelu(d: jax.Array, b: jax.Array) -> jax.Array:
    """Exact (erf) GELU of `d + b`; d [..., F], b [F] (BERT's "gelu", not the tanh one)."""
    return _gelu(d + b)


def _bias_gelu_fwd(d, b):
    return _gelu(d + b), (d, b)


def _bias_gelu_bwd(residuals, g):
    # The barrier keeps XLA from merging this erf with the forward's (common subexpressions):
    # merged, the forward would write Phi(h) out for the backward to read, two extra passes
    # over [tokens, intermediate] to save a polynomial that is cheaper to recompute here.
    d, b = lax.optimization_barrier(residuals)
    h = d + b
    dh = g * _gelu_derivative(h)
    db = jnp.sum(dh, axis=tuple(range(dh.ndim - 1)))
    return dh.astype(d.dtype), db.astype(b.dtype)


bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def dense_bias(x: jax.Array, w: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """`matmul(x, w, dtype) + b` (float32). Under low-precision compute its VJP casts the
    incoming float32 gradient to that dtype once: both products and the bias sum read the
    rounded copy (XLA otherwise wrote the float32 gradient for the bias sum and a converted
    one for the products)."""
    if jnp.dtype(dtype) == jnp.float32:
        return matmul(x, w, dtype) + b
    return _dense_bias(x.astype(dtype), w.astype(dtype), b)


@jax.custom_vjp
def _dense_bias(x, w, b):
    return _product(x, w) + b


def _dense_bias_fwd(x, w, b):
    return _product(x, w) + b, (x, w)


def _dense_bias_bwd(residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    db = jnp.sum(g.reshape(-1, g.shape[-1]).astype(jnp.float32), axis=0)
    dx, dw = _matmul_2d_bwd((x, w), g)
    return dx, dw, db


_dense_bias.defvjp(_dense_bias_fwd, _dense_bias_bwd)


def dense_bias_gelu(x: jax.Array, w: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """Exact GELU of `x @ w + b` (x [..., in], w [in, F], b [F]), returned in `dtype`: the
    input of the next product. Under low-precision compute the VJP keeps the pre-activation
    gradient in that dtype only: the two products take it, and the bias gradient sums it (in
    float32). Chained, `matmul` and `bias_gelu` wrote it in float32, converted it, and read the
    float32 copy again for the bias: two passes more over [tokens, F]."""
    if jnp.dtype(dtype) == jnp.float32:
        return bias_gelu(matmul(x, w, dtype), b)
    return _dense_gelu(x.astype(dtype), w.astype(dtype), b)


@jax.custom_vjp
def _dense_gelu(x, w, b):
    return _gelu(_product(x, w) + b).astype(x.dtype)


def _dense_gelu_fwd(x, w, b):
    d = _product(x, w)
    return _gelu(d + b).astype(x.dtype), (x, w, d, b)


def _dense_gelu_bwd(residuals, g):
    x, w, d, b = residuals
    d, b = lax.optimization_barrier((d, b))  # recompute Phi here (see _bias_gelu_bwd)
    h = d + b
    dh = g.astype(jnp.float32) * _gelu_derivative(h)
    # The bias gradient sums the rounded gradient (float32 accumulation): the reduction reads
    # the bf16 copy the products read, instead of a float32 one written for it alone.
    dx, dw, db = _dense_bias_bwd((x, w), dh)
    return dx, dw, db.astype(b.dtype)


_dense_gelu.defvjp(_dense_gelu_fwd, _dense_gelu_bwd)
