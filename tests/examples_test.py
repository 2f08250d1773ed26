"""examples/custom_loop.py: a loop written from jaxsim.functional gives train.py's losses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import HANG_GUARD_S, cpu_devices_env, write_run_data

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / 'examples' / 'custom_loop.py'
STEPS = 20  # 120 sentences / 16 = 7 batches an epoch: the runs cross two epoch boundaries


def _env():
    env = cpu_devices_env(1)
    env['PYTHONPATH'] = str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', '')
    return env


def _run(args):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_custom_loop_losses_equal_train_py(tmp_path):
    assert len(EXAMPLE.read_text().splitlines()) <= 50
    corpus = write_run_data(tmp_path, 's2.dev', 120, 8) / 'corpus.txt'
    workdir = tmp_path / 'run'
    _run(['train.py', '--config', str(REPO / 'configs' / 'tiny_unsup_simcse.py'),
          '--workdir', str(workdir), f'--config.train_file={corpus}',
          f'--config.max_steps={STEPS}', '--noprogress'])
    rows = [json.loads(x) for x in (workdir / 'metrics.jsonl').read_text().splitlines()]
    want = {r['step']: r['loss'] for r in rows if 'loss' in r}
    out = [json.loads(x) for x in _run([str(EXAMPLE), str(corpus), '--steps', str(STEPS)])
           .splitlines()]
    got = {r['step']: r['loss'] for r in out}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    losses = np.array([want[s] for s in sorted(want)])
    assert len(set(losses.tolist())) == STEPS  # every step's batch and masks differ
    np.testing.assert_allclose([got[s] for s in sorted(want)], losses, rtol=1e-6)
