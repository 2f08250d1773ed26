"""The embedding lookup casts only the gathered rows to the compute dtype (bert.RowCastEmbed):
the same vectors as flax's `nn.Embed`, which casts the whole [vocab, hidden] table first, with
no pass over the table in the forward program."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim.models.bert import RowCastEmbed

VOCAB, HIDDEN = 50, 8


def _tables(dtype):
    ids = jnp.asarray([[1, 4, 4, 0], [49, 3, 1, 1]], jnp.int32)
    mine, flax_embed = (cls(VOCAB, HIDDEN, param_dtype=jnp.float32, dtype=dtype)
                        for cls in (RowCastEmbed, nn.Embed))
    params = flax_embed.init(jax.random.key(0), ids)
    return ids, mine, flax_embed, params


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_same_vectors_as_flax_embed(dtype):
    ids, mine, flax_embed, params = _tables(dtype)
    got, want = mine.apply(params, ids), flax_embed.apply(params, ids)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_single_row_table_broadcasts_like_flax_embed():
    ids = jnp.zeros((2, 3), jnp.int32)
    mine, flax_embed = (cls(1, HIDDEN, dtype=jnp.bfloat16) for cls in (RowCastEmbed, nn.Embed))
    params = flax_embed.init(jax.random.key(1), ids)
    np.testing.assert_array_equal(np.asarray(mine.apply(params, ids), np.float32),
                                  np.asarray(flax_embed.apply(params, ids), np.float32))


def test_bf16_forward_never_converts_the_whole_table():
    ids, mine, flax_embed, params = _tables(jnp.bfloat16)

    def table_converts(module):
        jaxpr = jax.make_jaxpr(lambda p: module.apply(p, ids))(params)
        return [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
                and e.invars[0].aval.shape == (VOCAB, HIDDEN)]
    assert table_converts(flax_embed)  # what the check would see
    assert not table_converts(mine)


def test_bf16_gradient_sums_repeated_rows_in_float32():
    """Backward, the bf16 row gradients become float32 before they are summed into the table:
    the gradient equals a float32 scatter-add of them."""
    ids, mine, _, params = _tables(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(2), ids.shape + (HIDDEN,)).astype(jnp.bfloat16)
    grad = jax.grad(lambda p: jnp.sum((mine.apply(p, ids) * cotangent).astype(jnp.float32)))(
        params)["params"]["embedding"]
    want = np.zeros((VOCAB, HIDDEN), np.float32)
    np.add.at(want, np.asarray(ids).ravel(),
              np.asarray(cotangent, np.float32).reshape(-1, HIDDEN))
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=1e-7)  # bf16 sums: ~1e-2
