"""Whitening, SN, NATSV and none: identity covariance, top-K directions, the BERT-whitening
reference, degenerate inputs, and the affine map export uses."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim import calibrate
from jaxsim.calibrate import CalibrationError


def correlated(n=400, d=9, seed=0):
    """[n, d] Gaussian data with a distinct, well-separated covariance spectrum."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    scales = np.linspace(3.0, 0.2, d)
    return rng.normal(size=(n, d)) * scales @ q.T + rng.normal(size=d)


def test_whitened_covariance_is_identity():
    x = correlated()
    w = calibrate.fit('whitening', x)
    z = w.apply(x)
    assert z.shape == x.shape and not w.note and z.dtype == np.float64
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(9), atol=1e-9)


def test_matches_bert_whitening_reference():
    # bojone/BERT-whitening compute_kernel_bias: u, s, vh = svd(cov); W = u @ diag(1/sqrt(s)).
    x = correlated(seed=1)
    u, s, _ = np.linalg.svd(np.cov(x.T))
    ref = (x - x.mean(0)) @ (u @ np.diag(1 / np.sqrt(s)))
    z = calibrate.fit('whitening', x).apply(x)
    signs = np.sign((ref * z).sum(0))  # eigenvectors are defined up to sign
    np.testing.assert_allclose(z * signs, ref, atol=1e-9)


def test_k_dim_whitening_keeps_top_k_directions():
    x = correlated(seed=2)
    k = 4
    w = calibrate.fit(f'whitening:{k}', x)
    z = w.apply(x)
    assert z.shape == (400, k) and w.spec == 'whitening:4'
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(k), atol=1e-9)
    evals, evecs = np.linalg.eigh(np.cov(x, rowvar=False))
    top = evecs[:, np.argsort(evals)[::-1][:k]]
    wn = w.W / np.linalg.norm(w.W, axis=0)
    np.testing.assert_allclose(wn @ wn.T, top @ top.T, atol=1e-8)
    # ... in order: column i scales by 1/sqrt(lambda_i).
    np.testing.assert_allclose(np.linalg.norm(w.W, axis=0),
                               1 / np.sqrt(np.sort(evals)[::-1][:k]), rtol=1e-8)


def test_degenerate_covariance_never_nan():
    rng = np.random.default_rng(3)
    few = rng.normal(size=(5, 8))  # fewer sentences than dims: rank 4
    w = calibrate.fit('whitening', few)
    z = w.apply(few)
    assert w.dim_out == 4 and 'only 5 sentences for 8 dims' in w.note
    assert np.isfinite(z).all()
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(4), atol=1e-8)
    with pytest.raises(CalibrationError, match=r'rank 4.*cannot keep k=6'):
        calibrate.fit('whitening:6', few)
    const = correlated(seed=4)
    const[:, 2] = 0.7
    w = calibrate.fit('whitening', const)
    assert w.dim_out == 8 and 'constant columns [2]' in w.note
    assert np.isfinite(w.apply(const)).all()
    reg = calibrate.fit('whitening', const, eps=1e-6)  # regularized: keeps all dims, finite
    assert reg.dim_out == 9 and np.isfinite(reg.apply(const)).all()
    sn = calibrate.fit('sn', const)
    assert sn.dim_out == 8 and 'constant columns [2]' in sn.note
    with pytest.raises(CalibrationError, match='identical'):
        calibrate.fit('whitening', np.ones((10, 3)))


def test_bad_input_is_rejected_before_fitting():
    x = correlated()
    x[7, 3] = np.nan
    with pytest.raises(CalibrationError, match=r'non-finite .*row 7, column 3'):
        calibrate.fit('whitening', x)
    with pytest.raises(CalibrationError, match='at least 2'):
        calibrate.fit('sn', np.ones((1, 3)))
    with pytest.raises(CalibrationError, match='k must be in'):
        calibrate.fit('whitening:10', correlated())
    with pytest.raises(CalibrationError, match='fitted on 9-dim'):
        calibrate.fit('whitening', correlated()).apply(np.ones((2, 5)))
    with pytest.raises(CalibrationError, match='eps must be a finite number >= 0'):
        calibrate.fit('sn', correlated(), eps=-1.0)
    # NaN passes `eps < 0`: it would turn every calibrated vector into NaN (eval.py --eps nan).
    for spec in ('whitening', 'sn'):
        for eps in (float('nan'), float('inf')):
            with pytest.raises(CalibrationError, match=f'{spec}: eps must be a finite number'):
                calibrate.fit(spec, correlated(), eps=eps)


def test_sn_standardizes_columns():
    x = correlated(seed=5)
    z = calibrate.fit('sn', x).apply(x)
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(z.std(0), 1, atol=1e-10)


def test_natsv_nulls_top_directions():
    x = correlated(seed=6)
    k = 2
    z = calibrate.fit(f'natsv:{k}', x).apply(x)
    xc = x - x.mean(0)
    _, _, vh = np.linalg.svd(xc, full_matrices=False)
    np.testing.assert_allclose(z @ vh[:k].T, 0, atol=1e-9)  # top-k directions gone
    np.testing.assert_allclose(z @ vh[k:].T, xc @ vh[k:].T, atol=1e-9)  # the rest untouched
    with pytest.raises(CalibrationError, match='natsv: k must be'):
        calibrate.fit('natsv:9', x)


def test_none_is_the_identity():
    x = correlated(seed=8)
    cal = calibrate.fit('none', x)
    np.testing.assert_array_equal(cal.apply(x), x)
    mu, w = cal.affine()
    np.testing.assert_array_equal(mu, 0.0)
    np.testing.assert_array_equal(w, np.eye(9))


def _reference_affine(spec: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu, W) from each method's definition, by float64 SVD (not the eigh the fit uses)."""
    mu = x.mean(0)
    name, _, k = spec.partition(':')
    if name == 'whitening':  # BERT-whitening: u, s, vh = svd(cov); W = u diag(1/sqrt(s))
        u, s, _ = np.linalg.svd(np.cov(x.T))
        w = u / np.sqrt(s)
        return mu, w[:, :int(k)] if k else w
    if name == 'sn':
        return mu, np.diag(1 / x.std(0))
    _, _, vh = np.linalg.svd(x - mu, full_matrices=False)  # natsv: I - V_k V_k^T
    return mu, np.eye(x.shape[1]) - vh[:int(k)].T @ vh[:int(k)]


@pytest.mark.parametrize('spec', ['whitening', 'whitening:3', 'sn', 'natsv:2'])
def test_affine_matches_the_definition_and_apply(spec):
    x = correlated(seed=9)
    cal = calibrate.fit(spec, x)
    mu, w = cal.affine()
    want_mu, want_w = _reference_affine(spec, x)
    assert w.shape == want_w.shape
    signs = np.sign((want_w * w).sum(0))  # singular vectors are defined up to sign
    np.testing.assert_allclose(mu, want_mu, atol=1e-12)
    np.testing.assert_allclose(w * signs, want_w, atol=1e-9)
    np.testing.assert_allclose((x - mu) @ w, cal.apply(x), atol=1e-12)


def test_affine_calibration_is_a_pytree_usable_under_jit():
    x = correlated(seed=7)
    w = calibrate.fit('whitening:3', x)
    assert len(jax.tree_util.tree_leaves(w)) == 2  # mu, W; spec and note are static
    z = jax.jit(lambda w, x: w(x))(w, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(z), w.apply(x), atol=1e-4)
