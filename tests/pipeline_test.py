"""Data pipeline: tokenization and the resumable per-process iterator (the readers' tests are
in tests/data/readers_test.py)."""
from pathlib import Path

import numpy as np
import pytest

from jaxsim.data import pipeline
from jaxsim.paths import SENTEVAL_ROOT as SENTEVAL

if not SENTEVAL.is_dir():
    SENTEVAL = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'senteval'


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
