"""Counter-based dropout: statistics, scaling, key kinds, and the two forms of its bits."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.models import dropout


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_dropout_statistics_scaling_and_keys(impl):
    shape = (400, 7, 34)  # elements j and j + 17 share a hash (its two words)
    x = jnp.ones(shape, jnp.float32) * 2.0
    key = jax.random.key(0, impl=impl)
    y = np.asarray(dropout.dropout(x, 0.1, key))
    kept = y != 0
    n = kept.size
    assert abs(kept.mean() - 0.9) < 5 * np.sqrt(0.09 / n)
    np.testing.assert_allclose(y[kept], 2.0 / 0.9, rtol=1e-6)
    np.testing.assert_array_equal(y, np.asarray(dropout.dropout(x, 0.1, key)))  # a pure function
    other = np.asarray(dropout.dropout(x, 0.1, jax.random.key(1, impl=impl))) != 0
    assert (other != kept).mean() > 0.1
    # Elements fed by the two words of one hash (j and j + 17 on the last axis) are independent.
    a, b = kept[..., :17].ravel().astype(float), kept[..., 17:].ravel().astype(float)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)
    odd = np.asarray(dropout.dropout(jnp.ones((300, 33)), 0.1, key)) != 0  # one hash per element
    assert abs(odd.mean() - 0.9) < 5 * np.sqrt(0.09 / odd.size)
    assert dropout.dropout(x, 0.0, key) is x
    np.testing.assert_array_equal(dropout.dropout(x, 1.0, key), 0.0)


def test_dropout_quarter_words_are_independent_and_scaled():
    # Last axis 64: elements j, j + 16, j + 32, j + 48 take the four 16-bit halves of one hash.
    x = jnp.ones((500, 3, 64), jnp.float32) * 3.0
    y = np.asarray(dropout.dropout(x, 0.1, jax.random.key(7)))
    kept = y != 0
    assert abs(kept.mean() - 0.9) < 5 * np.sqrt(0.09 / kept.size)
    np.testing.assert_allclose(y[kept], 3.0 / 0.9, rtol=1e-6)
    quarters = [kept[..., 16 * i:16 * (i + 1)].ravel().astype(float) for i in range(4)]
    for i in range(4):
        assert abs(quarters[i].mean() - 0.9) < 5 * np.sqrt(0.09 / quarters[i].size)
        for j in range(i + 1, 4):
            assert abs(np.corrcoef(quarters[i], quarters[j])[0, 1]) < 5 / np.sqrt(
                quarters[i].size), (i, j)
    # Rows are independent of how many rows are drawn with them.
    np.testing.assert_array_equal(kept[:7], np.asarray(dropout.dropout(x[:7], 0.1,
                                                                    jax.random.key(7))) != 0)


def test_dropout_keep_rate_follows_the_rate():
    x = jnp.ones((256, 64, 64), jnp.float32)
    for rate in (0.05, 0.5, 0.9):
        kept = float(jnp.mean(dropout.dropout(x, rate, jax.random.key(3)) != 0))
        assert abs(kept - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / x.size), rate


def test_dropout_accepts_raw_threefry_key_data():
    x = jnp.ones((8, 10), jnp.float32)
    typed = dropout.dropout(x, 0.3, jax.random.key(5))
    raw = dropout.dropout(x, 0.3, jax.random.key_data(jax.random.key(5)))
    np.testing.assert_array_equal(typed, raw)


@pytest.mark.parametrize('words', [2, 4])
@pytest.mark.parametrize('offset', [None, 3])
def test_dropout_bits_are_the_same_in_both_forms(words, offset):
    """The CPU form (one hash per word, broadcast and reshaped) and the form compiled for
    accelerators (each element hashes its word's counter, no reshape) draw the same bits, also
    for rows further down a batch (`dropout_rows`): a TPU run keeps a CPU run's masks."""
    data = jnp.asarray([7, 11], jnp.uint32)
    shape = (3, 5, 16)
    with dropout.dropout_rows(offset) if offset is not None else contextlib.nullcontext():
        # Eagerly: a jit cache entry would not see the row offset (read while tracing).
        broadcast = dropout.word_bits_broadcast(data, shape, words)
        elementwise = dropout.word_bits_elementwise(data, shape, words)
    np.testing.assert_array_equal(np.asarray(broadcast), np.asarray(elementwise))
    assert len(np.unique(np.asarray(broadcast))) > 200  # distinct draws, not a constant
    if offset is not None:  # rows shifted: row r here is row r + 3 of a batch drawn unshifted
        whole = dropout.word_bits_broadcast(data, (6, 5, 16), words)
        np.testing.assert_array_equal(np.asarray(whole)[3:], np.asarray(broadcast))
