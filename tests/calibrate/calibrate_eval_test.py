"""A calibration registered outside jaxsim is usable by name in the STS evaluation, the way
`eval.py --post mycal:3` uses it (same runner, same spec parsing)."""
from __future__ import annotations

import hashlib

import numpy as np

from jaxsim.calibrate import CALIBRATIONS, Calibration
from jaxsim.eval import runner
from jaxsim.paths import SENTEVAL_ROOT


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
    return out + 1.0


def test_user_calibration_by_name_in_the_sts_evaluation():
    rows = runner.evaluate_rows(_bag_of_words, ['stsb'], SENTEVAL_ROOT,
                                posts=['none', 'test_keep_first:8'], diagnostics=False)
    none, mine = rows
    assert mine.post == 'test_keep_first:8' and mine.label == 'test_keep_first-8'
    assert mine.details['fit']['calibration'] == {
        'STSBenchmark': 'test_keep_first:8: first 8 centered dims'}
    assert np.isfinite(mine.avg) and np.isfinite(none.avg) and mine.avg != none.avg
