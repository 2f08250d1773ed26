"""The streamed input: the same global batches for any process count, the batches of the
in-memory path, an exact resume from a saved position, a digest that tokenizes nothing, and a
TFDS ArrayRecord source."""
import subprocess
import sys

import numpy as np
import pytest

from jaxsim import bundled_model_path
from jaxsim.data import batching, index, pipeline, readers, sources
from jaxsim.data.readers import DataError
from jaxsim.formats.hf_folder import load_tokenizer
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S

MAX_LEN = 12


@pytest.fixture(autouse=True)
def index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv('JAXSIM_INDEX_DIR', str(tmp_path / 'index-cache'))


@pytest.fixture(scope='module')
def tokenizer():
    return load_tokenizer(bundled_model_path())


@pytest.fixture
def corpus(tmp_path):
    lines = (SENTEVAL_ROOT / 'SNLI' / 's1.dev').read_text().splitlines()[:101]
    path = tmp_path / 'corpus.txt'
    path.write_text('\n\n'.join(lines) + '\n')  # blank lines between: skipped by both paths
    return path


def _stream(corpus, tokenizer, **kwargs):
    kwargs = {'seed': 5, **kwargs}
    return pipeline.StreamIterator(sources.TextSource(corpus), tokenizer, MAX_LEN, 8, **kwargs)


def _take(it, n):
    out = [next(it) for _ in range(n)]
    it.close()
    return out


@pytest.mark.parametrize('last_batch', ['drop', 'keep'])
def test_stream_yields_the_batches_of_the_in_memory_path(corpus, tokenizer, last_batch):
    arrays = batching.tokenize_examples(tokenizer, readers.read_sentences(corpus), MAX_LEN)
    ref = batching.BatchIterator(arrays, 8, seed=5, last_batch=last_batch, granularity=2)
    it = _stream(corpus, tokenizer, last_batch=last_batch, granularity=2)
    assert (it.num_examples, it.steps_per_epoch) == (101, ref.steps_per_epoch)
    for got in _take(it, 2 * ref.steps_per_epoch + 3):  # across two epoch boundaries
        want = next(ref)
        assert set(got) == set(batching.FIELDS)
        for k in batching.FIELDS:
            np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize('processes', [2, 4])
def test_processes_rows_tile_the_global_batches_of_one_process(corpus, tokenizer, processes):
    whole = _take(_stream(corpus, tokenizer, last_batch='keep', granularity=4), 30)
    parts = [_take(_stream(corpus, tokenizer, process_index=i, process_count=processes,
                           last_batch='keep', granularity=4), 30) for i in range(processes)]
    for step, glob in enumerate(whole):
        local = [p[step]['input_ids'] for p in parts]
        assert all(len(x) == len(glob['input_ids']) // processes for x in local)
        np.testing.assert_array_equal(np.concatenate(local), glob['input_ids'])


def test_mesh_rows_keep_the_last_batch_of_one_process(corpus, tokenizer):
    # Two processes holding the same rows (a tensor axis across them, one batch shard): the
    # kept last batch is rounded to the batch shards only, as with one process (101 = 12 x 8 + 5).
    whole = _stream(corpus, tokenizer, last_batch='keep')
    both = [_stream(corpus, tokenizer, last_batch='keep', process_count=2,
                    rows_fn=lambda size: np.arange(size)) for _ in range(2)]
    assert whole.order.last_size == both[0].order.last_size == 5
    last = whole.steps_per_epoch
    want = _take(whole, last)[-1]['input_ids']
    for it in both:
        np.testing.assert_array_equal(_take(it, last)[-1]['input_ids'], want)


def test_order_depends_on_seed_epoch_and_position_only():
    # Device counts change only the size of a kept last batch: the full batches never move.
    a = batching.EpochOrder(1000, 64, seed=3, granularity=1)
    b = batching.EpochOrder(1000, 64, seed=3, granularity=8, process_count=4)
    rows = np.arange(64)
    for epoch in range(3):
        perm = np.concatenate([a.examples(epoch, s, rows) for s in range(a.full_batches)]
                              + [a.examples(epoch, a.full_batches, np.arange(1000 % 64))])
        assert sorted(perm.tolist()) == list(range(1000))  # each epoch a permutation
        for s in range(a.full_batches):
            np.testing.assert_array_equal(a.examples(epoch, s, rows), b.examples(epoch, s, rows))
    assert not np.array_equal(a.examples(0, 0, rows), a.examples(1, 0, rows))
    other = batching.EpochOrder(1000, 64, seed=4)
    assert not np.array_equal(a.examples(0, 0, rows), other.examples(0, 0, rows))
    plain = batching.EpochOrder(1000, 64, shuffle=False)
    np.testing.assert_array_equal(plain.examples(2, 1, rows), 64 + rows)


def test_resume_from_a_saved_position_sees_the_same_batches(corpus, tokenizer):
    straight = _take(_stream(corpus, tokenizer), 30)
    it = _stream(corpus, tokenizer)
    for _ in range(17):  # past the epoch boundary (12 batches an epoch), with batches prefetched
        next(it)
    state = it.get_state()
    assert state == {'epoch': 1, 'step': 5, 'example': 40}
    resumed = _stream(corpus, tokenizer)
    resumed.set_state(state)
    for want, got in zip(straight[17:], _take(resumed, 13)):
        np.testing.assert_array_equal(got['input_ids'], want['input_ids'])
    it.set_state({'epoch': 0, 'step': 3})  # rewinding drops the prefetched batches
    np.testing.assert_array_equal(next(it)['input_ids'], straight[3]['input_ids'])
    it.close()


def test_a_resume_with_another_batch_size_reads_on_from_the_same_example(corpus, tokenizer):
    # The streamed path places its batches from the saved example position, as the in-memory
    # one: 5 batches of 8 taken, then batches of 16 from example 40 (not a multiple of 16),
    # across the end of the epoch (101 = 40 + 3 x 16 + 13, the 13 dropped).
    it = _stream(corpus, tokenizer)
    _take(it, 5)
    state = it.get_state()
    assert state == {'epoch': 0, 'step': 5, 'example': 40}
    arrays = batching.tokenize_examples(tokenizer, readers.read_sentences(corpus), MAX_LEN)
    ref = batching.BatchIterator(arrays, 16, seed=5)
    ref.set_state(state)
    resumed = pipeline.StreamIterator(sources.TextSource(corpus), tokenizer, MAX_LEN, 16, seed=5)
    resumed.set_state(state)
    for got in _take(resumed, 3 + 2 * ref.steps_per_epoch):
        np.testing.assert_array_equal(got['input_ids'], next(ref)['input_ids'])
    assert resumed.get_state() == ref.get_state() == {'epoch': 2, 'step': 6, 'example': 96}


def test_a_corpus_rewritten_mid_run_stops_the_stream_and_resumes_once_restored(corpus,
                                                                               tokenizer):
    # The file rewritten in place between two reads of the iterator: reading it through the
    # old offsets would train on other text; every read after the rewrite refuses, naming it.
    straight = _take(_stream(corpus, tokenizer), 30)
    it = _stream(corpus, tokenizer, workers=2, prefetch=2)
    _ = [next(it) for _ in range(5)]
    state, original = it.get_state(), corpus.read_bytes()
    lines = original.decode().splitlines()
    corpus.write_text('PREFIX LINE\n' + '\n'.join(reversed(lines)) + '\n')
    size = (len(original), corpus.stat().st_size)
    yielded = 5
    with pytest.raises(index.DataChangedError) as e:
        while yielded < len(straight):  # batches read before the rewrite may still come
            got = next(it)
            np.testing.assert_array_equal(got['input_ids'], straight[yielded]['input_ids'])
            yielded += 1
    it.close()
    assert str(e.value) == (f'{corpus} changed during the run (size {size[0]} -> {size[1]} '
                            f'bytes); restore it, or start a new run on it')
    corpus.write_bytes(original)  # restored: the same content, a new index, the same batches
    resumed = _stream(corpus, tokenizer)
    resumed.set_state(state)
    for want, got in zip(straight[5:], _take(resumed, 10)):
        np.testing.assert_array_equal(got['input_ids'], want['input_ids'])


def test_data_errors_of_the_workers_reach_the_caller(tokenizer):
    class Broken(sources.ListSource):
        def __getitem__(self, i):
            raise DataError(f'{self.name}: example {i} is broken')

    it = pipeline.StreamIterator(Broken(['a'] * 20, 'broken.txt'), tokenizer, MAX_LEN, 4)
    with pytest.raises(DataError, match='broken.txt: example .* is broken'):
        next(it)
    it.close()


def test_too_few_examples_for_one_batch_names_the_data(tmp_path, tokenizer):
    (tmp_path / 'three.txt').write_text('a\nb\nc\n')
    with pytest.raises(DataError, match=r'three.txt: 3 examples cannot fill one global batch '
                                        r'of 4$'):
        pipeline.StreamIterator(sources.TextSource(tmp_path / 'three.txt'), tokenizer,
                                MAX_LEN, 4)


def test_digest_follows_content_and_settings_not_paths(corpus, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(batching, 'tokenize_examples',
                        lambda *a, **k: pytest.fail('the digest tokenized the data'))
    digest = pipeline.data_digest(sources.TextSource(corpus), tokenizer, MAX_LEN)
    copy = tmp_path / 'elsewhere.txt'
    copy.write_bytes(corpus.read_bytes())
    assert pipeline.data_digest(sources.TextSource(copy), tokenizer, MAX_LEN) == digest
    assert pipeline.data_digest(sources.TextSource(copy), tokenizer, MAX_LEN + 1) != digest
    tokenizer(['calls set the truncation state'], truncation=True, max_length=5)
    assert pipeline.data_digest(sources.TextSource(copy), tokenizer, MAX_LEN) == digest
    copy.write_bytes(corpus.read_bytes().replace(b'.', b'!', 1))
    assert pipeline.data_digest(sources.TextSource(copy), tokenizer, MAX_LEN) != digest


_TFDS_BUILD = """
import sys
import tensorflow_datasets as tfds


class TinyPairs(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {'sent0': tfds.features.Text(), 'sent1': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {'train': self._generate_examples()}

    def _generate_examples(self):
        for i in range(30):
            yield i, {'sent0': f'first {i}' if i != 7 else ' ', 'sent1': f'second {i}'}


TinyPairs(data_dir=sys.argv[1], file_format='array_record').download_and_prepare()
"""


def test_tfds_array_record_source(tmp_path, tokenizer):
    subprocess.run([sys.executable, '-c', _TFDS_BUILD, str(tmp_path)], check=True,
                   capture_output=True, timeout=HANG_GUARD_S)
    folder = str(tmp_path / 'tiny_pairs' / '1.0.0')
    src = sources.TfdsSource(folder, 'train', fields=('sent0', 'sent1'))
    rows = sorted(src[i] for i in range(len(src)))
    assert src.views == 2 and len(src) == 29  # the example with a blank field is skipped
    assert rows == sorted(readers.read_tfds(folder, 'train', fields=('sent0', 'sent1')))
    assert src.build_s > 0
    again = sources.TfdsSource(folder, 'train', fields=('sent0', 'sent1'))
    assert again.build_s == 0.0 and again.fingerprint() == src.fingerprint()  # cached
    batch = next(pipeline.StreamIterator(again, tokenizer, MAX_LEN, 8, seed=0))
    assert batch['input_ids'].shape == (8, 2, MAX_LEN)
    with pytest.raises(DataError, match="no field 'text'"):
        sources.TfdsSource(folder, 'train', fields=('text',))
