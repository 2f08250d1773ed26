"""Multi-process training on loopback: 2 processes x 4 CPU devices == 1 process x 8 devices.

Each process reads only its block of every global batch (BatchIterator's process slice) and
feeds `jax.make_array_from_process_local_data`; CPU collectives go through gloo.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from jaxsim.paths import SENTEVAL_ROOT as SENTEVAL

ROOT = Path(__file__).resolve().parents[1]
if not SENTEVAL.is_dir():
    SENTEVAL = ROOT.parent / 'shared' / 'data' / 'senteval'

_SCRIPT = textwrap.dedent('''
    import json, sys
    root, corpus, workdir, coord, nproc, pid = sys.argv[1:7]
    sys.path.insert(0, root)
    from jaxsim import distributed
    if int(nproc) > 1:
        distributed.initialize(coord, int(nproc), int(pid))
    import jax
    from configs.tiny_unsup_simcse import get_config
    from jaxsim import train_lib
    assert jax.device_count() == 8 and jax.process_count() == int(nproc)
    c = get_config()
    c.model_overrides['num_hidden_layers'] = 1
    c.update(train_file=corpus, max_steps=3, batch_size=16, checkpoint=False, senteval_root='')
    r = train_lib.train_and_evaluate(c, workdir, progress=False)
    print('RESULT' + json.dumps({'pid': int(pid), 'steps': r.steps, 'loss': r.final_loss}),
          flush=True)
''')


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _launch(args, devices):
    env = dict(os.environ, JAX_PLATFORMS='cpu',
               XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
    return subprocess.Popen([sys.executable, '-c', _SCRIPT, str(ROOT), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(workdir):
    rows = [json.loads(x) for x in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return [m['loss'] for m in rows if 'loss' in m]


def test_two_processes_match_one_process(tmp_path):
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join((SENTEVAL / 'SNLI' / 's2.dev').read_text().splitlines()[:64]))
    coord = f'127.0.0.1:{_free_port()}'
    multi = [_launch([corpus, tmp_path / 'multi', coord, 2, pid], 4) for pid in (0, 1)]
    single = _launch([corpus, tmp_path / 'single', 'none', 1, 0], 8)
    outs = [p.communicate(timeout=600) for p in multi + [single]]
    for p, (out, err) in zip(multi + [single], outs):
        assert p.returncode == 0, err[-3000:]
        assert 'RESULT' in out
    results = [json.loads(o.split('RESULT')[1].splitlines()[0]) for o, _ in outs]
    assert [r['steps'] for r in results] == [3, 3, 3]
    # Every process sees the same (globally reduced) loss.
    assert results[0]['loss'] == results[1]['loss']
    single_losses, multi_losses = _losses(tmp_path / 'single'), _losses(tmp_path / 'multi')
    assert len(single_losses) == 3 and np.all(np.isfinite(single_losses))
    np.testing.assert_allclose(multi_losses, single_losses, atol=1e-5, rtol=0)
    # Only process 0 writes the workdir record.
    cfg = json.loads((tmp_path / 'multi' / 'config.json').read_text())
    assert cfg['processes'] == 2 and cfg['devices'] == 8
