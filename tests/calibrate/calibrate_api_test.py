"""The calibration interface: spec parsing, option routing, save/load round trips (JSON +
safetensors, no pickles), clear errors, and a calibration registered from outside jaxsim."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxsim import calibrate
from jaxsim.calibrate import CALIBRATIONS, AffineCalibration, Calibration, CalibrationError


def _x(n=300, d=6, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) + 2.0


def test_parse_spec():
    assert calibrate.parse_spec('whitening:256') == ('whitening', 256)
    assert calibrate.parse_spec(' whitening ') == ('whitening', None)
    assert calibrate.parse_spec('none') == ('none', None)
    assert calibrate.parse_spec('flow:configs/flow_glow.py') == ('flow', 'configs/flow_glow.py')
    assert calibrate.label('whitening:256') == 'whitening-256'
    assert calibrate.spec_string('natsv', 5) == 'natsv:5'
    for bad, msg in [('natsv', 'needs an argument'), ('sn:3', 'takes no'),
                     ('pca', "unknown calibration 'pca'.*whitening"),
                     ('whitening:x', 'integer'), ('whitening:0', 'positive'),
                     ('whitening:', 'empty argument'), ('', 'non-empty')]:
        with pytest.raises(CalibrationError, match=msg):
            calibrate.parse_spec(bad)


def test_options_reach_only_the_calibrations_that_take_them():
    x = _x()
    # One call site passes the options of several kinds: whitening gets eps, ignores the rest.
    cal = calibrate.fit('whitening', x, eps=1e-3, seed=3, config=None, progress=False)
    ref = calibrate.fit('whitening', x, eps=1e-3)
    np.testing.assert_array_equal(cal.W, ref.W)
    assert not np.allclose(cal.W, calibrate.fit('whitening', x).W)
    with pytest.raises(CalibrationError, match=r"unknown calibration option\(s\) \['epss'\]"):
        calibrate.fit('whitening', x, epss=1e-3)


@pytest.mark.parametrize('spec', ['none', 'whitening', 'whitening:3', 'sn', 'natsv:2'])
def test_save_load_round_trip(spec, tmp_path):
    x = _x(seed=1)
    x[:, 4] = 1.5  # a constant column: whitening/sn carry a note
    cal = calibrate.fit(spec, x)
    cal.save(tmp_path / 'cal')
    record = json.loads((tmp_path / 'cal' / 'calibration.json').read_text())
    assert record['kind'] == spec.split(':')[0] and record['spec'] == spec
    assert (tmp_path / 'cal' / 'arrays.safetensors').is_file()
    loaded = calibrate.load(tmp_path / 'cal')
    assert type(loaded) is type(cal) and loaded.spec == spec and loaded.note == cal.note
    np.testing.assert_array_equal(loaded.apply(x), cal.apply(x))


@pytest.mark.parametrize('spec', ['none', 'whitening:3', 'sn', 'natsv:2'])
def test_no_rows_in_gives_no_rows_out(spec):
    cal = calibrate.fit(spec, _x())
    out = cal.apply(np.zeros((0, 6)))
    assert out.shape == (0, cal.apply(_x(n=2)).shape[1])
    with pytest.raises(CalibrationError, match='fitted on 6-dim'):
        cal.apply(np.zeros((0, 5)))


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(CalibrationError, match='calibration.json: not found'):
        calibrate.load(tmp_path)
    (tmp_path / 'calibration.json').write_text('{"kind": "whitening"')
    with pytest.raises(CalibrationError, match='calibration.json: malformed'):
        calibrate.load(tmp_path)
    calibrate.fit('sn', _x()).save(tmp_path / 'ok')
    record = json.loads((tmp_path / 'ok' / 'calibration.json').read_text())
    record['kind'] = 'not_registered'
    (tmp_path / 'ok' / 'calibration.json').write_text(json.dumps(record))
    # A kind whose module is not loaded: not an affine map's arrays, so an error naming it.
    calibrate.fit('test_topk_scale:2', _x()).save(tmp_path / 'topk')
    topk = json.loads((tmp_path / 'topk' / 'calibration.json').read_text())
    topk['kind'] = 'not_registered'
    (tmp_path / 'topk' / 'calibration.json').write_text(json.dumps(topk))
    with pytest.raises(CalibrationError, match="unknown calibration 'not_registered'.*--import"):
        calibrate.load(tmp_path / 'topk')
    (tmp_path / 'ok' / 'arrays.safetensors').unlink()
    record['kind'] = 'sn'
    (tmp_path / 'ok' / 'calibration.json').write_text(json.dumps(record))
    with pytest.raises(CalibrationError, match='arrays.safetensors: not found'):
        calibrate.load(tmp_path / 'ok')
    # A truncated arrays file (a copy cut short): safetensors' own error type, not a traceback.
    calibrate.fit('sn', _x()).save(tmp_path / 'cut')
    with open(tmp_path / 'cut' / 'arrays.safetensors', 'r+b') as f:
        f.truncate(100)
    with pytest.raises(CalibrationError, match=r"cut: cannot rebuild 'sn' \(Error while "):
        calibrate.load(tmp_path / 'cut')


def test_an_unregistered_affine_kind_loads_as_the_map_its_file_holds(tmp_path, capsys):
    x = _x(seed=3)
    cal = calibrate.fit('whitening:4', x)
    cal.save(tmp_path / 'cal')
    record = json.loads((tmp_path / 'cal' / 'calibration.json').read_text())
    record['kind'], record['spec'] = 'users_own', 'users_own:0.5'
    (tmp_path / 'cal' / 'calibration.json').write_text(json.dumps(record))
    loaded = calibrate.load(tmp_path / 'cal')
    np.testing.assert_allclose(loaded.apply(x), cal.apply(x), atol=1e-12)
    assert loaded.spec == 'users_own:0.5' and loaded.affine() is not None
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith('note: ') and "'users_own'" in note[0]
    assert 'mean + 6x4 matrix' in note[0]


@CALIBRATIONS.register('test_shrink', replace=True)
class Shrink(AffineCalibration):
    """A calibration whose argument is a float: centre, then scale by 1 / (std + arg)."""

    arg = 'required'
    arg_type = float

    @classmethod
    def fit(cls, x, arg):
        x = np.asarray(x, np.float64)
        return cls(mu=x.mean(0), W=np.diag(1.0 / (x.std(0) + arg)))


def test_float_arguments():
    assert calibrate.parse_spec('test_shrink:0.3') == ('test_shrink', 0.3)
    assert calibrate.parse_spec('test_shrink:2') == ('test_shrink', 2.0)
    assert calibrate.label('test_shrink:0.3') == 'test_shrink-0.3'
    x = _x(seed=4)
    cal = calibrate.fit('test_shrink:0.3', x)
    assert cal.spec == 'test_shrink:0.3'
    np.testing.assert_allclose(cal.apply(x), (x - x.mean(0)) / (x.std(0) + 0.3))
    for bad, why in [('test_shrink:x', 'must be a number'), ('test_shrink:nan', 'finite'),
                     ('test_shrink:inf', 'finite')]:
        with pytest.raises(CalibrationError, match=why):
            calibrate.parse_spec(bad)
    with pytest.raises(CalibrationError, match='must be an integer'):
        calibrate.parse_spec('whitening:0.3')  # an int argument stays an int


def test_describe_and_repr_are_one_short_line():
    cal = calibrate.fit('whitening:3', _x())
    assert cal.describe() == 'whitening:3: affine, 6 -> 3 dims'
    assert repr(cal) == 'Whitening(whitening:3: affine, 6 -> 3 dims)'
    assert '\n' not in repr(cal) and 'array' not in repr(cal)


@CALIBRATIONS.register('test_topk_scale', replace=True)
class TopKScale(Calibration):
    """A calibration defined outside jaxsim: keep the first K columns, scaled by `factor`."""

    arg = 'required'

    def __init__(self, k: int, mu: np.ndarray, factor: float = 1.0):
        self.k, self.mu, self.factor = k, mu, factor

    @classmethod
    def fit(cls, x, arg, factor: float = 1.0):
        return cls(int(arg), np.asarray(x, np.float64).mean(0), factor)

    def apply(self, x):
        return (np.asarray(x, np.float64) - self.mu)[:, : self.k] * self.factor

    def describe(self):
        return f'{self.spec}: first {self.k} centered columns x{self.factor}'

    def state(self):
        return {'k': self.k, 'factor': self.factor}, {'mu': self.mu}

    @classmethod
    def from_state(cls, meta, arrays):
        return cls(meta['k'], arrays['mu'], meta['factor'])


def test_user_registered_calibration_works_by_name(tmp_path):
    x = _x(seed=2)
    assert calibrate.parse_spec('test_topk_scale:3') == ('test_topk_scale', 3)
    with pytest.raises(CalibrationError, match='needs an argument'):
        calibrate.parse_spec('test_topk_scale')
    # Its own option is routed to it, the affine options (eps) are not.
    cal = calibrate.fit('test_topk_scale:3', x, factor=2.0, eps=1e-3)
    assert cal.spec == 'test_topk_scale:3' and cal.affine() is None
    np.testing.assert_allclose(cal.apply(x), (x - x.mean(0))[:, :3] * 2.0)
    assert repr(cal) == 'TopKScale(test_topk_scale:3: first 3 centered columns x2.0)'
    cal.save(tmp_path / 'mine')
    loaded = calibrate.load(tmp_path / 'mine')
    np.testing.assert_array_equal(loaded.apply(x), cal.apply(x))
    assert loaded.spec == 'test_topk_scale:3'


def test_a_fit_that_returns_no_calibration_is_reported():
    @CALIBRATIONS.register('test_broken', replace=True)
    class Broken(Calibration):
        @classmethod
        def fit(cls, x, arg=None):
            return np.zeros(3)

    with pytest.raises(CalibrationError, match='Broken.fit returned ndarray'):
        calibrate.fit('test_broken', _x())
