"""Dropout whose masks are a pure function of (key, global element index).

Inverted dropout (`where(keep, x / keep_prob, 0)`, as flax's nn.Dropout). With a threefry key,
the mask uses all four 16-bit halves of the two 32-bit words of each threefry2x32 hash (one
hash per four elements, keep probability resolved to 2**-16; the partitionable jax stream
hashes once per element and XORs the words away): the hash's 20 rounds are most of a mask's
cost. Bits do not depend on how the array is laid out over devices. Inside
`dropout_rows(offset)` the first axis counts from `offset`: a micro-batch of rows
[offset, offset + m) of a larger batch draws exactly the masks those rows get when the whole
batch is encoded at once (GradCache relies on it).
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


def _row_shifted(counter: jax.Array, row_stride: int) -> jax.Array:
    """`counter` (row-major indices, `row_stride` a row) moved down by `_ROW_OFFSET` rows."""
    offset = _ROW_OFFSET.get()
    if offset is None:
        return counter
    return counter + jnp.asarray(offset).astype(jnp.uint32) * np.uint32(row_stride)


def _word_counters(shape: tuple[int, ...], words: int) -> tuple[jax.Array, jax.Array]:
    """For the last axis split into `words` equal parts: each element's counter (the flat
    index of its position within the first part, shifted by `_ROW_OFFSET` rows) and its part,
    as arrays of `shape`."""
    *lead, last = shape
    width = last // words
    column = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    part = column // np.uint32(width)
    row = jnp.zeros(shape, jnp.uint32)
    for axis, size in enumerate(lead):
        row = row * np.uint32(size) + lax.broadcasted_iota(jnp.uint32, shape, axis)
    counter = row * np.uint32(width) + column - part * np.uint32(width)
    return _row_shifted(counter, width * math.prod(lead[1:])), part


def _hash(data: jax.Array, counter: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax_random_ext.threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(counter),
                                              counter)


def _pick(low: jax.Array, high: jax.Array, part: jax.Array, words: int) -> jax.Array:
    """Each element's share of its hash: a whole word (2 parts) or a 16-bit half (4 parts)."""
    if words == 2:
        return jnp.where(part == 0, low, high)
    word = jnp.where(part < 2, low, high)
    return (word >> ((part & np.uint32(1)) * np.uint32(16))) & np.uint32(0xFFFF)


def word_bits_broadcast(data: jax.Array, shape: tuple[int, ...], words: int) -> jax.Array:
    """Bits for `shape` from one hash per counter of the last axis's first 1/`words`, broadcast
    to [..., words, n / words] (fused into the mask's consumer) and reshaped: the CPU form."""
    *lead, last = shape
    counter_shape = (*lead, 1, last // words)
    counter = _row_shifted(_flat_index(counter_shape), math.prod(counter_shape[1:]))
    low, high = _hash(data, counter)
    part = lax.broadcasted_iota(jnp.uint32, (*lead, words, last // words), len(lead))
    return _pick(low, high, part, words).reshape(shape)


def word_bits_elementwise(data: jax.Array, shape: tuple[int, ...], words: int) -> jax.Array:
    """The same bits as `word_bits_broadcast`, each element hashing its own word's counter:
    no reshape. On TPU the reshape from [..., k, n/k] to [..., n] is a relayout that XLA does
    not fuse; this way a dropout moves its input and output once (tests/plan/plan_test.py
    holds the TPU compile to that)."""
    counter, part = _word_counters(tuple(shape), words)
    low, high = _hash(data, counter)
    return _pick(low, high, part, words)


def _word_bits(data: jax.Array, shape: tuple[int, ...], words: int) -> jax.Array:
    """Chosen where the program is compiled: the broadcast form hashes `words` times less,
    which is what counts on CPU; the elementwise form moves no data, which counts elsewhere."""
    *lead, last = shape
    if math.prod((*lead, last // words)) >= 2 ** 32:
        raise ValueError(f"dropout over {shape} needs more than 2**32 counters")
    return lax.platform_dependent(
        data, cpu=lambda d: word_bits_broadcast(d, shape, words),
        default=lambda d: word_bits_elementwise(d, shape, words))


def _threefry_bits(key_data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits for `shape`: one threefry2x32 hash of (0, i) per index i of the first half of
    the last axis gives two words, the first for that element, the second for its partner in
    the second half. An odd last axis takes one hash per element (XOR of its words, as jax's
    partitionable stream does)."""
    if shape[-1] % 2:
        counter = _flat_index(tuple(shape))
        low, high = _hash(key_data, _row_shifted(counter, math.prod(shape[1:])))
        return low ^ high
    return _word_bits(key_data, tuple(shape), 2)


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
            return _word_bits(data, tuple(shape), 4) < threshold
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
    return lax.select(keep_mask(key, x.shape, keep_prob), x / keep_prob, jnp.zeros_like(x))
