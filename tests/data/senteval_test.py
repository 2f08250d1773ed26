"""SentEval STS readers: SentEval's subsets, empty gold lines, per-file roots, bad input."""
from __future__ import annotations

import numpy as np
import pytest

from jaxsim.data import senteval
from jaxsim.errors import JaxsimError
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.data.tiny_senteval import SICK_TEST, STSB, write_tiny_senteval


def test_sts12_subsets_drop_empty_gold_and_normalize_space(tmp_path):
    task = senteval.load_sts_task('sts12', write_tiny_senteval(tmp_path))
    assert task.name == 'STS12' and task.split == 'test'
    assert list(task.subsets) == ['MSRpar', 'MSRvid']  # STS.gs.ALL.txt has no input
    b = task.subsets['MSRvid']
    assert b.sent2 == ['cos 0.2 b', 'cos 0.8 b', 'cos 0.4 b']  # empty-gold pair dropped
    np.testing.assert_array_equal(b.gold, [2.0, 5.0, 2.0])
    assert task.num_pairs == 7
    assert len(task.files) == 4 and all(h.startswith('sha256:') for h in task.files.values())
    assert set(task.sources.values()) == {str(tmp_path)} and task.roots == (str(tmp_path),)
    # The three other SentEval STS12 subsets are absent: scored anyway, with a note.
    assert any('SMTeuroparl, surprise.OnWN, surprise.SMTnews not found' in n and
               'scored on 2 of 5' in n for n in task.notes)


def test_only_senteval_subsets_are_scored_others_are_reported(tmp_path):
    root = write_tiny_senteval(tmp_path)
    folder = root / 'STS' / 'STS12-en-test'
    (folder / 'STS.input.SMT.txt').write_text('anchor\tcos 0.3 z\nanchor\tcos 0.6 z\n')
    (folder / 'STS.gs.SMT.txt').write_text('1\n2\n')
    task = senteval.load_sts_task('sts12', root)
    assert list(task.subsets) == ['MSRpar', 'MSRvid']
    assert not any('SMT.txt' in f for f in task.files)
    assert any('STS.input.SMT.txt not scored' in n and 'MSRpar, MSRvid' in n for n in task.notes)
    # A folder holding none of the year's subsets is an error naming them.
    sts13 = root / 'STS' / 'STS13-en-test'
    sts13.mkdir()
    (sts13 / 'STS.input.SMT.txt').write_text('a\tb\n')
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r"STS13: none of SentEval's subsets \(FNWN, headlines, OnWN\)"):
        senteval.load_sts_task('sts13', root)


def test_subset_lists_are_sentevals():
    assert senteval.STS_SUBSETS['sts13'] == ('FNWN', 'headlines', 'OnWN')  # no SMT
    assert len(senteval.STS_SUBSETS['sts14']) == 6
    assert senteval.STS_SUBSETS['sts16'][-1] == 'question-question'


def test_stsb_splits_and_sick_fallback(tmp_path):
    root = write_tiny_senteval(tmp_path)
    for split, rows in STSB.items():
        pairs = senteval.load_stsb(root, split)
        assert pairs.sent2 == [b for _, b, _ in rows]
        np.testing.assert_allclose(pairs.gold, [g for _, _, g in rows])
    sick = senteval.load_sts_task('sickr', root)
    assert list(sick.subsets) == ['trial']
    assert 'SICK_test_annotated.txt not found' in sick.notes[0]
    with pytest.raises(senteval.SentEvalFormatError, match='SICK_test_annotated.txt not found'):
        senteval.load_sts_task('sickr', root, fallback=False)
    assert senteval.has_task('sickr', root) and not senteval.has_split('sickr', 'test', root)


def test_sick_test_file_preferred(tmp_path):
    sick = senteval.load_sts_task('sickr', write_tiny_senteval(tmp_path, sick_test=True))
    assert list(sick.subsets) == ['test'] and not sick.notes
    assert sick.subsets['test'].sent2[1] == 'cos 0.7 k'


def test_files_resolved_per_file_across_roots(tmp_path):
    """Root A: SICK train/trial, STS-B, STS12 MSRpar; root B: SICK test, STS12 MSRvid."""
    a = write_tiny_senteval(tmp_path / 'a')
    b = tmp_path / 'b'
    write_tiny_senteval(b, sick_test=True, sts12=True, stsb=False, sick=False)
    (a / 'STS' / 'STS12-en-test' / 'STS.input.MSRvid.txt').unlink()
    (b / 'STS' / 'STS12-en-test' / 'STS.input.MSRpar.txt').unlink()
    sick = senteval.load_sts_task('sickr', [a, b])
    assert list(sick.subsets) == ['test'] and not sick.notes  # a test file anywhere wins
    assert sick.sources == {'SICK/SICK_test_annotated.txt': str(b)}
    assert sick.subsets['test'].sent2 == [s for _, s, _ in SICK_TEST]
    sts12 = senteval.load_sts_task('sts12', [a, b])
    assert list(sts12.subsets) == ['MSRpar', 'MSRvid'] and sts12.roots == (str(a), str(b))
    assert sts12.sources['STS/STS12-en-test/STS.input.MSRvid.txt'] == str(b)
    # Earlier roots win when both hold a file.
    assert senteval.load_sts_task('sickr', [a, b], split='dev').roots == (str(a),)
    assert senteval.load_sts_task('stsb', [b, a]).roots == (str(a),)


def test_missing_task_and_split_errors(tmp_path):
    empty = tmp_path / 'empty'
    empty.mkdir()
    root = write_tiny_senteval(tmp_path / 'full')
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r'STS13: no task folder found; looked for .*STS13-en-test'):
        senteval.load_sts_task('sts13', [empty, root])
    (root / 'STS' / 'STSBenchmark' / 'sts-test.csv').unlink()
    with pytest.raises(senteval.SentEvalFormatError, match=r'sts-test\.csv not found'):
        senteval.load_sts_task('stsb', [empty, root])
    with pytest.raises(JaxsimError, match='unknown STS task'):
        senteval.load_sts_task('sts99', root)
    with pytest.raises(JaxsimError, match='only a test split'):
        senteval.load_sts_task('sts12', root, split='dev')


def test_file_hash_changes_with_content(tmp_path):
    root = write_tiny_senteval(tmp_path)
    h1 = senteval.load_sts_task('stsb', root).files
    path = root / 'STS' / 'STSBenchmark' / 'sts-test.csv'
    path.write_text(path.read_text().replace('4.500', '4.400'))
    h2 = senteval.load_sts_task('stsb', root).files
    key = 'STS/STSBenchmark/sts-test.csv'
    assert h1.keys() == h2.keys() == {key} and h1[key] != h2[key]


@pytest.mark.parametrize('relpath, line, text, match', [
    ('STS/STS12-en-test/STS.input.MSRpar.txt', 3, 'only one column\n',
     r'STS\.input\.MSRpar\.txt:3: expected 2'),
    ('STS/STS12-en-test/STS.gs.MSRvid.txt', 3, 'five\n',
     r"STS\.gs\.MSRvid\.txt:3: non-numeric score 'five'"),
    ('STS/STS12-en-test/STS.gs.MSRvid.txt', 1, 'nan\n',
     r'STS\.gs\.MSRvid\.txt:1: score .* not finite'),
    ('STS/STSBenchmark/sts-test.csv', 2, 'a\tb\tc\n', r'sts-test\.csv:2: expected 7'),
    ('STS/STSBenchmark/sts-test.csv', 1, 'g\tf\ty\t1\tx\ts1\ts2\n',
     r'sts-test\.csv:1: non-numeric'),
    ('SICK/SICK_trial.txt', 3, '1\ta\tb\tc\n', r'SICK_trial\.txt:3: expected 5'),
    ('SICK/SICK_trial.txt', 1, 'id\ta\tb\tc\td\n', r'SICK_trial\.txt:1: expected the SICK header'),
    ('STS/STS12-en-test/STS.input.MSRpar.txt', 2, 'anchor\t  \n',
     r'STS\.input\.MSRpar\.txt:2: empty sent'),
])
def test_malformed_lines_name_file_and_line(tmp_path, relpath, line, text, match):
    root = write_tiny_senteval(tmp_path)
    path = root / relpath
    lines = path.read_text().splitlines(keepends=True)
    lines[line - 1] = text
    path.write_text(''.join(lines))
    task = {'STS12-en-test': 'sts12', 'STSBenchmark': 'stsb', 'SICK': 'sickr'}[path.parent.name]
    with pytest.raises(senteval.SentEvalFormatError, match=match):
        senteval.load_sts_task(task, root, split='dev' if task == 'sickr' else 'test')


def test_undecodable_bytes_nul_and_line_mismatch_are_errors(tmp_path):
    root = write_tiny_senteval(tmp_path)
    path = root / 'STS' / 'STS12-en-test' / 'STS.input.MSRpar.txt'
    original = path.read_bytes()
    path.write_bytes(original.replace(b'cos 0.5 b', b'cos 0.5 \xff'))
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r'STS\.input\.MSRpar\.txt:3: not valid UTF-8'):
        senteval.load_sts_task('sts12', root)
    path.write_bytes(original.replace(b'cos 0.9', b'cos\x000.9'))
    with pytest.raises(senteval.SentEvalFormatError, match=r'MSRpar\.txt:4: NUL byte'):
        senteval.load_sts_task('sts12', root)
    path.write_text('anchor\tx\n')
    with pytest.raises(senteval.SentEvalFormatError,
                       match=r'STS\.input\.MSRpar\.txt:2: line missing; .* has 1 lines and '
                             r'STS\.gs\.MSRpar\.txt 4'):
        senteval.load_sts_task('sts12', root)


def test_load_sentences_is_the_sentence_file_reader(tmp_path):
    f = tmp_path / 'c.txt'
    f.write_text('  a   b \n\n\tc\r\n')
    assert senteval.load_sentences(f) == ['a b', 'c']
    (tmp_path / 'e.txt').write_text('\n \n')
    with pytest.raises(JaxsimError, match=r'e\.txt: no sentences'):
        senteval.load_sentences(tmp_path / 'e.txt')


def test_shipped_data_sizes():
    # SentEval's counts: STS12 'all' has 3108 scored pairs; STS-B test 1379; SICK trial 500.
    assert senteval.load_sts_task('sts12', SENTEVAL_ROOT).num_pairs == 3108
    assert len(senteval.load_stsb(SENTEVAL_ROOT, 'test')) == 1379
    assert len(senteval.load_stsb(SENTEVAL_ROOT, 'dev')) == 1500
    assert senteval.load_sts_task('sickr', SENTEVAL_ROOT).num_pairs == 500
