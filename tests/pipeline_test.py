"""Data pipeline: readers, SNLI triplets, tokenization, the resumable per-process iterator."""
from pathlib import Path

import numpy as np
import pytest

from jaxsim.data import pipeline
from jaxsim.paths import SENTEVAL_ROOT as SENTEVAL

if not SENTEVAL.is_dir():
    SENTEVAL = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'senteval'


def test_read_corpus_skips_blank_lines(tmp_path):
    f = tmp_path / 'c.txt'
    f.write_text('one sentence\n\n   \ntwo sentence \n')
    assert pipeline.read_corpus(f) == ['one sentence', 'two sentence']


def test_read_corpus_errors_name_the_file(tmp_path):
    with pytest.raises(pipeline.DataError, match='missing.txt: corpus file not found'):
        pipeline.read_corpus(tmp_path / 'missing.txt')
    (tmp_path / 'blank.txt').write_text('\n\n')
    with pytest.raises(pipeline.DataError, match='blank.txt: no sentences'):
        pipeline.read_corpus(tmp_path / 'blank.txt')
    (tmp_path / 'bad.txt').write_bytes(b'ok\n\xff\xfe\n')
    with pytest.raises(pipeline.DataError, match=r'bad.txt:2: not valid UTF-8'):
        pipeline.read_corpus(tmp_path / 'bad.txt')


def test_nli_csv_round_trip_and_malformed_rows(tmp_path):
    rows = [('a man sleeps', 'a person rests', 'a man runs'), ('x, "quoted"', 'y', 'z')]
    path = pipeline.write_nli_csv(rows, tmp_path / 'nli.csv')
    assert pipeline.read_nli_csv(path) == rows
    bad = tmp_path / 'bad.csv'
    bad.write_text('sent0,sent1,hard_neg\na,b,c\nd,e\n')
    with pytest.raises(pipeline.DataError, match=r'bad.csv:3: expected 3 columns'):
        pipeline.read_nli_csv(bad)
    bad.write_text('sent0,sent1,hard_neg\na,b,c\nd,,f\n')
    with pytest.raises(pipeline.DataError, match=r"bad.csv:3: empty 'sent1'"):
        pipeline.read_nli_csv(bad)
    bad.write_text('premise,hypothesis,neg\na,b,c\n')
    with pytest.raises(pipeline.DataError, match=r'bad.csv:1: header'):
        pipeline.read_nli_csv(bad)


def test_snli_triplets_synthetic(tmp_path):
    (tmp_path / 's1.dev').write_text('p1\np1\np1\np2\np2\np3\n')
    (tmp_path / 's2.dev').write_text('e1\nc1\nn1\ne2\ne2b\nc3\n')
    (tmp_path / 'labels.dev').write_text(
        'entailment\ncontradiction\nneutral\nentailment\nentailment\ncontradiction\n')
    # p2 has no contradiction and p3 no entailment: both dropped.
    assert pipeline.build_snli_triplets(tmp_path, ['dev']) == [('p1', 'e1', 'c1')]
    (tmp_path / 'labels.dev').write_text('entailment\n')
    with pytest.raises(pipeline.DataError, match='different line counts'):
        pipeline.build_snli_triplets(tmp_path, ['dev'])


def test_snli_triplets_real_files():
    snli = SENTEVAL / 'SNLI'
    rows = pipeline.build_snli_triplets(snli, ('dev', 'test'))
    assert 6000 < len(rows) < 7000  # ~one entailment per premise in dev (9842) + test (9824)
    s1 = (snli / 's1.dev').read_text().splitlines()
    s2 = (snli / 's2.dev').read_text().splitlines()
    lab = (snli / 'labels.dev').read_text().splitlines()
    labels = {(a.strip(), b.strip()): c for a, b, c in zip(s1, s2, lab)}
    for p, e, c in rows[:200]:
        assert labels[(p, e)] == 'entailment' and labels[(p, c)] == 'contradiction'


def test_corpus_from_senteval_excludes_sts_and_dedups():
    sents = pipeline.collect_corpus(SENTEVAL)
    assert len(sents) == len(set(sents)) > 20000
    assert all(len(s.split()) >= 3 for s in sents)


class _FakeTokenizer:
    """Whitespace tokenizer with [CLS]=101/[SEP]=102 and pad 0, like BERT's fast tokenizer."""

    def __call__(self, sentences, max_length, truncation, padding, return_overflowing_tokens):
        ids, mask = [], []
        for s in sentences:
            t = [101] + [1000 + len(w) for w in s.split()][:max_length - 2] + [102]
            ids.append(t + [0] * (max_length - len(t)))
            mask.append([1] * len(t) + [0] * (max_length - len(t)))
        return {'input_ids': ids, 'attention_mask': mask}


def test_tokenize_fixed_length_truncates_and_rejects_empty():
    tok = pipeline.tokenize_examples(_FakeTokenizer(), [('a b', 'c', 'd e f g h i j k l')], 6)
    assert tok['input_ids'].shape == (1, 3, 6) and tok['input_ids'].dtype == np.int32
    assert tok['attention_mask'][0, 2].tolist() == [1] * 6  # truncated, ends with [SEP]
    assert tok['input_ids'][0, 2, -1] == 102
    assert tok['token_type_ids'].sum() == 0
    with pytest.raises(pipeline.DataError, match='sentence 1 is empty'):
        pipeline.tokenize_examples(_FakeTokenizer(), ['ok', ' '], 6)


def _arrays(n=50):
    return {'x': np.arange(n)[:, None].repeat(2, 1)}


def test_iterator_is_deterministic_and_covers_each_epoch():
    a = pipeline.BatchIterator(_arrays(), 8, seed=3)
    b = pipeline.BatchIterator(_arrays(), 8, seed=3)
    epoch0 = [next(a)['x'][:, 0] for _ in range(a.steps_per_epoch)]
    for got in epoch0:
        np.testing.assert_array_equal(got, next(b)['x'][:, 0])
    seen = np.concatenate(epoch0)
    assert len(set(seen.tolist())) == 48  # 6 full batches, no repeats; remainder dropped
    nxt = next(a)['x'][:, 0]  # epoch 1 is a different permutation
    assert a.get_state() == {'epoch': 1, 'step': 1}
    assert not np.array_equal(nxt, epoch0[0])
    c = pipeline.BatchIterator(_arrays(), 8, seed=4)
    assert not np.array_equal(next(c)['x'], epoch0[0])


def test_iterator_state_round_trip_resumes_exactly():
    a = pipeline.BatchIterator(_arrays(), 8, seed=0)
    for _ in range(9):
        next(a)
    state = a.get_state()
    want = [next(a)['x'] for _ in range(5)]
    b = pipeline.BatchIterator(_arrays(), 8, seed=0)
    b.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(b)['x'], w)


def test_process_blocks_tile_the_global_batch():
    full = pipeline.BatchIterator(_arrays(), 8, seed=1)
    parts = [pipeline.BatchIterator(_arrays(), 8, seed=1, process_index=i, process_count=4)
             for i in range(4)]
    for _ in range(7):
        glob = next(full)['x']
        locs = [next(p)['x'] for p in parts]
        assert all(len(x) == 2 for x in locs)
        np.testing.assert_array_equal(np.concatenate(locs), glob)


def test_iterator_refuses_bad_sizes():
    with pytest.raises(ValueError, match='not divisible by the 3 processes'):
        pipeline.BatchIterator(_arrays(), 8, process_count=3)
    with pytest.raises(pipeline.DataError, match='cannot fill one global batch'):
        pipeline.BatchIterator(_arrays(5), 8)


_TFDS_BUILD = """
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
    import subprocess
    import sys
    subprocess.run([sys.executable, '-c', _TFDS_BUILD, str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    folder = tmp_path / 'tiny_corpus' / '1.0.0'
    rows = pipeline.read_tfds(str(folder), 'train')
    assert sorted(rows) == [('a cat sits',), ('a dog runs',)]  # the empty example is skipped
    with pytest.raises(pipeline.DataError, match="no field 'sent0'"):
        pipeline.read_tfds(str(folder), 'train', fields=('sent0',))
