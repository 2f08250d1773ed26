"""train.py with micro_batch_size: the same run as one pass, step by step.

Cached-gradient micro-batches compute the gradient of the whole batch's loss (every negative
kept) with the same dropout masks, so the logged losses and gradient norms equal the one-pass
run's up to reordered float32 summation (bounds as in sharding_test.py), and SGD keeps them so.
"""
import json
from pathlib import Path

import pytest

from jaxsim.cli import train
from tests.conftest import write_run_data

U = 2.0 ** -24
TINY = str(Path(__file__).resolve().parents[2] / 'configs' / 'tiny_unsup_simcse.py')
TOKENS = 16 * 2 * 16  # batch x views x max_len of the tiny config


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return write_run_data(tmp_path_factory.mktemp('micro'), 's1.dev', 64, 4)


def _run(data, workdir, *extra):
    code = train.main(['--config', TINY, '--workdir', str(workdir),
                       f'--config.train_file={data / "corpus.txt"}', '--config.max_steps=4',
                       '--config.optimizer=sgd', '--config.learning_rate=0.1',
                       '--config.max_grad_norm=0.0', '--config.checkpoint=false',
                       '--noprogress', *extra])
    assert code == 0
    return [json.loads(x) for x in (workdir / 'metrics.jsonl').read_text().splitlines()]


def test_micro_batches_log_the_one_pass_losses(data, tmp_path, capsys):
    one_pass = _run(data, tmp_path / 'one')
    micro = _run(data, tmp_path / 'micro', '--config.micro_batch_size=4',
                 '--config.remat=full')
    assert [r['step'] for r in micro] == [r['step'] for r in one_pass] == [1, 2, 3, 4]
    assert one_pass[0]['loss'] != one_pass[-1]['loss']  # it trained
    for step, (a, b) in enumerate(zip(one_pass, micro), 1):
        # Rounding grows with the steps taken on slightly different parameters.
        assert abs(a['loss'] - b['loss']) <= 4 * step * TOKENS * U * abs(a['loss']), (a, b)
        assert abs(a['grad_norm'] - b['grad_norm']) <= 1e-4 * a['grad_norm'], (a, b)
        for key in ('align', 'uniform'):
            assert abs(a[key] - b[key]) <= 1e-4 * (abs(a[key]) + 1e-3), (key, a, b)


def test_micro_batch_size_must_divide_the_batch(data, tmp_path, capsys):
    code = train.main(['--config', TINY, '--workdir', str(tmp_path),
                       f'--config.train_file={data / "corpus.txt"}',
                       '--config.micro_batch_size=5', '--noprogress'])
    assert code == 1
    assert capsys.readouterr().err.strip() == (
        'error: train config: batch_size 16 is not divisible by micro_batch_size 5')
