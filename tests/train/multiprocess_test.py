"""Multi-process training on loopback: 2 processes x 4 CPU devices == 1 process x 8 devices.

Each process reads and tokenizes only its block of every global batch (the streamed input,
`jaxsim.data.pipeline`) and feeds `jax.make_array_from_process_local_data`; CPU collectives go
through gloo. The two runs split the same sums differently, so they agree up to reordered float32 summation (see
sharding_test.py): SGD keeps that a bound on the parameters too.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np

from jaxsim.io.checkpoint import Checkpointer
from jaxsim.paths import SENTEVAL_ROOT

REPO = Path(__file__).resolve().parents[2]
U = 2.0 ** -24
LR, STEPS, TOKENS = 0.1, 3, 16 * 2 * 16  # batch x views x max_len

_SCRIPT = textwrap.dedent('''
    import json, sys
    root, corpus, workdir, coord, nproc, pid = sys.argv[1:7]
    sys.path.insert(0, root)
    from jaxsim import distributed
    if int(nproc) > 1:
        distributed.initialize(coord, int(nproc), int(pid))
    import jax
    from configs.tiny_unsup_simcse import get_config
    from jaxsim.train.config import TrainConfig, base_config
    from jaxsim.train.loop import train_and_evaluate
    from jaxsim.train.step import configure_jax
    configure_jax()
    assert jax.device_count() == 8 and jax.process_count() == int(nproc)
    fields = {**base_config().to_dict(), **get_config().to_dict()}
    fields['model_overrides']['num_hidden_layers'] = 1
    fields.update(train_file=corpus, max_steps=3, batch_size=16, optimizer='sgd',
                  learning_rate=0.1, max_grad_norm=0.0)
    r = train_and_evaluate(TrainConfig.from_dict(fields), workdir, progress=False)
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
    return subprocess.Popen([sys.executable, '-c', _SCRIPT, str(REPO), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(workdir):
    return [json.loads(x) for x in (workdir / 'metrics.jsonl').read_text().splitlines()]


def _params(workdir):
    with Checkpointer(workdir / 'checkpoints', read_only=True) as ckpt:
        return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore(STEPS).state['params'])]


def test_two_processes_match_one_process(tmp_path):
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join((SENTEVAL_ROOT / 'SNLI' / 's2.dev').read_text().splitlines()[:64]))
    coord = f'127.0.0.1:{_free_port()}'
    multi = [_launch([corpus, tmp_path / 'multi', coord, 2, pid], 4) for pid in (0, 1)]
    single = _launch([corpus, tmp_path / 'single', 'none', 1, 0], 8)
    outs = [p.communicate(timeout=600) for p in multi + [single]]
    for p, (out, err) in zip(multi + [single], outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(o.split('RESULT')[1].splitlines()[0]) for o, _ in outs]
    assert [r['steps'] for r in results] == [STEPS] * 3
    assert results[0]['loss'] == results[1]['loss']  # every process sees the global loss
    single_rows, multi_rows = _rows(tmp_path / 'single'), _rows(tmp_path / 'multi')
    assert [r['step'] for r in single_rows] == [r['step'] for r in multi_rows] == [1, 2, 3]
    ps, pm = _params(tmp_path / 'single'), _params(tmp_path / 'multi')
    count = sum(p.size for p in ps)
    for a, b in zip(single_rows, multi_rows):
        assert abs(a['loss'] - b['loss']) <= 2 * TOKENS * U * abs(a['loss']), (a, b)
        # | ||g|| - ||g'|| | <= ||g - g'|| <= sqrt(count) max|g - g'|, and max|g| <= ||g||.
        grad_tol = 2 * TOKENS * U * a['grad_norm'] * np.sqrt(count)
        assert abs(a['grad_norm'] - b['grad_norm']) <= grad_tol, (a, b)
    grad_max = max(r['grad_norm'] for r in single_rows)
    tol = STEPS * (LR * 2 * TOKENS * U * grad_max + 2 * U * max(np.abs(p).max() for p in ps))
    assert max(float(np.abs(a - b).max()) for a, b in zip(ps, pm)) <= tol
    assert single_rows[0]['loss'] != single_rows[-1]['loss']  # it trained
    # Only process 0 writes the run record; it names both processes.
    run = json.loads((tmp_path / 'multi' / 'config.json').read_text())['run']
    assert (run['processes'], run['devices']) == (2, 8)
