"""A calibration registered outside jaxsim is usable by name in the STS evaluation, the way
`eval.py --post mycal:3` uses it (same runner, same spec parsing)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import scipy.stats

from jaxsim.calibrate import CALIBRATIONS, Calibration
from jaxsim.eval import runner
from jaxsim.storage.paths import SENTEVAL_ROOT


@CALIBRATIONS.register('test_keep_first', replace=True)
class KeepFirst(Calibration):
    """Centers, then keeps the first K dims."""

    arg = 'required'

    def __init__(self, k: int, mu: np.ndarray):
        self.k, self.mu = k, mu

    @classmethod
    def fit(cls, x, arg):
        return cls(int(arg), np.asarray(x, np.float64).mean(0))

    def apply(self, x):
        return (np.asarray(x, np.float64) - self.mu)[:, : self.k]

    def describe(self):
        return f'{self.spec}: first {self.k} centered dims'


def _bag_of_words(sentences):
    """Deterministic 16-dim hashed bag-of-words vectors: similar sentences score higher."""
    out = np.zeros((len(sentences), 16))
    for i, s in enumerate(sentences):
        for word in s.lower().split():
            out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % 16] += 1.0
    # A small per-sentence offset breaks the count vectors' exact cosine ties, so the ranks
    # below do not depend on how a cosine's sum is ordered.
    noise = [np.random.default_rng(int(hashlib.md5(s.encode()).hexdigest()[:8], 16)).normal(size=16)
             for s in sentences]
    return out + 1.0 + 1e-3 * np.asarray(noise).reshape(len(sentences), 16)


def test_user_calibration_by_name_in_the_sts_evaluation():
    rows = runner.evaluate_rows(_bag_of_words, ['stsb'], SENTEVAL_ROOT,
                                posts=['none', 'test_keep_first:8'], diagnostics=False)
    none, mine = rows
    assert mine.post == 'test_keep_first:8' and mine.label == 'test_keep_first-8'
    assert mine.details['fit']['calibration'] == {
        'STSBenchmark': 'test_keep_first:8: first 8 centered dims'}
    # Independently: STS-B test read here, the calibration fitted on both sentences of every
    # pair (the default fit set: the evaluated tasks' sentences), Spearman x100 of cosine.
    rows = [line.split('\t') for line in
            (SENTEVAL_ROOT / 'STS' / 'STSBenchmark' / 'sts-test.csv').read_text().splitlines()]
    # The runner keeps vectors in float32: the same rounding keeps cosine ties the same.
    a, b = (_bag_of_words([r[i] for r in rows]).astype(np.float32).astype(np.float64)
            for i in (5, 6))
    gold = [float(r[4]) for r in rows]
    mu = np.concatenate([a, b]).mean(0)

    def score(u, v):
        cos = (u * v).sum(1) / (np.linalg.norm(u, axis=1) * np.linalg.norm(v, axis=1))
        return 100 * scipy.stats.spearmanr(cos, gold)[0]

    assert none.tasks['STSBenchmark'] == pytest.approx(score(a, b), abs=1e-6)
    assert mine.tasks['STSBenchmark'] == pytest.approx(score((a - mu)[:, :8], (b - mu)[:, :8]),
                                                       abs=1e-6)
    assert abs(mine.tasks['STSBenchmark'] - none.tasks['STSBenchmark']) > 0.5
