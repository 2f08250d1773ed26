"""The frequency table after calibrations, on a synthetic table with planted norms: each
calibration changes what it should (whitening: isotropic, flat-spectrum sentence vectors; sn:
unit-variance columns; a flow: a centred latent), the token tables equal a brute-force
version; the command line with --post and --tb on the bundled model."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.spatial.distance import cdist
from tensorboard.backend.event_processing import event_accumulator

from jaxsim import calibrate
from jaxsim.analysis.frequency_post import (
    CalibratedAnalysisError,
    analyze_calibrations,
    effective_rank,
    sentence_diagnostics,
    tb_folder,
)
from jaxsim.cli.main import main as jaxsim_main
from jaxsim.flows import FlowConfig, layer  # noqa: F401  (read by the eval of _FLOW_ARGS)
from jaxsim.storage.paths import SENTEVAL_ROOT

_DIM = 8
_FLOW_ARGS = ("name='tiny', levels=1, depth=2, step=(layer('actnorm'), "
              "layer('additive_coupling', width=8)), data_init=True, objective='nats', "
              "loss_scale=1.0, optimizer='adam', learning_rate=1e-3, weight_decay=0.0, "
              "adam_eps=1e-8, clip_norm=0.0, max_epochs=2, val_fraction=0.1, patience=100, "
              "evals_per_epoch=1, batch_size=64")
_FLOW = eval(f'FlowConfig({_FLOW_ARGS})')  # the same config as the command's config file


@pytest.fixture(scope='module')
def planted():
    """A 60-token table, rank r's token with norm 1 + r // 20 (buckets of 20 ranks: mean
    norms 1, 2, 3), and 1,500 anisotropic sentence vectors: a shared offset (the cone) and
    per-direction scales from 0.1 to 3."""
    rng = np.random.default_rng(0)
    vocab = 60
    ranked = rng.permutation(vocab)
    directions = rng.standard_normal((vocab, _DIM))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    table = np.zeros((vocab, _DIM), np.float32)
    for r, token in enumerate(ranked):
        table[token] = (1 + r // 20) * directions[r]
    q, _ = np.linalg.qr(rng.standard_normal((_DIM, _DIM)))
    sentences = (rng.standard_normal((1500, _DIM)) * np.logspace(-1, 0.5, _DIM)) @ q.T + 4.0
    return table, ranked, sentences.astype(np.float32)


def _brute_force(tokens: np.ndarray, buckets, k: int) -> list[tuple[float, float]]:
    d = cdist(tokens, tokens)
    np.fill_diagonal(d, np.inf)
    knn = np.sort(d, axis=1)[:, :k].mean(axis=1)
    norms = np.linalg.norm(tokens, axis=1)
    return [(norms[lo:hi].mean(), knn[lo:hi].mean()) for lo, hi in zip(buckets, buckets[1:])]


def test_calibrations_change_what_they_should(planted):
    table, ranked, sentences = planted
    buckets = (0, 20, 40, 60)
    out = analyze_calibrations(table, ranked, sentences, ['whitening', 'sn'], buckets=buckets,
                               k=2)
    raw = out['raw']
    np.testing.assert_allclose([b['mean_norm'] for b in raw['buckets']], [1, 2, 3], rtol=1e-6)
    # The raw sentence vectors form a cone: high anisotropy, one dominant direction.
    assert raw['sentence_diagnostics']['anisotropy'] > 0.8
    assert raw['sentence_diagnostics']['top1_energy'] > 0.8
    assert raw['sentence_diagnostics']['effective_rank'] < _DIM - 2

    white, sn = out['calibrations']
    assert (white['post'], sn['post']) == ('whitening', 'sn')
    d = white['sentence_diagnostics']
    assert abs(d['anisotropy']) < 0.01  # isotropic: random pairs are orthogonal on average
    s = np.asarray(d['singular_values'])
    np.testing.assert_allclose(s, s[0], rtol=1e-6)  # a flat spectrum ...
    assert d['effective_rank'] == pytest.approx(_DIM, rel=1e-9)  # ... of full rank
    assert d['top1_energy'] == pytest.approx(1 / _DIM, rel=1e-6)
    # sn: centred, unit-variance columns: the squared spectrum sums to N * D.
    s = np.asarray(sn['sentence_diagnostics']['singular_values'])
    assert (s ** 2).sum() == pytest.approx(len(sentences) * _DIM, rel=1e-6)
    assert abs(sn['sentence_diagnostics']['anisotropy']) < 0.05

    # The token tables are the calibration's affine map of the static embeddings, measured
    # as the raw table is (brute force over all pairs).
    for row in (white, sn):
        mu, w = calibrate.fit(row['post'], sentences).affine()
        mapped = (table[ranked].astype(np.float64) - mu) @ w
        want = _brute_force(mapped, buckets, 2)
        got = [(b['mean_norm'], b['mean_knn_distance']) for b in row['buckets']]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        assert row['token_anisotropy'] == pytest.approx(
            sentence_diagnostics(mapped)['anisotropy'], abs=1e-5)


def test_a_flow_fit_reports_to_tensorboard_and_centres_the_vectors(planted, tmp_path):
    table, ranked, sentences = planted

    def fit(spec, x, **options):
        return calibrate.fit(spec, x, config=_FLOW, **options)

    out = analyze_calibrations(table, ranked, sentences, ['flow'], buckets=(0, 30, 60), k=3,
                               fit=fit, options={'seed': 0}, tb_dir=str(tmp_path))
    (flow,) = out['calibrations']
    assert flow['sentence_diagnostics']['dim'] == _DIM
    assert abs(flow['sentence_diagnostics']['anisotropy']) < 0.1  # the cone is gone
    acc = event_accumulator.EventAccumulator(tb_folder(str(tmp_path), 'flow'))
    acc.Reload()
    assert [e.step for e in acc.Scalars('val_nll')] != []


def test_spectrum_measures():
    assert effective_rank([2.0, 2.0, 2.0, 2.0]) == pytest.approx(4.0)
    assert effective_rank([5.0, 0.0, 0.0]) == pytest.approx(1.0)
    assert effective_rank([0.0]) == 0.0
    assert tb_folder('runs/tb', 'flow:configs/my flow.py') == 'runs/tb/flow_configs_my_flow.py'
    assert tb_folder(None, 'flow') is None


def test_a_projection_head_is_refused(planted):
    table, ranked, sentences = planted
    with pytest.raises(CalibratedAnalysisError, match='8-dim token embeddings'):
        analyze_calibrations(table, ranked, sentences[:, :6], ['whitening'])


def test_command_with_calibrations(tmp_path, capsys):
    # 600 distinct sentences: more than the 384 dims, so whitening keeps them all.
    lines = list(dict.fromkeys((SENTEVAL_ROOT / 'SNLI' / 's2.test').read_text().splitlines()))
    lines = lines[:600]
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join(lines) + '\n')
    config = tmp_path / 'tiny_flow.py'
    config.write_text('from jaxsim.flows import FlowConfig, layer\n\n\ndef get_config():\n'
                      f'    return FlowConfig({_FLOW_ARGS})\n')
    out, tb = tmp_path / 'out', tmp_path / 'tb'
    argv = ['analyze', '--corpus', str(corpus), '--out', str(out), '--post', 'whitening',
            '--post', f'flow:{config}', '--tb', str(tb), '--buckets', '0,100,500,5000']
    assert jaxsim_main(argv) == 0
    printed = capsys.readouterr().out
    assert 'whitening: whitening: affine, 384 -> ' in printed and 'anisotropy' in printed
    result = json.loads((out / 'frequency.json').read_text())
    assert [c['post'] for c in result['calibrations']] == ['whitening', f'flow:{config}']
    raw, white = result['sentence_diagnostics'], result['calibrations'][0]
    # Centred isotropic vectors: the mean cosine of N of them is about -1/(N-1).
    assert raw['anisotropy'] > 0.01 and abs(white['sentence_diagnostics']['anisotropy']) < 0.005
    assert white['sentence_diagnostics']['effective_rank'] == pytest.approx(
        white['sentence_diagnostics']['dim'], rel=1e-6)
    assert result['unique_sentences'] == len(set(lines)) and result['timing']['encode_s'] > 0
    for name in ('frequency.png', 'spectrum.png'):
        assert (out / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    acc = event_accumulator.EventAccumulator(tb_folder(str(tb), f'flow:{config}'))
    acc.Reload()
    assert {'train_nll', 'val_nll', 'bpd'} <= set(acc.Tags()['scalars'])
    assert not (tb / 'whitening').exists()  # only fits that report write

    # Bad input: one line naming the flag, nothing written.
    for bad, says in ((['--post', 'whitenning'], 'whitenning'),
                      (['--tb', 'gs://bucket/tb'], '--tb must be a local folder')):
        assert jaxsim_main(argv[:5] + bad + ['--out', str(tmp_path / 'no')]) == 1
        err = capsys.readouterr().err
        assert says in err and err.count('\n') == 1
    assert not (tmp_path / 'no').exists()


def test_sentence_diagnostics_match_numpy():
    x = np.random.default_rng(1).standard_normal((50, 4)) + 1.0
    d = sentence_diagnostics(x)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = u @ u.T
    assert d['anisotropy'] == pytest.approx(cos[~np.eye(50, dtype=bool)].mean(), rel=1e-9)
    np.testing.assert_allclose(d['singular_values'], np.linalg.svd(x, compute_uv=False),
                               rtol=1e-9)
