"""jaxsim's encoder against SimCSE's own evaluation-time encoder, executed.

tests/golden/simcse_golden.npz holds what princeton-nlp/SimCSE's `sentemb_forward` (models.py
at the pinned commit; see make_simcse_golden.py) returns for the bundled all-MiniLM-L6-v2 on
20 STS-B sentences, for each pooler with mlp_only_train on and off. jaxsim.encode must agree
within 1e-5: in particular `avg_first_last` averages hidden_states[1] (the first layer's
output, not the embeddings) with the last layer, and 'cls' applies the dense+tanh head unless
mlp_only_train.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

import jaxsim

GOLDEN = pathlib.Path(__file__).with_name('simcse_golden.npz')
POOLERS = ('cls', 'cls_before_pooler', 'avg', 'avg_top2', 'avg_first_last')


@pytest.fixture(scope='module')
def golden():
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


def test_golden_file_is_what_the_generator_writes(golden):
    assert str(golden['simcse_commit']) == '49fa580a853752ede55b8c76d9debf748e214d3f'
    assert len(golden['sentences']) == 20
    for pooler in POOLERS:
        for flag in (0, 1):
            assert golden[f'{pooler}/mlp_only_train={flag}'].shape == (20, 384)
    # The head is a real difference the test can see: 'cls' with and without it.
    assert np.abs(golden['cls/mlp_only_train=0'] - golden['cls/mlp_only_train=1']).max() > 0.1


def test_tokenization_matches_the_reference(bundled, golden):
    ids = golden['input_ids']
    batch = bundled.tokenizer(list(golden['sentences']), padding=True, truncation=True,
                              max_length=int(golden['max_length']))
    np.testing.assert_array_equal(np.asarray(batch['input_ids']), ids)


@pytest.mark.parametrize('mlp_only_train', [False, True])
@pytest.mark.parametrize('pooler', POOLERS)
def test_encode_matches_simcse_sentemb_forward(bundled, golden, pooler, mlp_only_train):
    model = bundled.with_pooler(pooler)
    # SimCSE's tool reads the Hugging Face weights only: no sentence-transformers Normalize.
    model = dataclasses.replace(model, encoder=model.encoder.clone(mlp_only_train=mlp_only_train),
                                head=())
    got = jaxsim.encode(model, list(golden['sentences']), max_length=int(golden['max_length']),
                        batch_size=8)
    want = golden[f'{pooler}/mlp_only_train={int(mlp_only_train)}']
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
