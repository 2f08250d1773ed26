"""Spearman x100 of cosines and the all/mean/wmean aggregations, by hand and against scipy."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from jaxsim.errors import JaxsimError
from jaxsim.eval import metrics


def test_spearman_x100_equals_scipy_on_cosines():
    rng = np.random.default_rng(0)
    e1, e2 = rng.normal(size=(50, 7)), rng.normal(size=(50, 7))
    gold = rng.integers(0, 6, size=50).astype(float)  # many ties
    cos = (e1 * e2).sum(1) / np.linalg.norm(e1, axis=1) / np.linalg.norm(e2, axis=1)
    expected = scipy.stats.spearmanr(cos, gold).statistic * 100
    assert metrics.spearman_x100(e1, e2, gold) == pytest.approx(expected, abs=1e-10)
    assert metrics.spearman_x100(3 * e1, e2, gold) == pytest.approx(expected, abs=1e-10)
    assert metrics.pearson_x100(e1, e2, gold) == pytest.approx(
        scipy.stats.pearsonr(cos, gold).statistic * 100, abs=1e-10)


def test_aggregations_by_hand():
    # A: ranks [1 2.5 2.5 4] vs [1 2 3 4] -> 4.5 / sqrt(22.5); B: 1.5 / sqrt(3) (see the
    # derivation in tests/eval/runner_test.py); 'all' over the 7 pairs: 24 / sqrt(715).
    a = (np.array([.1, .5, .5, .9]), np.array([1., 2, 3, 4]))
    b = (np.array([.2, .8, .4]), np.array([2., 5, 2]))
    s = metrics.task_score('STS12', {'A': a, 'B': b})
    ra, rb = 4.5 / math.sqrt(22.5), 1.5 / math.sqrt(3.0)
    assert s.subsets['A'].spearman == pytest.approx(100 * ra)
    assert s.all == pytest.approx(100 * 24 / math.sqrt(715.0))
    assert s.mean == pytest.approx(50 * (ra + rb))
    assert s.wmean == pytest.approx(100 * (4 * ra + 3 * rb) / 7)
    assert s.n == 7 and s.get('wmean') == s.wmean
    avg = metrics.mean_task_score([s, metrics.task_score('STS12', {'A': a, 'B': (-b[0], b[1])})])
    assert avg.subsets['A'].spearman == pytest.approx(s.subsets['A'].spearman)
    assert avg.subsets['B'].spearman == pytest.approx(0.0, abs=1e-9)  # +r and -r


def test_bad_inputs_are_clear_errors():
    e = np.ones((3, 2))
    with pytest.raises(JaxsimError, match='zero vector'):
        metrics.spearman_x100(e, np.zeros((3, 2)), [1, 2, 3])
    with pytest.raises(JaxsimError, match='NaN'):
        metrics.spearman_x100(e, np.full((3, 2), np.nan), [1, 2, 3])
    with pytest.raises(JaxsimError, match='gold scores are all equal'):
        metrics.spearman_x100(e, e + np.eye(3, 2), [2, 2, 2])
    with pytest.raises(JaxsimError, match='STS12 subset B: a correlation needs at least 2'):
        metrics.task_score('STS12', {'B': (np.array([.1]), np.array([1.]))})
    with pytest.raises(JaxsimError, match='aggregate must be one of'):
        metrics.check_aggregate('median')
    assert metrics.spearman_of_scores_x100([1, 1, 1], [1, 2, 3]) == 0.0  # constant system
