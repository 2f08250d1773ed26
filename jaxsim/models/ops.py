"""The encoder's hot operations, written for fewer passes over memory on XLA.

Each function computes what the plain JAX expression would (same dtypes; same formulas up to
float32 rounding); they differ in what is stored for the backward pass and how the work is
laid out:

  matmul        x [..., in] @ w [in, *out] in float32, or with bf16 operands, float32
                accumulation and float32 output. Its VJP lays the weight gradient out itself:
                XLA's own choice transposed the [tokens, out] cotangent and ran the product on
                a slower dot path (in float32 even for bf16 operands); transposing the
                narrower operand moves fewer bytes and keeps the product on the fast one.
                With $JAXSIM_CPU_GEMM=auto|blas, bf16 products on CPU (forward and both
                gradients) run oneMKL's AMX kernel instead (jaxsim.native.blas_gemm; XLA:CPU
                only, opt-in), which reads transposed operands in place.
  bias_gelu     exact (erf) GELU of `d + b`, evaluated through erf (one polynomial) rather
                than erfc (exp and division branches). The custom VJP keeps only `d` and `b` as
                residuals and recomputes the derivative in one backward elementwise pass.
  dropout       inverted dropout (`where(keep, x / keep_prob, 0)`, as flax's nn.Dropout). With a
                threefry key, the mask uses all four 16-bit halves of the two 32-bit words of
                each threefry2x32 hash (one hash per four elements, keep probability resolved
                to 2**-16; the partitionable jax stream hashes once per element and XORs the
                words away). The hash's 20 rounds are most of a mask's cost. Bits stay a pure function of (key, global index):
                the mask does not depend on how the array is laid out over devices.
                Inside `dropout_rows(offset)` the first axis counts from `offset`: a
                micro-batch of rows [offset, offset + m) of a larger batch draws exactly the
                masks those rows get when the whole batch is encoded at once.
  dense_bias    matmul(x, w, dtype) + b whose VJP, under low-precision compute, rounds the
                incoming gradient once for both products and the bias sum.
  dense_bias_gelu
                bias_gelu(matmul(x, w, dtype), b) with its result in `dtype` and, under
                low-precision compute, a VJP that writes the pre-activation gradient in that
                dtype only (its products and the bias gradient read it there).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import jax
import jax.extend.random as jax_random_ext
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsim.native import blas_gemm

_SQRT_HALF = float(np.sqrt(0.5))
_INV_SQRT_2PI = float(1.0 / np.sqrt(2.0 * np.pi))


# ---------------------------------------------------------------------------------------------
# Products.
# ---------------------------------------------------------------------------------------------

def _contract_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] . w [in, out] -> [..., out], accumulated and returned in float32."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _through_blas(x: jax.Array, w: jax.Array) -> bool:
    """Whether products of these operands run oneMKL's kernel (jaxsim.native.blas_gemm)."""
    return x.dtype == w.dtype and blas_gemm.use_blas_gemm(w.dtype)


def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] float32; bf16 products run oneMKL's kernel where
    $JAXSIM_CPU_GEMM selects it, others XLA's dot."""
    if _through_blas(x, w):
        out = blas_gemm.bf16_gemm(x.reshape(-1, x.shape[-1]), w)
        return out.reshape(x.shape[:-1] + w.shape[1:])
    return _contract_in(x, w)


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
    if _through_blas(x, w):
        # The BLAS reads transposed operands in place: no transposed copies.
        g_rows, rows = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = blas_gemm.bf16_gemm(g_rows, w, transpose_b=True).reshape(x.shape)
        dw = blas_gemm.bf16_gemm(rows, g_rows, transpose_a=True)
        return dx.astype(x.dtype), dw.astype(w.dtype)
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


# ---------------------------------------------------------------------------------------------
# Exact GELU with the bias add.
# ---------------------------------------------------------------------------------------------

def _phi_cdf(h: jax.Array) -> jax.Array:
    # Phi(h) = (1 + erf(h / sqrt(2))) / 2, PyTorch's formula. XLA evaluates erf as one rational
    # polynomial; jax.nn.gelu's erfc(-h / sqrt(2)) expands into exp and division branches
    # that XLA:CPU splits over several passes (2.4x the time). They differ by < 1e-6 here.
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
    dh = dh.astype(x.dtype)
    rows = dh.reshape(-1, dh.shape[-1])
    # The bias gradient sums the rounded gradient (float32 accumulation): the reduction reads
    # the bf16 copy the products read, instead of a float32 one written for it alone.
    db = jnp.sum(rows.astype(jnp.float32), axis=0)
    dx, dw = _matmul_2d_bwd((x, w), dh)
    return dx, dw, db.astype(b.dtype)


_dense_gelu.defvjp(_dense_gelu_fwd, _dense_gelu_bwd)


# ---------------------------------------------------------------------------------------------
# Dropout.
# ---------------------------------------------------------------------------------------------

def _is_threefry(key: jax.Array) -> bool:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32"
    return key.shape == (2,) and key.dtype == jnp.uint32  # raw (old-style) threefry key data


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32 row-major index of every element of `shape`, built from per-axis iotas so that
    XLA's SPMD partitioner computes each device's share of it locally."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    return index


# The global index of the first row of the arrays being dropped out (None: 0). A context
# variable rather than an argument so that no module signature carries it; it may hold a
# traced value (the micro-batch index inside a scan).
_ROW_OFFSET: contextvars.ContextVar = contextvars.ContextVar("dropout_row_offset",
                                                             default=None)


@contextlib.contextmanager
def dropout_rows(offset) -> Iterator[None]:
    """Threefry dropout masks drawn inside this block are those of rows `offset`, `offset + 1`,
    ... of a larger batch (every dropped array has the batch rows as its first axis)."""
    token = _ROW_OFFSET.set(offset)
    try:
        yield
    finally:
        _ROW_OFFSET.reset(token)


def _row_shifted(counter: jax.Array) -> jax.Array:
    """`counter` (row-major indices) moved down by `_ROW_OFFSET` rows of its first axis."""
    offset = _ROW_OFFSET.get()
    if offset is None:
        return counter
    row_stride = np.uint32(math.prod(counter.shape[1:]))
    return counter + jnp.asarray(offset).astype(jnp.uint32) * row_stride


def _threefry_bits(key_data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits for `shape`: one threefry2x32 hash of (0, i) per index i of the first half of
    the last axis gives two words, the first for that element, the second for its partner in
    the second half. An odd last axis takes one hash per element (XOR of its words, as jax's
    partitionable stream does)."""
    *lead, last = shape
    hash_ = jax_random_ext.threefry2x32_p.bind
    if last % 2:
        counter = _row_shifted(_flat_index(tuple(shape)))
        low, high = hash_(key_data[0], key_data[1], jnp.zeros_like(counter), counter)
        return low ^ high
    half = last // 2
    counter_shape = (*lead, 1, half)
    if math.prod(counter_shape) >= 2 ** 32:
        raise ValueError(f"dropout over {shape} needs more than 2**32 counters")
    counter = _row_shifted(_flat_index(counter_shape))
    low, high = hash_(key_data[0], key_data[1], jnp.zeros_like(counter), counter)
    # [..., 2, half] by broadcasting (elementwise, so XLA fuses it into the mask's consumer;
    # a concatenate would be a pass of its own), then the last axis back: a free reshape.
    first = lax.broadcasted_iota(jnp.int32, (*lead, 2, half), len(lead)) == 0
    return jnp.where(first, low, high).reshape(shape)


def _threefry_quarter_bits(key_data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 values below 2**16 for `shape` (last axis divisible by 4): one threefry2x32 hash
    of (0, i) per index i of the first quarter of the last axis; its two words give four 16-bit
    halves, one for the element in each quarter."""
    *lead, last = shape
    quarter = last // 4
    counter_shape = (*lead, 1, quarter)
    if math.prod(counter_shape) >= 2 ** 32:
        raise ValueError(f"dropout over {shape} needs more than 2**32 counters")
    counter = _row_shifted(_flat_index(counter_shape))
    low, high = jax_random_ext.threefry2x32_p.bind(key_data[0], key_data[1],
                                                    jnp.zeros_like(counter), counter)
    # [..., 4, quarter] by broadcasting (elementwise: fused into the mask's consumer).
    part = lax.broadcasted_iota(jnp.uint32, (*lead, 4, quarter), len(lead))
    word = jnp.where(part < 2, low, high)
    half = (word >> ((part & np.uint32(1)) * np.uint32(16))) & np.uint32(0xFFFF)
    return half.reshape(shape)


# Rates (and keep probabilities) of at least this use 16-bit draws: the keep probability is
# then off by at most 2**-17, under 0.8% of the rate. Smaller ones take full 32-bit words.
_MIN_RATE_16_BITS = 2.0 ** -10


def keep_mask(key: jax.Array, shape: tuple[int, ...], keep_prob: float) -> jax.Array:
    """Bernoulli(keep_prob) booleans of `shape`.

    A threefry key takes the quarter-word path above (resolution 2**-16) when the last axis is
    a multiple of 4 and neither the rate nor keep_prob is below 2**-10, else the paired-word
    path (resolution 2**-32); any other key (e.g. 'rbg') draws `jax.random.bits` from its own
    implementation (resolution 2**-32).
    """
    if _is_threefry(key):
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) \
            else key
        if shape and shape[-1] % 4 == 0 and min(keep_prob, 1.0 - keep_prob) >= _MIN_RATE_16_BITS:
            threshold = np.uint32(int(round(keep_prob * 2.0 ** 16)))
            return _threefry_quarter_bits(data, tuple(shape)) < threshold
        bits = _threefry_bits(data, tuple(shape))
    else:
        bits = jax.random.bits(key, tuple(shape), jnp.uint32)
    return bits < np.uint32(min(int(round(keep_prob * 2.0 ** 32)), 2 ** 32 - 1))


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout: zero each element with probability `rate`, scale the rest by
    1 / (1 - rate), as `flax.linen.Dropout` does (with its own random stream)."""
    if rate <= 0.0:
        return x
    if rate >= 1.0:
        return jnp.zeros_like(x)
    keep_prob = 1.0 - rate
    keep = keep_mask(key, x.shape, keep_prob)
    return lax.select(keep, x / keep_prob, jnp.zeros_like(x))
