"""Progress on long work: tqdm only on a terminal, plain periodic lines (never a carriage
return) in logs and pipes, for encoding, flow fits and transfer classifiers; and the eval
report's seed spread and checkpoint line."""
from __future__ import annotations

import io
import types

import jax
import numpy as np
import pytest
from tqdm import tqdm

import jaxsim
from jaxsim import progress
from jaxsim.eval import report, transfer
from jaxsim.flows import FlowConfig, fit_flow, layer
from jaxsim.storage.paths import SENTEVAL_ROOT


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def every_update(monkeypatch):
    """A plain progress line at every update (instead of every 15 s)."""
    monkeypatch.setattr(progress, 'PLAIN_EVERY_S', 0.0)


def test_bar_on_a_terminal_lines_elsewhere(every_update):
    assert isinstance(progress.progress_bar(10, 'work', file=_Terminal()), tqdm)
    log = io.StringIO()
    bar = progress.progress_bar(10, 'work', unit='item', file=log)
    for _ in range(4):
        bar.update(2)
    bar.set_postfix(loss='0.50')
    bar.update(2)
    bar.close()
    lines = log.getvalue().splitlines()
    assert '\r' not in log.getvalue()
    assert lines[0].startswith('work: 2/10 item (20%), ') and lines[0].endswith(' s')
    assert lines[4].startswith('work: 10/10 item (100%)') and lines[4].endswith('loss 0.50')
    silent = io.StringIO()
    off = progress.progress_bar(10, 'work', enable=False, file=silent)
    off.update(5)
    off.close()
    assert silent.getvalue() == ''


def test_encode_progress_in_a_log_has_no_carriage_returns(bundled, capsys, every_update):
    jaxsim.encode(bundled, [f'sentence {i} .' for i in range(130)], batch_size=64,
                  progress=True)
    err = capsys.readouterr().err
    assert '\r' not in err
    assert [line.split(' (')[0] for line in err.splitlines()] == [
        'encode: 64/130 sent', 'encode: 128/130 sent', 'encode: 130/130 sent']


def test_flow_fit_progress_in_a_log_has_no_carriage_returns(capsys, every_update):
    config = FlowConfig(name='tiny', levels=1, depth=1, step=(
        layer('actnorm'), layer('additive_coupling', width=8)), max_epochs=1,
        val_fraction=0.0, evals_per_epoch=1, batch_size=64)
    x = np.random.default_rng(0).standard_normal((256, 4)).astype(np.float32)
    fit_flow(x, config, jax.random.key(0), progress=True)
    err = capsys.readouterr().err
    assert '\r' not in err and err.splitlines()[-1].startswith('flow fit: 4/4 step (100%)')


def test_transfer_classifiers_report_progress(tmp_path, capsys, every_update):
    for name in ('rt-polarity.pos', 'rt-polarity.neg'):
        lines = (SENTEVAL_ROOT / 'MR' / name).read_bytes().split(b'\n')[:30]
        (tmp_path / 'MR').mkdir(exist_ok=True)
        (tmp_path / 'MR' / name).write_bytes(b'\n'.join(lines) + b'\n')
    rng = np.random.default_rng(0)
    transfer.evaluate_transfer('mr', lambda s: rng.standard_normal((len(s), 5)), tmp_path)
    err = capsys.readouterr().err
    assert '\r' not in err
    last = err.splitlines()[-1]
    # 10 outer folds x (10 inner + 1 refit) problems x 4 L2 values.
    assert last.startswith('MR classifiers: ') and '/440 clf (' in last, err


def test_seed_spread_and_checkpoint_lines():
    row = types.SimpleNamespace(
        scores={'STS12': None, 'STSBenchmark': None},
        details={'per_seed': {'STS12': [60.0, 62.0], 'STSBenchmark': [80.0, 80.0]},
                 'checkpoint': {'source': 'runs/sup', 'workdir': '/abs/runs/sup', 'step': 60,
                                'selected_by': 'best', 'metric': 'stsb_dev', 'value': 84.123}})
    assert report.seed_spread(row, 'all') == {'STS12': ' ±1.00', 'STSBenchmark': ' ±0.00',
                                              'avg': ' ±0.50'}
    assert report.checkpoint_lines([row, row]) == [
        'checkpoint: runs/sup step 60 (best stsb_dev 84.12)']
    row.details = {'per_seed': None}
    assert report.seed_spread(row, 'all') == {} and report.checkpoint_lines([row]) == []
