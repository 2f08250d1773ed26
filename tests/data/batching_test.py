"""Training batches: fixed-length tokenization, the resumable per-process iterator (dropping or
keeping the last partial batch), global arrays."""
import jax
import numpy as np
import pytest

from jaxsim import bundled_model_path, sharding
from jaxsim.data import batching
from jaxsim.data.readers import DataError
from jaxsim.formats.hf_folder import load_tokenizer


@pytest.fixture(scope='module')
def tokenizer():
    return load_tokenizer(bundled_model_path())


def test_tokenize_examples_fixed_length_truncates_and_pads(tokenizer):
    rows = [('a b', 'c', 'd e f g h i j k l m n o p')]
    tok = batching.tokenize_examples(tokenizer, rows, 6)
    assert set(tok) == set(batching.FIELDS)
    assert tok['input_ids'].shape == (1, 3, 6) and tok['input_ids'].dtype == np.int32
    cls, sep, pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    long = tok['input_ids'][0, 2]
    assert long[0] == cls and long[-1] == sep and tok['attention_mask'][0, 2].tolist() == [1] * 6
    short = tok['input_ids'][0, 1]  # [CLS] c [SEP] pad pad pad
    assert short[0] == cls and short[2] == sep and short[3:].tolist() == [pad] * 3
    assert tok['attention_mask'][0, 1].tolist() == [1, 1, 1, 0, 0, 0]
    assert tok['token_type_ids'].sum() == 0
    # Same ids as the tokenizer's own fixed-length padding: one path, no drift.
    ref = tokenizer(['c'], max_length=6, truncation=True, padding='max_length')
    assert short.tolist() == ref['input_ids'][0]


def test_tokenize_examples_single_sentences_and_bad_rows(tokenizer):
    tok = batching.tokenize_examples(tokenizer, ['one sentence', 'two'], 8)
    assert tok['input_ids'].shape == (2, 1, 8)
    with pytest.raises(DataError, match='corpus.txt: example 1 has an empty sentence'):
        batching.tokenize_examples(tokenizer, ['ok', ' '], 6, 'corpus.txt')
    with pytest.raises(DataError, match='example 1 has 2 sentences, example 0 has 3'):
        batching.tokenize_examples(tokenizer, [('a', 'b', 'c'), ('a', 'b')], 6)
    with pytest.raises(DataError, match='no examples'):
        batching.tokenize_examples(tokenizer, [], 6)


def _arrays(n=50):
    return {'x': np.arange(n)[:, None].repeat(2, 1)}


def test_iterator_is_deterministic_and_covers_each_epoch():
    a = batching.BatchIterator(_arrays(), 8, seed=3)
    b = batching.BatchIterator(_arrays(), 8, seed=3)
    assert a.steps_per_epoch == 6 and a.dropped_per_epoch == 2
    epoch0 = [next(a)['x'][:, 0] for _ in range(a.steps_per_epoch)]
    for got in epoch0:
        np.testing.assert_array_equal(got, next(b)['x'][:, 0])
    assert len(set(np.concatenate(epoch0).tolist())) == 48  # no repeats; remainder dropped
    nxt = next(a)['x'][:, 0]  # epoch 1 is another permutation
    assert a.get_state() == {'epoch': 1, 'step': 1, 'example': 8}
    assert not np.array_equal(nxt, epoch0[0])
    c = batching.BatchIterator(_arrays(), 8, seed=4)
    assert not np.array_equal(next(c)['x'], epoch0[0])


def test_keep_last_batch_rounds_to_the_granularity_and_covers_the_rest():
    # 50 = 6 x 8 + 2; keeping a multiple of 2 keeps both, of 4 keeps none.
    it = batching.BatchIterator(_arrays(), 8, seed=0, last_batch='keep', granularity=2)
    assert (it.steps_per_epoch, it.last_size, it.dropped_per_epoch) == (7, 2, 0)
    sizes, seen = [], []
    for _ in range(7):
        x = next(it)['x'][:, 0]
        sizes.append(len(x))
        seen += x.tolist()
    assert sizes == [8] * 6 + [2] and sorted(seen) == list(range(50))
    assert len(next(it)['x']) == 8 and it.get_state() == {'epoch': 1, 'step': 1, 'example': 8}
    it4 = batching.BatchIterator(_arrays(), 8, last_batch='keep', granularity=4)
    assert (it4.steps_per_epoch, it4.dropped_per_epoch) == (6, 2)
    # Fewer examples than one batch: the kept partial batch is the only one.
    small = batching.BatchIterator(_arrays(5), 8, last_batch='keep', granularity=2)
    assert small.steps_per_epoch == 1 and len(next(small)['x']) == 4


def test_iterator_state_round_trip_resumes_exactly():
    a = batching.BatchIterator(_arrays(), 8, seed=0, last_batch='keep', granularity=2)
    for _ in range(9):
        next(a)
    state = a.get_state()
    want = [next(a)['x'] for _ in range(6)]
    b = batching.BatchIterator(_arrays(), 8, seed=0, last_batch='keep', granularity=2)
    b.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(b)['x'], w)


@pytest.mark.parametrize('last_batch', ['drop', 'keep'])
def test_process_blocks_tile_the_global_batch(last_batch):
    full = batching.BatchIterator(_arrays(), 8, seed=1, last_batch=last_batch, granularity=2)
    parts = [batching.BatchIterator(_arrays(), 8, seed=1, process_index=i, process_count=2,
                                    last_batch=last_batch, granularity=2) for i in range(2)]
    for _ in range(15):  # two epochs, across the partial batch
        glob = next(full)['x']
        locs = [next(p)['x'] for p in parts]
        assert all(len(x) == len(glob) // 2 for x in locs)
        np.testing.assert_array_equal(np.concatenate(locs), glob)


def test_iterator_refuses_bad_sizes():
    with pytest.raises(ValueError, match='not divisible by 3'):
        batching.BatchIterator(_arrays(), 8, process_count=3)
    with pytest.raises(DataError, match='5 examples cannot fill one global batch of 8'):
        batching.BatchIterator(_arrays(5), 8)
    with pytest.raises(ValueError, match="last_batch must be 'drop' or 'keep'"):
        batching.BatchIterator(_arrays(), 8, last_batch='pad')


def test_assemble_batch_makes_batch_sharded_arrays():
    mesh = sharding.make_mesh()
    local = {k: np.arange(24, dtype=np.int32).reshape(4, 2, 3) for k in batching.FIELDS}
    out = sharding.assemble_batch(local, mesh)
    assert all(isinstance(v, jax.Array) and v.shape == (4, 2, 3) for v in out.values())
    assert all(v.sharding == sharding.batch_sharding(mesh, 3) for v in out.values())
    np.testing.assert_array_equal(np.asarray(out['input_ids']), local['input_ids'])


@pytest.mark.parametrize('before, after, last_batch', [
    (16, 8, 'drop'), (8, 16, 'drop'), (16, 8, 'keep'), (8, 12, 'keep')])
def test_a_resume_with_another_batch_size_goes_on_from_the_same_example(before, after,
                                                                        last_batch):
    # --allow-change=batch_size mid-epoch: the saved position is in examples, and the order of
    # examples does not depend on the batch size, so the epoch goes on where it stopped.
    kwargs = {'seed': 7, 'last_batch': last_batch, 'granularity': 4}
    a = batching.BatchIterator(_arrays(100), before, **kwargs)
    taken = [next(a)['x'][:, 0] for _ in range(3)]
    state = a.get_state()
    assert state == {'epoch': 0, 'step': 3, 'example': 3 * before}
    b = batching.BatchIterator(_arrays(100), after, **kwargs)
    b.set_state(state)
    while True:
        x = next(b)['x'][:, 0]
        if b.get_state()['epoch'] != 0:
            break
        taken.append(x)
    seen = np.concatenate(taken)
    assert len(set(seen.tolist())) == len(seen)  # nothing repeated ...
    whole = batching.EpochOrder(100, 100, seed=7).examples(0, 0, np.arange(100))
    np.testing.assert_array_equal(seen, whole[:len(seen)])  # ... nor skipped
    rest = 100 - len(seen)  # only what no batch of the new size can hold is left out
    assert rest < (after if last_batch == 'drop' else 4)
    # The next epoch is the new batch size's own, from its start.
    fresh = batching.BatchIterator(_arrays(100), after, **kwargs)
    np.testing.assert_array_equal(x, fresh.batch(1, 0)['x'][:, 0])
    assert b.get_state() == {'epoch': 1, 'step': 1, 'example': after}


def test_a_state_saved_as_a_batch_index_still_resumes():
    # Checkpoints written before positions were kept in examples hold {'epoch', 'step'}.
    a = batching.BatchIterator(_arrays(), 8, seed=2)
    want = [next(a)['x'] for _ in range(9)][4:]
    b = batching.BatchIterator(_arrays(), 8, seed=2)
    b.set_state({'epoch': 0, 'step': 4})
    for w in want:
        np.testing.assert_array_equal(next(b)['x'], w)
    assert b.get_state() == a.get_state()
