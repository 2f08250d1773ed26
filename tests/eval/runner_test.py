"""The STS protocol end to end on a tiny SentEval folder with a fake encoder: hand-computed
Spearman values, single encoding, fit sets (target / task / paper / file), seeds."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import jaxsim
from jaxsim import calibrate
from jaxsim.errors import JaxsimError
from jaxsim.eval import metrics, protocol, report, runner
from jaxsim.eval.embeddings import CachedEncoder
from tests.data.tiny_senteval import STSB, CountingEncoder, fake_vector, write_tiny_senteval

# Hand computation (Spearman = Pearson of average ranks, ties share the mean rank):
# MSRpar: cos [.1 .5 .5 .9], gold [1 2 3 4] -> ranks [1 2.5 2.5 4] vs [1 2 3 4];
#   deviations [-1.5 0 0 1.5] . [-1.5 -.5 .5 1.5] = 4.5; var 4.5 and 5 -> 4.5 / sqrt(22.5).
A = 4.5 / math.sqrt(22.5)
# MSRvid (pair with empty gold dropped): cos [.2 .8 .4], gold [2 5 2] -> ranks [1 3 2] vs
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
STSB_GOLD = [0.5, 4.5, 4.8, 4.1]


def _vectors(sentences):
    return np.stack([fake_vector(s) for s in sentences])


def _sn_score(fit_sentences, task_sentences=('cos 0.1 s', 'cos 0.3 s', 'cos 0.2 s', 'cos 0.9 s')):
    """STS-B test Spearman after SN fitted on `fit_sentences`: (x - mu) / std per dim."""
    c = _vectors(fit_sentences)
    mu, sd = c.mean(0), c.std(0)
    e1 = (_vectors(['anchor'] * 4) - mu) / sd
    e2 = (_vectors(task_sentences) - mu) / sd
    return metrics.spearman_x100(e1, e2, STSB_GOLD)


def test_protocol_matches_hand_computation(tmp_path):
    root = write_tiny_senteval(tmp_path)
    res = runner.evaluate(CountingEncoder(), ['sts12', 'stsb', 'sickr'], root)
    s12 = res.scores['STS12']
    assert s12.subsets['MSRpar'].spearman == pytest.approx(100 * A, abs=1e-9)
    assert s12.subsets['MSRvid'].spearman == pytest.approx(100 * B, abs=1e-9)
    assert s12.subsets['MSRvid'].n == 3
    assert s12.all == pytest.approx(100 * ALL, abs=1e-9)
    assert s12.mean == pytest.approx(100 * (A + B) / 2, abs=1e-9)
    assert s12.wmean == pytest.approx(100 * (4 * A + 3 * B) / 7, abs=1e-9)
    assert res.scores['STSBenchmark'].all == pytest.approx(100 * STSB_TEST, abs=1e-9)
    assert res.scores['SICKRelatedness'].all == pytest.approx(100 * SICK, abs=1e-9)
    assert res.tasks == pytest.approx(
        {'STS12': 100 * ALL, 'STSBenchmark': 100 * STSB_TEST, 'SICKRelatedness': 100 * SICK})
    assert res.avg == pytest.approx(100 * (ALL + STSB_TEST + SICK) / 3)
    assert res.avg_of('wmean') == pytest.approx(100 * ((4 * A + 3 * B) / 7 + STSB_TEST + SICK) / 3)
    assert res.details['aggregates']['mean']['tasks']['STS12'] == pytest.approx(50 * (A + B))
    assert len(res.details['data_files']) == 6
    assert res.details['data_sources'] == {t: [str(root)] for t in res.scores}
    assert res.details['fit'] is None and res.details['fit_on'] is None
    assert any('SICK_test_annotated.txt not found' in n for n in res.details['notes'])


def test_dev_split_scores_stsb_dev(tmp_path):
    root = write_tiny_senteval(tmp_path)
    res = runner.evaluate(CountingEncoder(), ['stsb'], root, split='dev', diagnostics=False)
    assert res.split == 'dev' and list(res.scores['STSBenchmark'].subsets) == ['dev']
    assert res.avg == pytest.approx(100 * STSB_DEV)
    assert runner.stsb_score(CountingEncoder(), root) == pytest.approx(100 * STSB_DEV)


def test_roots_none_is_the_default_data_root(tmp_path, monkeypatch):
    root = write_tiny_senteval(tmp_path)
    monkeypatch.setattr('jaxsim.data.senteval.SENTEVAL_ROOT', root)
    rows = runner.evaluate_rows(CountingEncoder(), ['stsb'], None, diagnostics=False)
    assert rows[0].avg == pytest.approx(100 * STSB_TEST, abs=1e-9)
    assert rows[0].details['data_sources'] == {'STSBenchmark': [str(root)]}
    assert runner.stsb_score(CountingEncoder(), None) == pytest.approx(100 * STSB_DEV)


def test_each_sentence_encoded_once_across_posts(tmp_path):
    root = write_tiny_senteval(tmp_path)
    enc = CountingEncoder()
    rows = runner.evaluate_rows(enc, 'sts12,stsb,sickr', root, posts=['none', 'sn', 'natsv:1'])
    assert [r.label for r in rows] == ['none', 'sn', 'natsv-1']
    assert len(enc.calls) == 1
    # anchor, STS12, STS-B test, SICK
    assert len(enc.calls[0]) == len(set(enc.calls[0])) == 1 + 7 + 4 + 3
    cached = CachedEncoder(enc)
    runner.evaluate(cached, ['stsb'], root, diagnostics=False)
    runner.evaluate(cached, ['stsb'], root, post='sn', diagnostics=False)
    assert len(enc.calls) == 2 and cached.num_encoded == 5


def test_fit_on_target_task_and_file(tmp_path):
    root = write_tiny_senteval(tmp_path)
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('cos 0.15 c\n\ncos 0.25 c\ncos 0.95 c\nanchor\n')
    enc = CountingEncoder()
    target, by_task, by_file = (
        runner.evaluate(enc, ['sts12', 'stsb'], root, post='sn', fit_on=fit_on)
        for fit_on in ('target', 'task', str(corpus)))
    sets = lambda r: {k: v['sentences'] for k, v in r.details['fit']['sets'].items()}  # noqa
    assert sets(target) == {'STS12': 22, 'STSBenchmark': 22}
    assert sets(by_task) == {'STS12': 14, 'STSBenchmark': 8}
    assert sets(by_file) == {'STS12': 4, 'STSBenchmark': 4}  # the blank line is skipped
    assert by_task.details['fit']['sets']['STSBenchmark']['parts'] == [
        {'source': 'STSBenchmark', 'split': 'test', 'sentences': 8, 'repeats': 1}]
    assert by_task.details['fit']['sets']['STSBenchmark']['missing'] == []
    assert str(corpus) in by_file.details['data_files']
    stsb_test = ['anchor', 'cos 0.1 s', 'anchor', 'cos 0.3 s', 'anchor', 'cos 0.2 s',
                 'anchor', 'cos 0.9 s']
    assert by_task.scores['STSBenchmark'].all == pytest.approx(_sn_score(stsb_test))
    assert by_file.scores['STSBenchmark'].all == pytest.approx(
        _sn_score(['cos 0.15 c', 'cos 0.25 c', 'cos 0.95 c', 'anchor']))


def test_fit_on_paper_follows_each_papers_rule(tmp_path):
    root = write_tiny_senteval(tmp_path)
    enc = CountingEncoder()
    res = runner.evaluate(enc, ['sts12', 'stsb', 'sickr'], root, post='sn', fit_on='paper')
    fit = res.details['fit']
    assert fit['fit_on'] == 'paper' and 'BERT-whitening' in fit['rule']
    parts = {k: [(p['split'], p['sentences'], p['repeats']) for p in v['parts']]
             for k, v in fit['sets'].items()}
    assert parts == {'STS12': [('test', 14, 1)],
                     'STSBenchmark': [('train', 4, 1), ('dev', 6, 1), ('test', 8, 1)],
                     'SICKRelatedness': [('train', 4, 1), ('dev', 6, 1)]}
    assert fit['sets']['SICKRelatedness']['missing'] == ['SICK_test_annotated.txt']
    assert fit['sets']['STSBenchmark']['missing'] == []
    assert any('SICKRelatedness: the paper fit set needs train+dev+test; '
               'SICK_test_annotated.txt not found' in n for n in res.details['notes'])
    # STS-B's SN is fitted on its train+dev+test sentences, by hand:
    fit_sentences = [s for split in ('train', 'dev', 'test') for a, b, _ in STSB[split]
                     for s in (a, b)]
    assert res.scores['STSBenchmark'].all == pytest.approx(_sn_score(fit_sentences))
    # Train/dev sentences are encoded once, along with the evaluated ones.
    assert len(enc.calls) == 1 and 'cos 0.3 t' in enc.calls[0]


def test_paper_fit_set_for_flows_repeats_sts12_and_finds_sick_test_in_another_root(tmp_path):
    a = write_tiny_senteval(tmp_path / 'a')
    b = write_tiny_senteval(tmp_path / 'b', sick_test=True, sts12=False, stsb=False, sick=False)
    tasks = protocol.load_tasks(['sts12', 'sickr'], [a, b])
    sets = protocol.fit_sets('paper', tasks, [a, b], 'flow')
    assert [(p.split, p.sentences, p.repeats) for p in sets['STS12'].parts] == [('test', 42, 3)]
    assert len(sets['STS12'].sentences) == 42
    assert [p.split for p in sets['SICKRelatedness'].parts] == ['train', 'dev', 'test']
    assert not sets['SICKRelatedness'].notes
    assert sets['SICKRelatedness'].sources['SICK/SICK_test_annotated.txt'] == str(b)


class Shift(calibrate.Calibration):
    """A seeded stand-in calibration: z = x + [0, seed + 1]; records its fits."""

    fits: list = []

    def __init__(self, seed):
        self.seed = seed

    @classmethod
    def fit(cls, x, arg=None, *, seed: int = 0, embed=None):
        noisy = embed(jax_key(seed)) if embed is not None else None
        cls.fits.append((x.shape, seed, None if noisy is None else noisy.shape))
        return cls(seed)

    def apply(self, x):
        return np.asarray(x) + np.array([0.0, self.seed + 1.0])


def jax_key(seed):
    return jax.random.key(seed)


calibrate.CALIBRATIONS.register('test_shift', replace=True)(Shift)


def test_seeded_calibration_fitted_per_seed_and_averaged(tmp_path):
    root = write_tiny_senteval(tmp_path)
    Shift.fits.clear()
    noisy_calls = []

    def noisy(sentences, key):
        noisy_calls.append(len(sentences))
        return _vectors(sentences)

    res = runner.evaluate(CountingEncoder(), ['stsb'], root, post='test_shift', seeds=[0, 1],
                          noisy_encode_fn=noisy, diagnostics=False)
    assert [(s, seed, n) for s, seed, n in Shift.fits] == [((8, 2), 0, (8, 2)), ((8, 2), 1, (8, 2))]
    assert noisy_calls == [8, 8]  # the fit set's sentences, freshly noised per call
    per_seed = res.details['per_seed']['STSBenchmark']
    expected = [metrics.pearson_x100(_vectors(['anchor'] * 4) + [0, s + 1],
                                     _vectors(['cos 0.1 s', 'cos 0.3 s', 'cos 0.2 s', 'cos 0.9 s'])
                                     + [0, s + 1], STSB_GOLD) for s in (0, 1)]
    assert res.details['seeds'] == [0, 1]
    assert res.scores['STSBenchmark'].pearson_all == pytest.approx(np.mean(expected))
    assert res.scores['STSBenchmark'].all == pytest.approx(np.mean(per_seed))
    # Deterministic calibrations are fitted once whatever the seeds.
    sn = runner.evaluate(CountingEncoder(), ['stsb'], root, post='sn', seeds=[0, 1],
                         diagnostics=False)
    assert sn.details['seeds'] is None and sn.details['per_seed'] is None


def test_flow_checkpoint_is_loaded_instead_of_fitted(tmp_path, monkeypatch):
    root = write_tiny_senteval(tmp_path)
    loaded = []
    monkeypatch.setattr(calibrate, 'load', lambda d: loaded.append(d) or Shift(0))
    res = runner.evaluate(CountingEncoder(), ['stsb'], root, post='flow',
                          flow_checkpoint='ckpt', diagnostics=False)
    assert loaded == ['ckpt'] and res.details['fit']['fit_on'] == 'target'


def test_flow_checkpoint_of_another_kind_is_refused(tmp_path):
    # A saved whitening given as --flow-checkpoint: scored, it would be reported as 'flow'.
    root = write_tiny_senteval(tmp_path)
    calibrate.fit('sn', _vectors(['cos 0.1', 'cos 0.5', 'cos 0.9'])).save(tmp_path / 'sn')
    with pytest.raises(JaxsimError, match=r"--flow-checkpoint .*sn: holds a 'sn' calibration, "
                                          r"not a flow"):
        runner.evaluate(CountingEncoder(), ['stsb'], root, post='flow',
                        flow_checkpoint=tmp_path / 'sn', diagnostics=False)


def test_bad_requests_are_clear_errors(tmp_path):
    root = write_tiny_senteval(tmp_path)
    with pytest.raises(JaxsimError, match="unknown calibration 'pca'"):
        runner.evaluate_rows(CountingEncoder(), ['stsb'], root, posts=['pca'])
    with pytest.raises(JaxsimError, match='returned NaN'):
        CachedEncoder(lambda s: np.full((len(s), 2), np.nan))(['a'])
    with pytest.raises(JaxsimError, match='a task is listed twice'):
        runner.evaluate(CountingEncoder(), ['stsb', 'STS-B'], root)
    with pytest.raises(JaxsimError, match=r'nofile\.txt: sentence file not found'):
        runner.evaluate(CountingEncoder(), ['stsb'], root, post='sn',
                        fit_on=str(tmp_path / 'nofile.txt'))


def test_evaluation_never_uses_dropout(tiny_model_dir):
    """The eval encoder is `jaxsim.encode` in eval mode: equal to it, unlike a dropout draw."""
    folder, _ = tiny_model_dir('bert', add_pooler=False)
    model = jaxsim.load_pretrained(folder)
    sentences = ['a man plays a guitar .', 'the cat sat .']
    got = runner.make_encoder(model, 32, 8)(sentences)
    np.testing.assert_allclose(got, jaxsim.encode(model, sentences, max_length=32), atol=1e-6)
    noisy = runner.make_noisy_encoder(model, 32, 8)(sentences, jax_key(1))
    assert np.abs(noisy - got).max() > 1e-3  # dropout (0.1) would move the vectors


def test_several_fit_sets_give_one_row_each(tmp_path):
    root = write_tiny_senteval(tmp_path)
    enc = CountingEncoder()
    rows = runner.evaluate_rows(enc, ['sts12', 'stsb'], root, posts=['none', 'sn'],
                                fit_on=['target', 'task'], diagnostics=False)
    assert [(r.post, r.fit_on) for r in rows] == [('none', None), ('sn', 'target'),
                                                  ('sn', 'task')]
    assert len(enc.calls) == 1
    assert rows[2].scores['STSBenchmark'].all == pytest.approx(runner.evaluate(
        enc, ['sts12', 'stsb'], root, post='sn', fit_on='task').scores['STSBenchmark'].all)
    table = report.markdown_table(rows)
    assert '| sn (target) |' in table and '| sn (task) |' in table and '| none |' in table
    with pytest.raises(JaxsimError, match='give each fit set once'):
        runner.evaluate_rows(enc, ['stsb'], root, posts=['sn'], fit_on=['task', 'task'])


def test_split_tasks_into_sts_and_transfer():
    assert runner.split_tasks(['STS-B', 'mr', ' sickr', 'SST2', '']) == (
        ['stsb', 'sickr'], ['MR', 'SST2'])
    with pytest.raises(JaxsimError,
                       match=r"unknown task 'sts99'; STS tasks: .* transfer tasks: mr"):
        runner.split_tasks(['sts99'])
