"""A tiny SentEval folder for tests.

Sentences 'cos C ...' are decoded by `fake_vector` into 2-d vectors whose cosine with
'anchor' is C, so the scores of a fake encoder can be computed by hand.
"""
from __future__ import annotations

import math
import pathlib

import numpy as np

# STS12 subsets (SentEval names); 'cos 0.7 b' has no gold score and is dropped.
STS12_A = [('anchor', 'cos 0.1 a', '1'), ('anchor', 'cos 0.5 a', '2'),
           ('anchor', 'cos 0.5 b', '3'), ('anchor', 'cos 0.9 a', '4')]
STS12_B = [('anchor', 'cos 0.2 b', '2'), ('anchor', 'cos 0.7 b', ''),
           ('anchor', 'cos 0.8 b', '5.0'), ('anchor', ' cos  0.4   b ', '2.000')]
STS12_FILES = {'MSRpar': STS12_A, 'MSRvid': STS12_B}
STSB = {
    'train': [('anchor', 'cos 0.3 t', 1.0), ('anchor', 'cos 0.6 t', 3.0)],
    'dev': [('anchor', 'cos 0.2 d', 1.0), ('anchor', 'cos 0.6 d', 4.5),
            ('anchor', 'cos 0.4 d', 4.2)],
    'test': [('anchor', 'cos 0.1 s', 0.5), ('anchor', 'cos 0.3 s', 4.5),
             ('anchor', 'cos 0.2 s', 4.8), ('anchor', 'cos 0.9 s', 4.1)],
}
SICK_TRIAL = [('anchor', 'cos 0.1 k', 1.5), ('anchor', 'cos 0.6 k', 3.0),
              ('anchor', 'cos 0.3 k', 4.0)]
SICK_TRAIN = [('anchor', 'cos 0.2 r', 2.0), ('anchor', 'cos 0.5 r', 3.5)]
SICK_TEST = [('anchor', 'cos 0.1 k', 1.5), ('anchor', 'cos 0.7 k', 3.0),
             ('anchor', 'cos 0.3 k', 4.0)]
SICK_HEADER = 'pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n'


def _sick(rows) -> str:
    return SICK_HEADER + ''.join(f'{i}\t{a}\t{b}\t{g}\tNEUTRAL\n' for i, (a, b, g) in
                                 enumerate(rows))


def write_tiny_senteval(root: pathlib.Path, sick_test: bool = False, sts12: bool = True,
                        stsb: bool = True, sick: bool = True) -> pathlib.Path:
    """Writes the tiny SentEval folder under `root` (the parts asked for) and returns it."""
    if sts12:
        sts = root / 'STS' / 'STS12-en-test'
        sts.mkdir(parents=True)
        for name, rows in STS12_FILES.items():
            (sts / f'STS.input.{name}.txt').write_text(''.join(f'{a}\t{b}\n' for a, b, _ in rows))
            (sts / f'STS.gs.{name}.txt').write_text(''.join(f'{g}\n' for _, _, g in rows))
        (sts / 'STS.gs.ALL.txt').write_text('1\n2\n')  # no matching input: ignored
        (sts / '00-readme.txt').write_text('readme\n')
    if stsb:
        folder = root / 'STS' / 'STSBenchmark'
        folder.mkdir(parents=True)
        for split, rows in STSB.items():
            (folder / f'sts-{split}.csv').write_text(''.join(
                f'main-captions\tMSRvid\t2012test\t{i:04d}\t{g:.3f}\t{a}\t{b}\n'
                for i, (a, b, g) in enumerate(rows)))
    if sick:
        folder = root / 'SICK'
        folder.mkdir(parents=True)
        (folder / 'SICK_trial.txt').write_text(_sick(SICK_TRIAL))
        (folder / 'SICK_train.txt').write_text(_sick(SICK_TRAIN))
    if sick_test:
        (root / 'SICK').mkdir(parents=True, exist_ok=True)
        (root / 'SICK' / 'SICK_test_annotated.txt').write_text(_sick(SICK_TEST))
    return root


def fake_vector(sentence: str) -> np.ndarray:
    """'anchor' -> [1, 0]; 'cos C ...' -> [C, sqrt(1 - C^2)], so cosine(anchor, it) = C."""
    if sentence == 'anchor':
        return np.array([1.0, 0.0])
    c = float(sentence.split()[1])
    return np.array([c, math.sqrt(1.0 - c * c)])


class CountingEncoder:
    """A fake encode_fn (sentences -> fake_vector rows) recording every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, sentences):
        self.calls.append(list(sentences))
        return np.stack([fake_vector(s) for s in sentences]).astype(np.float32)
