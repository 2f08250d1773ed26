"""The 'flow' calibration: configs by name, path or object, save/load (JSON + safetensors),
apply/inverse, one-line description, and clear errors."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from jaxsim import calibrate
from jaxsim.calibrate import CalibrationError, FlowCalibration
from jaxsim.calibrate.flow import resolve_config
from jaxsim.flows import FlowConfig, layer, load_config_file

_CONFIGS = pathlib.Path(__file__).resolve().parents[2] / 'configs'
_CFG = FlowConfig(name='tiny', levels=2, depth=1, step=(
    layer('actnorm'), layer('linear_lu'), layer('affine_coupling', width=8)),
    data_init=True, max_epochs=2)


def _x(n=600, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) * 0.2).astype(np.float32)


@pytest.fixture(scope='module')
def fitted():
    x = _x()
    return x, calibrate.fit('flow', x, config=_CFG)


def test_flow_maps_to_its_latent_and_back(fitted):
    x, cal = fitted
    assert isinstance(cal, FlowCalibration) and cal.spec == 'flow'
    z = cal.apply(x)
    assert z.shape == x.shape and z.dtype == np.float32 and np.isfinite(z).all()
    assert not np.allclose(z, x)
    np.testing.assert_allclose(cal.inverse(z), x, atol=1e-3, rtol=1e-4)
    assert cal.affine() is None and not cal.linear  # export must refuse it


def test_no_rows_in_gives_no_rows_out(fitted):
    x, cal = fitted
    for out in (cal.apply(x[:0]), cal.inverse(x[:0])):
        assert out.shape == (0, x.shape[1]) and out.dtype == np.float32


def test_nll_is_the_change_of_variables_density(fitted):
    """nll(x) = -log N(f(x); 0, I) - log|det df/dx|, the Jacobian taken by central differences
    of `apply` in float64 (independent of the layers' own log-determinants)."""
    x, cal = fitted
    rows, h, d = x[:5].astype(np.float64), 1e-3, x.shape[1]
    steps = np.concatenate([rows[:, None, :] + h * np.eye(d), rows[:, None, :] - h * np.eye(d)],
                           axis=1).reshape(-1, d)
    z = cal.apply(steps).astype(np.float64).reshape(5, 2, d, d)
    jacobian = (z[:, 0] - z[:, 1]) / (2 * h)  # [row, input dim, output dim]
    logdet = np.linalg.slogdet(jacobian)[1]
    z0 = cal.apply(rows).astype(np.float64)
    want = 0.5 * (z0 ** 2).sum(1) + 0.5 * d * np.log(2 * np.pi) - logdet
    got = cal.nll(x[:5])
    assert got.shape == (5,) and np.abs(logdet).min() > 1.0  # the Jacobian term matters
    np.testing.assert_allclose(got, want, atol=0.02)


def test_describe_and_repr_never_dump_parameters(fitted):
    _, cal = fitted
    line = cal.describe()
    assert line.startswith('flow: tiny (2x1 steps of actnorm+linear_lu+affine_coupling) on 8 dims')
    assert 'bits/dim' in line and '\n' not in line
    assert repr(cal) == f'FlowCalibration({line})' and len(repr(cal)) < 200


def test_save_load_round_trip(fitted, tmp_path):
    x, cal = fitted
    cal.save(tmp_path / 'flow')
    record = json.loads((tmp_path / 'flow' / 'calibration.json').read_text())
    assert record['kind'] == 'flow' and record['meta']['dim'] == 8
    assert [s['layer'] for s in record['meta']['config']['step']] == [
        'actnorm', 'linear_lu', 'affine_coupling']
    loaded = calibrate.load(tmp_path / 'flow')
    assert loaded.config == cal.config and loaded.best_step == cal.best_step
    np.testing.assert_array_equal(loaded.apply(x[:50]), cal.apply(x[:50]))


def test_load_rejects_params_that_do_not_fit_the_config(fitted, tmp_path):
    _, cal = fitted
    cal.save(tmp_path / 'flow')
    meta_path = tmp_path / 'flow' / 'calibration.json'
    record = json.loads(meta_path.read_text())
    record['meta']['config']['depth'] = 2
    meta_path.write_text(json.dumps(record))
    with pytest.raises(CalibrationError, match='do not match the flow of its config'):
        calibrate.load(tmp_path / 'flow')
    record['meta']['config']['step'][0]['layer'] = 'unregistered_layer'
    meta_path.write_text(json.dumps(record))
    with pytest.raises(CalibrationError, match="unknown flow layer 'unregistered_layer'"):
        calibrate.load(tmp_path / 'flow')


def test_apply_checks_its_input(fitted):
    _, cal = fitted
    with pytest.raises(CalibrationError, match='8-dim'):
        cal.apply(np.zeros((3, 6), np.float32))
    with pytest.raises(CalibrationError, match='row 1'):
        cal.apply(np.array([[0.0] * 8, [np.nan] * 8], np.float32))


def test_config_by_shipped_name_path_or_object():
    assert resolve_config(None) == FlowConfig()
    assert resolve_config('glow') == load_config_file(_CONFIGS / 'flow_glow.py')
    assert resolve_config(str(_CONFIGS / 'flow_realnvp.py')).name == 'realnvp'
    assert resolve_config(_CFG) is _CFG
    with pytest.raises(CalibrationError, match="no shipped flow config 'nope'"):
        resolve_config('nope')


def test_flow_fit_errors_are_calibration_errors():
    x = _x(n=200)
    with pytest.raises(CalibrationError, match='both name a flow config'):
        calibrate.fit('flow:glow', x, config=_CFG)
    with pytest.raises(CalibrationError, match='embed='):
        calibrate.fit('flow', x, config=_CFG.replace(dropout_noise=True))
    with pytest.raises(CalibrationError, match='multiple of 4'):
        calibrate.fit('flow', x[:, :6])


def test_plain_flow_fits_on_dropout_noised_vectors_when_given_them():
    """'flow' is BERT-flow as its code runs: fitted under the encoder in train mode, i.e. on
    `embed`'s noised vectors; on bare vectors it fits those and says so; 'flow:bert_flow'
    names the clean fit."""
    x = _x(n=128)
    calls = []

    def embed(key):
        calls.append(key)
        return x + 0.05 * np.random.default_rng(len(calls)).standard_normal(x.shape).astype(
            np.float32)

    noised = calibrate.fit('flow', x, embed=embed)
    assert noised.spec == 'flow' and len(calls) == 1  # one epoch, one fresh noised draw
    assert noised.config == load_config_file(_CONFIGS / 'flow_bert_flow_dropout.py')
    assert noised.note == ''

    bare = calibrate.fit('flow', x)
    assert bare.config == load_config_file(_CONFIGS / 'flow_bert_flow.py')
    assert 'clean vectors' in bare.note and 'flow:bert_flow' in bare.note

    clean = calibrate.fit('flow:bert_flow', x, embed=embed)
    assert len(calls) == 1 and clean.note == '' and not clean.config.dropout_noise
    # The same flow, same seed: only the inputs differ.
    np.testing.assert_array_equal(clean.apply(x), bare.apply(x))
    assert not np.allclose(noised.apply(x), bare.apply(x))
