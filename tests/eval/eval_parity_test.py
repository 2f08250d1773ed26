"""eval.py's scores on all-MiniLM-L6-v2 equal sentence-transformers + scipy within 0.05 points.

The reference side shares no code with jaxsim: it parses the SentEval files itself, encodes
with sentence-transformers (PyTorch, mean pooling as the model folder declares), and scores
with numpy cosine + scipy.stats.spearmanr, following SentEval/SimCSE. Both read the first
lines of each shipped file (about 300 pairs a task, STS12 split over its five subsets): the
parsing, encoding and scoring paths are the same as on the whole files, at a sixth of the
encoding.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.stats

from jaxsim import bundled_model_path
from jaxsim.eval import runner
from jaxsim.storage.paths import SENTEVAL_ROOT as DATA

STS12_SUBSETS = ('MSRpar', 'MSRvid', 'SMTeuroparl', 'surprise.OnWN', 'surprise.SMTnews')


PAIRS_PER_FILE = {'STS12': 60, 'STSBenchmark': 300, 'SICKRelatedness': 300}


def write_head_of_data(root: Path) -> Path:
    """The first lines of each shipped STS12 subset, STS-B test and SICK trial under `root`."""
    sts12 = root / 'STS' / 'STS12-en-test'
    sts12.mkdir(parents=True)
    for sub in STS12_SUBSETS:
        for kind in ('input', 'gs'):
            src = DATA / 'STS' / 'STS12-en-test' / f'STS.{kind}.{sub}.txt'
            lines = src.read_bytes().split(b'\n')[:PAIRS_PER_FILE['STS12']]
            (sts12 / src.name).write_bytes(b'\n'.join(lines) + b'\n')
    stsb = root / 'STS' / 'STSBenchmark'
    stsb.mkdir(parents=True)
    src = DATA / 'STS' / 'STSBenchmark' / 'sts-test.csv'
    lines = src.read_bytes().split(b'\n')[:PAIRS_PER_FILE['STSBenchmark']]
    (stsb / src.name).write_bytes(b'\n'.join(lines) + b'\n')
    (root / 'SICK').mkdir()
    src = DATA / 'SICK' / 'SICK_trial.txt'
    lines = src.read_bytes().split(b'\n')[:PAIRS_PER_FILE['SICKRelatedness'] + 1]  # + header
    (root / 'SICK' / src.name).write_bytes(b'\n'.join(lines) + b'\n')
    return root


def reference_pairs(data: Path) -> dict[str, tuple[list[str], list[str], list[float]]]:
    """Task -> (sent1, sent2, gold), read the way SentEval does (its STS12 subset list)."""
    out = {}
    s1, s2, gold = [], [], []
    for sub in STS12_SUBSETS:
        d = data / 'STS' / 'STS12-en-test'
        inputs = (d / f'STS.input.{sub}.txt').read_text(encoding='utf-8').split('\n')
        scores = (d / f'STS.gs.{sub}.txt').read_text(encoding='utf-8').split('\n')
        for line, g in zip(inputs, scores):
            if g.strip():
                a, b = line.split('\t')
                s1.append(a)
                s2.append(b)
                gold.append(float(g))
    out['STS12'] = (s1, s2, gold)
    text = (data / 'STS' / 'STSBenchmark' / 'sts-test.csv').read_text(encoding='utf-8')
    rows = [ln.split('\t') for ln in text.splitlines()]
    out['STSBenchmark'] = ([r[5] for r in rows], [r[6] for r in rows], [float(r[4]) for r in rows])
    rows = [ln.split('\t') for ln in
            (data / 'SICK' / 'SICK_trial.txt').read_text(encoding='utf-8').splitlines()[1:]]
    out['SICKRelatedness'] = (
        [r[1] for r in rows], [r[2] for r in rows], [float(r[3]) for r in rows])
    return out


def test_scores_match_sentence_transformers(tmp_path):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    data = write_head_of_data(tmp_path / 'data')
    pairs = reference_pairs(data)
    st = SentenceTransformer(str(bundled_model_path()), device='cpu')
    assert st.max_seq_length == 256
    unique = list(dict.fromkeys(s for a, b, _ in pairs.values() for s in a + b))
    vecs = dict(zip(unique, st.encode(unique, batch_size=64, convert_to_numpy=True)))
    expected = {}
    for task, (a, b, gold) in pairs.items():
        ea = np.stack([vecs[s] for s in a]).astype(np.float64)
        eb = np.stack([vecs[s] for s in b]).astype(np.float64)
        cos = (ea * eb).sum(1) / (np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1))
        expected[task] = 100 * scipy.stats.spearmanr(cos, gold)[0]
    assert [len(pairs[t][2]) for t in PAIRS_PER_FILE] == [300, 300, 300]

    # Same token limit as the sentence-transformers folder (256), mean pooling.
    (row,) = runner.run([str(bundled_model_path())], [data], ['sts12', 'stsb', 'sickr'],
                        pooler='avg', max_length=256, diagnostics=False)
    got = row.tasks
    assert row.aggregate == 'all' and set(got) == set(expected)
    for task in expected:
        assert abs(got[task] - expected[task]) < 0.05, (task, got[task], expected[task])
    # Sanity: the bundled model is a strong STS model, not a broken one scoring near 0.
    assert expected['STSBenchmark'] > 75
    print({t: (round(got[t], 4), round(expected[t], 4)) for t in expected})
