"""TensorBoard scalars read back with TensorBoard's own reader: the writer's purge and file
naming, and a flow fit's NLL curves against its returned history."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from jaxsim import calibrate
from jaxsim.flows import FlowConfig, fit_flow, layer
from jaxsim.storage.tb import ScalarWriter, optional_writer

# Tiny RealNVP-like flow: compiles in seconds, 2 evaluations per epoch.
_FLOW = FlowConfig(name='tb_test', levels=1, depth=2, step=(
    layer('actnorm'), layer('additive_coupling', width=8)), data_init=True, objective='nats',
    loss_scale=1.0, optimizer='adam', learning_rate=3e-3, weight_decay=0.0, adam_eps=1e-8,
    clip_norm=0.0, max_epochs=3, val_fraction=0.2, patience=100, evals_per_epoch=2,
    batch_size=32)


def _scalars(folder) -> dict:
    """tag -> [(step, value)] as TensorBoard shows them (purged steps dropped)."""
    acc = event_accumulator.EventAccumulator(str(folder), purge_orphaned_data=True)
    acc.Reload()
    curves = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
              for tag in acc.Tags()['scalars']}
    return {tag: points for tag, points in curves.items() if points}  # all purged: no curve


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in want[tag]],
                                   rtol=1e-6, err_msg=tag)


def test_writer_skips_missing_values_and_a_reopened_folder_continues(tmp_path):
    with ScalarWriter(tmp_path) as tb:
        assert tb.active
        for step in range(1, 6):
            tb.write(step, {'loss': 1.0 / step, 'dev': None if step % 2 else float(step),
                            'bad': math.nan})
    # A resume from step 3 in the same second: its own file, the steps after 3 replaced.
    with ScalarWriter(tmp_path, purge_step=4) as tb:
        tb.write(4, {'loss': 40.0})
    assert len(list(tmp_path.iterdir())) == 2
    _close(_scalars(tmp_path), {'loss': [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 40.0)],
                                'dev': [(2, 2.0)]})
    assert optional_writer(None) is None and optional_writer('') is None
    assert not ScalarWriter('gs://bucket/tb').active  # event files: local folders only


def _data(n=400, dim=4, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, dim)) * np.array([0.1, 1.0, 3.0, 10.0]) + 2.0).astype(
        np.float32)


def test_flow_fit_writes_its_history_and_a_refit_replaces_it(tmp_path):
    x = _data()
    first = fit_flow(x, _FLOW, jax.random.key(0), tb_dir=str(tmp_path))
    assert len(first.history) == 6
    want = {k: [(h['step'], h[k]) for h in first.history]
            for k in ('train_nll', 'val_nll', 'bpd')}
    _close(_scalars(tmp_path), want)

    # A refit into the same folder through the calibration API (another seed, no held-out
    # rows): TensorBoard shows only the refit's curves; NaN held-out values are left out.
    cal = calibrate.fit('flow', x, config=_FLOW.replace(val_fraction=0.0), seed=1,
                        tb_dir=str(tmp_path))
    got = _scalars(tmp_path)
    assert set(got) == {'train_nll', 'bpd'}
    _close(got, {k: [(h['step'], h[k]) for h in cal.history] for k in ('train_nll', 'bpd')})
    assert [s for s, _ in got['train_nll']] == [h['step'] for h in cal.history] != []
    assert all(math.isnan(h['val_nll']) for h in cal.history)


def test_no_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fit_flow(_data(n=100), _FLOW.replace(max_epochs=1), jax.random.key(0))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize('index', [1])
def test_only_process_zero_writes(tmp_path, monkeypatch, index):
    monkeypatch.setattr(jax, 'process_index', lambda: index)
    with ScalarWriter(tmp_path / 'tb') as tb:
        tb.write(1, {'loss': 1.0})
        assert not tb.active
    assert not (tmp_path / 'tb').exists()
