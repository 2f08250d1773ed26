"""Flow fitting: NLL falls, anisotropic Gaussians come out white, determinism, save/load,
and clear errors for bad inputs before anything is compiled."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import numpy as np
import pytest

from jaxsim.flows import FlowConfig, fit_flow_calibration, load_flow, save_flow
from jaxsim.flows import fit as fit_lib

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Small but reference-shaped: Glow 2 levels x depth 3, additive couplings.
# lr 3e-3 (reference 1e-3) so a few hundred steps reach the optimum.
_CFG = FlowConfig(width=16, batch_size=64, max_epochs=6, patience=3, evals_per_epoch=2,
                  learning_rate=3e-3)
_DIM = 8


def _anisotropic(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Samples of N(mu, A A^T) with covariance eigenvalues spread over 4 orders of magnitude."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((_DIM, _DIM)))
    a = q * np.logspace(-1, 1, _DIM)  # columns scaled 0.1 .. 10
    x = rng.standard_normal((n, _DIM)) @ a.T + 3.0
    return x.astype(np.float32), a @ a.T


@pytest.fixture(scope='module')
def fitted():
    x, cov = _anisotropic()
    return x, cov, fit_flow_calibration(x, _CFG, seed=0, progress=False)


def test_nll_falls(fitted):
    _, _, fc = fitted
    val = [h['val_nll'] for h in fc.history]
    assert len(val) >= 4
    # From actnorm init to the end, the held-out NLL drops clearly.
    assert val[-1] < val[0] - 1.0, val
    assert min(val) == pytest.approx(min(h['val_nll'] for h in fc.history))


def test_latents_of_anisotropic_gaussian_are_white(fitted):
    x, cov, fc = fitted
    assert np.linalg.cond(cov) > 1e3  # strongly anisotropic input
    z = fc.apply(x)
    assert z.shape == x.shape and z.dtype == np.float32
    cov_z = np.cov(z.T)
    # Sampling noise of 3,000 rows and a held-out early stop leave entries ~0.1-0.2 off.
    np.testing.assert_allclose(z.mean(0), 0.0, atol=0.25)
    assert np.abs(cov_z - np.eye(_DIM)).max() < 0.25, np.round(cov_z, 2)
    assert np.abs(np.cov(x.T) - np.eye(_DIM)).max() > 10  # ... and the input was far from it
    # The exact MLE optimum: the Gaussian's entropy 0.5 * log det(2 pi e cov) nats per row.
    entropy = 0.5 * np.linalg.slogdet(2 * np.pi * np.e * cov)[1]
    best = min(h['val_nll'] for h in fc.history)
    assert abs(best - entropy) < 0.3, (best, entropy)
    # The inverse maps the latents back.
    np.testing.assert_allclose(fc.inverse(z), x, atol=1e-3, rtol=1e-4)


def test_fit_is_deterministic_per_seed(fitted):
    x, _, fc = fitted
    again = fit_flow_calibration(x, _CFG, seed=0, progress=False)
    other = fit_flow_calibration(x, _CFG, seed=1, progress=False)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                        fc.params, again.params)
    assert all(jax.tree.leaves(same))
    assert not np.allclose(fc.apply(x[:10]), other.apply(x[:10]))


def test_save_load_round_trip(fitted, tmp_path):
    x, _, fc = fitted
    save_flow(fc, tmp_path / 'flow')
    meta = json.loads((tmp_path / 'flow' / 'flow.json').read_text())
    assert meta['config']['levels'] == 2 and meta['dim'] == _DIM
    loaded = load_flow(tmp_path / 'flow')
    assert loaded.config == fc.config and loaded.best_step == fc.best_step
    np.testing.assert_array_equal(loaded.apply(x[:50]), fc.apply(x[:50]))


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match='flow.json'):
        load_flow(tmp_path)
    (tmp_path / 'flow.json').write_text('{"config": {"levels": "x"')
    with pytest.raises(ValueError, match='flow.json'):
        load_flow(tmp_path)


def test_realnvp_fit_lowers_nll():
    x, _ = _anisotropic(n=1500, seed=1)
    cfg = FlowConfig(arch='realnvp', coupling='affine', num_couplings=2, width=16, max_epochs=2,
                     evals_per_epoch=2)
    fc = fit_flow_calibration(x, cfg, seed=0, progress=False)
    assert fc.history[-1]['val_nll'] < fc.history[0]['val_nll']
    assert np.isfinite(fc.apply(x)).all()


def test_constant_channels_do_not_diverge():
    # Real sentence vectors can hold exactly constant channels (all-MiniLM-L6-v2 avg does).
    x, _ = _anisotropic(n=1000, seed=2)
    x[:, 3] = 0.25
    cfg = FlowConfig(width=16, max_epochs=1, evals_per_epoch=2)
    fc = fit_flow_calibration(x, cfg, seed=0, progress=False)
    assert all(np.isfinite(h['val_nll']) and abs(h['val_nll']) < 1e3 for h in fc.history)
    assert np.isfinite(fc.apply(x)).all()


@pytest.fixture
def no_compile(monkeypatch):
    """Fails the test if fitting gets as far as building jitted functions."""

    def boom(*args, **kwargs):
        raise AssertionError('bad input reached the compiled fit')

    monkeypatch.setattr(fit_lib, '_jitted', boom)


def test_nan_and_inf_rejected_before_training(no_compile):
    x, _ = _anisotropic(n=500)
    x[7, 2] = np.nan
    with pytest.raises(ValueError, match='row 7'):
        fit_flow_calibration(x, _CFG)
    x[7, 2] = 0.0
    x[11, 0] = np.inf
    with pytest.raises(ValueError, match='row 11'):
        fit_flow_calibration(x, _CFG)


def test_dimension_the_glow_cannot_split(no_compile):
    x = np.random.default_rng(0).standard_normal((500, 7)).astype(np.float32)
    with pytest.raises(ValueError, match='multiple of 2'):
        fit_flow_calibration(x, FlowConfig())
    with pytest.raises(ValueError, match='multiple of 4'):
        fit_flow_calibration(np.zeros((500, 6), np.float32), FlowConfig(levels=3))


def test_config_that_does_not_fit_the_data(no_compile):
    x, _ = _anisotropic(n=40)
    with pytest.raises(ValueError, match='batch_size=64'):
        fit_flow_calibration(x, FlowConfig())
    with pytest.raises(ValueError, match='matrix'):
        fit_flow_calibration(x[0], FlowConfig())
    with pytest.raises(TypeError, match='FlowConfig'):
        fit_flow_calibration(x, {'levels': 2})


def test_apply_checks_the_dimension(fitted):
    _, _, fc = fitted
    with pytest.raises(ValueError, match='8-dim'):
        fc.apply(np.zeros((3, 6), np.float32))
    with pytest.raises(ValueError, match='row 1'):
        fc.apply(np.array([[0.0] * 8, [np.nan] * 8], np.float32))


def _config(name: str) -> FlowConfig:
    spec = importlib.util.spec_from_file_location(name, _ROOT / 'configs' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_reference_configs():
    glow = _config('flow_glow')
    assert (glow.arch, glow.levels, glow.depth, glow.coupling, glow.width,
            glow.learning_rate) == ('glow', 2, 3, 'additive', 32, 1e-3)
    assert glow == FlowConfig()  # the calibration default is the reference
    nvp = _config('flow_realnvp')
    assert nvp.arch == 'realnvp' and nvp.coupling == 'affine'
    assert FlowConfig.from_dict(json.loads(glow.to_json())) == glow


def test_diverged_initialization_is_a_clear_error():
    # RealNVP with actnorm cannot fit an exactly constant column: its NLL explodes to ~1e29. The fit must say so instead of returning garbage latents.
    from jaxsim.flows.config import load_config_file
    cfg = load_config_file(pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'flow_realnvp.py')
    x = (np.random.default_rng(0).standard_normal((3000, 16)) * np.linspace(0.01, 1, 16))
    x = x.astype(np.float32)
    x[:, 3] = 0.25
    with pytest.raises(FloatingPointError, match=r'diverged.*constant column\(s\) \[3\]'):
        fit_flow_calibration(x, cfg)
