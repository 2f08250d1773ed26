"""Readers: the one sentence-file reader, NLI CSV, SNLI triplets, corpora, TFDS."""
from __future__ import annotations

import subprocess
import sys

import pytest

from jaxsim.data import readers, sources
from jaxsim.data.readers import DataError
from jaxsim.errors import JaxsimError
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S


def test_read_sentences_rule(tmp_path):
    f = tmp_path / 'c.txt'
    # BOM dropped, '\r\n' line ends, surrounding whitespace stripped, blank lines skipped,
    # inner whitespace and a U+2028 inside a line kept.
    f.write_bytes('\ufeffone  sentence\r\n\n   \n two\u2028half \n\tlast'.encode())
    assert readers.read_sentences(f) == ['one  sentence', 'two\u2028half', 'last']
    assert readers.read_corpus is readers.read_sentences
    assert issubclass(DataError, JaxsimError)


@pytest.mark.parametrize('data, match', [
    (b'ok\n\xff\xfe\n', r'bad\.txt:2: not valid UTF-8'),
    (b'\xef\xbb\xbfok\nstill ok\n\xc3', r'bad\.txt:3: not valid UTF-8'),  # truncated char
    (b'ok\nfine\nnul\x00here\n', r'bad\.txt:3: NUL byte'),
    (b'a\n' + b'x' * (readers.MAX_LINE_CHARS + 1), r'bad\.txt:2: line of 100001 characters'),
    (b'', r'bad\.txt: no sentences'),
    (b'\n  \n\r\n', r'bad\.txt: no sentences'),
])
def test_read_sentences_errors_name_file_and_line(tmp_path, data, match):
    (tmp_path / 'bad.txt').write_bytes(data)
    with pytest.raises(DataError, match=match):
        readers.read_sentences(tmp_path / 'bad.txt')


def test_read_sentences_unreadable_paths(tmp_path):
    with pytest.raises(DataError, match=r'missing\.txt: sentence file not found'):
        readers.read_sentences(tmp_path / 'missing.txt')
    with pytest.raises(DataError, match='is a directory'):
        readers.read_sentences(tmp_path)
    (tmp_path / 'f').write_text('x')
    with pytest.raises(DataError, match='cannot read sentence file'):
        readers.read_sentences(tmp_path / 'f' / 'below')


def test_nli_csv_round_trip_and_malformed_rows(tmp_path):
    rows = [('a man sleeps', 'a person rests', 'a man runs'), ('x, "quoted"', 'y', 'z')]
    path = readers.write_nli_csv(rows, tmp_path / 'nli.csv')
    assert readers.read_nli_csv(path) == rows
    bad = tmp_path / 'bad.csv'
    for text, match in [
            ('sent0,sent1,hard_neg\na,b,c\nd,e\n', r'bad\.csv:3: expected 3 columns'),
            ('sent0,sent1,hard_neg\na,b,c\nd,,f\n', r"bad\.csv:3: empty 'sent1'"),
            ('premise,hypothesis,neg\na,b,c\n', r'bad\.csv:1: header'),
            ('sent0,sent1,hard_neg\n\na,"b\nc",d\n', r'bad\.csv:3: a quoted cell runs over 2'),
            ('sent0,sent1,hard_neg\na,"b"x,c\n', r'bad\.csv:2: malformed CSV'),
            ('sent0,sent1,hard_neg\n', r'bad\.csv: no triplets'),
            ('', r'bad\.csv: empty file')]:
        bad.write_text(text)
        with pytest.raises(DataError, match=match):
            readers.read_nli_csv(bad)


def test_snli_triplets_synthetic(tmp_path):
    (tmp_path / 's1.dev').write_text('p1\np1\np1\np2\np2\np3\n')
    (tmp_path / 's2.dev').write_text('e1\nc1\nn1\ne2\ne2b\nc3\n')
    (tmp_path / 'labels.dev').write_text(
        'entailment\ncontradiction\nneutral\nentailment\nentailment\ncontradiction\n')
    # p2 has no contradiction and p3 no entailment: both dropped.
    assert readers.build_snli_triplets(tmp_path, ['dev']) == [('p1', 'e1', 'c1')]
    (tmp_path / 'labels.dev').write_text('entailment\n')
    with pytest.raises(DataError, match=r'labels\.dev:2: line missing'):
        readers.build_snli_triplets(tmp_path, ['dev'])
    (tmp_path / 'labels.dev').write_text('entailment\ncontradiction\nneutral\nentailment\n'
                                         'entailed\ncontradiction\n')
    with pytest.raises(DataError, match=r"labels\.dev:5: label 'entailed' is not one of"):
        readers.build_snli_triplets(tmp_path, ['dev'])


def test_snli_triplets_real_files():
    snli = SENTEVAL_ROOT / 'SNLI'
    rows = readers.build_snli_triplets(snli, ('dev', 'test'))
    assert 6000 < len(rows) < 7000  # ~one entailment per premise in dev (9842) + test (9824)
    s1 = (snli / 's1.dev').read_text().splitlines()
    s2 = (snli / 's2.dev').read_text().splitlines()
    lab = (snli / 'labels.dev').read_text().splitlines()
    labels = {(a.strip(), b.strip()): c for a, b, c in zip(s1, s2, lab)}
    for p, e, c in rows[:200]:
        assert labels[(p, e)] == 'entailment' and labels[(p, c)] == 'contradiction'


def _sts_sentences(root):
    """Every sentence of the shipped STS12, STS-B and SICK files, read here."""
    out = set()
    for f in (root / 'STS' / 'STS12-en-test').glob('STS.input.*.txt'):
        out.update(x.strip() for line in f.read_text().splitlines() for x in line.split('\t'))
    for f in (root / 'STS' / 'STSBenchmark').glob('*.csv'):
        out.update(x.strip() for line in f.read_text().splitlines()
                   for x in line.split('\t')[5:7])
    for f in (root / 'SICK').glob('SICK_*.txt'):
        out.update(x.strip() for line in f.read_text().splitlines()[1:]
                   for x in line.split('\t')[1:3])
    return out


def test_corpus_from_senteval_excludes_sts_and_dedups():
    sents = readers.collect_corpus(SENTEVAL_ROOT)
    assert len(sents) == len(set(sents)) > 20000
    assert all(len(s.split()) >= 3 for s in sents)
    # No sentence that only the STS/SICK evaluation files hold (a few common ones, e.g.
    # 'A man is running', are in SNLI too and may stay).
    sources = set()
    for rel in readers.CORPUS_FILES:
        sources.update(x.strip() for x in (SENTEVAL_ROOT / rel).read_text().splitlines())
    sts_only = _sts_sentences(SENTEVAL_ROOT) - sources
    assert len(sts_only) > 10000
    assert not sts_only & {part.strip() for s in sents for part in s.split('\t')}
    assert set(sents) <= sources


_TFDS_BUILD = r"""
import sys
import tensorflow_datasets as tfds


class TinyCorpus(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {'train': self._generate_examples()}

    def _generate_examples(self):
        for i, s in enumerate(['a cat sits', '', 'a dog runs']):
            yield i, {'text': s}


TinyCorpus(data_dir=sys.argv[1], file_format='array_record').download_and_prepare()
"""


def test_tfds_source_reads_prepared_array_record_dataset(tmp_path):
    # Built in a subprocess: tfds resolves a builder's module resources, which a test module
    # outside a package does not have; users likewise read a prepared folder, not the code.
    subprocess.run([sys.executable, '-c', _TFDS_BUILD, str(tmp_path)], check=True,
                   capture_output=True, timeout=HANG_GUARD_S)
    folder = tmp_path / 'tiny_corpus' / '1.0.0'
    rows = readers.read_tfds(str(folder), 'train')
    assert sorted(rows) == [('a cat sits',), ('a dog runs',)]  # the empty example is skipped
    with pytest.raises(DataError, match="no field 'sent0'"):
        readers.read_tfds(str(folder), 'train', fields=('sent0',))


def test_an_unknown_tfds_name_is_one_short_line(tmp_path):
    """TFDS's own message for an unknown name lists every dataset it knows (thousands of
    names); the error keeps what went wrong."""
    with pytest.raises(DataError) as caught:
        sources.TfdsSource('no_such_dataset_here', data_dir=str(tmp_path))
    message = str(caught.value)
    assert message.startswith("TFDS 'no_such_dataset_here' split 'train'")
    assert 'DatasetNotFoundError' in message and 'not found' in message
    assert len(message) < 400 and 'mnist' not in message
    with pytest.raises(DataError, match=r'not found\. Did you mean: mnistt -> mnist \?$'):
        sources.TfdsSource('mnistt', data_dir=str(tmp_path))  # its suggestion kept
