"""SentEval-format readers: layout, empty gold lines, several roots, and bad input."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jaxsim.data import senteval

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'senteval'

# A tiny SentEval folder. Sentences 'cos C ...' are decoded by the fake encoders of
# sts_test.py into 2-d vectors whose cosine with 'anchor' is C.
STS12_A = [('anchor', 'cos 0.1 a', '1'), ('anchor', 'cos 0.5 a', '2'),
           ('anchor', 'cos 0.5 b', '3'), ('anchor', 'cos 0.9 a', '4')]
STS12_B = [('anchor', 'cos 0.2 b', '2'), ('anchor', 'cos 0.7 b', ''),  # no gold: dropped
           ('anchor', 'cos 0.8 b', '5.0'), ('anchor', ' cos  0.4   b ', '2.000')]
STSB = {
    'train': [('anchor', 'cos 0.3 t', 1.0), ('anchor', 'cos 0.6 t', 3.0)],
    'dev': [('anchor', 'cos 0.2 d', 1.0), ('anchor', 'cos 0.6 d', 4.5),
            ('anchor', 'cos 0.4 d', 4.2)],
    'test': [('anchor', 'cos 0.1 s', 0.5), ('anchor', 'cos 0.3 s', 4.5),
             ('anchor', 'cos 0.2 s', 4.8), ('anchor', 'cos 0.9 s', 4.1)],
}
SICK_TRIAL = [('anchor', 'cos 0.1 k', 1.5), ('anchor', 'cos 0.6 k', 3.0),
              ('anchor', 'cos 0.3 k', 4.0)]


def write_tiny_senteval(root: pathlib.Path, sick_test: bool = False) -> pathlib.Path:
    """Writes the tiny SentEval folder under `root` and returns it."""
    sts = root / 'STS' / 'STS12-en-test'
    sts.mkdir(parents=True)
    for name, rows in (('A', STS12_A), ('B', STS12_B)):
        (sts / f'STS.input.{name}.txt').write_text(''.join(f'{a}\t{b}\n' for a, b, _ in rows))
        (sts / f'STS.gs.{name}.txt').write_text(''.join(f'{g}\n' for _, _, g in rows))
    (sts / 'STS.gs.ALL.txt').write_text('1\n2\n')  # No matching input: must be ignored.
    (sts / '00-readme.txt').write_text('readme\n')
    stsb = root / 'STS' / 'STSBenchmark'
    stsb.mkdir(parents=True)
    for split, rows in STSB.items():
        (stsb / f'sts-{split}.csv').write_text(''.join(
            f'main-captions\tMSRvid\t2012test\t{i:04d}\t{g:.3f}\t{a}\t{b}\n'
            for i, (a, b, g) in enumerate(rows)))
    sick = root / 'SICK'
    sick.mkdir()
    header = 'pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n'
    body = ''.join(f'{i}\t{a}\t{b}\t{g}\tNEUTRAL\n' for i, (a, b, g) in enumerate(SICK_TRIAL))
    (sick / 'SICK_trial.txt').write_text(header + body)
    (sick / 'SICK_train.txt').write_text(header + body)
    if sick_test:
        (sick / 'SICK_test_annotated.txt').write_text(header + body.replace('NEUTRAL', 'X')
                                                      .replace('cos 0.6 k', 'cos 0.7 k'))
    return root


def test_sts12_subsets_drop_empty_gold_and_normalize_space(tmp_path):
    task = senteval.load_sts_task('sts12', write_tiny_senteval(tmp_path))
    assert task.name == 'STS12'
    assert sorted(task.subsets) == ['A', 'B']  # STS.gs.ALL.txt has no input: not a subset
    b = task.subsets['B']
    assert b.sent2 == ['cos 0.2 b', 'cos 0.8 b', 'cos 0.4 b']  # empty-gold pair dropped
    np.testing.assert_array_equal(b.gold, [2.0, 5.0, 2.0])
    assert task.num_pairs == 7
    assert len(task.files) == 4 and all(h.startswith('sha256:') for h in task.files.values())


def test_stsb_splits_and_sick_fallback(tmp_path, capsys):
    root = write_tiny_senteval(tmp_path)
    for split, rows in STSB.items():
        pairs = senteval.load_stsb(root, split)
        assert pairs.sent2 == [b for _, b, _ in rows]
        np.testing.assert_allclose(pairs.gold, [g for _, _, g in rows])
    sick = senteval.load_sts_task('sickr', root)
    assert list(sick.subsets) == ['trial']
    assert 'SICK_test_annotated.txt not found' in sick.notes[0]
    assert 'SICK_test_annotated.txt not found' in capsys.readouterr().err


def test_sick_test_file_preferred(tmp_path):
    sick = senteval.load_sts_task('sickr', write_tiny_senteval(tmp_path, sick_test=True))
    assert list(sick.subsets) == ['test'] and not sick.notes
    assert sick.subsets['test'].sent2[1] == 'cos 0.7 k'


def test_task_found_in_whichever_root_holds_it(tmp_path):
    empty = tmp_path / 'empty'
    empty.mkdir()
    root = write_tiny_senteval(tmp_path / 'full')
    task = senteval.load_sts_task('STSBenchmark', [empty, root])
    assert task.root == str(root) and list(task.files) == ['STS/STSBenchmark/sts-test.csv']
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r'STS13: no task folder found; looked for .*STS13-en-test'):
        senteval.load_sts_task('sts13', [empty, root])


def test_file_hash_changes_with_content(tmp_path):
    root = write_tiny_senteval(tmp_path)
    h1 = senteval.load_sts_task('stsb', root).files
    path = root / 'STS' / 'STSBenchmark' / 'sts-test.csv'
    path.write_text(path.read_text().replace('4.500', '4.400'))
    h2 = senteval.load_sts_task('stsb', root).files
    key = 'STS/STSBenchmark/sts-test.csv'
    assert h1.keys() == h2.keys() and h1[key] != h2[key]


@pytest.mark.parametrize('relpath, line, text, match', [
    ('STS/STS12-en-test/STS.input.A.txt', 3, 'only one column\n',
     r'STS\.input\.A\.txt:3: expected 2'),
    ('STS/STS12-en-test/STS.gs.B.txt', 3, 'five\n', r"STS\.gs\.B\.txt:3: non-numeric score 'five'"),
    ('STS/STS12-en-test/STS.gs.B.txt', 1, 'nan\n', r'STS\.gs\.B\.txt:1: score .* not finite'),
    ('STS/STSBenchmark/sts-test.csv', 2, 'a\tb\tc\n', r'sts-test\.csv:2: expected 7'),
    ('STS/STSBenchmark/sts-test.csv', 1, 'g\tf\ty\t1\tx\ts1\ts2\n',
     r"sts-test\.csv:1: non-numeric"),
    ('SICK/SICK_trial.txt', 3, '1\ta\tb\tc\n', r'SICK_trial\.txt:3: expected 5'),
    ('STS/STS12-en-test/STS.input.A.txt', 2, 'anchor\t  \n', r'STS\.input\.A\.txt:2: empty sent'),
])
def test_malformed_lines_name_file_and_line(tmp_path, relpath, line, text, match):
    root = write_tiny_senteval(tmp_path)
    path = root / relpath
    lines = path.read_text().splitlines(keepends=True)
    lines[line - 1] = text
    path.write_text(''.join(lines))
    task = {'STS12-en-test': 'sts12', 'STSBenchmark': 'stsb', 'SICK': 'sickr'}[path.parent.name]
    with pytest.raises(senteval.SentEvalFormatError, match=match):
        senteval.load_sts_task(task, root)


def test_undecodable_bytes_and_line_mismatch_are_errors(tmp_path):
    root = write_tiny_senteval(tmp_path)
    path = root / 'STS' / 'STS12-en-test' / 'STS.input.A.txt'
    path.write_bytes(path.read_bytes().replace(b'cos 0.5 b', b'cos 0.5 \xff'))
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r'STS\.input\.A\.txt:3: .*not valid UTF-8'):
        senteval.load_sts_task('sts12', root)
    path.write_text('anchor\tx\n')
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r'has 1 lines but .*STS\.gs\.A\.txt has 4'):
        senteval.load_sts_task('sts12', root)


def test_unknown_task_and_split():
    with pytest.raises(ValueError, match='unknown STS task'):
        senteval.load_sts_task('sts99', SHIPPED)
    with pytest.raises(ValueError, match='only a test split'):
        senteval.load_sts_task('sts12', SHIPPED, split='dev')


def test_shipped_data_sizes():
    # SentEval's counts: STS12 'all' has 3108 scored pairs; STS-B test 1379; SICK trial 500.
    assert senteval.load_sts_task('sts12', SHIPPED).num_pairs == 3108
    assert len(senteval.load_stsb(SHIPPED, 'test')) == 1379
    assert len(senteval.load_stsb(SHIPPED, 'dev')) == 1500
    assert senteval.load_sts_task('sickr', SHIPPED, verbose=False).num_pairs == 500
