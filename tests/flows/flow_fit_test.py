"""Flow fitting: NLL falls, anisotropic Gaussians come out white, determinism, every shipped
config on near-constant columns, the dropout-noise option, and clear errors for bad inputs
before anything is compiled."""
from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from jaxsim.flows import (
    FlowConfig,
    FlowError,
    fit_flow,
    layer,
    load_config_file,
    make_flow,
    training,
)

_CONFIGS = pathlib.Path(__file__).resolve().parents[2] / 'configs'
# Small but Glow-shaped: 2 levels x depth 3, data-init actnorm, LU, additive couplings;
# lr 3e-3 so a few hundred steps reach the optimum.
_GLOW = FlowConfig(name='test_glow', levels=2, depth=3, step=(
    layer('actnorm'), layer('linear_lu'), layer('additive_coupling', width=16)),
    data_init=True, objective='nats', loss_scale=1.0, optimizer='adam', learning_rate=3e-3,
    weight_decay=0.0, adam_eps=1e-8, clip_norm=0.0, max_epochs=6, val_fraction=0.1,
    patience=3, evals_per_epoch=2)
_DIM = 8


def _anisotropic(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Samples of N(mu, A A^T) with covariance eigenvalues spread over 4 orders of magnitude."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((_DIM, _DIM)))
    a = q * np.logspace(-1, 1, _DIM)  # columns scaled 0.1 .. 10
    x = rng.standard_normal((n, _DIM)) @ a.T + 3.0
    return x.astype(np.float32), a @ a.T


def _apply(config, dim, params, x):
    module = make_flow(config, dim)
    return np.asarray(jax.jit(lambda p, x: module.apply({'params': p}, x, method='forward'))(
        params, x).z)


@pytest.fixture(scope='module')
def fitted():
    # Enough rows that the held-out NLL, flat near the optimum, stops the fit close to it
    # (with 3,000 the early stop lands anywhere on the plateau, up to 0.3 from white).
    x, cov = _anisotropic(n=10_000)
    return x, cov, fit_flow(x, _GLOW, jax.random.key(0))


def test_nll_falls_and_anisotropic_gaussian_comes_out_white(fitted):
    x, cov, result = fitted
    val = [h['val_nll'] for h in result.history]
    assert len(val) > _GLOW.patience and val[-1] < result.init_nll - 1.0, (result.init_nll, val)
    assert np.linalg.cond(cov) > 1e3  # strongly anisotropic input
    z = _apply(_GLOW, _DIM, result.params, x)
    # Sampling noise and the held-out early stop leave entries ~0.1-0.2 off.
    np.testing.assert_allclose(z.mean(0), 0.0, atol=0.25)
    assert np.abs(np.cov(z.T) - np.eye(_DIM)).max() < 0.25, np.round(np.cov(z.T), 2)
    # The exact MLE optimum: the Gaussian's entropy 0.5 * log det(2 pi e cov) nats per row.
    entropy = 0.5 * np.linalg.slogdet(2 * np.pi * np.e * cov)[1]
    assert abs(min(val) - entropy) < 0.3, (min(val), entropy)
    assert result.best_step == result.history[int(np.argmin(val))]['step']


def test_fit_is_deterministic_per_seed(fitted):
    x, _, result = fitted
    cfg = _GLOW.replace(max_epochs=1)
    a = fit_flow(x, cfg, jax.random.key(0))
    b = fit_flow(x, cfg, jax.random.key(0))
    c = fit_flow(x, cfg, jax.random.key(1))
    same = jax.tree.map(lambda u, v: np.array_equal(np.asarray(u), np.asarray(v)),
                        a.params, b.params)
    assert all(jax.tree.leaves(same))
    assert not np.allclose(_apply(cfg, _DIM, a.params, x[:10]),
                           _apply(cfg, _DIM, c.params, x[:10]))


def _near_constant(n=3000, d=16) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((n, d)) * np.linspace(0.01, 1, d)
    x[:, 3] = 0.25  # exactly constant, as all-MiniLM-L6-v2 avg has
    x[:, 7] = 0.5 + 1e-7 * np.random.default_rng(1).standard_normal(n)  # near-constant
    return x.astype(np.float32)


@pytest.mark.parametrize('name', ['realnvp', 'glow', 'bert_flow'])
def test_every_shipped_config_fits_near_constant_columns(name):
    # RealNVP with data-init actnorms used to reach NLL ~1e30 here after one step: each
    # actnorm gave the constant channel a gain of 1e3, compounding once a coupling moved it.
    cfg = load_config_file(_CONFIGS / f'flow_{name}.py')
    x = _near_constant()
    result = fit_flow(x, cfg, jax.random.key(0))
    final = result.history[-1]
    assert np.isfinite(final['train_nll']) and final['train_nll'] < result.init_nll
    z = _apply(cfg, 16, result.params, x)
    assert np.isfinite(z).all() and np.abs(z).max() < 1e3
    if cfg.val_fraction:
        assert final['val_nll'] < result.init_nll


def test_fewer_rows_than_a_batch_fit_with_a_smaller_batch():
    # Any matrix whitening can fit: 20 rows, one constant column.
    x = _near_constant(n=20)
    cfg = load_config_file(_CONFIGS / 'flow_realnvp.py')
    result = fit_flow(x, cfg, jax.random.key(0))
    assert 'batch 18 instead of batch_size=64' in result.note  # 2 rows held out
    assert result.best_step >= 1 and np.isfinite(result.history[-1]['val_nll'])
    assert np.isfinite(_apply(cfg, 16, result.params, x)).all()


def test_realnvp_gains_stay_bounded_after_a_step():
    cfg = load_config_file(_CONFIGS / 'flow_realnvp.py').replace(max_epochs=1)
    x = _near_constant(n=1000)
    result = fit_flow(x, cfg, jax.random.key(0))
    gains = [np.abs(np.asarray(v['logs'])).max() for k, v in result.params['l0'].items()
             if k.endswith('actnorm')]
    assert len(gains) == 2
    # Data init standardizes live channels (|log gain| up to log(1/0.01) ~ 4.6); the dead ones
    # keep gain 1 instead of the 1e3 (log 6.9) a floored std would give at every layer.
    assert max(gains) < 5.0, gains


def test_dropout_noise_option_draws_fresh_embeddings_each_epoch():
    x, _ = _anisotropic(n=800)
    keys = []

    def embed(key):
        keys.append(np.asarray(jax.random.key_data(key)).tolist())
        noise = np.asarray(jax.random.normal(key, x.shape)) * 0.05
        return x + noise

    cfg = _GLOW.replace(max_epochs=2, dropout_noise=True)
    noisy = fit_flow(x, cfg, jax.random.key(0), embed=embed)
    assert len(keys) == 2 and keys[0] != keys[1]
    # Without dropout_noise the config fits the clean vectors: embed is offered but unused.
    clean = fit_flow(x, cfg.replace(dropout_noise=False), jax.random.key(0), embed=embed)
    assert len(keys) == 2
    assert not np.allclose(_apply(cfg, _DIM, noisy.params, x[:5]),
                           _apply(cfg, _DIM, clean.params, x[:5]))
    # The same key gives the same noise, so the noised fit is reproducible.
    again = fit_flow(x, cfg, jax.random.key(0), embed=embed)
    assert len(keys) == 4 and keys[2:] == keys[:2]
    np.testing.assert_array_equal(_apply(cfg, _DIM, again.params, x[:5]),
                                  _apply(cfg, _DIM, noisy.params, x[:5]))


@pytest.fixture
def no_compile(monkeypatch):
    """Fails the test if fitting gets as far as building jitted functions."""

    def boom(*args, **kwargs):
        raise AssertionError('bad input reached the compiled fit')

    monkeypatch.setattr(training, 'compiled', boom)


def test_bad_inputs_are_rejected_before_compiling(no_compile):
    x, _ = _anisotropic(n=500)
    x[7, 2] = np.nan
    with pytest.raises(FlowError, match='row 7, column 2'):
        fit_flow(x, _GLOW, jax.random.key(0))
    x[7, 2] = 0.0
    with pytest.raises(FlowError, match='multiple of 2'):
        fit_flow(x[:, :7], _GLOW, jax.random.key(0))
    with pytest.raises(FlowError, match='multiple of 4'):
        fit_flow(np.zeros((500, 6), np.float32), FlowConfig(), jax.random.key(0))
    with pytest.raises(FlowError, match='too few for a batch'):
        fit_flow(x[:2], _GLOW, jax.random.key(0))
    with pytest.raises(FlowError, match='matrix'):
        fit_flow(x[0], _GLOW, jax.random.key(0))
    with pytest.raises(FlowError, match='dropout_noise=True.*embed='):
        fit_flow(x, _GLOW.replace(dropout_noise=True), jax.random.key(0))


def test_embed_returning_the_wrong_shape_is_a_clear_error():
    x, _ = _anisotropic(n=300)
    with pytest.raises(FlowError, match=r'embed\(key\) returned shape \(10, 8\)'):
        fit_flow(x, _GLOW.replace(max_epochs=1, dropout_noise=True), jax.random.key(0),
                 embed=lambda k: x[:10])


def test_bad_flow_config_files_are_one_line_errors(tmp_path):
    with pytest.raises(FlowError, match='nope.py: no such flow config file'):
        load_config_file(tmp_path / 'nope.py')
    broken = tmp_path / 'broken.py'
    broken.write_text('def get_config(:\n')
    with pytest.raises(FlowError, match=r'broken.py:1: syntax error'):
        load_config_file(broken)
    empty = tmp_path / 'empty.py'
    empty.write_text('x = 1\n')
    with pytest.raises(FlowError, match=r'empty.py: defines no get_config\(\)'):
        load_config_file(empty)
    wrong = tmp_path / 'wrong.py'
    wrong.write_text('def get_config():\n    return {}\n')
    with pytest.raises(FlowError, match='must return a FlowConfig'):
        load_config_file(wrong)
