"""The SimCSE STS protocol on a hand-made SentEval folder with hand-computed Spearman values."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from jaxsim.eval import sts
from tests.senteval_test import write_tiny_senteval


def fake_vector(sentence: str) -> np.ndarray:
    """'anchor' -> [1, 0]; 'cos C ...' -> [C, sqrt(1 - C^2)], so cosine(anchor, it) = C."""
    if sentence == 'anchor':
        return np.array([1.0, 0.0])
    c = float(sentence.split()[1])
    return np.array([c, math.sqrt(1.0 - c * c)])


class CountingEncoder:
    def __init__(self):
        self.calls = []

    def __call__(self, sentences):
        self.calls.append(list(sentences))
        return np.stack([fake_vector(s) for s in sentences]).astype(np.float32)


# Hand computation (Spearman = Pearson of average ranks, ties share the mean rank):
# subset A: cos [.1 .5 .5 .9], gold [1 2 3 4] -> ranks [1 2.5 2.5 4] vs [1 2 3 4];
#   deviations [-1.5 0 0 1.5] . [-1.5 -.5 .5 1.5] = 4.5; var 4.5 and 5 -> 4.5 / sqrt(22.5).
A = 4.5 / math.sqrt(22.5)
# subset B (pair with empty gold dropped): cos [.2 .8 .4], gold [2 5 2] -> ranks [1 3 2] vs
#   [1.5 3 1.5]; deviations [-1 1 0] . [-.5 1 -.5] = 1.5; var 2 and 1.5 -> 1.5 / sqrt(3).
B = 1.5 / math.sqrt(3.0)
# 'all' (7 pairs): cos ranks [1 4.5 4.5 7 2 6 3], gold ranks [1 3 5 6 3 7 3], means 4:
#   dev [-3 .5 .5 3 -2 2 -1] . [-3 -1 1 2 -1 3 -1] = 24; var 27.5 and 26 -> 24 / sqrt(715).
ALL = 24.0 / math.sqrt(715.0)
# STS-B test: cos [.1 .3 .2 .9] vs gold [.5 4.5 4.8 4.1] -> ranks [1 3 2 4] vs [1 3 4 2]:
#   sum d^2 = 0 + 0 + 4 + 4 = 8 -> 1 - 6 * 8 / (4 * 15) = 0.2.
STSB_TEST = 0.2
# SICK trial: cos [.1 .6 .3] vs gold [1.5 3 4] -> ranks [1 3 2] vs [1 2 3]: 1 - 6*2/24 = .5.
SICK = 0.5
# STS-B dev: cos [.2 .6 .4] vs gold [1 4.5 4.2] -> ranks [1 3 2] vs [1 3 2]: 1.
STSB_DEV = 1.0


def test_protocol_matches_hand_computation(tmp_path):
    root = write_tiny_senteval(tmp_path)
    res = sts.evaluate(CountingEncoder(), ['sts12', 'stsb', 'sickr'], root, verbose=False)
    s12 = res.scores['STS12']
    assert s12.subsets['A'].spearman == pytest.approx(100 * A, abs=1e-9)
    assert s12.subsets['B'].spearman == pytest.approx(100 * B, abs=1e-9)
    assert s12.subsets['B'].n == 3
    assert s12.all == pytest.approx(100 * ALL, abs=1e-9)
    assert s12.mean == pytest.approx(100 * (A + B) / 2, abs=1e-9)
    assert s12.wmean == pytest.approx(100 * (4 * A + 3 * B) / 7, abs=1e-9)
    assert res.scores['STSBenchmark'].all == pytest.approx(100 * STSB_TEST, abs=1e-9)
    assert res.scores['SICKRelatedness'].all == pytest.approx(100 * SICK, abs=1e-9)
    # Default aggregation 'all'; STS-B / SICK have one subset, so all aggregations agree there.
    assert res.tasks == pytest.approx(
        {'STS12': 100 * ALL, 'STSBenchmark': 100 * STSB_TEST, 'SICKRelatedness': 100 * SICK})
    assert res.avg == pytest.approx(100 * (ALL + STSB_TEST + SICK) / 3)
    assert res.avg_of('wmean') == pytest.approx(100 * ((4 * A + 3 * B) / 7 + STSB_TEST + SICK) / 3)
    # The JSON details carry every aggregation and the data file hashes.
    assert res.details['aggregates']['mean']['tasks']['STS12'] == pytest.approx(50 * (A + B))
    assert len(res.details['data_files']) == 6


def test_dev_split_scores_stsb_dev(tmp_path):
    root = write_tiny_senteval(tmp_path)
    res = sts.evaluate(CountingEncoder(), ['stsb'], root, split='dev', diagnostics=False)
    assert res.split == 'dev' and list(res.scores['STSBenchmark'].subsets) == ['dev']
    assert res.avg == pytest.approx(100 * STSB_DEV)
    assert sts.stsb_dev_score(CountingEncoder(), root) == pytest.approx(100 * STSB_DEV)


def test_each_sentence_encoded_once_across_posts(tmp_path):
    root = write_tiny_senteval(tmp_path)
    enc = CountingEncoder()
    rows = sts.evaluate_rows(enc, 'sts12,stsb,sickr', root, posts=['none', 'sn', 'natsv:1'],
                             verbose=False)
    assert [r.label for r in rows] == ['none', 'sn', 'natsv-1']
    assert len(enc.calls) == 1
    # anchor, STS12, STS-B test, SICK
    assert len(enc.calls[0]) == len(set(enc.calls[0])) == 1 + 7 + 4 + 3
    cached = sts.CachedEncoder(enc)
    sts.evaluate(cached, ['stsb'], root, diagnostics=False)
    sts.evaluate(cached, ['stsb'], root, post='sn', diagnostics=False)
    assert len(enc.calls) == 2 and cached.num_encoded == 5


def test_fit_on_task_and_corpus_file(tmp_path):
    root = write_tiny_senteval(tmp_path)
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('cos 0.15 c\n\ncos 0.25 c\ncos 0.95 c\nanchor\n')
    enc = CountingEncoder()
    by_task, by_file = (
        sts.evaluate(enc, ['sts12', 'stsb'], root, post='sn', fit_on=fit_on, verbose=False)
        for fit_on in ('task', str(corpus)))
    assert by_task.details['fit_sentences'] == {'STS12': 14, 'STSBenchmark': 8}
    assert by_file.details['fit_sentences'] == 4  # the blank line is skipped
    assert str(corpus) in by_file.details['data_files']
    # SN fitted on the corpus: per-dim (x - mu) / std with the corpus' mu, std.
    c = np.stack([fake_vector(s) for s in ['cos 0.15 c', 'cos 0.25 c', 'cos 0.95 c', 'anchor']])
    mu, sd = c.mean(0), c.std(0)
    e1 = (np.stack([fake_vector('anchor')] * 4) - mu) / sd
    e2 = (np.stack([fake_vector(f'cos {x} s') for x in (0.1, 0.3, 0.2, 0.9)]) - mu) / sd
    gold = [0.5, 4.5, 4.8, 4.1]
    assert by_file.scores['STSBenchmark'].all == pytest.approx(sts.spearman_x100(e1, e2, gold))


def test_flow_post_plugs_in_the_flow_calibration(tmp_path, monkeypatch):
    """--post flow fits jaxsim.flows.calibration on the fit set, or loads a saved one."""
    from jaxsim.flows import calibration as flow_calibration

    class Shift:  # A stand-in flow, z = x + [0, 1]: changes the cosines in a known way.
        def apply(self, x):
            return np.asarray(x) + np.array([0.0, 1.0])

    fitted, loaded = [], []
    monkeypatch.setattr(flow_calibration, 'fit_flow_calibration',
                        lambda x, config=None, seed=0: fitted.append(x.shape) or Shift())
    monkeypatch.setattr(flow_calibration, 'load_flow', lambda d: loaded.append(d) or Shift())
    root = write_tiny_senteval(tmp_path)
    none, flow = sts.evaluate_rows(CountingEncoder(), ['stsb'], root, posts=['none', 'flow'],
                                   verbose=False)
    assert fitted == [(8, 2)]  # fitted once, on all 8 sentence slots of the evaluated pairs
    e2 = np.stack([fake_vector(f'cos {c} s') for c in (0.1, 0.3, 0.2, 0.9)]) + [0.0, 1.0]
    e1 = np.tile([1.0, 1.0], (4, 1))  # the shifted anchor
    # The shift keeps the ranking on this data, so check the (value-sensitive) Pearson.
    expected = sts.pearson_x100(e1, e2, [0.5, 4.5, 4.8, 4.1])
    assert flow.scores['STSBenchmark'].pearson_all == pytest.approx(expected)
    assert expected != pytest.approx(none.scores['STSBenchmark'].pearson_all, abs=1.0)
    sts.evaluate(CountingEncoder(), ['stsb'], root, post='flow', flow_checkpoint='ckpt')
    assert loaded == ['ckpt'] and len(fitted) == 1


def test_spearman_x100_equals_scipy_on_cosines():
    rng = np.random.default_rng(0)
    e1, e2 = rng.normal(size=(50, 7)), rng.normal(size=(50, 7))
    gold = rng.integers(0, 6, size=50).astype(float)  # many ties
    cos = (e1 * e2).sum(1) / np.linalg.norm(e1, axis=1) / np.linalg.norm(e2, axis=1)
    expected = scipy.stats.spearmanr(cos, gold).statistic * 100
    assert sts.spearman_x100(e1, e2, gold) == pytest.approx(expected, abs=1e-10)
    # Cosine ignores scale.
    assert sts.spearman_x100(3 * e1, e2, gold) == pytest.approx(expected, abs=1e-10)


def test_bad_embeddings_are_clear_errors():
    e = np.ones((3, 2))
    with pytest.raises(ValueError, match='zero vector'):
        sts.spearman_x100(e, np.zeros((3, 2)), [1, 2, 3])
    with pytest.raises(ValueError, match='NaN'):
        sts.spearman_x100(e, np.full((3, 2), np.nan), [1, 2, 3])
    with pytest.raises(ValueError, match='gold scores are all equal'):
        sts.spearman_x100(e, e + np.eye(3, 2), [2, 2, 2])
    with pytest.raises(ValueError, match='returned NaN'):
        sts.CachedEncoder(lambda s: np.full((len(s), 2), np.nan))(['a'])
    with pytest.raises(ValueError, match='unknown --post'):
        sts.evaluate_rows(CountingEncoder(), ['stsb'], '.', posts=['pca'])


def test_evaluation_never_uses_dropout():
    """The eval encoder equals the deterministic forward pass, even with dropout 0.5."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxsim.eval import runner
    from jaxsim.models.bert import BertConfig, BertModel
    from jaxsim.models.pooling import pool
    from jaxsim.pretrained import Pretrained, bundled_model_path, load_tokenizer

    tokenizer = load_tokenizer(bundled_model_path())
    config = BertConfig(model_type='bert', vocab_size=tokenizer.vocab_size, hidden_size=16,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                        hidden_act='gelu', hidden_dropout_prob=0.5,
                        attention_probs_dropout_prob=0.5, max_position_embeddings=64,
                        type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0)
    module = BertModel(config)
    ids = jnp.ones((1, 4), jnp.int32)
    init = jax.jit(lambda key: module.init(key, ids, jnp.ones_like(ids), deterministic=True))
    params = init(jax.random.key(0))['params']  # jitted: one compile instead of one per op
    model = Pretrained(config=config, params=params, tokenizer=tokenizer, path='tiny')
    sentences = ['a man plays a guitar .', 'the cat sat .']
    got = runner.make_encoder(model, 'avg', 32, 8)(sentences)

    batch = tokenizer(sentences, padding=True, return_tensors='np')
    mask = jnp.asarray(batch['attention_mask'])

    def forward(deterministic, key):
        out = module.apply({'params': params}, jnp.asarray(batch['input_ids']), mask,
                           jnp.zeros_like(mask), deterministic=deterministic,
                           rngs={'dropout': key})
        return pool('avg', out, mask)

    forward = jax.jit(forward, static_argnums=0)  # one compile, not one per eager op
    np.testing.assert_allclose(got, np.asarray(forward(True, jax.random.key(1))), atol=1e-5)
    # Sanity: dropout at 0.5 would change the vectors a lot, so the equality above means off.
    assert np.abs(np.asarray(forward(False, jax.random.key(1))) - got).max() > 1e-2
    assert dataclasses.is_dataclass(model)
