"""Whitening, SN and NATSV: identity covariance, top-K directions, degenerate inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim import calibration as cal


def correlated(n=400, d=9, seed=0):
    """[n, d] Gaussian data with a distinct, well-separated covariance spectrum."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    scales = np.linspace(3.0, 0.2, d)
    return rng.normal(size=(n, d)) * scales @ q.T + rng.normal(size=d)


def test_whitened_covariance_is_identity():
    x = correlated()
    w = cal.fit_whitening(x)
    z = cal.apply_whitening(w, x)
    assert z.shape == x.shape and not w.note
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(9), atol=1e-9)


def test_matches_bert_whitening_reference():
    # bojone/BERT-whitening compute_kernel_bias: u, s, vh = svd(cov); W = u @ diag(1/sqrt(s)).
    x = correlated(seed=1)
    u, s, _ = np.linalg.svd(np.cov(x.T))
    ref = (x - x.mean(0)) @ (u @ np.diag(1 / np.sqrt(s)))
    z = cal.apply_whitening(cal.fit_whitening(x), x)
    signs = np.sign((ref * z).sum(0))  # eigenvectors are defined up to sign
    np.testing.assert_allclose(z * signs, ref, atol=1e-9)


def test_k_dim_whitening_keeps_top_k_directions():
    x = correlated(seed=2)
    k = 4
    w = cal.fit_whitening(x, k=k)
    z = cal.apply_whitening(w, x)
    assert z.shape == (400, k)
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(k), atol=1e-9)
    # The columns of W span the top-k eigenvectors of the covariance.
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
    w = cal.fit_whitening(few)
    z = cal.apply_whitening(w, few)
    assert w.dim_out == 4 and 'only 5 sentences for 8 dims' in w.note
    assert np.isfinite(z).all()
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(4), atol=1e-8)
    with pytest.raises(cal.CalibrationError, match=r'rank 4.*cannot keep k=6'):
        cal.fit_whitening(few, k=6)
    const = correlated(seed=4)
    const[:, 2] = 0.7
    w = cal.fit_whitening(const)
    assert w.dim_out == 8 and 'constant columns [2]' in w.note
    assert np.isfinite(cal.apply_whitening(w, const)).all()
    reg = cal.fit_whitening(const, eps=1e-6)  # regularized: keeps all dims, finite
    assert reg.dim_out == 9 and np.isfinite(cal.apply_whitening(reg, const)).all()
    sn = cal.fit_sn(const)
    assert sn.dim_out == 8 and 'constant columns [2]' in sn.note
    with pytest.raises(cal.CalibrationError, match='identical'):
        cal.fit_whitening(np.ones((10, 3)))


def test_bad_input_is_rejected_before_fitting():
    x = correlated()
    x[7, 3] = np.nan
    with pytest.raises(cal.CalibrationError, match=r'non-finite .*row 7, column 3'):
        cal.fit_whitening(x)
    with pytest.raises(cal.CalibrationError, match='at least 2'):
        cal.fit_sn(np.ones((1, 3)))
    with pytest.raises(cal.CalibrationError, match='k must be in'):
        cal.fit_whitening(correlated(), k=10)
    with pytest.raises(cal.CalibrationError, match='fitted on 9-dim'):
        cal.apply_whitening(cal.fit_whitening(correlated()), np.ones((2, 5)))


def test_sn_standardizes_columns():
    x = correlated(seed=5)
    z = cal.apply_whitening(cal.fit_sn(x), x)
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(z.std(0), 1, atol=1e-10)


def test_natsv_nulls_top_directions():
    x = correlated(seed=6)
    k = 2
    z = cal.apply_whitening(cal.fit_natsv(x, k), x)
    xc = x - x.mean(0)
    _, _, vh = np.linalg.svd(xc, full_matrices=False)
    np.testing.assert_allclose(z @ vh[:k].T, 0, atol=1e-9)  # top-k directions gone
    np.testing.assert_allclose(z @ vh[k:].T, xc @ vh[k:].T, atol=1e-9)  # the rest untouched
    with pytest.raises(cal.CalibrationError, match='natsv: k must be'):
        cal.fit_natsv(x, 9)


def test_whitening_is_a_pytree_usable_under_jit():
    x = correlated(seed=7)
    w = cal.fit_whitening(x, k=3)
    leaves = jax.tree_util.tree_leaves(w)
    assert len(leaves) == 2  # mu, W; kind and note are static
    z = jax.jit(cal.apply_whitening)(w, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(z), cal.apply_whitening(w, x), atol=1e-4)


def test_parse_post():
    assert cal.parse_post('whitening:256') == ('whitening', 256)
    assert cal.parse_post('none') == ('none', None)
    assert cal.post_label('whitening:256') == 'whitening-256'
    for bad, msg in [('natsv', 'needs K'), ('sn:3', 'no ":K"'), ('pca', 'unknown'),
                     ('whitening:x', 'integer'), ('whitening:0', 'positive')]:
        with pytest.raises(ValueError, match=msg):
            cal.parse_post(bad)
