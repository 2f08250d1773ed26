"""bfloat16 corpus: scored in bf16, rescored in float32, certified to be the float32 result.

The error bound against worst-case and random rounding, planted rows whose order bf16
rounding reverses (the rescore must restore it), queries the certificate must refuse (searched
again in float32), ties, unnormalized rows and indexes too small for the bf16 pass.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxsim.search import SearchError, SearchIndex, bf16, topk
from tests.search.search_test import _brute_force, _four_hot, _gaussian


def _bf16_scores(queries, rows):
    """Scores as the bf16 pass computes them: bf16 operands, float32 sums."""
    return np.asarray(jax.lax.dot_general(
        bf16.bf16_round(jnp.asarray(queries))[0], jnp.asarray(rows, jnp.bfloat16),
        (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))


def _margin(queries, rows):
    _, norms = bf16.bf16_corpus(rows)
    norm_args = jnp.array([norms.rows, norms.rounded, norms.rounding], jnp.float32)
    return np.asarray(bf16.bf16_margin(jnp.asarray(queries), norm_args))


def test_query_rounding_is_nearest_even_like_ml_dtypes():
    x = _gaussian(64, 50, 45) * np.exp(np.linspace(-20, 20, 50, dtype=np.float32))
    halfway = (1 + np.arange(1, 64, 2) * 2.0 ** -9).astype(np.float32)  # ties: to even
    for values in (x, np.stack([halfway, -halfway])):
        want = values.astype(ml_dtypes.bfloat16)
        low, wide = jax.jit(bf16.bf16_round)(jnp.asarray(values))
        np.testing.assert_array_equal(np.asarray(low).view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(np.asarray(wide), want.astype(np.float32))


def test_error_bound_holds_at_worst_case_rounding_and_is_tight():
    # 1 + 2^-8 lies halfway between two bf16 values and rounds (to even) down to 1: every
    # product loses 2^-7 + 2^-16 of itself, twice a per-side 2^-8 bound.
    dim = 96
    x = np.full((1, dim), 1 + 2.0 ** -8, np.float32)
    assert x.astype(ml_dtypes.bfloat16).astype(np.float32)[0, 0] == 1.0
    error = float(x[0].astype(np.float64) @ x[0]) - float(_bf16_scores(x, x)[0, 0])
    assert error == pytest.approx(dim * (2.0 ** -7 + 2.0 ** -16), rel=1e-6)
    margin = float(_margin(x, x)[0])
    assert error <= margin <= 1.01 * error


def test_error_bound_holds_for_random_rows_of_many_scales():
    rng = np.random.default_rng(40)
    rows = _gaussian(300, 64, 41) * np.exp(rng.uniform(-5, 5, (300, 1))).astype(np.float32)
    queries = _gaussian(50, 64, 42) * np.exp(rng.uniform(-5, 5, (50, 1))).astype(np.float32)
    error = np.abs(queries.astype(np.float64) @ rows.T.astype(np.float64)
                   - _bf16_scores(queries, rows))
    margin = _margin(queries, rows)
    assert (error <= margin[:, None]).all()
    # Not vacuous: within 30x of the worst error of each query.
    assert (margin < 30 * error.max(axis=1)).all()


def _flipped_pair(dim, seed):
    """A query q and rows a, b with q.b > q.a in float32 but q.a > q.b in bf16."""
    rng = np.random.default_rng(seed)
    while True:
        q = rng.standard_normal(dim).astype(np.float32)
        a = (q + 0.3 * rng.standard_normal(dim)).astype(np.float32)
        b = (a + 2e-3 * rng.standard_normal(dim)).astype(np.float32)
        exact = q.astype(np.float64) @ np.stack([a, b]).T.astype(np.float64)
        low = _bf16_scores(q[None], np.stack([a, b]))[0]
        if exact[1] - exact[0] > 1e-4 * exact[0] and low[0] - low[1] > 1e-4 * low[0]:
            return q, a, b


def _planted(dim, places, seed):
    """Rows orthogonal to q (scores ~0), with given rows (row number -> vector) planted."""
    q, a, b = _flipped_pair(dim, seed)
    filler = _gaussian(1000, dim, seed + 1).astype(np.float64)
    filler -= np.outer(filler @ q, q) / (q @ q)
    corpus = filler.astype(np.float32)
    for row, vector in places(a, b).items():
        corpus[row] = vector
    return corpus, q[None]


def _same_group(*rows):
    """Whether the rows share a bf16 group (blocks of 64 rows, as the tests here place them)."""
    return len({bf16.group_of(topk.plan_layout(1000, 64, 1, 64), r) for r in rows}) == 1


@pytest.mark.parametrize("places,k", [
    (lambda a, b: {40: a, 200: b}, 2),  # in different groups: both are their group's best
    (lambda a, b: {16: a, 24: b}, 2),  # in one group: b is its second best, rescored whole
])
def test_rescore_restores_the_order_bf16_rounding_reverses(places, k):
    corpus, queries = _planted(64, places, 43)
    index = SearchIndex.from_vectors(corpus, normalize=False, corpus_dtype="bfloat16",
                                     block_rows=64)
    hits = index.search_vectors(queries, top_k=k)
    a_row, b_row = places(0, 1).keys()
    assert _same_group(a_row, b_row) == (b_row == 24)
    low = _bf16_scores(queries, corpus)[0]
    assert low[a_row] > low[b_row]  # bf16 alone would put a first
    np.testing.assert_array_equal(hits.rows[0], [b_row, a_row])
    np.testing.assert_allclose(hits.scores[0], queries[0].astype(np.float64)
                               @ corpus[[b_row, a_row]].T.astype(np.float64), rtol=1e-6)
    assert index.last_search_stats == {"bf16_again": 0, "float32_again": 0}  # one bf16 pass


def test_rows_the_first_bound_cannot_separate_go_through_the_wider_pass():
    # Three groups each hold a flipped pair (scaled 1, 0.99, 0.98); two are rescored whole, the
    # third only through its bf16 best row (144, the fifth in bf16), while the float32 fifth is
    # its second best (152), within bf16's error of it: the first certificate must refuse it.
    def places(a, b):
        return {16: a, 24: b, 80: 0.99 * a, 88: 0.99 * b, 144: 0.98 * a, 152: 0.98 * b}
    assert _same_group(16, 24) and _same_group(80, 88) and _same_group(144, 152)
    assert not _same_group(16, 80, 144)
    corpus, queries = _planted(64, places, 44)
    index = SearchIndex.from_vectors(corpus, normalize=False, corpus_dtype="bfloat16",
                                     block_rows=64)
    hits = index.search_vectors(queries, top_k=5)
    # The wider second pass rescores all three groups whole and certifies it.
    assert index.last_search_stats == {"bf16_again": 1, "float32_again": 0}
    np.testing.assert_array_equal(hits.rows[0], [24, 16, 88, 80, 152])
    want = SearchIndex.from_vectors(corpus, normalize=False).search_vectors(queries, top_k=5)
    np.testing.assert_array_equal(hits.rows, want.rows)
    np.testing.assert_allclose(hits.scores, want.scores, rtol=1e-6)  # sums in another order


def test_bf16_corpus_equals_numpy_brute_force():
    corpus, queries = _gaussian(3001, 48, 20), _gaussian(41, 48, 21)
    index = SearchIndex.from_vectors(corpus, corpus_dtype="bfloat16", block_rows=256,
                                     query_batch=16)
    hits = index.search_vectors(queries, top_k=10)
    want_scores, want_rows = _brute_force(corpus, queries, 10)
    np.testing.assert_array_equal(hits.rows, want_rows)
    np.testing.assert_allclose(hits.scores, want_scores, atol=2e-6, rtol=0)
    assert index.last_search_stats == {"bf16_again": 0, "float32_again": 0}  # all certified


def test_bf16_corpus_sends_uncertain_queries_back_to_float32():
    # Near-duplicate rows: their scores differ by less than bf16's error, so the bf16 pass
    # cannot tell which are the top k and those queries are searched again in float32.
    rng = np.random.default_rng(22)
    centre = rng.standard_normal(32).astype(np.float32)
    near = centre + 1e-3 * rng.standard_normal((600, 32)).astype(np.float32)
    corpus = np.concatenate([_gaussian(2400, 32, 23), near])
    queries = np.concatenate([centre[None] + 0.01 * _gaussian(5, 32, 24), _gaussian(5, 32, 25)])
    index = SearchIndex.from_vectors(corpus, corpus_dtype="bfloat16", block_rows=512)
    hits = index.search_vectors(queries, top_k=12)
    stats = index.last_search_stats  # neither bf16 pass can order them: float32 does
    assert stats["float32_again"] >= 5 and stats["bf16_again"] >= stats["float32_again"]
    # Scores 1e-6 apart: float32 rounding orders them, so the reference is the float32 index.
    want = SearchIndex.from_vectors(corpus, block_rows=512).search_vectors(queries, top_k=12)
    np.testing.assert_array_equal(hits.rows, want.rows)
    np.testing.assert_allclose(hits.scores, want.scores, atol=1e-6, rtol=0)


def test_bf16_corpus_unnormalized_ties_and_small_indexes():
    # Inner products of rows with norms up to 40 (the error bound scales with the largest);
    # four-hot rows, whose equal scores must still come out lowest row first; an index too small
    # for the bf16 pass (fewer groups than k needs) searches in float32.
    rows = _gaussian(2000, 24, 26) * np.linspace(0.1, 40, 2000, dtype=np.float32)[:, None]
    queries = _gaussian(9, 24, 27)
    index = SearchIndex.from_vectors(rows, normalize=False, corpus_dtype="bfloat16")
    want = np.argsort(-(queries.astype(np.float64) @ rows.T), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(index.search_vectors(queries, 10).rows, want)
    ties, ties_q = _four_hot(800, 16, 28), _four_hot(15, 16, 29)
    index = SearchIndex.from_vectors(ties, corpus_dtype="bfloat16", block_rows=64)
    np.testing.assert_array_equal(index.search_vectors(ties_q, 20).rows,
                                  _brute_force(ties, ties_q, 20)[1])
    small = SearchIndex.from_vectors(ties[:50], corpus_dtype="bfloat16")
    np.testing.assert_array_equal(small.search_vectors(ties_q, 20).rows,
                                  _brute_force(ties[:50], ties_q, 20)[1])
    assert small.last_search_stats == {"bf16_again": 0, "float32_again": 15}
    with pytest.raises(SearchError, match="corpus_dtype must be one of float32, bfloat16"):
        SearchIndex.from_vectors(ties, corpus_dtype="int8")


